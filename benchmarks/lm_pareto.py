"""Mixed precision on the language-model benchmark: validation bits per character against the converted model's
weight bytes, for uniform weight-only recipes and for `eqx_quant.auto_recipe` under the same budgets.

Run with `python benchmarks/lm_pareto.py --preset {smoke,full} --out DIR [--cache DIR] [--plot PNG]`, or
`python benchmarks/lm_pareto.py --results JSON [--plot PNG]` to print (and plot) a stored run. It uses the float
model, corpus, fine-tuning and validation protocol of `lm.py` (same presets, same `--cache`), and

1. quantizes the float model with uniform recipes: W8, W4, W3 and W2 weights per group of 32 along the contraction,
   inputs in float (`UNIFORM`);
2. allocates a format per layer with `eqx_quant.auto_recipe` among `CANDIDATES` (the same four grids) at `AUTO_BITS`
   average weight bits, by each method of `AUTO_METHODS` (Hessian traces, or the measured loss of each layer
   quantized alone), the loss being the KL divergence from the float model's next-character distributions
   (`loss="kl"`) on the first `AUTO_BATCHES` of `lm.py`'s GPTQ calibration batches (training windows), with
   `AUTO_PROBES` probes per unit for the Hessian traces; the predictions are made once per method (at the first
   budget) and reused for the others (`auto_recipe(model, report, ...)`). A stack of
   blocks is one unit of the allocation: each of the block's linear layers (`qkv`, `proj`, the MLP's two) takes one
   format for every block;
3. scores every model by round to nearest (`rtn`) and after quantization-aware training (`qat`: learned scales from
   the round-to-nearest ones, `lm.finetune`'s budget, optimizer and batches, as `lm.py`'s QAT arm);
4. writes `DIR/lm_pareto.json` (rows, allocations, the targets' figures) and prints the table.

The embedding (the model's input layer and tied output head) is kept at 8 bits per row in every row (`lm.KEEP`), and
counts in the bytes. `bytes` is `eqx_quant.summary(model).stored_bytes`: what `eqx_quant.convert` stores of every
weight (codes, scales; the biases and norms are not counted). `bits` is the average bits per element of the allocated
layers' weights (the embedding excluded; with groups of 32, each adds one bit of float32 scale per element to the
bytes, the same for every candidate, so equal `bits` means equal bytes).

Targets (`targets` in the JSON, round to nearest): at 3.0 bits (the bytes of uniform W3), `auto_recipe` closes at
least 40% of the gap between uniform W3 and uniform W4 (`w3_w4_gap_closed` >= 0.4); at 2.5 bits it beats uniform W2 by
at least half of the W2-W3 gap (`w2_w3_gap_closed` >= 0.5). Each is given for the better of `AUTO_METHODS`, and for
each method.
"""

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import eqx_quant


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import lm  # noqa: E402


UNIFORM = {"W8 g32": 8, "W4 g32": 4, "W3 g32": 3, "W2 g32": 2}
CANDIDATES = ("int8_g32", "int4_g32", "int3_g32", "int2_g32")
AUTO_BITS = (4.0, 3.0, 2.5)
AUTO_METHODS = ("hessian", "measured")
AUTO_BATCHES = 4  # of `lm.calibration_batches`: the data `auto_recipe` predicts from
AUTO_PROBES = 8  # Hutchinson probes per unit
GROUP = 32


def _keep_rule() -> eqx_quant.Rule:
    return eqx_quant.Rule("|".join(lm.KEEP), weight=eqx_quant.LayerQuantizer(eqx_quant.int_format(8)), input=None)


def uniform_rules(bits: int, *, learned: bool) -> list[eqx_quant.Rule]:
    """Every layer but the kept embedding at `bits` per group of 32, inputs in float."""
    weight = eqx_quant.LayerQuantizer(eqx_quant.int_format(bits), GROUP, learned=learned)
    return [_keep_rule(), eqx_quant.Rule(".*", weight=weight, input=None)]


def learned_rule(rule: eqx_quant.Rule) -> eqx_quant.Rule:
    """`rule` with learned weight scales (as `auto_recipe(..., learned=True)` would have made it)."""
    return dataclasses.replace(rule, weight=dataclasses.replace(rule.weight, learned=True))


def auto_rules(model: Any, bench: lm.Bench, bits: float, method: str, earlier: Any = None) -> eqx_quant.AutoRecipe:
    """`auto_recipe`'s allocation at `bits` (the embedding kept at 8 bits, outside the allocation); with `earlier`, the
    predictions of that report again."""
    if earlier is not None:
        return eqx_quant.auto_recipe(model, earlier, average_bits=bits, candidates=CANDIDATES, keep=lm.KEEP)
    return eqx_quant.auto_recipe(
        model,
        lm.calibration_batches(bench)[:AUTO_BATCHES],
        average_bits=bits,
        candidates=CANDIDATES,
        method=method,  # pyright: ignore[reportArgumentType]
        loss="kl",
        keep=lm.KEEP,
        **({"probes": AUTO_PROBES} if method == "hessian" else {}),
    )


def run(
    preset: str,
    out: pathlib.Path,
    *,
    cache: pathlib.Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Runs the comparison and writes `lm_pareto.json` to `out`; returns the results."""
    say = log or (lambda line: None)
    bench = lm.prepare(lm.PRESETS[preset], progress)
    model, training = lm.float_model(bench, cache)
    float_bpc = lm.validation_bpc(model, bench)
    say(f"float: {float_bpc:.4f} bpc ({'cached' if training['cached'] else 'trained'})")
    results: dict[str, Any] = {"preset": preset, "float_bpc": float_bpc, "rows": [], "allocations": {}}

    def add(name: str, kind: str, bits: float, make: Callable[[bool], list[eqx_quant.Rule]]) -> None:
        start = time.perf_counter()
        rtn = eqx_quant.quantize(model, make(False))
        row = {"name": name, "kind": kind, "bits": bits, "bytes": eqx_quant.summary(rtn).stored_bytes}
        row["rtn_bpc"] = lm.validation_bpc(rtn, bench)
        qat = lm.finetune(eqx_quant.quantize(model, make(True)), bench, description=f"qat {name}")
        row["qat_bpc"] = lm.validation_bpc(qat, bench)
        row["seconds"] = time.perf_counter() - start
        results["rows"].append(row)
        say(f"{name}: {row['bytes']:,} B, rtn {row['rtn_bpc']:.4f}, qat {row['qat_bpc']:.4f} bpc")

    for name, bits in UNIFORM.items():
        add(name, "uniform", bits, lambda learned, bits=bits: uniform_rules(bits, learned=learned))
    for method in AUTO_METHODS:
        earlier = None
        for bits in AUTO_BITS:
            start = time.perf_counter()
            auto = auto_rules(model, bench, bits, method, earlier)
            earlier = auto.report
            learned = [learned_rule(rule) for rule in auto["rules"]]
            name = f"auto {method} {bits:g}"
            results["allocations"][name] = {
                "seconds": time.perf_counter() - start,
                "average_bits": auto.report.average_bits,
                "choices": {row.path: row.choice for row in auto.report.rows},
                "traces": {row.path: row.trace for row in auto.report.rows},
                "costs": {row.path: row.costs for row in auto.report.rows},
            }
            say(f"{name}: {results['allocations'][name]['choices']}")
            chosen = auto["rules"]

            def make(flag: bool, chosen=chosen, learned=learned) -> list[eqx_quant.Rule]:
                return [_keep_rule(), *(learned if flag else chosen)]

            add(name, "auto", auto.report.average_bits, make)
    results["targets"] = targets(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lm_pareto.json").write_text(json.dumps(results, indent=1))
    say(table(results))
    return results


def _rtn_bpc(results: dict, name: str) -> float:
    return next(row["rtn_bpc"] for row in results["rows"] if row["name"] == name)


def targets(results: dict) -> dict[str, float]:
    """The targets' figures, from round to nearest: the share of the W3-W4 gap closed at 3 bits, and of the W2-W3
    gap at 2.5 bits, by each method and by the better one."""
    w4, w3, w2 = (_rtn_bpc(results, f"W{b} g32") for b in (4, 3, 2))
    figures = {}
    for method in AUTO_METHODS:
        figures[f"w3_w4_gap_closed_{method}"] = (w3 - _rtn_bpc(results, f"auto {method} 3")) / (w3 - w4)
        figures[f"w2_w3_gap_closed_{method}"] = (w2 - _rtn_bpc(results, f"auto {method} 2.5")) / (w2 - w3)
    for name in ("w3_w4_gap_closed", "w2_w3_gap_closed"):
        figures[name] = max(figures[f"{name}_{method}"] for method in AUTO_METHODS)
    return figures


def table(results: dict) -> str:
    """The rows as a text table, then the targets."""
    header = f"{'row':<20} {'bits':>5} {'bytes':>9} {'rtn':>7} {'qat':>7}"
    lines = [f"float: {results['float_bpc']:.4f} bpc", "", header]
    for row in results["rows"]:
        lines.append(
            f"{row['name']:<20} {row['bits']:>5.2f} {row['bytes']:>9,} {row['rtn_bpc']:>7.4f} {row['qat_bpc']:>7.4f}"
        )
    lines.append("")
    lines += [f"{name}: {value:.3f}" for name, value in results["targets"].items()]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Bits per character against stored bytes: uniform recipes as a line, `auto_recipe` as markers, RTN and QAT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for arm, style in (("rtn_bpc", "-"), ("qat_bpc", "--")):
        uniform = [row for row in results["rows"] if row["kind"] == "uniform"]
        ax.plot([r["bytes"] for r in uniform], [r[arm] for r in uniform], style, marker="o", color="0.4",
                label=f"uniform, {arm[:3]}")  # fmt: skip
        for method, marker in zip(AUTO_METHODS, ("s", "^"), strict=True):
            rows = [row for row in results["rows"] if row["name"].startswith(f"auto {method}")]
            fill = "full" if arm == "rtn_bpc" else "none"
            ax.plot([r["bytes"] for r in rows], [r[arm] for r in rows], marker, linestyle="none", fillstyle=fill,
                    label=f"auto_recipe {method}, {arm[:3]}")  # fmt: skip
    ax.axhline(results["float_bpc"], color="k", linewidth=0.8, label="float")
    ax.set_xlabel("stored weight bytes")
    ax.set_ylabel("validation bits per character")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(lm.PRESETS))
    parser.add_argument("--out", type=pathlib.Path, help="folder for lm_pareto.json")
    parser.add_argument("--cache", type=pathlib.Path, default=None, help="folder of lm.py's trained float model")
    parser.add_argument("--plot", type=pathlib.Path, default=None, help="where to draw the plot")
    parser.add_argument("--results", type=pathlib.Path, default=None, help="print (and plot) a stored run; no run")
    args = parser.parse_args(argv)
    if args.results is not None:
        results = json.loads(args.results.read_text())
        print(table(results))
    else:
        if args.preset is None or args.out is None:
            parser.error("--preset and --out are needed for a run")
        results = run(args.preset, args.out, cache=args.cache)
    if args.plot is not None:
        plot(results, args.plot)
    return results


if __name__ == "__main__":
    main()
