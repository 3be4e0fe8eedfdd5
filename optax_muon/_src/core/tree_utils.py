"""Leaf paths, frozen prefix trees, and broadcasting with errors that name the
leaf path."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax


def _is_wrapper_key(key: Any) -> bool:
  """The ``.value`` step into a Flax ``nnx.Variable`` or a linen ``Partitioned``
  box."""
  return isinstance(key, jax.tree_util.GetAttrKey) and key.name == "value"


def _key_value(key: Any) -> Any:
  for field in ("key", "idx", "name"):
    if hasattr(key, field):
      return getattr(key, field)
  return str(key)


def canonical_path(path) -> tuple:
  """A key path as plain values, without the ``.value`` steps of Flax wrappers.

  So ``nnx.State`` trees (with or without ``nnx.Variable`` wrappers), linen's
  boxed params and pure dicts of the same model name their leaves alike:
  ``('blocks', 0, 'k', 'kernel')``, whether 0 came from a list, a dict or an
  ``nnx.List``.
  """
  return tuple(_key_value(k) for k in path if not _is_wrapper_key(k))


def path_str(path) -> str:
  """``('layers', 0, 'kernel')``-style key path → ``"layers/0/kernel"`` (Flax's
  ``.value`` steps left out)."""
  return "/".join(str(k) for k in canonical_path(path)) or "<root>"


def is_placeholder(x: Any) -> bool:
  """None and optax's MaskedNode stand where a partition removed a leaf."""
  return x is None or isinstance(x, optax.MaskedNode)


def is_flax_variable(x: Any) -> bool:
  """Whether ``x`` is an ``nnx.Variable`` (without importing Flax)."""
  return any(
      c.__module__.startswith("flax.") and c.__name__ == "Variable"
      for c in type(x).__mro__
  )


def flatten_positions(tree: Any):
  """Flattens a tree keeping placeholders (None, MaskedNode) as positions.

  Returns:
    (list of (key path, leaf-or-placeholder), treedef).
  """
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_placeholder)


def is_array_leaf(x: Any) -> bool:
  return not is_placeholder(x)


def check_same_shapes(updates: Any, reference: Any, what: str) -> None:
  """Raises a ValueError naming the leaf where ``updates`` and ``reference``
  (the params, or state made from them) differ in shape; placeholders on either
  side are skipped.

  Raises:
    ValueError: for a shape mismatch, or trees with different numbers of leaves.
  """
  ours, _ = flatten_positions(updates)
  theirs, _ = flatten_positions(reference)
  if len(ours) != len(theirs):
    ours_paths = [path_str(p) for p, _ in ours]
    theirs_paths = [path_str(p) for p, _ in theirs]
    missing = [p for p in theirs_paths if p not in set(ours_paths)]
    extra = [p for p in ours_paths if p not in set(theirs_paths)]
    named = "; ".join(
        part
        for part in (
            f"missing from the updates: {listing(missing)}" if missing else "",
            f"not in {what}: {listing(extra)}" if extra else "",
        )
        if part
    )
    raise ValueError(
        f"the updates have {len(ours)} leaves and {what} {len(theirs)}"
        f"{' (' + named + ')' if named else ''}: pass gradients of the tree the"
        " optimizer was initialized with."
    )
  for (path, u), (_, r) in zip(ours, theirs):
    if is_placeholder(u) or is_placeholder(r) or not hasattr(r, "shape"):
      continue
    if tuple(u.shape) != tuple(r.shape):
      raise ValueError(
          f"the update of leaf '{path_str(path)}' has shape {tuple(u.shape)}, "
          f"{what} {tuple(r.shape)}: pass gradients of the tree the optimizer "
          "was initialized with."
      )


def _child(node: Any, key: Any) -> Any:
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  raise LookupError(key)


def owner_classes(tree: Any) -> list[tuple[str, ...]]:
  """Per position of ``flatten_positions(tree)``, the classes of the object that
  holds the leaf (``"module.QualName"``, the whole MRO), or () where the path
  cannot be followed.

  For trees of module objects (Equinox): the layer a weight belongs to.
  """
  positions, _ = flatten_positions(tree)
  owners = []
  for path, _ in positions:
    node = tree
    try:
      for key in path[:-1]:
        node = _child(node, key)
    except (LookupError, AttributeError, TypeError):
      owners.append(())
      continue
    owners.append(
        tuple(f"{c.__module__}.{c.__qualname__}" for c in type(node).__mro__)
    )
  return owners


def listing(paths: list[str], limit: int = 6) -> str:
  shown = ", ".join(f"'{p}'" for p in paths[:limit])
  return (
      f"[{shown}{', ...' if len(paths) > limit else ''}] ({len(paths)} in all)"
  )


@dataclasses.dataclass(frozen=True)
class FrozenPrefix:
  """A user's tree, prefix tree or single value, frozen: hashable, compared by
  value.

  Entries are keyed by ``canonical_path``, so the tree it came from may be a
  pure dict, an ``nnx.State`` or a tree of Flax variables or boxes;
  ``broadcast_prefix`` matches it to any of these.

  Attributes:
    what: the argument's name, for error messages.
    entries: (canonical path, value or None) pairs, in the tree's order.
  """

  what: str
  entries: tuple[tuple[tuple, Any], ...]


def _hashable(value: Any, path: str, what: str) -> Any:
  """``value`` with list fields of a NamedTuple made tuples; raises if still
  unhashable."""
  if isinstance(value, tuple) and hasattr(value, "_fields"):
    value = type(value)(
        *(tuple(f) if isinstance(f, list) else f for f in value)
    )
  try:
    hash(value)
  except TypeError:
    raise ValueError(
        f"{what}: the entry at '{path}' ({value!r}) is not hashable; pass "
        "plain values (numbers, strings, tuples, shardings)."
    ) from None
  return value


def freeze_prefix(
    prefix: Any, *, is_value: Callable[[Any], bool], what: str
) -> FrozenPrefix | Callable | None:
  """A per-leaf argument in the form options keep: frozen, or a callable kept as
  it is.

  Args:
    prefix: None, a single value, a tree or prefix tree of values (None or
      MaskedNode entries read as None), a callable ``params -> such a tree``, or
      a ``FrozenPrefix``.
    is_value: which objects are values rather than containers.
    what: the argument's name, for error messages.

  Returns:
    None, the callable, or a ``FrozenPrefix``.

  Raises:
    ValueError: for a value that is not hashable, naming its path.
  """
  if prefix is None or isinstance(prefix, FrozenPrefix):
    return prefix
  if callable(prefix) and not is_value(prefix):
    return prefix
  entries, _ = jax.tree_util.tree_flatten_with_path(
      prefix, is_leaf=lambda x: is_placeholder(x) or is_value(x)
  )
  return FrozenPrefix(
      what,
      tuple(
          (
              canonical_path(path),
              None
              if is_placeholder(value)
              else _hashable(value, path_str(path), what),
          )
          for path, value in entries
      ),
  )


def resolve_prefix(
    prefix: FrozenPrefix | Callable | None,
    tree: Any,
    *,
    is_value: Callable[[Any], bool],
    what: str,
) -> list[Any]:
  """One value (or None) per position of ``flatten_positions(tree)``.

  Args:
    prefix: as ``freeze_prefix`` returns it; a callable is called with ``tree``.
    tree: the params (or updates).
    is_value: which objects are values rather than containers.
    what: the argument's name, for error messages.

  Raises:
    ValueError: as ``broadcast_prefix``.
  """
  if prefix is None:
    return [None] * len(flatten_positions(tree)[0])
  if not isinstance(prefix, FrozenPrefix):
    prefix = freeze_prefix(prefix(tree), is_value=is_value, what=what)
    if prefix is None:
      return [None] * len(flatten_positions(tree)[0])
  return broadcast_prefix(prefix, tree)


def broadcast_prefix(prefix: FrozenPrefix, tree: Any) -> list[Any]:
  """Gives every position of ``tree`` the value of the ``prefix`` entry above
  it.

  Args:
    prefix: the frozen prefix tree; a single value stands for the whole tree.
    tree: the params (or updates).

  Returns:
    One value per position of ``flatten_positions(tree)``, in that order.

  Raises:
    ValueError: if a position has no entry above it, or an entry matches no
      position; the message names the leaf and lists the params' and the
      argument's paths side by side.
  """
  what = prefix.what
  by_path = dict(prefix.entries)
  positions, _ = flatten_positions(tree)
  leaf_paths = [canonical_path(path) for path, _ in positions]
  show = lambda paths: listing(
      ["/".join(map(str, p)) or "<root>" for p in paths]
  )
  side_by_side = (
      f" The params have leaves {show(leaf_paths)}; {what} has entries "
      f"{show(list(by_path))}."
  )
  used, values = set(), []
  for path in leaf_paths:
    for i in range(len(path), -1, -1):
      if path[:i] in by_path:
        used.add(path[:i])
        values.append(by_path[path[:i]])
        break
    else:
      name = "/".join(map(str, path)) or "<root>"
      deeper = [p for p in by_path if p[: len(path)] == path]
      if deeper:
        raise ValueError(
            f"{what} does not match the params: at leaf '{name}' it has a "
            f"container (entries such as '{'/'.join(map(str, deeper[0]))}') "
            f"instead of a single entry.{side_by_side}"
        )
      raise ValueError(
          f"{what} does not match the params: no entry for leaf '{name}'. "
          "Pass a tree (or prefix tree) of the params' structure."
          f"{side_by_side}"
      )
  unused = ["/".join(map(str, p)) for p in by_path if p not in used]
  if unused:
    raise ValueError(
        f"{what} does not match the params: entries {unused} name no leaf "
        f"of the params.{side_by_side}"
    )
  return values
