"""What the benchmark scripts share: their command line, and timing that interleaves the candidates."""

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax


def arguments(doc: str, repeats: int) -> argparse.Namespace:
    """Parses `--rounds` and `--repeats` (default `repeats`), and prints what the figures are measured on."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=repeats)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    return args


def interleaved_times(calls: dict[str, Callable[[], Any]], rounds: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each of `calls`: `rounds` rounds in which each takes its turn for `repeats` timed calls,
    after one untimed call (which compiles), so that drifts in machine load hit every candidate alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            jax.block_until_ready(call())
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(call())
                times[name].append(time.perf_counter() - t0)
    return times


def flax_mlp(widths: tuple[int, ...]) -> tuple[Any, Any] | None:
    """A Flax MLP (`Dense` layers of `widths` features, ReLU between them) and the `qwix` module, for the side-by-side
    rows; `None` if `flax` or `qwix` is not installed (`pip install -e ".[bench]"`)."""
    try:
        import flax.linen as nn
        import qwix
    except ImportError:
        return None

    class FlaxMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, features in enumerate(widths):
                x = nn.Dense(features)(x)
                x = jax.nn.relu(x) if i < len(widths) - 1 else x
            return x

    return FlaxMLP(), qwix
