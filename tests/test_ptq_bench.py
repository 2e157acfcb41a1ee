"""The tabular post-training benchmark (`benchmarks/ptq_tabular.py`): its smoke preset end to end, and its targets
and table from hand-made rows."""

import importlib
import json
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant


BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
ptq = importlib.import_module("ptq_tabular")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptq_tabular")
    lines: list[str] = []
    results = ptq.run("smoke", out, log=lines.append)
    return out, results, lines


def test_smoke_run_writes_plausible_results(smoke):
    out, results, lines = smoke
    written = json.loads((out / "ptq_tabular_smoke.json").read_text())
    assert written == json.loads(json.dumps(results))  # what run returns is what it wrote
    assert {"preset", "split", "machine", "datasets", "seconds"} <= set(written)
    assert written["preset"]["name"] == "smoke" and written["machine"]["jax"]
    assert list(written["datasets"]) == ["wine"]

    wine = written["datasets"]["wine"]
    assert (wine["n_train"], wine["n_test"], wine["features"], wine["classes"]) == (124, 54, 13, 3)
    assert max(wine["feature_absmax"]) > 1000 > 100 * min(wine["feature_absmax"])  # proline, and the small ones
    rows = {r["name"]: r for r in wine["rows"]}
    assert list(rows) == ["float", *ptq.SMOKE_CONFIGS]
    for row in wine["rows"]:
        assert len(row["per_seed"]) == 1 and row["per_seed"][0]["seed"] == 0
        correct = row["accuracy"] * wine["n_test"] / 100  # a whole number of test examples
        assert correct == pytest.approx(round(correct)) and 0 <= row["accuracy"] <= 100
        if row["name"] != "float":
            # The converted (integer) model's logits are the fake-quantized model's, bit for bit (run asserts it).
            assert row["per_seed"][0]["converted_equals_fake"] is True
            assert row["rel_error"] > 0  # every quantized model moves off the float one
    f = rows["float"]
    assert f["drop"] == 0 and f["rel_error"] == 0
    assert f["accuracy"] > 80  # trained on raw features, still far above chance (40%, the largest class)
    # How much the examples' magnitudes differ at each layer's input: at the first, those of the raw features.
    spread = f["per_seed"][0]["input_spread"]
    absmax = np.abs(ptq.load("wine").x_train).max(axis=1)
    assert [s["layer"] for s in spread] == [0, 1, 2]
    assert (spread[0]["median"], spread[0]["max"]) == (float(np.median(absmax)), float(absmax.max()))
    for s in spread:
        assert 0 < s["median"] <= s["max"] and s["median_levels"] == pytest.approx(127 * s["median"] / s["max"])
    assert "the median training example spans" in lines[0]

    # The outliers matter: calibrated per-tensor inputs and RTN weights lose accuracy, and SmoothQuant recovers most
    # of it, with a far smaller error of the logits.
    rtn, smooth = rows["W8A8 RTN"], rows["W8A8 SmoothQuant 0.5"]
    assert rtn["drop"] >= 2 and rtn["rel_error"] > 0.02
    assert smooth["accuracy"] > rtn["accuracy"] and 3 * smooth["rel_error"] < rtn["rel_error"]
    # Smoothed, with GPTQ, weights of 4 bits err less than round-to-nearest ones of 8 bits. (GPTQ alone, and what
    # smoothing adds to it, is measured by the full preset: its "W4A8 GPTQ" row.)
    assert rows["W4A8 SmoothQuant 0.5 + GPTQ"]["rel_error"] < rtn["rel_error"]

    t = wine["targets"]
    assert list(t) == list(ptq.TARGETS) and t["outliers_matter"]["met"] is True
    assert [r["row"] for r in t["smoothquant_w8a8"]["rows"]] == [  # the rows the run has
        "W8A8 SmoothQuant 0.5",
        "W8A8 SmoothQuant 0.5, MSE inputs",
    ]
    # The row's calibration method reaches `calibrate`: the clipped input scales give other logits.
    mse = rows["W8A8 SmoothQuant 0.5, MSE inputs"]
    assert mse["config"]["method"] == "mse" and smooth["config"]["method"] == "absmax"
    assert mse["rel_error"] != smooth["rel_error"]
    assert lines[0].startswith("wine seed 0: float trained") and len(lines) == 1 + len(ptq.SMOKE_CONFIGS)


def _rows(drops_and_errors: dict[str, tuple[float, float]]) -> list[dict]:
    rows = [{"name": "float", "accuracy": 90.0, "drop": 0.0, "rel_error": 0.0, "per_seed": [{"accuracy": 90.0}]}]
    for name, (drop, rel_error) in drops_and_errors.items():
        seeds = [{"accuracy": 90.0 - drop + d} for d in (-1, 1)]
        rows.append({"name": name, "accuracy": 90.0 - drop, "drop": drop, "rel_error": rel_error, "per_seed": seeds})
    return rows


def test_targets_and_table_from_hand_made_rows():
    figures = {
        "W8A8 RTN": (1.0, 0.03),  # loses 1 point only, but 3% relative error: the premise holds
        "W8A8 SmoothQuant 0.5": (0.75, 0.004),  # the relative error is within 0.5%
        "W8A8 SmoothQuant 0.75": (-1.0, 0.02),  # a gain is within 0.5 points
        "W4A8 SmoothQuant 0.5 + GPTQ": (2.5, 0.1),
        "W4A8 AWQ + GPTQ": (3.0, 0.01),  # only points count here
    }
    dataset = {"n_train": 10, "n_test": 5, "features": 3, "classes": 2, "rows": _rows(figures)}
    t = ptq.targets(dataset)
    assert t["outliers_matter"]["met"] is True
    assert t["smoothquant_w8a8"]["met"] is True and [r["met"] for r in t["smoothquant_w8a8"]["rows"]] == [True, True]
    assert t["w4a8_smoothquant_or_awq_gptq"]["met"] is False
    dataset["targets"] = t
    lines = ptq.target_lines("toy", dataset)
    assert lines[0] == (
        "toy: calibrated RTN W8A8 loses >= 2 points or has >= 2% rel. error: met "
        "(W8A8 RTN: drop +1.00 points, rel. error 3.00%)"
    )
    assert lines[2].startswith("toy: W4A8 SmoothQuant or AWQ + GPTQ within 2 points: missed (W4A8 SmoothQuant")
    table = ptq.table("toy", dataset).splitlines()
    assert len(table) == 4 + 1 + len(figures)
    assert table[5] == "| W8A8 RTN | 88.00 / 90.00 | 89.00 | +1.00 | 3.00% |"

    figures["W8A8 RTN"] = (1.0, 0.01)
    assert ptq.targets({"rows": _rows(figures)})["outliers_matter"]["met"] is False


def test_refuses_an_unknown_preset(tmp_path):
    with pytest.raises(SystemExit) as info:
        ptq.main(["--preset", "huge", "--out", str(tmp_path)])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="`preset`"):
        ptq.run("huge", tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_traced_twins_score_as_the_layers_do(smoke, tmp_path):
    """`--traced`: the MLPs written with bare arrays (`x @ W.T + b`), quantized by tracing and transformed by the same
    algorithms, score as the layers do: the same accuracies, and logits' errors within 1e-4 of each other (SmoothQuant
    multiplies a traced weight's input where it folds a hidden layer's factors into the layer before)."""
    _, layers, _ = smoke
    traced = ptq.run("smoke", tmp_path, log=None, traced=True)
    assert traced["traced"] is True and layers["traced"] is False
    assert json.loads((tmp_path / "ptq_tabular_smoke_traced.json").read_text()) == json.loads(json.dumps(traced))
    ours, theirs = (d["datasets"]["wine"]["rows"] for d in (traced, layers))
    assert [r["name"] for r in ours] == [r["name"] for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a["accuracy"] == b["accuracy"], a["name"]
        assert a["rel_error"] == pytest.approx(b["rel_error"], abs=1e-4), a["name"]
        if a["name"] != "float":
            assert a["per_seed"][0]["converted_equals_fake"] is True


@pytest.mark.slow
def test_a_traced_twin_with_static_weight_scales_converts_bit_for_bit():
    """A regression case of the full preset: wine's seed-0 MLP written with bare arrays, SmoothQuant with α searched
    per layer, calibrated, then GPTQ (static scales for the weights and the inputs). Its converted logits are the
    fake-quant model's bit for bit under `jit`: the weights' constant scales once met the inputs' constant scale
    first there, and the logits differed in the last bit."""
    data = ptq.load("wine")
    model, _ = ptq.train(data, ptq.PRESETS["full"], 0)
    config = ptq._config("W4A8 SmoothQuant, alpha per layer + GPTQ")
    fake = ptq.quantized(model, config, [jnp.asarray(data.x_train)], 0, traced=True)
    x = jnp.asarray(data.x_test)
    assert (ptq.logits(fake, x) == ptq.logits(eqx_quant.convert(fake), x)).all()
