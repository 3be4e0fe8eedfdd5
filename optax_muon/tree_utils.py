"""Leaf paths and prefix-tree broadcasting with errors that name the offending path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax


def _is_wrapper_key(key: Any) -> bool:
  """The ``.value`` step into a Flax ``nnx.Variable`` or a linen ``Partitioned`` box."""
  return isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value"


def _key_value(key: Any) -> Any:
  for field in ("key", "idx", "name"):
    if hasattr(key, field):
      return getattr(key, field)
  return str(key)


def canonical_path(path) -> tuple:
  """A key path as plain values, without the ``.value`` steps of Flax wrappers.

  So ``nnx.State`` trees (with or without ``nnx.Variable`` wrappers), linen's boxed
  params and pure dicts of the same model name their leaves alike: ``('blocks', 0, 'k',
  'kernel')``, whether 0 came from a list, a dict or an ``nnx.List``.
  """
  return tuple(_key_value(k) for k in path if not _is_wrapper_key(k))


def path_str(path) -> str:
  """``('layers', 0, 'kernel')``-style key path → ``"layers/0/kernel"`` (Flax's ``.value``
  steps left out)."""
  return "/".join(str(k) for k in canonical_path(path)) or "<root>"


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


def _listing(paths: list[str], limit: int = 6) -> str:
  shown = ", ".join(f"'{p}'" for p in paths[:limit])
  return f"[{shown}{', ...' if len(paths) > limit else ''}] ({len(paths)} in all)"


def broadcast_prefix(prefix: Any, tree: Any, *, is_value: Callable[[Any], bool],
                     what: str) -> list[Any]:
  """Gives every position of ``tree`` the value of the ``prefix`` entry above it.

  Entries are matched to leaves by path (``canonical_path``), so the prefix may be a pure
  dict, an ``nnx.State`` or a tree of Flax variables or boxes while the tree is another of
  these.

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
    ValueError: if a position has no entry above it, or an entry matches no position; the
      message names the leaf and lists the params' and the argument's paths side by side.
  """
  entries, _ = jax.tree_util.tree_flatten_with_path(
      prefix, is_leaf=lambda x: _is_placeholder(x) or is_value(x))
  by_path = {canonical_path(path): None if _is_placeholder(value) else value
             for path, value in entries}
  positions, _ = flatten_positions(tree)
  leaf_paths = [canonical_path(path) for path, _ in positions]
  show = lambda paths: _listing(["/".join(map(str, p)) or "<root>" for p in paths])
  side_by_side = (f" The params have leaves {show(leaf_paths)}; {what} has entries "
                  f"{show(list(by_path))}.")
  used, values = set(), []
  for path in leaf_paths:
    for i in range(len(path), -1, -1):
      if path[:i] in by_path:
        used.add(path[:i])
        values.append(by_path[path[:i]])
        break
    else:
      name = "/".join(map(str, path)) or "<root>"
      deeper = [p for p in by_path if p[:len(path)] == path]
      if deeper:
        raise ValueError(f"{what} does not match the params: at leaf '{name}' it has a "
                         f"container (entries such as '{'/'.join(map(str, deeper[0]))}') "
                         f"instead of a single entry.{side_by_side}")
      raise ValueError(f"{what} does not match the params: no entry for leaf '{name}'. "
                       f"Pass a tree (or prefix tree) of the params' structure."
                       f"{side_by_side}")
  unused = ["/".join(map(str, p)) for p in by_path if p not in used]
  if unused:
    raise ValueError(f"{what} does not match the params: entries {unused} name no leaf "
                     f"of the params.{side_by_side}")
  return values
