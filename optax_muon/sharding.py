"""Reading shardings: which mesh axes split each dimension of a leaf, on which mesh.

Explicit meshes carry the sharding in each array's type (``jax.typeof(x).sharding``); under
Auto meshes the user passes ``param_shardings``. Everything here runs at trace time.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax_muon import tree_utils

DimAxes = tuple[tuple[str, ...], ...]  # per leaf dimension, the mesh axes splitting it


@dataclasses.dataclass(frozen=True)
class LeafSharding:
  """How one leaf is laid out over a mesh.

  Attributes:
    mesh: the (possibly abstract) mesh.
    dim_axes: per leaf dimension, the mesh axes that split it, major to minor.
  """

  mesh: Any
  dim_axes: DimAxes

  @property
  def spec(self) -> PartitionSpec:
    return PartitionSpec(*[None if not axes else axes[0] if len(axes) == 1 else axes
                           for axes in self.dim_axes])

  def shards(self, dim: int) -> int:
    return math.prod(self.mesh.shape[a] for a in self.dim_axes[dim])

  def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(size // self.shards(d) for d, size in enumerate(shape))

  def global_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(size * self.shards(d) for d, size in enumerate(local_shape))

  @property
  def used_axes(self) -> set[str]:
    return {a for axes in self.dim_axes for a in axes}


def dim_axes_of(spec: PartitionSpec, ndim: int) -> DimAxes:
  """A PartitionSpec as one tuple of axis names per dimension."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
               for e in entries)


def _mesh_signature(mesh) -> tuple:
  return tuple(mesh.shape.items())


def is_explicit_sharding(sharding: Any) -> bool:
  """Whether ``sharding`` is a NamedSharding on a mesh with Explicit axes."""
  mesh = getattr(sharding, "mesh", None)
  return (isinstance(sharding, NamedSharding) and mesh is not None and not mesh.empty
          and any(t == AxisType.Explicit for t in mesh.axis_types))


def check_axis_types(mesh, where: str) -> None:
  """Raises for a mesh mixing Explicit and Auto axes (the two need different handling)."""
  types = set(mesh.axis_types)
  if AxisType.Explicit in types and AxisType.Auto in types:
    raise ValueError(f"{where}: the mesh mixes Explicit and Auto axes "
                     f"({dict(zip(mesh.axis_names, mesh.axis_types))}); optax_muon needs all "
                     "of a mesh's axes Explicit, or all Auto with param_shardings.")


def leaf_shardings(shapes: list[tuple[int, ...]], typed: list[Any], paths: list[str],
                   param_shardings: list[Any] | None) -> list[LeafSharding | None]:
  """The sharding of each Muon leaf, from ``param_shardings`` or the leaves' types.

  Args:
    shapes: the leaves' global shapes.
    typed: each leaf's typed sharding (``jax.typeof(x).sharding``), or None.
    paths: their paths, for messages.
    param_shardings: one ``NamedSharding`` (or None) per leaf, or None.

  Returns:
    One ``LeafSharding`` per leaf, or None for a leaf with no sharding information.

  Raises:
    ValueError: for mixed Explicit/Auto meshes, leaves on different meshes, a
      ``param_shardings`` entry that is not a ``NamedSharding`` or disagrees with an Explicit
      leaf's type, or a dimension that does not divide evenly over its mesh axes.
  """
  out = []
  for i, (shape, typed_sharding, path) in enumerate(zip(shapes, typed, paths)):
    ndim = len(shape)
    given = param_shardings[i] if param_shardings is not None else None
    if given is not None and not isinstance(given, NamedSharding):
      raise ValueError(f"{path}: param_shardings must hold NamedSharding values; got "
                       f"{type(given).__name__}.")
    explicit = is_explicit_sharding(typed_sharding)
    if explicit:
      check_axis_types(typed_sharding.mesh, path)
    if given is not None:
      check_axis_types(given.mesh, path)
    if explicit and given is not None:
      if (dim_axes_of(given.spec, ndim) != dim_axes_of(typed_sharding.spec, ndim)
          or _mesh_signature(given.mesh) != _mesh_signature(typed_sharding.mesh)):
        raise ValueError(f"{path}: param_shardings says {given.spec} on mesh "
                         f"{dict(given.mesh.shape)}, but the leaf is typed "
                         f"{typed_sharding.spec} on {dict(typed_sharding.mesh.shape)}.")
    source = typed_sharding if explicit else given
    if source is None:
      if getattr(typed_sharding, "mesh", None) is not None and not typed_sharding.mesh.empty:
        warnings.warn(f"optax_muon: {path} is on a mesh with Auto axes and no "
                      "param_shardings were given, so Newton–Schulz is left to XLA's "
                      "partitioner (possibly redundant or with collectives inside the "
                      "loop). Pass param_shardings to muon/scale_by_muon.", stacklevel=4)
      out.append(None)
      continue
    sharding = LeafSharding(source.mesh, dim_axes_of(source.spec, ndim))
    for d, size in enumerate(shape):
      if size % sharding.shards(d):
        raise ValueError(f"{path}: dimension {d} of size {size} does not divide evenly over "
                         f"mesh axes {sharding.dim_axes[d]} ({sharding.shards(d)} shards).")
    out.append(sharding)
  meshes = {_mesh_signature(s.mesh) for s in out if s is not None}
  if len(meshes) > 1:
    raise ValueError(f"optax_muon: the Muon leaves live on different meshes: {meshes}.")
  return out


def _mesh_in_context():
  """The (abstract) mesh set with ``jax.set_mesh``, or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def resolve_param_shardings(param_shardings: Any, tree: Any) -> list[Any] | None:
  """One NamedSharding (or None) per position of ``tree``.

  Args:
    param_shardings: a tree or prefix tree, matched to ``tree`` by path, of
      ``NamedSharding`` or ``PartitionSpec`` (resolved against the mesh set with
      ``jax.set_mesh``): a pure dict, an ``nnx.State``, a tree of ``nnx.Variable``s or
      linen boxes (``nnx.get_named_sharding``, ``nn.get_sharding``,
      ``nn.logical_to_mesh_sharding`` output), or None.
    tree: the params or updates.

  Returns:
    A list aligned with ``tree_utils.flatten_positions(tree)``, or None.

  Raises:
    ValueError: if the trees don't match (naming the leaf), or PartitionSpecs are given
      with no mesh set.
  """
  if param_shardings is None:
    return None
  values = tree_utils.broadcast_prefix(
      param_shardings, tree, is_value=lambda x: isinstance(x, (NamedSharding, PartitionSpec)),
      what="param_shardings")
  if not any(isinstance(v, PartitionSpec) for v in values):
    return values
  mesh = _mesh_in_context()
  if mesh is None:
    raise ValueError("param_shardings holds PartitionSpecs but no mesh is set: call the "
                     "optimizer under `with jax.set_mesh(mesh):`, or pass NamedShardings.")
  return [NamedSharding(mesh, v) if isinstance(v, PartitionSpec) else v for v in values]


def place_like_params(state: Any, params: Any, shardings: list[Any] | None) -> Any:
  """Every array of ``state`` shaped like its param, placed by that param's sharding.

  Under ``jax.jit`` on an Auto mesh the zeros an ``init`` creates carry no sharding, and the
  compiler replicates them: every device would hold the whole optimizer state until the
  first update. Subtrees of ``state`` with the params' structure (momenta, Adam moments)
  are constrained to ``shardings``; arrays of other shapes (counts, NorMuon's per-neuron
  moments) are left as they are, and so is everything on an Explicit mesh (there the types
  say where arrays live, and the update checks them against ``param_shardings``).

  Args:
    state: an optimizer state.
    params: the params it was made for (global arrays, tracers or structs).
    shardings: per position of ``tree_utils.flatten_positions(params)``, a NamedSharding or
      None; None for no placement at all.

  Returns:
    ``state`` with its param-shaped arrays placed.
  """
  if shardings is None:
    return state
  positions, treedef = tree_utils.flatten_positions(params)
  targets = [(getattr(leaf, "shape", None), s) for (_, leaf), s in zip(positions, shardings)]

  def place(x, shape, sharding):
    if sharding is None or getattr(x, "shape", None) != shape or is_explicit_sharding(sharding):
      return x
    traced = isinstance(x, jax.core.Tracer)
    current = getattr(jax.typeof(x), "sharding", None) if traced else getattr(x, "sharding", None)
    if is_explicit_sharding(current):
      return x
    if traced:
      return jax.lax.with_sharding_constraint(x, sharding)
    if (isinstance(x, jax.Array) and isinstance(sharding.mesh, jax.sharding.Mesh)
        and not x.sharding.is_equivalent_to(sharding, x.ndim)):
      return jax.device_put(x, sharding)
    return x

  def _placeholder(x) -> bool:
    return not tree_utils.is_array_leaf(x)

  def like_params(node) -> bool:
    return (not isinstance(node, jax.Array)
            and jax.tree.structure(node, is_leaf=_placeholder) == treedef)

  def visit(node):
    if not like_params(node):
      return node
    leaves = jax.tree.leaves(node, is_leaf=_placeholder)
    return jax.tree.unflatten(treedef, [place(x, *t) for x, t in zip(leaves, targets)])

  return jax.tree.map(visit, state, is_leaf=like_params)
