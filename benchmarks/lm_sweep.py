"""The sweep behind the LM benchmark's fine-tuning defaults: the peak learning rate of the QAT arm, and delayed
quantization, measured on the benchmark's own model, data and protocol (`lm.py`).

Run with `python benchmarks/lm_sweep.py --preset {smoke,full} --out DIR [--cache DIR] [--recipes ...] [--rates ...]`
(the `examples` extra; the full preset also the `lm` extra, as for `lm.py`), or `--results JSON` to print a stored
run. For each peak learning rate (and the preset's) it fine-tunes, with the preset's steps, warm-up and batches:

- the control arm (the float model, fine-tuned in float), and
- for each recipe, the `qat` arm ([`lm.arm_qat`][]: learned scales from round to nearest),

and scores them by validation bits per character; for each recipe it also scores the `qat` arm with the first half
of the steps in float (delayed quantization, [`eqx_quant.quantized_after`][]) at the preset's learning rate. It writes
`DIR/lm_sweep.json` and prints a table: bits per character, and each QAT row's recovery `(rtn - qat) / (rtn -
control)` against the control arm of the same learning rate.
"""

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Sequence

import lm

import eqx_quant


RATES = (1e-4, 2e-4, 5e-4, 1e-3)
RECIPES = ("w4a16_g32", "w2a16_g32", "ternary")


def run(
    preset: str,
    out: pathlib.Path,
    *,
    cache: pathlib.Path | None = None,
    recipes: Sequence[str] = RECIPES,
    rates: Sequence[float] = RATES,
    progress: bool = True,
) -> dict:
    """Runs the sweep and writes `lm_sweep.json` to `out`; returns the results."""
    if preset not in lm.PRESETS:
        raise ValueError(f"`preset` must be one of {sorted(lm.PRESETS)}, got {preset!r}.")
    for name in recipes:
        eqx_quant.recipe(name)
    if not rates or any(not rate > 0 for rate in rates):
        raise ValueError(f"`rates` must be positive learning rates, got {list(rates)!r}.")
    out.mkdir(parents=True, exist_ok=True)
    base = lm.PRESETS[preset]
    bench = lm.prepare(base, progress)
    model, _ = lm.float_model(bench, cache)  # the float model of the preset, whatever the fine-tuning rate
    results: dict = {
        "preset": dataclasses.asdict(base),
        "float_bpc": lm.validation_bpc(model, bench),
        "rtn": {recipe: lm.validation_bpc(lm.arm_rtn(model, bench, recipe), bench) for recipe in recipes},
        "rows": [],
    }

    def add(kind: str, recipe: str | None, rate: float, delayed: bool, derived) -> None:
        row = {"arm": kind, "recipe": recipe, "learning_rate": rate, "delayed": delayed,
               "val_bpc": lm.validation_bpc(derived, bench)}  # fmt: skip
        results["rows"].append(row)
        print(f"{kind} {recipe or ''} lr {rate:g}{' delayed' if delayed else ''}: {row['val_bpc']:.4f}", flush=True)

    start = time.perf_counter()
    for rate in sorted({*rates, base.finetune_learning_rate}):  # the preset's rate too: the delayed rows' control
        rates_of = dict(finetune_learning_rate=rate, low_bit_learning_rate=rate)
        swept = dataclasses.replace(bench, preset=dataclasses.replace(base, **rates_of))
        add("control", None, rate, False, lm.arm_control(model, swept))
        for recipe in recipes:
            add("qat", recipe, rate, False, lm.arm_qat(model, swept, recipe))
    half = base.finetune_steps // 2
    for recipe in recipes:
        learned = lm.quantized(model, recipe, learned=True)
        rate = base.finetune_learning_rate
        add("qat", recipe, rate, True, lm.finetune(learned, bench, description=f"delayed {recipe}", float_steps=half,
                                                   learning_rate=rate))  # fmt: skip
    results["seconds"] = time.perf_counter() - start
    (out / "lm_sweep.json").write_text(json.dumps(results, indent=1))
    return results


def table(results: dict) -> str:
    """The rows as a Markdown table, with each QAT row's recovery against the control of its learning rate."""
    control = {r["learning_rate"]: r["val_bpc"] for r in results["rows"] if r["arm"] == "control"}
    lines = ["| arm | recipe | peak lr | schedule | val bpc | recovery |", "|---|---|---:|---|---:|---:|"]
    for r in results["rows"]:
        schedule = "half float, then quantized" if r["delayed"] else "quantized throughout"
        recovery = ""
        if r["arm"] == "qat":
            rtn = results["rtn"][r["recipe"]]
            recovery = f"{(rtn - r['val_bpc']) / (rtn - control[r['learning_rate']]):.3f}"
        schedule = "" if r["arm"] == "control" else schedule
        lines.append(
            f"| {r['arm']} | {r['recipe'] or ''} | {r['learning_rate']:g} | {schedule} | {r['val_bpc']:.4f} | "
            f"{recovery} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(lm.PRESETS))
    parser.add_argument("--out", type=pathlib.Path, help="folder for lm_sweep.json")
    parser.add_argument("--cache", type=pathlib.Path, default=None, help="folder for the trained float model")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--rates", nargs="+", type=float, default=list(RATES))
    parser.add_argument("--results", type=pathlib.Path, default=None, help="print the table of an lm_sweep.json")
    args = parser.parse_args(argv)
    if args.results is not None:
        results = json.loads(args.results.read_text())
    elif args.preset is None or args.out is None:
        parser.error("--preset and --out are required unless --results is given")
    else:
        results = run(args.preset, args.out, cache=args.cache, recipes=args.recipes, rates=args.rates)
    print(f"float {results['float_bpc']:.4f} bpc; round to nearest: " + ", ".join(
        f"{recipe} {bpc:.4f}" for recipe, bpc in results["rtn"].items()))  # fmt: skip
    print(table(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
