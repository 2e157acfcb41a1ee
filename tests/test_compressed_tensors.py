"""compressed-tensors checkpoints written by `export_compressed_tensors`, read back with NumPy alone by the layout
that compressed-tensors' source documents (its decompressors need torch, which the test environment does not
install): packed int32 words, zero-point offsets, E2M1 nibbles, E8M0 and E4M3 block scales, and the config."""

import json
import re
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import eqx_quant
from eqx_quant import DynamicFakeQuant, LayerQuantizer, Rule

from .helpers import slow_unless


F32 = np.float32
_DTYPES = {"F32": np.float32, "I32": np.int32, "I64": np.int64, "I8": np.int8, "U8": np.uint8, "U16": np.uint16,
           "U32": np.uint32, "U64": np.uint64, "F8_E4M3": ml_dtypes.float8_e4m3fn,
           "F8_E5M2": ml_dtypes.float8_e5m2}  # fmt: skip
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], F32)


def read_safetensors(path):
    """The tensors of a safetensors file: an 8-byte header length, a JSON header, then the raw little-endian data."""
    data = (path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + start : 8 + n + end], _DTYPES[info["dtype"]]).reshape(info["shape"])
    return out, header.get("__metadata__")


def unpack_int32(words, bits, cols):
    """compressed-tensors' `unpack_from_int32` along the last axis: element i of a row from bits i*bits onwards of
    the row's words, minus the offset 2**(bits - 1)."""
    stream = np.ascontiguousarray(words).astype("<u4").view(np.uint8)  # the bytes of the words, in order
    bitstream = np.unpackbits(stream.reshape(*words.shape[:-1], -1), axis=-1, bitorder="little")
    weights = 1 << np.arange(bits)
    values = bitstream[..., : cols * bits].reshape(*words.shape[:-1], cols, bits) @ weights
    return values.astype(np.int64) - (1 << (bits - 1))


def unpack_fp4(packed):
    """Two E2M1 codes a byte, the first in the low nibble; bit 3 the sign."""
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    return np.where(codes & 8, -1.0, 1.0).astype(F32) * E2M1[codes & 7]


def dequantize(tensors, module, args):
    """A layer's weight as compressed-tensors' decompressors compute it, in float32."""
    t = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".")}
    scale = t["weight_scale"]
    if args["type"] == "int":
        if "weight_packed" in t:
            rows, cols = t["weight_shape"]
            q = unpack_int32(t["weight_packed"], args["num_bits"], cols)
        else:
            q = t["weight"].astype(np.int64)
        zp = t.get("weight_zero_point")
        if zp is not None and "weight_packed" in t and args["strategy"] != "tensor":
            zp = unpack_int32(zp.T, args["num_bits"], scale.shape[0]).T  # packed along the output channels
        zp = np.zeros_like(scale) if zp is None else zp.astype(F32)
        if args["strategy"] == "group":
            groups = q.reshape(q.shape[0], -1, args["group_size"]).astype(F32)
            return ((groups - zp[..., None]) * scale[..., None]).reshape(q.shape)
        return (q.astype(F32) - zp) * scale
    if args["num_bits"] == 8:
        return t["weight"].astype(F32) * scale
    values = unpack_fp4(t["weight_packed"])
    g = args["group_size"]
    if args["strategy"] == "group":  # MXFP4: E8M0 scales
        block = np.ldexp(np.ones_like(scale, F32), scale.astype(np.int32) - 127)
    else:  # NVFP4: E4M3 block scales divided by the global scale
        block = scale.astype(F32) / t["weight_global_scale"]
    return (values.reshape(values.shape[0], -1, g) * block[..., None]).reshape(values.shape)


def _rules(name):
    if name == "int4_asym":
        return [Rule(".*", weight=DynamicFakeQuant(4, group_size=32, symmetric=False), input=None)]
    if name == "int8_asym_w8a8":
        weight = DynamicFakeQuant(8, axis=0, symmetric=False)
        return [Rule(".*", weight=weight, input=DynamicFakeQuant(8, symmetric=False))]
    rules = eqx_quant.recipe(name)["rules"]
    if name == "nvfp4":  # NVFP4 inputs need a calibrated global scale: weights only here
        rules = [Rule(".*", weight=rules[0].weight, input=None)]
    return rules


CASES = {
    "w4a16_g32": ("pack-quantized", None),
    "w2a16_g32": ("pack-quantized", None),
    "w8a16": ("pack-quantized", None),
    "int4_asym": ("pack-quantized", None),
    "w8a8": ("int-quantized", "token"),
    "w4a8_g32": ("int-quantized", "token"),
    "int8_asym_w8a8": ("int-quantized", "token"),
    "fp8": ("float-quantized", "token"),
    "mxfp4": ("mxfp4-pack-quantized", "group"),
    "nvfp4": ("nvfp4-pack-quantized", None),
}


@pytest.mark.parametrize("name", slow_unless(["w4a16_g32", "w8a8", "fp8", "nvfp4"], list(CASES)))
def test_layout_and_values(name, tmp_path):
    mlp = eqx.nn.MLP(64, 16, 96, 2, key=jax.random.key(0))
    model = eqx_quant.convert(eqx_quant.quantize(mlp, _rules(name)))
    eqx_quant.export_compressed_tensors(tmp_path, model, config={"architectures": ["MLP"], "hidden_size": 96})
    tensors, metadata = read_safetensors(tmp_path / "model.safetensors")
    assert metadata == {"format": "pt"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MLP"] and config["hidden_size"] == 96
    qc = config["quantization_config"]
    compression, input_strategy = CASES[name]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == compression and qc["ignore"] == []
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["layers.0", "layers.1", "layers.2"] and group["format"] == compression
    inputs = group["input_activations"]
    assert (inputs and inputs["strategy"]) == input_strategy
    if inputs is not None:
        assert inputs["dynamic"] is True
    args = group["weights"]
    for i, layer in enumerate(model.layers):
        ours = np.asarray(layer.weight)
        theirs = dequantize(tensors, f"layers.{i}", args)
        if name == "nvfp4":
            # The codes and block scales are eqx_quant's; the global scale is the reciprocal of its tensor scale.
            np.testing.assert_array_equal(
                tensors[f"layers.{i}.weight_scale"].view(np.uint8), layer.qweight.scale[..., 0]
            )
            t = np.asarray(layer.qweight.tensor_scale, F32)
            np.testing.assert_array_equal(tensors[f"layers.{i}.weight_global_scale"], [F32(1) / t])
            np.testing.assert_allclose(theirs, ours, rtol=2**-22, atol=0)
        else:
            np.testing.assert_array_equal(theirs.view(np.uint32), ours.view(np.uint32))  # bit for bit, signed zeros too
        np.testing.assert_array_equal(tensors[f"layers.{i}.bias"], layer.layer.bias)
    if args["type"] == "int" and compression == "pack-quantized" and not name.endswith("asym"):
        # the safetensors library itself reads the file
        assert set(safetensors.numpy.load_file(tmp_path / "model.safetensors")) == set(tensors)


@pytest.mark.slow
def test_config_groups_ignore_names_stacked_and_static_inputs(tmp_path):
    k = jax.random.split(jax.random.key(1), 4)
    model = {
        "blocks": eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 64, key=k))(jax.random.split(k[0], 2)),
        "mlp": eqx.nn.Linear(64, 32, key=k[1]),
        "head": eqx.nn.Linear(32, 8, key=k[2]),
        "embed": eqx.nn.Embedding(10, 64, key=k[3]),
    }
    rules = [Rule("head", weight=None, input=None), Rule("mlp", weight=DynamicFakeQuant(8, axis=0)),
             Rule(".*", weight=LayerQuantizer(eqx_quant.int_format(4), 32), input=None)]  # fmt: skip
    fake = eqx_quant.quantize(model, rules)
    data = [jax.random.normal(jax.random.key(2), (4, 64))]
    calibrated = eqx.tree_at(lambda m: m["mlp"], fake, eqx_quant.calibrate(fake["mlp"], data))
    converted = eqx_quant.convert(calibrated)
    names = {"blocks.weight": "model.layers.{layer}.proj.weight", "blocks.bias": "model.layers.{layer}.proj.bias",
             "mlp.weight": "model.mlp.weight", "mlp.bias": "model.mlp.bias", "head.weight": "lm_head.weight",
             "head.bias": None, "embed.weight": "model.embed_tokens.weight"}  # fmt: skip
    with pytest.warns(UserWarning, match=r"the quantized weights \[.embed.weight.\] .* dequantized"):
        eqx_quant.export_compressed_tensors(tmp_path, converted, names=names)
    tensors, _ = read_safetensors(tmp_path / "model.safetensors")
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision" and qc["ignore"] == ["lm_head"]
    groups = {tuple(g["targets"]): g for g in qc["config_groups"].values()}
    assert set(groups) == {("model.layers.0.proj", "model.layers.1.proj"), ("model.mlp",)}
    static = groups[("model.mlp",)]
    assert static["format"] == "int-quantized"
    assert static["input_activations"]["strategy"] == "tensor" and static["input_activations"]["dynamic"] is False
    np.testing.assert_array_equal(tensors["model.mlp.input_scale"], [converted["mlp"].input_quant.scale])
    for i in range(2):
        theirs = dequantize(
            tensors, f"model.layers.{i}.proj", groups[("model.layers.0.proj", "model.layers.1.proj")]["weights"]
        )
        np.testing.assert_array_equal(theirs, np.asarray(converted["blocks"].weight[i]))
    # the quantized embedding is written as the weight the model uses; the float head as it is, its bias left out
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], converted["embed"].weight)
    np.testing.assert_array_equal(tensors["lm_head.weight"], model["head"].weight)
    assert "lm_head.bias" not in tensors


class _Scanned(eqx.Module):
    blocks: eqx.nn.Linear

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        return jax.lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), x, dynamic)[0]


def test_a_calibrated_stack_writes_an_input_scale_per_layer(tmp_path):
    """`calibrate` gives a scanned stack one static input scale per layer, in a LearnedFakeQuant: each layer gets its
    own `input_scale`, a static `tensor` strategy; the weights dequantize to the converted model's bit for bit."""
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(8, 8, key=k))(jax.random.split(jax.random.key(1), 3))
    data = [jax.random.normal(jax.random.key(2), (4, 8))]
    calibrated = eqx_quant.calibrate(eqx_quant.quantize(_Scanned(blocks), **eqx_quant.recipe("w8a8")), data)
    quantizer = calibrated.blocks.input_quant
    assert isinstance(quantizer, eqx_quant.LearnedFakeQuant) and quantizer.scale.shape == (3,)
    converted = eqx_quant.convert(calibrated)
    names = {"blocks.weight": "layers.{layer}.proj.weight", "blocks.bias": "layers.{layer}.proj.bias"}
    eqx_quant.export_compressed_tensors(tmp_path, converted, names=names)
    tensors, _ = read_safetensors(tmp_path / "model.safetensors")
    (group,) = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"].values()
    assert group["targets"] == [f"layers.{i}.proj" for i in range(3)] and group["format"] == "int-quantized"
    assert group["input_activations"]["strategy"] == "tensor" and group["input_activations"]["dynamic"] is False
    scales = np.asarray(quantizer.scale)
    assert len(set(scales.tolist())) == 3  # a scale of each layer's own
    for i in range(3):
        np.testing.assert_array_equal(tensors[f"layers.{i}.proj.input_scale"], scales[i : i + 1])
        np.testing.assert_array_equal(dequantize(tensors, f"layers.{i}.proj", group["weights"]),
                                      np.asarray(converted.blocks.weight[i]))  # fmt: skip


def test_a_stack_written_whole_describes_its_stacked_shape(tmp_path):
    """Without `{layer}` in the names a stack's packed weight is one tensor with the stack's axis in front, and its
    `weight_shape` says so: unpacked at that shape, each layer's codes times scales are its converted weight."""
    blocks = eqx.filter_vmap(lambda k: eqx.nn.Linear(64, 16, key=k))(jax.random.split(jax.random.key(1), 2))
    converted = eqx_quant.convert(eqx_quant.quantize(_Scanned(blocks), **eqx_quant.recipe("w4a16_g32")))
    eqx_quant.export_compressed_tensors(tmp_path, converted)
    tensors, _ = read_safetensors(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(tensors["blocks.weight_shape"], [2, 16, 64])
    codes = unpack_int32(tensors["blocks.weight_packed"], 4, 64)
    scales = tensors["blocks.weight_scale"]
    assert codes.shape == (2, 16, 64) and scales.shape == (2, 16, 2)
    weights = (codes.reshape(2, 16, 2, 32).astype(F32) * scales[..., None]).reshape(2, 16, 64)
    np.testing.assert_array_equal(weights, np.asarray(converted.blocks.weight))


def test_a_learned_asymmetric_input_writes_its_step_size_and_rounded_zero_point(tmp_path):
    """The step size a LearnedFakeQuant uses (floored at `min_scale`) and its zero point rounded into the grid."""
    linear = {"a": eqx.nn.Linear(64, 8, key=jax.random.key(0))}
    for zero_point, stored, scale in ((3.4, 3, 0.05), (300.0, 127, 1e-12)):
        learned = eqx_quant.LearnedFakeQuant(scale, -128, 127, zero_point=0.0, min_scale=1e-9)
        # Set as training leaves it, off the grid perhaps (the constructor refuses a start outside it).
        learned = eqx.tree_at(lambda q: q.zero_point, learned, jnp.float32(zero_point))
        rules = [Rule(".*", weight=DynamicFakeQuant(8, axis=0), input=learned)]
        eqx_quant.export_compressed_tensors(tmp_path, eqx_quant.convert(eqx_quant.quantize(linear, rules)))
        tensors, _ = read_safetensors(tmp_path / "model.safetensors")
        (group,) = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"].values()
        inputs = group["input_activations"]
        assert inputs["symmetric"] is False and inputs["zp_dtype"] == "torch.int8"
        np.testing.assert_array_equal(tensors["a.input_scale"], np.asarray([max(scale, 1e-9)], np.float32))
        np.testing.assert_array_equal(tensors["a.input_zero_point"], np.asarray([stored], np.int8))


def test_a_head_tied_by_shared_is_written_once_and_its_input_quantizer_refused(tmp_path):
    """A head tied with `eqx.nn.Shared` has no weight of its own: the checkpoint holds the table once (an embedding:
    its dequantized float32 values), for a reader that ties the head to it; a tied head that quantizes its input,
    which the checkpoint cannot describe without a weight, is refused naming it and the rule that fixes it."""
    from .test_gguf import _Tied

    model = eqx_quant.convert(eqx_quant.quantize(_Tied(), **eqx_quant.recipe("w4a16_g32")))
    with pytest.warns(UserWarning, match=r"\['shared\.pytree\.0\.weight'\] \(of embeddings or convolutions\)"):
        eqx_quant.export_compressed_tensors(tmp_path / "w4", model)
    tensors, _ = read_safetensors(tmp_path / "w4" / "model.safetensors")
    assert list(tensors) == ["shared.pytree.0.weight"]
    np.testing.assert_array_equal(tensors["shared.pytree.0.weight"], np.asarray(model.shared()[0].weight))
    w8a8 = eqx_quant.convert(eqx_quant.quantize(_Tied(), **eqx_quant.recipe("w8a8")))
    message = r"'shared\.pytree\.1' reads its weight through an `eqx\.nn\.Shared` tie and quantizes its input"
    with pytest.raises(ValueError, match=message + r".*Rule\('shared\.pytree\.1', input=None\)"):
        eqx_quant.export_compressed_tensors(tmp_path / "w8a8", w8a8)
    assert not (tmp_path / "w8a8").exists()


def test_errors(tmp_path):
    mlp = {"a": eqx.nn.Linear(64, 8, key=jax.random.key(0))}

    def convert(rules):
        return eqx_quant.convert(eqx_quant.quantize(mlp, rules))

    with pytest.raises(ValueError, match=r"Layer 'a' has weights in format q4_0 .* compressed-tensors does not store"):
        eqx_quant.export_compressed_tensors(tmp_path, convert(eqx_quant.recipe("q4_0")["rules"]))
    with pytest.raises(ValueError, match="3-bit values"):
        eqx_quant.export_compressed_tensors(tmp_path, convert(eqx_quant.recipe("w3a16_g32")["rules"]))
    with pytest.raises(ValueError, match="format uint4"):
        eqx_quant.export_compressed_tensors(
            tmp_path, convert([Rule(".*", weight=DynamicFakeQuant("uint4", axis=0), input=None)])
        )
    with pytest.raises(ValueError, match="NVFP4 activations need a calibrated global scale"):
        eqx_quant.export_compressed_tensors(tmp_path, convert(eqx_quant.recipe("nvfp4")["rules"]))
    with pytest.raises(ValueError, match="not converted"):
        eqx_quant.export_compressed_tensors(tmp_path, eqx_quant.quantize(mlp, **eqx_quant.recipe("w8a16")))
    with pytest.raises(ValueError, match="must end in 'weight'"):
        eqx_quant.export_compressed_tensors(
            tmp_path, convert(eqx_quant.recipe("w8a16")["rules"]), names=lambda p: p + "_w"
        )
    # A convolution's quantized input: the error says how to leave it out, and that model exports.
    net = {"conv": eqx.nn.Conv1d(2, 4, 3, key=jax.random.key(1)), "a": mlp["a"]}
    rules = [Rule("conv", input=None), *eqx_quant.recipe("w8a8")["rules"]]
    with pytest.raises(ValueError, match=r"'conv.input_quant' is a DynamicFakeQuant, .* `Rule\('conv', input=None\)`"):
        eqx_quant.export_compressed_tensors(tmp_path, eqx_quant.convert(eqx_quant.quantize(net, rules[1:])))
    assert not (tmp_path / "config.json").exists()
    with pytest.warns(UserWarning, match=r"the quantized weights \['conv.weight'\] \(of embeddings or convolutions\)"):
        eqx_quant.export_compressed_tensors(tmp_path, eqx_quant.convert(eqx_quant.quantize(net, rules)))
    assert (tmp_path / "config.json").exists()
    conv = eqx_quant.convert(eqx_quant.quantize(net, rules))["conv"]
    tensors, _ = read_safetensors(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(tensors["conv.weight"], conv.weight)  # the weight the converted model uses


def test_a_bad_config_is_refused_before_anything_is_written(tmp_path):
    """`config` is checked, and serialised, before the checkpoint is touched: an existing one keeps its bytes, a new
    directory is not made. The exporter writes `quantization_config` itself: a `config` holding one is refused."""
    linear = {"a": eqx.nn.Linear(64, 8, key=jax.random.key(0))}
    model = eqx_quant.convert(eqx_quant.quantize(linear, **eqx_quant.recipe("w4a16_g32")))
    other = eqx_quant.convert(eqx_quant.quantize({"a": eqx.nn.Linear(64, 8, key=jax.random.key(1))},
                                                 **eqx_quant.recipe("w4a16_g32")))  # fmt: skip
    eqx_quant.export_compressed_tensors(tmp_path / "ct", model, config={"hidden_size": 64})
    files = {name: (tmp_path / "ct" / name).read_bytes() for name in ("model.safetensors", "config.json")}
    cases = [
        (TypeError, r"`config`\['k'\]=<object object at .*> is not JSON: Object of type object", {"k": object()}),
        (ValueError, r"`config`\['k'\]=nan is not valid JSON", {"k": float("nan")}),
        (ValueError, r"`config`\['k'\]=\{'x': \[inf\]\} is not valid JSON", {"k": {"x": [float("inf")]}}),
        # (Under this suite's jaxtyping hook, beartype names `config` first: "`config` must be a mapping ... got
        # config='x' of type str" and "`config` keys must be strings, got 1 of type int" without it.)
        (TypeError, "config", {1: 2}),
        (TypeError, "config", "x"),
        (ValueError, r"`config` holds 'quantization_config' \(=\{'format': 'dense'\}\), which export_compressed_"
         r"tensors writes itself", {"hidden_size": 64, "quantization_config": {"format": "dense"}}),
    ]  # fmt: skip
    for error, message, config in cases:
        with pytest.raises(error, match=message):
            eqx_quant.export_compressed_tensors(tmp_path / "ct", other, config=config)
        with pytest.raises(error, match=message):
            eqx_quant.export_compressed_tensors(tmp_path / "fresh", model, config=config)
        assert {name: (tmp_path / "ct" / name).read_bytes() for name in files} == files
        assert not (tmp_path / "fresh").exists()


def test_a_model_with_nothing_to_write_is_refused(tmp_path):
    """No converted layer (None, a float model), or `names` that leave out every tensor: refused as
    `export_safetensors` refuses them, nothing written. A partly converted model is written, its float layers
    ignored."""
    linear = {"a": eqx.nn.Linear(64, 8, key=jax.random.key(0)), "b": eqx.nn.Linear(8, 8, key=jax.random.key(1))}
    for model in (None, linear):
        with pytest.raises(ValueError, match="`model` has no converted layer; convert it first"):
            eqx_quant.export_compressed_tensors(tmp_path / "ct", model)
        with pytest.raises(ValueError, match="`model` has no converted layer"):
            eqx_quant.export_safetensors(tmp_path / "ct.safetensors", model)
    partly = eqx_quant.convert(eqx_quant.quantize(linear, [Rule("b", weight=None, input=None),
                                                          *eqx_quant.recipe("w4a16_g32")["rules"]]))  # fmt: skip
    with pytest.raises(ValueError, match=r"`names` leaves out every tensor of `model` \(None for each of \['a.bias'"):
        eqx_quant.export_compressed_tensors(tmp_path / "ct", partly, names=lambda path: None)
    assert not (tmp_path / "ct").exists()
    eqx_quant.export_compressed_tensors(tmp_path / "ct", partly)
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["b"] and [g["targets"] for g in qc["config_groups"].values()] == [["a"]]


def test_every_dtype_safetensors_holds_is_stored_and_others_refused_naming_the_leaf(tmp_path):
    """Arrays beside the layers are written in their own dtype where safetensors has one (unsigned integers, an old
    `jax.random.PRNGKey`'s uint32 words, FP8 variants), read back bit for bit by the `safetensors` package. A dtype
    it lacks (typed PRNG keys, int4) is refused naming the leaf, before the directory is made; `names` can leave
    such a leaf out."""
    linear = eqx_quant.convert(eqx_quant.quantize(eqx.nn.Linear(64, 8, key=jax.random.key(0)),
                                                  **eqx_quant.recipe("w8a16")))  # fmt: skip
    extra = {"u16": jnp.array([0, 1, 65535], jnp.uint16), "u32": jax.random.PRNGKey(0),
             "u64": np.array([2**64 - 1, 3], np.uint64),
             "e5m2": jnp.array([-57344.0, 0.5], jnp.float8_e5m2)}  # fmt: skip
    eqx_quant.export_compressed_tensors(tmp_path / "ct", {"linear": linear, **extra})
    path = tmp_path / "ct" / "model.safetensors"
    header = json.loads(path.read_bytes()[8 : 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]])
    assert {name: header[name]["dtype"] for name in extra} == {"u16": "U16", "u32": "U32", "u64": "U64",
                                                               "e5m2": "F8_E5M2"}  # fmt: skip
    with safetensors.safe_open(path, "numpy") as f:  # its header, F8_E5M2 included; NumPy has no float8_e5m2
        ints = {name: f.get_tensor(name) for name in ("u16", "u32", "u64")}
    for name, array in ints.items():
        assert array.dtype == np.asarray(extra[name]).dtype
        np.testing.assert_array_equal(array, np.asarray(extra[name]))
    raw, _ = read_safetensors(path)
    assert raw["e5m2"].tobytes() == np.asarray(extra["e5m2"]).tobytes()
    cases = [
        (jax.random.key(0), "'seed' is an array of PRNG keys (dtype key<fry>), which safetensors does not store: "
         "hold `jax.random.key_data(key)` (its uint32 words) in the model instead. Or leave it out: `names` giving "
         "None for it."),
        (jnp.zeros(4, jnp.int4), "'seed' has dtype int4, which safetensors does not store (it stores bool, int8, "),
    ]  # fmt: skip
    for seed, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            eqx_quant.export_compressed_tensors(tmp_path / "fresh", {"linear": linear, "seed": seed})
        assert not (tmp_path / "fresh").exists()
        eqx_quant.export_compressed_tensors(tmp_path / "left_out", {"linear": linear, "seed": seed},
                                            names=lambda p: None if p == "seed" else p)  # fmt: skip
        with safetensors.safe_open(tmp_path / "left_out" / "model.safetensors", "numpy") as f:
            assert "seed" not in f.keys() and "linear.weight_scale" in f.keys()


def test_a_directory_holding_other_safetensors_files_is_refused(tmp_path):
    """A previous sharded checkpoint (`model.safetensors.index.json` and its shards) or any other `.safetensors` file
    would be read beside the new `model.safetensors`, or instead of it (vLLM reads every `.safetensors` file of the
    directory, or those the index lists): refused naming them, nothing written or removed. A previous
    `model.safetensors` and `config.json` are replaced."""
    model = eqx_quant.convert(eqx_quant.quantize({"a": eqx.nn.Linear(64, 8, key=jax.random.key(0))},
                                                 **eqx_quant.recipe("w4a16_g32")))  # fmt: skip
    index = {"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                                            "a.bias": "model-00002-of-00002.safetensors"}}  # fmt: skip
    sharded = {"model.safetensors.index.json": json.dumps(index).encode(), "config.json": b"{}",
               "model-00001-of-00002.safetensors": b"shard 1",
               "model-00002-of-00002.safetensors": b"shard 2"}  # fmt: skip
    cases = [
        (sharded, "['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors."
         "index.json']"),
        ({"model.safetensors.index.json": b"{}"}, "['model.safetensors.index.json']"),
        ({"model-00001-of-00002.safetensors": b"shard 1", "tokenizer.json": b"{}"},
         "['model-00001-of-00002.safetensors']"),
    ]  # fmt: skip
    for i, (files, listed) in enumerate(cases):
        directory = tmp_path / str(i)
        directory.mkdir()
        for name, data in files.items():
            (directory / name).write_bytes(data)
        message = (f"`directory`={str(directory)!r} holds {listed}, which loaders read beside the "
                   "model.safetensors written, or instead of it (vLLM reads every .safetensors file of a directory, "
                   "or those that model.safetensors.index.json lists): write into a new directory, or remove them "
                   "first.")  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            eqx_quant.export_compressed_tensors(directory, model)
        assert {p.name: p.read_bytes() for p in directory.iterdir()} == files
    eqx_quant.export_compressed_tensors(tmp_path / "again", model)
    (tmp_path / "again" / "config.json").write_text("{}")
    eqx_quant.export_compressed_tensors(tmp_path / "again", model)
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["config.json", "model.safetensors"]
    assert "quantization_config" in json.loads((tmp_path / "again" / "config.json").read_text())
