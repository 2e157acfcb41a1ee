"""Sharded training on virtual CPU devices, in subprocesses so that this process keeps its single device.

`tests/sharded/check_sharding.py` holds the tests proper; it is run here by a pytest of its own with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (a `2 x 2` mesh: both axes split, at half the cost of 8 devices
on a small machine), and this test fails with that run's report unless every one of its tests passed (none skipped).
The default run checks five of them, `pytest --all` every one (in two tests).
The example script runs on its own 8 devices.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(args: list[str], devices: int, timeout: float) -> subprocess.CompletedProcess:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")  # virtual devices are CPU devices, even next to a GPU
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


# Five core checks run in the default tier (CI's): a W8A8 training step against one device, the integer forward and
# the conversion on the mesh, calibration (of the MLP), and per-tensor statistics under `shard_map`. The rest are slow.
_CORE = "mlp-static or per_tensor_statistics or calibrate_sharded_model_matches_single_device[mlp]"


@pytest.mark.parametrize("part", ["core", pytest.param("rest", marks=pytest.mark.slow)])
def test_sharded_checks_on_four_devices(part):
    result = _run(
        # `-n 0`: one process for the sharded tests, not pytest-xdist workers (this test's worker waits meanwhile)
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-o", "python_files=check_*.py", "tests/sharded"]
        + ["-k", _CORE if part == "core" else f"not ({_CORE})"],
        devices=4,
        timeout=600,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    summary = report.strip().splitlines()[-1]
    match = re.fullmatch(r"=*\s*(\d+) passed, (\d+) deselected in [\d.]+s( \([\d:]+\))?\s*=*", summary)
    assert match is not None, f"expected every sharded test to pass and none to be skipped, got: {summary}\n{report}"
    core, rest = (int(match[1]), int(match[2])) if part == "core" else (int(match[2]), int(match[1]))
    assert core == 5 and core + rest >= 20, report


@pytest.mark.slow
def test_sharded_example_runs():
    result = _run(["examples/sharded_qat.py", "--steps", "40"], devices=8, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "8 devices, mesh {'data': 4, 'model': 2}" in out
    assert "layers.0: weight (256, 64) P('model', None), step sizes (256,) P('model',)" in out
    assert "layers.1: weight (256, 256) P(None, 'model'), step sizes (256,) P()" in out
    assert "every parameter kept its sharding: True" in out
    assert "converted layers.0: int8 (256, 64) P('model', None), scales P('model', None)" in out
    assert "converted logits equal the QAT model's bit for bit: True" in out
    accuracy = float(re.search(r"test accuracy of the converted model: ([\d.]+)%", out)[1])
    assert accuracy > 50.0  # 40 steps of Adam on the digits: far above the 10% of chance
