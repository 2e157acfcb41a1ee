"""The library's own argument errors, as users meet them: without the jaxtyping import hook.

Under the hook that the main suite runs with, beartype rejects a wrong `Literal` or `bool` argument before the
library's own check runs, so these messages would never be seen by a test. `tests/test_edge_cases.py` runs this file
in a pytest of its own, with the hook off.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_quant
from tests.helpers import few_rows


def test_the_hook_is_off():
    # Under the hook, this call would raise beartype's error instead of ours.
    with pytest.raises(TypeError, match=re.escape("`signed` must be a bool, got 'yes'.")):
        eqx_quant.int_range(8, signed="yes")


def test_literal_and_bool_arguments():
    x = jnp.linspace(-1.0, 1.0, 8)
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    linear = eqx.nn.Linear(3, 2, key=jax.random.key(0))

    def unread():  # batches that must not be read
        raise AssertionError("read")
        yield

    cases = [
        (ValueError, "`method` must be one of ('absmax', 'minmax', 'percentile', 'mse'), got method='max'.",
         lambda: eqx_quant.FakeQuant.calibrate(x, 8, method="max")),
        (ValueError, "`method` must be one of ('absmax', 'minmax', 'percentile', 'mse'), got method='mean'.",
         lambda: eqx_quant.calibrate(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], method="mean")),
        (ValueError, "`matmul` must be 'int' or 'float', got matmul='int8'.",
         lambda: eqx_quant.quantize(mlp, matmul="int8")),
        (ValueError, "`matmul` must be one of ('int', 'float'), got matmul='fp'.",
         lambda: eqx_quant.nn.QuantLinear(linear, matmul="fp")),
        (TypeError, "`symmetric` must be a bool, got 1.",
         lambda: eqx_quant.DynamicFakeQuant(8, symmetric=1)),
        (TypeError, "`narrow` must be a bool, got 1.",
         lambda: eqx_quant.int_range(8, narrow=1)),
        (TypeError, "`x` must have a real dtype, got complex64.",
         lambda: eqx_quant.FakeQuant.calibrate(jnp.ones(3, jnp.complex64), 8)),
        (TypeError, "`x` must have a real dtype, got complex64.",
         lambda: eqx_quant.LearnedFakeQuant.init_from(jnp.ones(3, jnp.complex64), 8)),
        (TypeError, "`layer` must be an eqx.nn.Linear, got Conv2d.",
         lambda: eqx_quant.nn.QuantLinear(eqx.nn.Conv2d(1, 1, 1, key=jax.random.key(0)))),
        (TypeError, "`weight_quant` must be a quantizer module or None, got 'int8'.",
         lambda: eqx_quant.nn.QuantLinear(linear, weight_quant="int8")),
        (TypeError, "`axis_name` must be None, a non-empty str or a tuple of them, got axis_name=3.",
         lambda: eqx_quant.DynamicFakeQuant(8, axis_name=3)),
        (TypeError, "`format` must be a Format, a format's name or a number of bits, got 8.0 of type float.",
         lambda: eqx_quant.DynamicFakeQuant(8.0)),
        (TypeError, "`lo` must be a real number, got 'a'.",
         lambda: eqx_quant.PassthroughClip("a", 1.0)),
        (TypeError, "`qmin` must be an int, got 1.5 of type float.",
         lambda: eqx_quant.FakeQuant(1.0, 1.5, 7)),
        (TypeError, "`min_scale` must be a real number, got 'x' of type str.",
         lambda: eqx_quant.LearnedFakeQuant(1.0, -8, 7, min_scale="x")),
        (TypeError, "`min_scale` must be a real number, got None of type NoneType.",
         lambda: eqx_quant.LearnedFloatFakeQuant("float8_e4m3fn", 1.0, min_scale=None)),
        (TypeError, "`backward` must be a QuantizedBackward, an UnquantizedBackward or None, got backward='int8'.",
         lambda: eqx_quant.quantize(mlp, backward="int8")),
        (TypeError, "`backward` must be a QuantizedBackward, an UnquantizedBackward or None, got backward='int8'.",
         lambda: eqx_quant.Rule(backward="int8")),
        (TypeError, "`backward` must be a QuantizedBackward, an UnquantizedBackward or None, got backward='int8'.",
         lambda: eqx_quant.recipe("w8a8", backward="int8")),
        (TypeError, "`backward` must be an UnquantizedBackward or None, got backward=QuantizedBackward(bits=8, "
                    "rounding='nearest').",
         lambda: eqx_quant.nn.QuantConv(eqx.nn.Conv1d(1, 1, 1, key=jax.random.key(0)),
                                        backward=eqx_quant.QuantizedBackward(8))),
        (ValueError, "`rounding` must be one of ('nearest', 'stochastic'), got rounding='up'.",
         lambda: eqx_quant.QuantizedBackward(8, rounding="up")),
        (TypeError, "`backward` must be a QuantizedBackward, an UnquantizedBackward or None, got backward='int8'.",
         lambda: eqx_quant.nn.QuantLinear(linear, backward="int8")),
        (ValueError, "`method` must be 'lsq', 'absmax' or 'paretoq', got method='ternary'.",
         lambda: eqx_quant.LearnedFakeQuant.init_from(x, 2, method="ternary")),
        (ValueError, "`method` must be 'absmax' or 'paretoq', got method='lsq'.",
         lambda: eqx_quant.LayerQuantizer(eqx_quant.int_format(4), learned=True, method="lsq")),
        (ValueError, "`matmul` must be None, 'int' or 'float', got matmul='fast'.",
         lambda: eqx_quant.convert(eqx_quant.quantize(mlp), matmul="fast")),
        (TypeError, "`rules` must be a list of eqx_quant.Rule, got a dict with keys ['rules']: pass a recipe as "
                    "keyword arguments, `eqx_quant.quantize(model, **eqx_quant.recipe(name))`.",
         lambda: eqx_quant.quantize(mlp, eqx_quant.recipe("w8a8"))),
        (TypeError, "`rules` must be a list of eqx_quant.Rule, got the string 'w8a8': pass a recipe as keyword "
                    "arguments, `eqx_quant.quantize(model, **eqx_quant.recipe('w8a8'))`.",
         lambda: eqx_quant.quantize(mlp, "w8a8")),
        (TypeError, "`per_token` must be a bool, got per_token='yes'.",
         lambda: eqx_quant.LayerQuantizer(8, input=True, per_token="yes")),
        (TypeError, "`n_steps` must be an int, got n_steps=2.0.",
         lambda: eqx_quant.quantized_after(2.0, 0, lambda m: 0.0, eqx_quant.quantize(mlp))),
        (TypeError, "`step` must be an integer scalar, got step=1.5.",
         lambda: eqx_quant.quantized_after(2, 1.5, lambda m: 0.0, eqx_quant.quantize(mlp))),
        (TypeError, "`alpha` must be a real number, got '0.5' of type str.",
         lambda: eqx_quant.smoothquant(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], alpha="0.5")),
        (TypeError, "`alpha` must be a real number, got [0.3, 0.5] of type list.",
         lambda: eqx_quant.smoothquant(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], alpha=[[0.3, 0.5]])),
        (TypeError, "`alpha` must be a real number or a sequence of them, got None of type NoneType.",
         lambda: eqx_quant.smoothquant(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], alpha=None)),
        (TypeError, "`alpha` must be a real number, got 'high' of type str.",
         lambda: eqx_quant.smoothquant(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], alpha=[0.5, "high"])),
        (TypeError, "`batched` must be a bool, got batched=1.",
         lambda: eqx_quant.smoothquant(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], batched=1)),
        (TypeError, "`fold` must be True, False or 'only', got fold=1.",
         lambda: eqx_quant.smoothquant(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], fold=1)),
        (TypeError, "`fold` must be True, False or 'only', got fold=None.",
         lambda: eqx_quant.awq(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], fold=None)),
        (TypeError, "`grid` must be an int, got 2.5 of type float.",
         lambda: eqx_quant.awq(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], grid=2.5)),
        (TypeError, "`clip` must be a bool, got clip='yes'.",
         lambda: eqx_quant.awq(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], clip="yes")),
        (TypeError, "`key` must be a JAX PRNG key (`jax.random.key(0)`), got key=0.",
         lambda: eqx_quant.rotate(eqx_quant.quantize(mlp), key=0)),
        (TypeError, "`where` must be a function `f(path, layer)`, a regular expression or None, got where=0.",
         lambda: eqx_quant.rotate(eqx_quant.quantize(mlp), key=jax.random.key(0), where=0)),
        (ValueError, "`where`='layers.(' is not a regular expression: missing ), unterminated subpattern at "
                     "position 7.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], where="layers.(")),
        (TypeError, "`batched` must be a bool, got batched='yes'.",
         lambda: eqx_quant.rotate(eqx_quant.quantize(mlp), key=jax.random.key(0), batched="yes")),
        (TypeError, "`act_order` must be a bool, got act_order=1.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), iter(()), act_order=1)),
        (TypeError, "`damp` must be a real number, got '0.1' of type str.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), iter(()), damp="0.1")),
        (TypeError, "`quantized_inputs` must be a bool, got quantized_inputs=1.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), iter(()), quantized_inputs=1)),
        (TypeError, "`sequential` must be a bool, got sequential=1.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), [jnp.ones((2, 3))], sequential=1)),
        (ValueError, "`method` must be 'absmax' or 'mse', got method='max'.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), iter(()), method="max")),
        (TypeError, "`model` must be callable, as it runs on the batches, got a dict with keys ['a', 'b']. Wrap its "
                    "parts in a module whose `__call__` runs them.",
         lambda: eqx_quant.calibrate(eqx_quant.quantize({"a": linear, "b": linear}), unread())),
        (TypeError, "`model` must be callable, as it runs on the batches, got a dict with keys ['a', 'b']. Wrap its "
                    "parts in a module whose `__call__` runs them.",
         lambda: eqx_quant.gptq(eqx_quant.quantize({"a": linear, "b": linear}), unread())),
        (TypeError, "`model` must be callable, as it runs on the batches, got a dict with keys ['a', 'b']. Wrap its "
                    "parts in a module whose `__call__` runs them.",
         lambda: eqx_quant.smoothquant(eqx_quant.quantize({"a": linear, "b": linear}), unread())),
        (ValueError, "`method` must be 'absmax' or 'mse', got method='max'.",
         lambda: eqx_quant.gptq_quantize(jnp.ones((3, 4)), jnp.eye(4), -8, 7, method="max")),
        (TypeError, "`num_candidates` must be an int, got 2.0 of type float.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), iter(()), num_candidates=2.0)),
        (TypeError, "`input_transform` must be an input transform module or None, got 2.0.",
         lambda: eqx_quant.nn.QuantLinear(linear, input_transform=2.0)),
        (TypeError, "`example` must be a tuple of arguments for one call `model(*example)`, or a function f(model) "
                    "that calls the model, got [1.0].",
         lambda: eqx_quant.quantize(mlp, example=[1.0])),
        # The flags of the functions that read batches (a string flag was taken for `batched`'s truth, then failed on
        # the batch's shape), and batches that are not an iterable, checked before anything is read.
        (TypeError, "`batched` must be a bool, got batched='yes'.",
         lambda: eqx_quant.calibrate(eqx_quant.quantize(mlp), unread(), batched="yes")),
        (TypeError, "`progress` must be a bool, got progress='yes'.",
         lambda: eqx_quant.calibrate(eqx_quant.quantize(mlp), unread(), progress="yes")),
        (TypeError, "`batched` must be a bool, got batched='yes'.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), unread(), batched="yes")),
        (TypeError, "`batched` must be a bool, got batched='yes'.",
         lambda: eqx_quant.autoround(eqx_quant.quantize(mlp), unread(), batched="yes")),
        (TypeError, "`batches` must be an iterable of batches (a list of arrays, each with a leading batch axis), "
                    "got None of type NoneType.",
         lambda: eqx_quant.calibrate(eqx_quant.quantize(mlp), None)),
        (TypeError, "`batches` must be an iterable of batches (a list of arrays, each with a leading batch axis), "
                    "got None of type NoneType.",
         lambda: eqx_quant.gptq(eqx_quant.quantize(mlp), None)),
        (TypeError, "`group_size` must be an int, got '32' of type str.",
         lambda: eqx_quant.LayerQuantizer(4, group_size="32")),
        (TypeError, "`learned` must be a bool, got learned='yes'.",
         lambda: eqx_quant.LayerQuantizer(4, learned="yes")),
        (TypeError, "`input` must be a bool, got input=1.",
         lambda: eqx_quant.LayerQuantizer(4, input=1)),
        (TypeError, "`path` must be a str or an os.PathLike, got 3 of type int.",
         lambda: eqx_quant.save(3, mlp)),
        (TypeError, "`config` must be a mapping (the model's configuration) or None, got config='x' of type str.",
         lambda: eqx_quant.export_compressed_tensors("unwritten", mlp, config="x")),
        (TypeError, "`config` keys must be strings, got 1 of type int.",
         lambda: eqx_quant.export_compressed_tensors("unwritten", mlp, config={1: 2})),
        (TypeError, "`metadata` must be a mapping or None, got metadata='x' of type str.",
         lambda: eqx_quant.export_gguf("unwritten.gguf", mlp, metadata="x")),
        (TypeError, "`format` must be a Format, a format's name or a number of bits, got None.",
         lambda: eqx_quant.DynamicFakeQuant(None)),
        (TypeError, "`bits` must be an int in [1, 8], got bits=2.0.",
         lambda: eqx_quant.stretched_format(2.0)),
        (TypeError, "`signs` must be an int8 array of ±1, got [1, -1] of type list.",
         lambda: eqx_quant.nn.RotateInput([1, -1])),
        (TypeError, "`qweight` must be a QuantizedArray, got 'x' of type str.",
         lambda: eqx_quant.nn.ConvertedLinear(linear, "x", None)),
    ]  # fmt: skip
    for error, message, call in cases:
        with pytest.raises(error) as info:
            call()
        assert str(info.value) == message, (str(info.value), message)


def test_calibration_batches_the_quantized_model_would_refuse_are_refused():
    """Integer batches for a model whose first layer quantizes its input, and (inputs, labels) pairs, are the
    `TypeError`s that the calibrated model would raise on them, with a note of the batch. (Under the hook, the
    layer's annotation refuses them first.)"""
    mlp = eqx.nn.MLP(4, 3, 16, 1, key=jax.random.key(0))
    q = eqx_quant.quantize(mlp)
    x = jnp.arange(32.0).reshape(8, 4)
    with pytest.raises(TypeError, match="`x` must be a floating array, got dtype int32") as info:
        eqx_quant.calibrate(q, [x.astype(jnp.int32)])
    assert "int32[8, 4]" in "".join(info.value.__notes__)
    pair = r"`x` must be an array, one example, got a tuple \(for \(inputs, labels\) pairs, pass the inputs alone\)"
    with pytest.raises(TypeError, match=pair):
        eqx_quant.calibrate(q, [(x, jnp.zeros(8, jnp.int32))])
    with pytest.raises(TypeError, match=pair):
        q((x[0], 0))


def test_quantizer_inputs_learned_leaves_and_logits_of_the_wrong_type():
    """A quantizer called on something that is not an array (a raw `AttributeError` once), a string or `None` for a
    learned quantizer's leaves (`jnp.asarray` parsed the string), integer logits for `distillation_loss` (promoted
    once): `TypeError`s naming the argument, which under the hook are beartype's."""
    logits = jnp.zeros((1, 3))
    cases = [
        ("`x` must be a floating array, got [1.0, 2.0] of type list.",
         lambda: eqx_quant.FakeQuant(0.5, -8, 7)([1.0, 2.0])),
        ("`x` must be a floating array, got None of type NoneType.", lambda: eqx_quant.FakeQuant(0.5, -8, 7)(None)),
        ("`x` must be a floating array, got 1.0 of type float.", lambda: eqx_quant.DynamicFakeQuant(8)(1.0)),
        ("`x` must be a floating array, got [1.0] of type list.",
         lambda: eqx_quant.LearnedFakeQuant(0.5, -8, 7)([1.0])),
        ("`x` must be a floating array, got [1.0] of type list.", lambda: eqx_quant.PassthroughClip(0.0, 1.0)([1.0])),
        ("`x` must be a floating array, got [1.0] of type list.",
         lambda: eqx_quant.DynamicFakeQuant(8).quantization_params([1.0])),
        ("`x` must be a floating array, got [1.0] of type list.",
         lambda: eqx_quant.DynamicFakeQuant(8).quantize_array([1.0])),
        ("`scale` must be a real number or an array of them, got '0.5' of type str.",
         lambda: eqx_quant.LearnedFakeQuant("0.5", -8, 7)),
        ("`scale` must be a real number or an array of them, got None of type NoneType.",
         lambda: eqx_quant.LearnedFakeQuant(None, -8, 7)),
        ("`zero_point` must be a real number or an array of them, got '1' of type str.",
         lambda: eqx_quant.LearnedFakeQuant(0.5, -8, 7, zero_point="1")),
        ("`zero_point` must be a real number or an array of them, got True of type bool.",
         lambda: eqx_quant.LearnedFakeQuant(0.5, -8, 7, zero_point=True)),
        ("`student_logits` must be floating logits, got dtype int32.",
         lambda: eqx_quant.distillation_loss(jnp.array([[1, 2, 3]]), logits)),
        ("`teacher_logits` must be floating logits, got dtype bool.",
         lambda: eqx_quant.distillation_loss(logits, jnp.array([[True, False, False]]))),
    ]  # fmt: skip
    for message, call in cases:
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == message, (str(info.value), message)


@few_rows
def test_map_style_batches_are_read():
    # `__len__` and `__getitem__` alone (a map-style dataset), which Python iterates: read as a list of batches.
    # (Under the hook, the `Iterable` annotation refuses such an object first.)
    class MapStyle:
        def __len__(self):
            return 1

        def __getitem__(self, i):
            if i >= 1:
                raise IndexError(i)
            return jnp.ones((3, 4))

    w8a8 = eqx_quant.quantize(eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)), **eqx_quant.recipe("w8a8"))
    scales = [eqx_quant.calibrate(w8a8, b).layers[0].input_quant.scale for b in (MapStyle(), [jnp.ones((3, 4))])]
    assert scales[0] == scales[1]
    w4 = eqx_quant.quantize(
        eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)), **eqx_quant.recipe("w4a16_g32", group_size=4)
    )
    assert eqx.tree_equal(eqx_quant.gptq(w4, MapStyle()), eqx_quant.gptq(w4, [jnp.ones((3, 4))]))
