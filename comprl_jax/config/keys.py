"""Dotted config keys (``"actor.loss.clip_eps"``): the one walker for ConfigDicts and saved JSON trees alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _is_node(x) -> bool:
    # ConfigDict is not a Mapping; both answer keys() and [].
    return isinstance(x, Mapping) or (
        hasattr(x, "keys") and hasattr(x, "__getitem__") and not isinstance(x, str)
    )


def parent(tree, dotted: str, create: bool = False) -> tuple[Any, str]:
    """``(the node holding the dotted key's leaf, the leaf name)``; the node is None where a parent is missing
    (``create``: missing parents of a dict tree are made)."""
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        if not _is_node(node):
            return None, leaf
        if p not in node.keys():
            if not create:
                return None, leaf
            node[p] = {}
        node = node[p]
    return (node if _is_node(node) else None), leaf


def get(tree, dotted: str):
    """``tree["a"]["b"]["c"]`` for ``"a.b.c"``; KeyError names the dotted key."""
    node, leaf = parent(tree, dotted)
    if node is None or leaf not in node.keys():
        raise KeyError(f"config key {dotted} does not exist")
    return node[leaf]


def set_key(tree, dotted: str, value) -> None:
    """``tree["a"]["b"]["c"] = value`` (a ConfigDict must be unlocked for a new leaf)."""
    node, leaf = parent(tree, dotted)
    if node is None:
        raise KeyError(f"config key {dotted}: its section does not exist")
    node[leaf] = value


def flatten(tree, prefix: str = "") -> dict[str, Any]:
    """``{"actor": {"lr": 1}}`` -> ``{"actor.lr": 1}`` (insertion order kept; tuples as lists)."""
    out: dict[str, Any] = {}
    for k in tree.keys():
        v, key = tree[k], f"{prefix}{k}"
        if _is_node(v):
            out.update(flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out
