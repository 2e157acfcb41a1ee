"""File sizes of converted float-format models against the float32 model.

Run with `python benchmarks/float_formats_size.py --out DIR`. For an MLP of three 256 x 256 linear layers (with
biases), it writes the float32 model with `eqx.tree_serialise_leaves`, then quantizes it with each weight format
(FP8 e4m3 per output channel, MXFP8 e4m3, MXFP6 e2m3, MXFP4, NVFP4; blocks along the input axis), converts it with
`eqx_quant.convert` and writes it with `eqx_quant.save`. It prints each file's size, its ratio to the float32 file,
and the bits per weight element of the stored codes and scales alone (`QuantizedArray.nbytes`), and writes the
figures to `DIR/float_formats_size.json`. Sizes do not depend on the machine.
"""

import argparse
import json
import os
import pathlib
import tempfile

import equinox as eqx
import jax
import numpy as np

import eqx_quant


# The targets of the float-format issue: an MXFP4 file at most 14% of the float32 one, NVFP4 at most 15%.
TARGETS = {"mxfp4": 0.14, "nvfp4": 0.15}


def _model(width: int, depth: int) -> eqx.nn.MLP:
    """An MLP of `depth + 1` linear layers `width x width`, with NumPy-random parameters."""
    rng = np.random.default_rng(0)
    skeleton = eqx.filter_eval_shape(lambda: eqx.nn.MLP(width, width, width, depth, key=jax.random.key(0)))

    def fill(leaf):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        return jax.numpy.asarray((rng.uniform(-1, 1, leaf.shape) / np.sqrt(width)).astype(leaf.dtype))

    return jax.tree.map(fill, skeleton)


def _weight_formats() -> dict[str, eqx_quant.AbstractQuantizer]:
    return {
        "fp8": eqx_quant.DynamicFloatFakeQuant("float8_e4m3fn", axis=0),
        "mxfp8_e4m3": eqx_quant.MXFakeQuant("mxfp8_e4m3"),
        "mxfp6_e2m3": eqx_quant.MXFakeQuant("mxfp6_e2m3"),
        "mxfp4": eqx_quant.MXFakeQuant("mxfp4"),
        "nvfp4": eqx_quant.NVFP4FakeQuant(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for float_formats_size.json")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2, help="hidden layers (the MLP has depth + 1 linear layers)")
    args = parser.parse_args()
    model = _model(args.width, args.depth)
    elements = sum(layer.weight.size for layer in model.layers)
    results: dict = {"width": args.width, "linear_layers": len(model.layers), "weight_elements": elements}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "float32.eqx")
        eqx.tree_serialise_leaves(path, model)
        base = os.path.getsize(path)
        results["float32_bytes"] = base
        print(f"MLP of {len(model.layers)} linear layers {args.width} x {args.width} ({elements} weights)")
        print(f"{'weights':<12}{'file bytes':>12}{'of float32':>12}{'bits/weight':>13}{'target':>9}")
        print(f"{'float32':<12}{base:>12,}{1:>12.2%}{32:>13.3f}{'':>9}")
        results["formats"] = {}
        for name, quantizer in _weight_formats().items():
            converted = eqx_quant.convert(eqx_quant.quantize(model, weights=quantizer, activations=None))
            path = os.path.join(tmp, f"{name}.eqx")
            eqx_quant.save(path, converted)
            size = os.path.getsize(path)
            stored = sum(layer.qweight.nbytes for layer in converted.layers)
            ratio = size / base
            target = TARGETS.get(name)
            results["formats"][name] = {
                "file_bytes": size,
                "ratio_to_float32": ratio,
                "weight_bits_per_element": 8 * stored / elements,
                "target_ratio": target,
                "meets_target": None if target is None else ratio <= target,
            }
            shown = "" if target is None else f"<= {target:.0%}"
            print(f"{name:<12}{size:>12,}{ratio:>12.2%}{8 * stored / elements:>13.3f}{shown:>9}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "float_formats_size.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out / 'float_formats_size.json'}")


if __name__ == "__main__":
    main()
