"""Draws the figures of the documentation into `docs/figures/`.

Run from the repository root with `python docs/figures.py` (it needs matplotlib, which the `docs` extra installs).
Every number plotted is computed by eqx_quant itself, so the figures follow the library. The output is byte-for-byte
reproducible for a given matplotlib version: the data come from a fixed PRNG key and the PNGs carry no timestamp or
version metadata.
"""

import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import ml_dtypes
import numpy as np


matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

import eqx_quant  # noqa: E402


OUT_DIR = pathlib.Path(__file__).resolve().parent / "figures"
STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 9.0,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.dpi": 100,
    "savefig.dpi": 150,
}
BLUE, ORANGE, GREY = "#3f51b5", "#e65100", "#9e9e9e"


def _save(fig: plt.Figure, name: str) -> None:
    path = OUT_DIR / name
    # No "Software" entry: the bytes then do not depend on which matplotlib drew them beyond the pixels themselves.
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path.relative_to(pathlib.Path.cwd()) if path.is_relative_to(pathlib.Path.cwd()) else path}")


def _value_and_slope(fn, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`fn(x)` and its derivative at each point, as the custom rules of eqx_quant define it."""
    return jax.vmap(jax.value_and_grad(fn))(x)


def straight_through() -> None:
    """The staircase of `fake_quant` and the pass-through clip, each above the derivative that training sees."""
    scale, qmin, qmax = 0.5, -4, 3
    lo, hi = qmin * scale, qmax * scale
    x = jnp.linspace(-3.0, 3.0, 1201, dtype=jnp.float32)

    q, dq = _value_and_slope(lambda t: eqx_quant.fake_quant(t, scale, qmin, qmax), x)
    c, dc = _value_and_slope(lambda t: eqx_quant.clip_passthrough(t, lo, hi), x)

    fig, axes = plt.subplots(2, 2, figsize=(8.0, 5.2), sharex=True, height_ratios=(2.0, 1.0), layout="constrained")
    panels = (
        (axes[0, 0], axes[1, 0], q, dq, "fake_quant(x, 0.5, -4, 3)", "clipped straight-through estimator"),
        (axes[0, 1], axes[1, 1], c, dc, "clip_passthrough(x, -2.0, 1.5)", "pass-through"),
    )
    for top, bottom, y, dy, title, rule in panels:
        top.plot(x, x, color=GREY, linestyle="--", linewidth=1.0, label="identity")
        top.plot(x, y, color=BLUE, linewidth=1.6, label="forward")
        for edge in (lo, hi):
            top.axvline(edge, color=ORANGE, linestyle=":", linewidth=1.0)
            bottom.axvline(edge, color=ORANGE, linestyle=":", linewidth=1.0)
        top.set_title(title, family="DejaVu Sans Mono", fontsize=9.0)
        top.set_ylabel("output")
        top.set_ylim(-3.2, 3.2)
        top.legend(loc="upper left", frameon=False)
        bottom.plot(x, dy, color=BLUE, linewidth=1.6)
        bottom.set_ylim(-0.15, 1.25)
        bottom.set_yticks([0.0, 1.0])
        bottom.set_ylabel("d output / dx")
        bottom.set_xlabel("x")
        bottom.set_title(f"derivative used in training: {rule}", fontsize=9.0)
    _save(fig, "straight-through.png")


def error_vs_bits() -> None:
    """RMS error of `fake_quant` on standard Gaussian data, with an absmax scale, for bit widths 2 to 8."""
    x = jax.random.normal(jax.random.key(0), (2**16,), dtype=jnp.float32)
    absmax = jnp.max(jnp.abs(x))
    bits = list(range(2, 9))
    measured, model = [], []
    for b in bits:
        qmin, qmax = eqx_quant.int_range(b, narrow=True)
        scale = absmax / qmax
        err = eqx_quant.fake_quant(x, scale, qmin, qmax) - x
        measured.append(float(jnp.sqrt(jnp.mean(err * err))))
        # Rounding error spread evenly over one step has standard deviation scale / sqrt(12).
        model.append(float(scale) / 12**0.5)

    fig, ax = plt.subplots(figsize=(6.0, 3.8), layout="constrained")
    ax.semilogy(bits, model, color=GREY, linestyle="--", marker="s", markersize=4, label="scale / sqrt(12)")
    ax.semilogy(bits, measured, color=BLUE, marker="o", markersize=5, label="measured RMS error")
    for b, e in zip(bits, measured, strict=True):
        ax.annotate(f"{e:.3g}", (b, e), textcoords="offset points", xytext=(6, 4), fontsize=8, color=BLUE)
    ax.set_xlabel("bits (signed, narrow range)")
    ax.set_ylabel("RMS error")
    ax.set_title(f"fake_quant of {x.size} N(0, 1) samples, scale = max|x| / qmax", fontsize=9.0)
    ax.legend(frameon=False)
    _save(fig, "error-vs-bits.png")


def float_grids() -> None:
    """The positive values of each low-precision float format on a log scale, and the rounding of the two smallest
    formats on the real line."""
    names = ("float8_e5m2", "float8_e4m3fn", "float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn")
    # A sweep finer than every grid: rounding it onto a format hits each of the format's values.
    sweep = jnp.exp2(jnp.linspace(-18.0, 17.0, 35 * 4096 + 1, dtype=jnp.float32))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.0, 6.2), height_ratios=(1.3, 1.0), layout="constrained")
    for row, name in enumerate(names):
        values = np.unique(np.asarray(eqx_quant.fake_quant_float(sweep, 1.0, name)))
        values = values[values > 0]
        smallest_normal = float(ml_dtypes.finfo(getattr(ml_dtypes, name)).smallest_normal)
        for subnormal, color in ((True, ORANGE), (False, BLUE)):
            chosen = values[(values < smallest_normal) == subnormal]
            top.scatter(np.log2(chosen), np.full(chosen.shape, row), marker="|", s=120, color=color, linewidths=1.2)
        top.annotate(
            f"{len(values)} positive values, largest {values[-1]:g}",
            (np.log2(values[-1]), row),
            textcoords="offset points",
            xytext=(8, -3),
            fontsize=8,
        )
    top.scatter([], [], marker="|", color=BLUE, label="normal")
    top.scatter([], [], marker="|", color=ORANGE, label="subnormal")
    top.set_yticks(range(len(names)), names, family="DejaVu Sans Mono")
    top.set_ylim(-0.7, len(names) - 0.3)
    top.set_xlim(-18, 24)
    top.set_xlabel("log2 of the value (the negative values mirror the positive ones; each format also has 0)")
    top.legend(loc="upper right", frameon=False, ncols=2)
    top.set_title("The grid of each element format (scale 1)", fontsize=9.0)

    x = jnp.linspace(-8.0, 8.0, 1601, dtype=jnp.float32)
    bottom.plot(x, x, color=GREY, linestyle="--", linewidth=1.0, label="identity")
    for name, color in (("float6_e2m3fn", ORANGE), ("float4_e2m1fn", BLUE)):
        bottom.plot(x, eqx_quant.fake_quant_float(x, 1.0, name), color=color, linewidth=1.4, label=name)
    bottom.set_xlabel("x")
    bottom.set_ylabel("fake_quant_float(x, 1.0, dtype)")
    bottom.legend(loc="upper left", frameon=False)
    bottom.set_title("Round to nearest (ties to even), saturating at the largest value", fontsize=9.0)
    _save(fig, "float-grids.png")


def main() -> None:
    OUT_DIR.mkdir(exist_ok=True)
    with plt.rc_context(STYLE):
        straight_through()
        error_vs_bits()
        float_grids()


if __name__ == "__main__":
    main()
