"""Leaf paths and prefix-tree broadcasting with errors that name the offending path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax


def path_str(path) -> str:
  """``('layers', 0, 'kernel')``-style key path → ``"layers/0/kernel"``."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/") or "<root>"


def _is_placeholder(x: Any) -> bool:
  """None and optax's MaskedNode stand where a partition removed a leaf."""
  return x is None or isinstance(x, optax.MaskedNode)


def flatten_positions(tree: Any):
  """Flattens a tree keeping placeholders (None, MaskedNode) as positions.

  Returns:
    (list of (key path, leaf-or-placeholder), treedef).
  """
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_placeholder)


def is_array_leaf(x: Any) -> bool:
  return not _is_placeholder(x)


def broadcast_prefix(prefix: Any, tree: Any, *, is_value: Callable[[Any], bool],
                     what: str) -> list[Any]:
  """Gives every position of ``tree`` the value of the ``prefix`` entry above it.

  Args:
    prefix: a tree whose leaves (``is_value``, None or MaskedNode, the last two read as None)
      each stand for a subtree of ``tree``; a single value stands for the whole tree.
      Callables are resolved by the caller.
    tree: the params (or updates).
    is_value: which objects in ``prefix`` are values rather than containers.
    what: the argument's name, for error messages.

  Returns:
    One value per position of ``flatten_positions(tree)``, in that order.

  Raises:
    ValueError: if a position has no entry above it, or an entry matches no position.
  """
  entries, _ = jax.tree_util.tree_flatten_with_path(
      prefix, is_leaf=lambda x: _is_placeholder(x) or is_value(x))
  by_path = {tuple(path): None if _is_placeholder(value) else value
             for path, value in entries}
  positions, _ = flatten_positions(tree)
  used, values = set(), []
  for path, _ in positions:
    path = tuple(path)
    for i in range(len(path), -1, -1):
      if path[:i] in by_path:
        used.add(path[:i])
        values.append(by_path[path[:i]])
        break
    else:
      deeper = [p for p in by_path if p[:len(path)] == path]
      if deeper:
        raise ValueError(f"{what} does not match the params: at leaf '{path_str(path)}' it "
                         f"has a container (entries such as '{path_str(deeper[0])}') instead "
                         "of a single entry.")
      raise ValueError(f"{what} does not match the params: no entry for leaf "
                       f"'{path_str(path)}'. Pass a tree (or prefix tree) of the params' "
                       "structure.")
  unused = [path_str(p) for p in by_path if p not in used]
  if unused:
    raise ValueError(f"{what} does not match the params: entries {unused} name no leaf "
                     "of the params.")
  return values

