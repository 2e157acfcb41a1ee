"""Walking a model's layers: naming them by their path, finding them and replacing them."""

from collections.abc import Callable
from typing import Any

import jax
from jaxtyping import PyTree


def path_string(path: tuple) -> str:
    """A key path as eqx_quant names layers: `layers.0`, `blocks.conv`, `heads.key` (dict keys and attributes alike)."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


def join_path(*parts: str) -> str:
    """The path of `parts` one inside the other, the empty ones (a model's root) left out: `join_path("", "qweight")`
    is `"qweight"`."""
    return ".".join(p for p in parts if p)


def map_nodes(model: PyTree, types: tuple[type, ...], fn: Callable[[str, Any], Any]) -> PyTree:
    """Replaces every node of `model` that is an instance of `types` by `fn(path, node)`; other leaves are kept."""
    is_node = lambda node: isinstance(node, types)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_node)
    new = [fn(path_string(path), leaf) if is_node(leaf) else leaf for path, leaf in leaves]
    return jax.tree_util.tree_unflatten(treedef, new)


def nodes(model: PyTree, types: tuple[type, ...]) -> list[tuple[str, Any]]:
    """The `(path, node)` pairs of every node of `model` that is an instance of `types`, in tree order."""
    is_node = lambda node: isinstance(node, types)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_node)[0]
    return [(path_string(path), leaf) for path, leaf in leaves if is_node(leaf)]


def unique_nodes(model: PyTree, types: tuple[type, ...], name: str) -> dict[str, Any]:
    """The nodes of `model` that are instances of `types`, by path; raises if two of them have the same path (a dict
    key with a dot, `{"a.b": ...}`, reads like the attributes `a.b`)."""
    is_node = lambda node: isinstance(node, types)  # noqa: E731
    found: dict[str, tuple[Any, Any]] = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(model, is_leaf=is_node)[0]:
        if not is_node(leaf):
            continue
        path = path_string(key_path)
        if path in found:
            first = jax.tree_util.keystr(found[path][0])
            raise ValueError(
                f"`{name}` has two quantizers or quantized arrays at the path {path!r}: at {first} and at "
                f"{jax.tree_util.keystr(key_path)}. Paths join keys with '.', so rename the dict key that holds a "
                f"'.' (or that reads like another key)."
            )
        found[path] = (key_path, leaf)
    return {path: leaf for path, (_, leaf) in found.items()}
