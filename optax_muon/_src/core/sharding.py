"""Shardings: reading them (once per tree, into the spec), placing state, sums
over matrices.

Explicit meshes carry the sharding in each array's type
(``jax.typeof(x).sharding``); under Auto meshes and inside ``shard_map`` the
user passes ``param_shardings``. Reading and validating happens at trace time,
in ``spec.tree_spec``; the update's stages get the result.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax_muon._src.core import tree_utils

DimAxes = tuple[
    tuple[str, ...], ...
]  # per leaf dimension, the mesh axes splitting it


def dim_axes_of(spec: PartitionSpec, ndim: int) -> DimAxes:
  """A PartitionSpec as one tuple of axis names per dimension."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(
      () if e is None else (e,) if isinstance(e, str) else tuple(e)
      for e in entries
  )


@dataclasses.dataclass(frozen=True)
class LeafSharding:
  """How one leaf is laid out over a mesh.

  Attributes:
    mesh: the (possibly abstract) mesh.
    dim_axes: per leaf dimension, the mesh axes that split it, major to minor.
  """

  mesh: Any
  dim_axes: DimAxes

  @classmethod
  def of(cls, sharding: NamedSharding, ndim: int) -> LeafSharding:
    return cls(sharding.mesh, dim_axes_of(sharding.spec, ndim))

  @property
  def spec(self) -> PartitionSpec:
    return PartitionSpec(
        *[
            None if not axes else axes[0] if len(axes) == 1 else axes
            for axes in self.dim_axes
        ]
    )

  @property
  def named(self) -> NamedSharding:
    return NamedSharding(self.mesh, self.spec)

  def shards(self, dim: int) -> int:
    return math.prod(self.mesh.shape[a] for a in self.dim_axes[dim])

  def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(size // self.shards(d) for d, size in enumerate(shape))

  def global_shape(
      self, local_shape: tuple[int, ...], manual: frozenset[str] | None = None
  ) -> tuple[int, ...]:
    """The global shape of a local block: each dimension times its shards over
    the ``manual`` axes (all of its axes when None)."""
    return tuple(
        size
        * math.prod(
            self.mesh.shape[a]
            for a in self.dim_axes[d]
            if manual is None or a in manual
        )
        for d, size in enumerate(local_shape)
    )

  def axes_of(self, dims: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh axes splitting any of ``dims``, sorted."""
    return tuple(sorted({a for d in dims for a in self.dim_axes[d]}))

  def without(self, dims: tuple[int, ...]) -> LeafSharding:
    """The same sharding with ``dims`` replicated."""
    return LeafSharding(
        self.mesh,
        tuple(
            () if d in dims else axes for d, axes in enumerate(self.dim_axes)
        ),
    )

  @property
  def used_axes(self) -> set[str]:
    return {a for axes in self.dim_axes for a in axes}


def _mesh_signature(mesh) -> tuple:
  return tuple(mesh.shape.items())


def is_explicit_sharding(sharding: Any) -> bool:
  """Whether ``sharding`` is a NamedSharding on a mesh with Explicit axes."""
  mesh = getattr(sharding, "mesh", None)
  return (
      isinstance(sharding, NamedSharding)
      and mesh is not None
      and not mesh.empty
      and any(t == AxisType.Explicit for t in mesh.axis_types)
  )


def typed_sharding(x: Any) -> Any:
  """The sharding a leaf carries itself: a concrete array's or a struct's own, a
  traced leaf's type's."""
  if isinstance(x, jax.ShapeDtypeStruct) or (
      isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
  ):
    return x.sharding
  return getattr(jax.typeof(x), "sharding", None)


def placement_of(x: Any, known: LeafSharding | None) -> LeafSharding | None:
  """Where state made for leaf ``x`` should live: ``known`` (the spec's), else
  where a concrete array or struct already lies (also on an Auto mesh without
  param_shardings)."""
  if known is not None:
    return known
  own = None if isinstance(x, jax.core.Tracer) else typed_sharding(x)
  return (
      LeafSharding.of(own, x.ndim) if isinstance(own, NamedSharding) else None
  )


def manual_axes() -> frozenset[str]:
  """The mesh axes that are manual here (inside ``shard_map`` over them, arrays
  are local blocks along the dimensions they split); empty outside."""
  mesh = jax.sharding.get_abstract_mesh()
  return frozenset() if mesh.empty else frozenset(mesh.manual_axes)


def inside_shard_map() -> bool:
  """Whether this runs inside ``shard_map`` (leaves are then local blocks)."""
  return bool(manual_axes())


def _check_axis_types(mesh, path: str) -> None:
  types = set(mesh.axis_types)
  if AxisType.Explicit in types and AxisType.Auto in types:
    raise ValueError(
        f"{path}: the mesh mixes Explicit and Auto axes"
        f" ({dict(zip(mesh.axis_names, mesh.axis_types))}); optax_muon needs"
        " all of a mesh's axes Explicit, or all Auto with param_shardings."
    )


def is_sharding_value(x: Any) -> bool:
  return isinstance(x, (NamedSharding, PartitionSpec))


def resolve_param_shardings(param_shardings: Any, tree: Any) -> list[Any]:
  """One NamedSharding (or None) per position of ``tree``.

  Args:
    param_shardings: as ``tree_utils.freeze_prefix`` keeps it: frozen, a
      callable, or None. Entries are ``NamedSharding``s or ``PartitionSpec``s
      (resolved against the mesh set with ``jax.set_mesh``).
    tree: the params or updates.

  Raises:
    ValueError: if the trees don't match (naming the leaf), or PartitionSpecs
      are given with no mesh set.
  """
  values = tree_utils.resolve_prefix(
      param_shardings, tree, is_value=is_sharding_value, what="param_shardings"
  )
  if not any(isinstance(v, PartitionSpec) for v in values):
    return values
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    raise ValueError(
        "param_shardings holds PartitionSpecs but no mesh is set: call the "
        "optimizer under `with jax.set_mesh(mesh):`, or pass NamedShardings."
    )
  return [
      NamedSharding(mesh, v) if isinstance(v, PartitionSpec) else v
      for v in values
  ]


def leaf_sharding(
    path: str,
    shape: tuple[int, ...],
    typed: Any,
    given: Any,
    *,
    split_evenly: bool,
) -> LeafSharding | None:
  """The sharding of one leaf, from its ``param_shardings`` entry or its type.

  Args:
    path: the leaf's path, for messages.
    shape: its global shape.
    typed: its typed sharding (``typed_sharding``), or None.
    given: its ``param_shardings`` entry (a NamedSharding), or None.
    split_evenly: require every dimension to divide evenly over its mesh axes
      (the plan cuts Muon leaves into equal pieces; other leaves may be padded
      by XLA).

  Returns:
    A ``LeafSharding``, or None for a leaf without sharding information.

  Raises:
    ValueError: for mixed Explicit/Auto meshes, an entry that is not a
      ``NamedSharding`` or disagrees with an Explicit leaf's type, or a
      dimension that does not divide evenly over its mesh axes.
  """
  ndim = len(shape)
  if given is not None and not isinstance(given, NamedSharding):
    raise ValueError(
        f"{path}: param_shardings must hold NamedSharding or PartitionSpec "
        f"values; got {type(given).__name__}."
    )
  explicit = is_explicit_sharding(typed)
  for sharding in (typed if explicit else None, given):
    if sharding is not None:
      _check_axis_types(sharding.mesh, path)
  if (
      explicit
      and given is not None
      and (
          dim_axes_of(given.spec, ndim) != dim_axes_of(typed.spec, ndim)
          or _mesh_signature(given.mesh) != _mesh_signature(typed.mesh)
      )
  ):
    raise ValueError(
        f"{path}: param_shardings says {given.spec} on mesh "
        f"{dict(given.mesh.shape)}, but the leaf is typed {typed.spec} on "
        f"{dict(typed.mesh.shape)}."
    )
  source = typed if explicit else given
  if source is None:
    return None
  sharding = LeafSharding.of(source, ndim)
  for d, size in enumerate(shape):
    if split_evenly and size % sharding.shards(d):
      raise ValueError(
          f"{path}: dimension {d} of size {size} does not divide evenly over "
          f"mesh axes {sharding.dim_axes[d]} ({sharding.shards(d)} shards)."
      )
  return sharding


def left_to_the_partitioner_notice(paths: list[str]) -> str | None:
  """The warning for Muon leaves on an Auto mesh without ``param_shardings`` (no
  plan)."""
  if not paths:
    return None
  return (
      f"optax_muon: {tree_utils.listing(paths)} lie on a mesh with Auto axes"
      " and no param_shardings were given, so Newton–Schulz is left to XLA's"
      " partitioner (possibly redundant, or with collectives inside the loop)."
      " Pass param_shardings to muon/scale_by_muon."
  )


def zeros(
    shape: tuple[int, ...], dtype: Any, sharding: LeafSharding | None, like: Any
) -> jax.Array:
  """Zeros placed by ``sharding``: a type on Explicit meshes, a constraint under
  ``jit`` on Auto meshes, a placement for eager init; plain zeros inside
  ``shard_map`` or without one.

  Args:
    shape, dtype: the array's.
    sharding: where it lives, or None.
    like: the param it belongs to (tells whether this runs under a trace).
  """
  if sharding is None or inside_shard_map():
    return jnp.zeros(shape, dtype)
  target = sharding.named
  if not isinstance(like, jax.core.Tracer):
    if isinstance(target.mesh, jax.sharding.Mesh):
      return jnp.zeros(shape, dtype, device=target)
    return jnp.zeros(shape, dtype)
  if all(t == AxisType.Explicit for t in target.mesh.axis_types):
    return jnp.zeros(shape, dtype, out_sharding=target)
  return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), target)


def place_like_params(
    state: Any, params: Any, shardings: list[LeafSharding | None], keep: type
) -> Any:
  """Every array of ``state`` shaped like its param, placed by that param's
  sharding.

  Under ``jax.jit`` on an Auto mesh the zeros an ``init`` creates carry no
  sharding, and the compiler replicates them: every device would hold the whole
  optimizer state until the first update. Subtrees of ``state`` with the params'
  structure (AdamW's moments) are constrained to ``shardings``; subtrees of type
  ``keep`` (Muon's own state, already placed when made) and arrays of other
  shapes are left as they are, and so is everything on an Explicit mesh (there
  the types say where arrays live).

  Args:
    state: an optimizer state.
    params: the params it was made for (global arrays, tracers or structs).
    shardings: per position of ``tree_utils.flatten_positions(params)``.
    keep: a state type to leave alone.

  Returns:
    ``state`` with its param-shaped arrays placed.
  """
  positions, treedef = tree_utils.flatten_positions(params)
  targets = [
      (getattr(leaf, "shape", None), s)
      for (_, leaf), s in zip(positions, shardings)
  ]

  def place(x, shape, sharding):
    if sharding is None or getattr(x, "shape", None) != shape:
      return x
    if is_explicit_sharding(sharding.named) or is_explicit_sharding(
        typed_sharding(x)
    ):
      return x
    if isinstance(x, jax.core.Tracer):
      return jax.lax.with_sharding_constraint(x, sharding.named)
    if (
        isinstance(x, jax.Array)
        and isinstance(sharding.mesh, jax.sharding.Mesh)
        and not x.sharding.is_equivalent_to(sharding.named, x.ndim)
    ):
      return jax.device_put(x, sharding.named)
    return x

  def placeholder(x) -> bool:
    return not tree_utils.is_array_leaf(x)

  def like_params(node) -> bool:
    return (
        not isinstance(node, (jax.Array, keep))
        and jax.tree.structure(node, is_leaf=placeholder) == treedef
    )

  def visit(node):
    if not like_params(node):
      return node
    leaves = jax.tree.leaves(node, is_leaf=placeholder)
    return jax.tree.unflatten(
        treedef, [place(x, *t) for x, t in zip(leaves, targets)]
    )

  return jax.tree.map(
      visit, state, is_leaf=lambda n: isinstance(n, keep) or like_params(n)
  )


def sum_over(
    x: jax.Array, dims: tuple[int, ...], sharding: LeafSharding | None
) -> jax.Array:
  """Σ of ``x`` over ``dims`` (kept as size 1), over the whole leaf.

  On global arrays a plain sum (XLA adds the small all-reduces); inside
  ``shard_map``, where ``x`` is a local block, the partial sums are completed
  with a ``psum`` over the mesh axes that split ``dims``.
  """
  partial = jnp.sum(x, axis=dims, keepdims=True)
  if sharding is None or not inside_shard_map():
    return partial
  axes = sharding.axes_of(dims)
  return jax.lax.psum(partial, axes) if axes else partial
