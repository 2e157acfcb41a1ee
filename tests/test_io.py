"""`save` / `load`: damaged and foreign files, files of another grid, failing saves, colliding paths."""

import io
import json
import os
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant
from eqx_quant import DynamicFakeQuant
from eqx_quant.nn import QuantLinear

from .helpers import assert_trees_equal, zeros_like_tree


MAGIC = b"EQXQUANT"  # the first 8 bytes of a saved file, then the header length as a little-endian uint64


def linear(seed: int, n_in: int = 6, n_out: int = 4) -> eqx.nn.Linear:
    """A linear layer with NumPy-random parameters (no random initialisation to compile)."""
    rng = np.random.default_rng(seed)
    layer = eqx.filter_eval_shape(lambda: eqx.nn.Linear(n_in, n_out, key=jax.random.key(0)))
    weight = jnp.asarray(rng.uniform(-1, 1, (n_out, n_in)).astype(np.float32))
    bias = jnp.asarray(rng.uniform(-1, 1, (n_out,)).astype(np.float32))
    return eqx.tree_at(lambda l: (l.weight, l.bias), layer, (weight, bias))


def converted(quantizer=None, seed: int = 0):
    """A converted model of two linear layers, its weights on the grid of `quantizer`."""
    quantizer = DynamicFakeQuant(4, axis=0) if quantizer is None else quantizer
    layers = [linear(seed), linear(seed + 1, 4, 3)]
    return eqx_quant.convert([QuantLinear(layer, weight_quant=quantizer) for layer in layers])


def header_end(data: bytes) -> int:
    (length,) = struct.unpack("<Q", data[8:16])
    return 16 + length


@pytest.fixture(scope="module")
def model():
    return converted()


# ---------------------------------------------------------------------------------------------------------------------
# Damaged files.


def test_header_cut_short(model, tmp_path):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    cut = tmp_path / "cut.eqx"
    for length in (len(MAGIC), len(MAGIC) + 3, 16, 16 + 5, header_end(data) - 1):
        cut.write_bytes(data[:length])
        with pytest.raises(ValueError, match=rf"`path`='{str(cut)}' is cut short within its `eqx_quant.save` header"):
            eqx_quant.load(cut, model)


def test_header_damaged(model, tmp_path):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    data = path.read_bytes()
    end = header_end(data)
    damaged = tmp_path / "damaged.eqx"
    for header in (b"{" * (end - 16), json.dumps([1]).encode().ljust(end - 16), b"\xff" * (end - 16)):
        damaged.write_bytes(data[:16] + header + data[end:])
        with pytest.raises(ValueError, match="damaged `eqx_quant.save` header"):
            eqx_quant.load(damaged, model)
    for version in (3, 5):  # an earlier development version, and a newer one
        other = json.dumps({"format": "eqx_quant", "version": version, "static_quantizers": {}}).encode()
        damaged.write_bytes(MAGIC + struct.pack("<Q", len(other)) + other + data[end:])
        with pytest.raises(ValueError, match=f"format version {version}; this release reads version 4"):
            eqx_quant.load(damaged, model)
    # The current version with a part of the header missing.
    partial = json.dumps({"format": "eqx_quant", "version": 4, "static_quantizers": {}}).encode()
    damaged.write_bytes(MAGIC + struct.pack("<Q", len(partial)) + partial + data[end:])
    with pytest.raises(ValueError, match="damaged `eqx_quant.save` header"):
        eqx_quant.load(damaged, model)


def test_arrays_cut_short(model, tmp_path):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    data = path.read_bytes()
    cut = tmp_path / "cut.eqx"
    # right after the header, inside the first array's NumPy header, inside the last array's data
    for length in (header_end(data), header_end(data) + 20, len(data) - 1):
        cut.write_bytes(data[:length])
        with pytest.raises(ValueError, match="are cut short or do not match those of `like`") as info:
            eqx_quant.load(cut, model)
        if length > header_end(data):  # cut within an array: not taken for a file of another model
            assert "the file holds" not in str(info.value)


def test_more_data_than_like_reads(model, tmp_path):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    assert_trees_equal(eqx_quant.load(path, zeros_like_tree(model)), model)
    longer = tmp_path / "longer.eqx"
    longer.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="holds more data than `like` reads"):
        eqx_quant.load(longer, model)
    # A model with one more array after those of `like` (its quantized tensors are the same): the arrays in the file
    # say where they differ.
    extended = tmp_path / "extended.eqx"
    eqx_quant.save(extended, model + [jnp.arange(3.0)])
    with pytest.raises(ValueError, match=r"holds 7 arrays and `like` 6; .* the end of `like`'s arrays and, in the "
                                         r"file, an array of shape \(3,\)\."):  # fmt: skip
        eqx_quant.load(extended, model + [None])
    # One of another shape in `like` (and one more after it).
    wider = [model[0], eqx.tree_at(lambda l: l.layer.bias, model[1], jnp.zeros(5)), jnp.zeros(2)]
    with pytest.raises(ValueError, match=r"holds 6 arrays and `like` 7; the first that differ are `like`'s "
                                         r"'1.layer.bias', of shape \(5,\) and, in the file, an array of shape \(3,\)"):  # fmt: skip
        eqx_quant.load(path, wider)


# ---------------------------------------------------------------------------------------------------------------------
# Files of another grid.


@pytest.mark.parametrize(
    "saved, like, differing",
    [
        # signed 4-bit levels read as unsigned ones would be other numbers in the same bytes
        (DynamicFakeQuant(4, axis=0), DynamicFakeQuant(4, axis=0, signed=False, symmetric=False),
         ("format='int4'", "zero_point=False", "format='uint4'", "zero_point=True")),
        (DynamicFakeQuant(8, axis=0), DynamicFakeQuant(4, axis=0), ("packed_bits=None", "packed_bits=4")),
        (DynamicFakeQuant(2, axis=0), DynamicFakeQuant(3, axis=0), ("packed_bits=2", "packed_bits=3")),
        (DynamicFakeQuant(4, group_size=2), DynamicFakeQuant(4, axis=0), ("layout=[[], 2, 0]", "layout=[[0], None, 0]")),
    ],
)  # fmt: skip
@pytest.mark.slow
def test_another_grid_is_refused(saved, like, differing, tmp_path):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, converted(saved))
    expected = rf"The quantized array at '0.qweight' has .*in '{str(path)}' but .* in `like`"
    with pytest.raises(ValueError, match=expected) as error:
        eqx_quant.load(path, converted(like, seed=5))
    message = str(error.value)
    saved_part, like_part = message.split(" but ")
    for field in differing:
        assert field in message
    assert all(f in saved_part for f in differing[: len(differing) // 2])
    assert all(f in like_part for f in differing[len(differing) // 2 :])
    assert_trees_equal(eqx_quant.load(path, converted(saved, seed=5)), converted(saved))


def test_quantized_tensors_elsewhere_are_refused(model, tmp_path):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    with pytest.raises(ValueError, match=r"quantized arrays saved in .* are at \['0.qweight', '1.qweight'\]"):
        eqx_quant.load(path, [None, *model])


def with_input(input_quant, seed: int = 0, convert: bool = True):
    """`converted()` with `input_quant` as the layers' input quantizer (or the model before conversion)."""
    layers = [linear(seed), linear(seed + 1, 4, 3)]
    weight_quant = DynamicFakeQuant(4, axis=0)
    model = [QuantLinear(layer, weight_quant=weight_quant, input_quant=input_quant) for layer in layers]
    return eqx_quant.convert(model) if convert else model


def test_dynamic_and_learned_quantizers_of_another_configuration_are_refused(tmp_path):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, with_input(DynamicFakeQuant(8)))
    data = path.read_bytes()
    saved = json.loads(data[16 : header_end(data)])["other_quantizers"]
    config = {"type": "DynamicFakeQuant", "format": "int8", "layout": [[], None, 0], "symmetric": True, "axis_name": None}
    assert saved == {"0.input_quant": config, "1.input_quant": config}
    # Integers on the same grid, but inputs quantized at another width: the loaded model would compute otherwise.
    with pytest.raises(ValueError, match=r"The quantizer at '0.input_quant' has format='int8'.* but format='int4'"):
        eqx_quant.load(path, with_input(DynamicFakeQuant(4), seed=5))
    assert_trees_equal(eqx_quant.load(path, with_input(DynamicFakeQuant(8), seed=5)), with_input(DynamicFakeQuant(8)))
    # A `like` made with `eqx.filter_eval_shape` (its arrays only shapes and dtypes) loads as well.
    shapes = eqx.filter_eval_shape(lambda: with_input(DynamicFakeQuant(8), seed=5))
    assert_trees_equal(eqx_quant.load(path, shapes), with_input(DynamicFakeQuant(8)))
    # A model saved without input quantizers does not load into one with them.
    eqx_quant.save(path, with_input(None))
    with pytest.raises(ValueError, match=r"dynamic and learned quantizers saved in .* are at \[\], but `like` has"):
        eqx_quant.load(path, with_input(DynamicFakeQuant(4), seed=5))
    # A learned quantizer of a model in training (conversion makes it static): its arrays are saved, its type and
    # static fields checked.
    eqx_quant.save(path, with_input(eqx_quant.LearnedFakeQuant(0.1, -128, 127), convert=False))
    other_range = with_input(eqx_quant.LearnedFakeQuant(0.1, -8, 7), seed=5, convert=False)
    with pytest.raises(ValueError, match=r"has format='int8' in .* but format='int4' in `like`"):
        eqx_quant.load(path, other_range)
    with pytest.raises(ValueError, match=r"has type='LearnedFakeQuant', .* but type='DynamicFakeQuant', "):
        eqx_quant.load(path, with_input(DynamicFakeQuant(8), seed=5, convert=False))
    # Into the float model, on a grid without 0 or 1 (the rebuilt quantizer's placeholder zero point lies on it).
    learned = with_input(eqx_quant.LearnedFakeQuant(0.1, 2, 5, zero_point=3.0), convert=False)
    eqx_quant.save(path, learned)
    assert_trees_equal(eqx_quant.load(path, eqx_quant.float_model(learned)), learned)


# ---------------------------------------------------------------------------------------------------------------------
# A failing save leaves the old file.


def test_failing_save_keeps_the_old_file(model, tmp_path, monkeypatch):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    old = path.read_bytes()

    # A leaf that cannot be written: a deleted array, after the others.
    gone = jnp.arange(3.0)
    gone.delete()
    with pytest.raises(RuntimeError):  # raised by the writing of the third leaf
        eqx_quant.save(path, model + [gone])
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["model.eqx"]

    # The disk fills up halfway through the arrays.
    def fill_up(f, tree):
        f.write(b"\0" * 100)
        raise OSError("No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(eqx, "tree_serialise_leaves", fill_up)
        with pytest.raises(OSError, match="No space left"):
            eqx_quant.save(path, converted(seed=9))
        with pytest.raises(OSError, match="No space left"):
            eqx_quant.save(tmp_path / "new.eqx", model)
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["model.eqx"]
    assert_trees_equal(eqx_quant.load(path, zeros_like_tree(model)), model)


def test_saves_that_cannot_be_written_are_refused_before_any_work(model, tmp_path, monkeypatch):
    # A directory or a missing directory failed naming the hidden temporary file, after serialising everything; a
    # model without arrays wrote a file that holds nothing; a PRNG key failed inside Equinox.
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, model)
    old = path.read_bytes()
    with monkeypatch.context() as patch:
        patch.setattr(eqx, "tree_serialise_leaves", lambda f, tree: pytest.fail("serialised"))
        with pytest.raises(IsADirectoryError, match=f"`path` must name a file, got the directory path='{tmp_path}'"):
            eqx_quant.save(tmp_path, model)
        with pytest.raises(FileNotFoundError, match="`path` is in a directory that does not exist, got path='"):
            eqx_quant.save(tmp_path / "missing" / "model.eqx", model)
        with pytest.raises(ValueError, match="`path` must name a file, got path=''"):
            eqx_quant.save("", model)
        for nothing in (None, "abc", {"a": 1.0}):
            with pytest.raises(ValueError, match="`model` holds no array nor quantizer to save"):
                eqx_quant.save(path, nothing)
        with pytest.raises(TypeError, match=r"PRNG key array at \['key'\], which cannot be saved"):
            eqx_quant.save(path, {"w": jnp.ones(2), "key": jax.random.key(0)})
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["model.eqx"]


def test_save_replaces_the_file_with_the_usual_permissions(model, tmp_path, monkeypatch):
    path = tmp_path / "model.eqx"
    eqx_quant.save(path, converted(seed=9))
    eqx_quant.save(path, model)
    assert_trees_equal(eqx_quant.load(path, zeros_like_tree(model)), model)
    plain = tmp_path / "plain"
    with open(plain, "wb"):
        pass
    assert os.stat(path).st_mode == os.stat(plain).st_mode
    assert sorted(os.listdir(tmp_path)) == ["model.eqx", "plain"]
    # An existing file keeps its permission bits (a private checkpoint stays private), as `open(path, "wb")` keeps
    # them; a symbolic link keeps pointing at its target, whose contents are replaced.
    os.chmod(path, 0o600)
    os.chmod(plain, 0o600)
    with open(plain, "wb"):
        pass
    eqx_quant.save(path, model)
    assert os.stat(path).st_mode == os.stat(plain).st_mode
    assert os.stat(path).st_mode & 0o777 == 0o600
    link = tmp_path / "link.eqx"
    os.symlink(path, link)
    eqx_quant.save(link, converted(seed=9))
    assert os.path.islink(link) and os.readlink(link) == str(path)
    assert_trees_equal(eqx_quant.load(path, converted(seed=9)), converted(seed=9))
    assert sorted(os.listdir(tmp_path)) == ["link.eqx", "model.eqx", "plain"]
    # A file system that refuses `chmod` (vfat, some network mounts): the save goes on with the new file's bits.
    with monkeypatch.context() as patch:
        patch.setattr(os, "chmod", lambda *args, **kwargs: (_ for _ in ()).throw(PermissionError("refused")))
        eqx_quant.save(path, model)
    assert_trees_equal(eqx_quant.load(path, zeros_like_tree(model)), model)
    assert sorted(os.listdir(tmp_path)) == ["link.eqx", "model.eqx", "plain"]


# ---------------------------------------------------------------------------------------------------------------------
# Paths.


def test_colliding_paths_are_refused(tmp_path):
    lin_a, lin_b = converted()
    path = tmp_path / "model.eqx"
    path.write_bytes(b"old")
    colliding = {"a.b": lin_a, "a": {"b": lin_b}}  # both weights are named 'a.b.qweight'
    with pytest.raises(ValueError, match=r"`model` has two .* at the path 'a.b.qweight'") as error:
        eqx_quant.save(path, colliding)
    assert "['a.b'].qweight" in str(error.value) and "['a']['b'].qweight" in str(error.value)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.eqx"]

    # A dotted key that names nothing else is fine.
    dotted = {"a.b": lin_a, "c": lin_b}
    eqx_quant.save(path, dotted)
    assert_trees_equal(eqx_quant.load(path, zeros_like_tree(dotted)), dotted)
    with pytest.raises(ValueError, match="`like` has two"):
        eqx_quant.load(path, colliding)
