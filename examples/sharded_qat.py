"""Sharded QAT: an MLP quantized with learned step sizes, trained on a `(data=4, model=2)` mesh of 8 devices.

Run with `python examples/sharded_qat.py` (needs the `examples` extra for optax and scikit-learn's digits). It needs
8 devices: XLA is asked for 8 virtual CPU devices, which a CPU-only machine uses (next to an accelerator, set
`JAX_PLATFORMS=cpu` to use them); on a machine with 8 accelerators the same code runs on those.

The recipe:

1. shard the float model with `jax.device_put` and `NamedSharding`s, as for any Equinox model: here tensor
   parallel, the first and last layers split by output features (column parallel) and the middle one by input
   features (row parallel), so that activations stay split between the two;
2. quantize it: the float leaves are kept, shardings included, and the learned per-channel step sizes, computed from
   the sharded weights, come out sharded like the channels they scale;
3. train with `eqx.filter_jit`: batches split along `data`; JAX propagates the shardings through the step, so the
   updated parameters keep theirs (checked below), and the integer forward, the statistics of dynamic quantizers and
   the gradients are computed by XLA's SPMD partitioner, with global reductions where a tensor is split;
4. convert: the integer weights and their scales are sharded like the float weights they replace.
"""

import os


# Virtual CPU devices must be asked for before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from qat_demo import load_digits  # noqa: E402  (the QAT demo beside this file)

import eqx_quant  # noqa: E402


ROW_PARALLEL = {"layers.1"}


def partition_spec(path, leaf) -> P:
    """Tensor parallelism for `eqx.nn.MLP`: weights `(out, in)` split along `out`, or along `in` for the row-parallel
    layers (whose bias is then replicated)."""
    name = jax.tree_util.keystr(path, simple=True, separator=".")
    layer, kind = name.rsplit(".", 1)
    if layer in ROW_PARALLEL:
        return P(None, "model") if kind == "weight" else P()
    return P("model", *([None] * (leaf.ndim - 1)))


def shard(model, mesh):
    place = lambda path, leaf: jax.device_put(leaf, NamedSharding(mesh, partition_spec(path, leaf)))  # noqa: E731
    params, static = eqx.partition(model, eqx.is_array)
    return eqx.combine(jax.tree_util.tree_map_with_path(place, params), static)


def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    print(f"{jax.device_count()} devices, mesh {dict(mesh.shape)}")
    train_x, train_y, test_x, test_y = load_digits(seed=0)
    train_x, test_x = train_x.reshape(len(train_x), -1), test_x.reshape(len(test_x), -1)

    # 1. The float model, sharded.
    model = shard(eqx.nn.MLP(64, 10, 256, 2, activation=jax.nn.relu, key=jax.random.key(0)), mesh)
    # 2. Quantized: learned per-output-channel step sizes for the weights, 8-bit dynamic inputs.
    model = eqx_quant.quantize(
        model,
        weights=lambda path, layer: eqx_quant.LearnedFakeQuant.init_from(layer.weight, 8, axis=0),
        activations=eqx_quant.DynamicFakeQuant(8),
    )
    for i, layer in enumerate(model.layers):
        weight, scale = layer.layer.weight, layer.weight_quant.scale
        print(
            f"layers.{i}: weight {weight.shape} {weight.sharding.spec}, step sizes {scale.shape} {scale.sharding.spec}"
        )

    # 3. Training: batches split along `data`.
    optimizer = optax.adam(1e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    batch_sharding = NamedSharding(mesh, P("data"))

    @eqx.filter_jit(donate="all")
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    before = [leaf.sharding for leaf in jax.tree.leaves(eqx.filter(model, eqx.is_array))]
    rng = np.random.default_rng(0)
    for i in range(args.steps):
        index = rng.choice(len(train_x), 64, replace=False)
        x = jax.device_put(train_x[index], batch_sharding)
        y = jax.device_put(train_y[index], batch_sharding)
        model, opt_state, loss = step(model, opt_state, x, y)
        if (i + 1) % 100 == 0 or i + 1 == args.steps:
            print(f"step {i + 1}: loss {float(loss):.4f}")
    after = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    kept = all(leaf.sharding.is_equivalent_to(b, leaf.ndim) for leaf, b in zip(after, before, strict=True))
    print(f"every parameter kept its sharding: {kept}")

    # 4. Conversion to integer weights, sharded like the float ones.
    converted = eqx_quant.convert(model)
    values, scale = converted.layers[0].qweight.values, converted.layers[0].qweight.scale
    print(f"converted layers.0: {values.dtype} {values.shape} {values.sharding.spec}, scales {scale.sharding.spec}")
    forward = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    x = jax.device_put(test_x[: len(test_x) // 8 * 8], batch_sharding)
    fake, real = forward(model, x), forward(converted, x)
    print(f"converted logits equal the QAT model's bit for bit: {bool(jnp.array_equal(fake, real))}")
    accuracy = float(jnp.mean(jnp.argmax(real, axis=-1) == test_y[: len(x)]))
    print(f"test accuracy of the converted model: {100 * accuracy:.2f}%")


if __name__ == "__main__":
    main()
