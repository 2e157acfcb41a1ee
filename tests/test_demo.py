import json
import pathlib
import struct
import subprocess
import sys

import equinox as eqx
import jax
import numpy as np
import pytest

from examples import qat_demo as demo


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO = pathlib.Path(__file__).resolve().parent.parent


def _percent(fraction):
    return f"{100 * fraction:.2f}%"


@pytest.mark.slow
def test_quick_run_writes_results_and_plot(tmp_path, capsys):
    # optax's Adam mixes its int32 step count with Python floats, which strict promotion (set in conftest.py) rejects.
    with jax.numpy_dtype_promotion("standard"):
        demo.main(["--quick", "--out", str(tmp_path)])
    stdout = capsys.readouterr().out
    results = json.loads((tmp_path / "results.json").read_text())
    config = results["config"]
    assert config["quick"] is True
    n = config["test_examples"]
    assert 0 < n <= 128
    accuracies = {
        "float.accuracy": results["float"]["accuracy"],
        **{f"{kind}.{name}.accuracy": r["accuracy"] for kind in ("ptq", "qat") for name, r in results[kind].items()},
    }
    assert set(accuracies) == {
        "float.accuracy",
        "ptq.W8A8.accuracy",
        "ptq.W4A4.accuracy",
        "ptq.W2A4.accuracy",
        "qat.W8A8.accuracy",
        "qat.W4A4.accuracy",
        "qat.W2A4.accuracy",
    }
    for name, value in accuracies.items():
        assert isinstance(value, float) and 0.0 <= value <= 1.0, (name, value)
        assert abs(value * n - round(value * n)) < 1e-3, (name, value)  # a fraction of the test examples
    # Ten steps of training already beat chance (10 classes) by a wide margin.
    assert accuracies["float.accuracy"] > 0.2 and accuracies["qat.W8A8.accuracy"] > 0.2
    # Parameter bytes, counted by hand for the convnet: weights 1*16*9 + 16*32*9 + 512*64 + 64*10 = 38160 values,
    # biases 16 + 32 + 64 + 10 = 122 values, output channels 122 (one float32 scale each when quantized).
    expected_bytes = {"W8A8": 38160 + 4 * 122 + 4 * 122, "W4A4": 38160 // 2 + 8 * 122, "W2A4": 38160 // 4 + 8 * 122}
    assert results["float"]["weight_bytes"] == 4 * (38160 + 122)
    for kind in ("ptq", "qat"):
        for name, value in expected_bytes.items():
            assert results[kind][name]["weight_bytes"] == value, (kind, name)
    # A summary line per phase, in the order the phases run, with the figures of results.json. A quick run trains
    # 10 steps (fewer than one epoch of 1437 // 64 = 22 batches).
    f = results["float"]
    assert f["steps"] == 10
    assert f["file_bytes"] == (tmp_path / "models" / "float.eqx").stat().st_size
    expected_lines = [
        f"float: trained 10 steps in {f['wall_time_s']:.1f} s, test accuracy {_percent(f['accuracy'])}, "
        f"saved {f['file_bytes']:,} B"
    ]

    def converted(name, method, r):
        # The sizes quoted are those of the files written.
        models = tmp_path / "models"
        assert r["int_file_bytes"] == (models / f"{method.lower()}_{name}.int.eqx").stat().st_size
        assert r["file_bytes"] == (models / f"{method.lower()}_{name}.fake.eqx").stat().st_size
        return (
            f"{name} {method}: converted and saved in {r['convert_time_s']:.2f} s, int accuracy "
            f"{_percent(r['int_accuracy'])}, {r['int_file_bytes']:,} B (fake-quant file {r['file_bytes']:,} B)"
        )

    for name in ("W8A8", "W4A4", "W2A4"):
        r = results["ptq"][name]
        expected_lines.append(
            f"{name} PTQ: calibrated in {r['wall_time_s']:.1f} s, test accuracy {_percent(r['accuracy'])}"
        )
        expected_lines.append(converted(name, "PTQ", r))
    for name in ("W8A8", "W4A4", "W2A4"):
        r = results["qat"][name]
        assert r["steps"] == 10
        expected_lines.append(
            f"{name} QAT: trained 10 steps in {r['wall_time_s']:.1f} s, test accuracy {_percent(r['accuracy'])}"
        )
        expected_lines.append(converted(name, "QAT", r))
    lines = stdout.splitlines()
    assert lines[: len(expected_lines)] == expected_lines
    # Then the table (its first data row is the float model) and where the files went.
    assert lines[len(expected_lines)].split()[:3] == ["method", "bits", "accuracy"]
    assert lines[len(expected_lines) + 2].split()[:3] == ["float", "float32", _percent(f["accuracy"])]
    assert lines[-1] == f"wrote {tmp_path / 'results.json'} and {tmp_path / 'accuracy.png'}"
    png = (tmp_path / "accuracy.png").read_bytes()
    assert len(png) > 100 and png[:8] == PNG_SIGNATURE
    assert png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (720, 504)  # 6.0 x 4.2 inches at 120 dpi


@pytest.mark.slow
def test_help_exits_cleanly():
    result = subprocess.run(
        [sys.executable, "examples/qat_demo.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "--quick" in result.stdout and "--bits" in result.stdout and "--out" in result.stdout


class _Trained(Exception):
    pass


@pytest.mark.parametrize("bits", ["W4", "W8A8,8bit", "W1A4", "W8A0"])
def test_bad_bits_fail_before_any_training(tmp_path, monkeypatch, bits):
    def train(*args, **kwargs):
        raise _Trained

    monkeypatch.setattr(demo, "train", train)
    with pytest.raises((ValueError, SystemExit)) as info:
        demo.main(["--quick", "--bits", bits, "--out", str(tmp_path)])
    if isinstance(info.value, SystemExit):
        assert info.value.code not in (0, None)
    assert not (tmp_path / "results.json").exists()


def test_accuracy_against_numpy():
    model = eqx.nn.Linear(3, 4, key=jax.random.key(0))
    images = np.asarray(jax.random.normal(jax.random.key(1), (8, 3)))
    logits = images @ np.asarray(model.weight).T + np.asarray(model.bias)
    predictions = np.argmax(logits, axis=1)
    labels = predictions.astype(np.int32)
    labels[[1, 4, 6]] = (labels[[1, 4, 6]] + 1) % 4
    assert demo.accuracy(model, images, labels) == np.count_nonzero(predictions == labels) / 8 == 0.625
    labels[:] = predictions
    assert demo.accuracy(model, images, labels) == 1.0


def test_binomial_interval_by_hand():
    # 1.96 * sqrt(0.9 * 0.1 / 100) = 1.96 * 0.03; a perfect score keeps the interval of one error in 2n.
    assert demo.binomial_interval(0.9, 100) == pytest.approx(0.0588)
    assert demo.binomial_interval(1.0, 360) == pytest.approx(1.96 * np.sqrt(0.25 / 360) / np.sqrt(360))
