"""Walking a model's layers: naming them by their path, finding them and replacing them."""

from collections.abc import Callable
from typing import Any

import jax
from jaxtyping import PyTree


def path_string(path: tuple) -> str:
    """A key path as eqx_quant names layers: `layers.0`, `blocks.conv`, `heads.key` (dict keys and attributes alike)."""
    return jax.tree_util.keystr(path, simple=True, separator=".")


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
