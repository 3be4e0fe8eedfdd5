"""The static spec of a tree: computed from shapes, dtypes, shardings and
options.

``tree_spec(tree, options)`` is the one place that decides, per leaf, where it
goes (the matrix optimizer or AdamW, and why), how it is seen as matrices (its
layout, with the side the orthogonalization runs on) and how it lies on the
mesh. It reads Python values only (no arrays, nothing remembered between calls),
plus whether it is called inside ``shard_map`` (then the leaves are local
blocks); ``init``, ``update``, ``summarize`` and ``diagnostics`` each call it,
and nothing downstream re-derives any of it. Each optimizer adds what it needs
on top (Muon: its orthogonalization plan, ``muon.spec``).

``TreeOptions`` is what the spec depends on: the static options both optimizers
share.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from optax_muon._src.core import tree_utils
from optax_muon._src.core.matrices import (
    MatrixLayout,
    is_dimension_numbers,
    make_layout,
)
from optax_muon._src.core.options import Routing, ShardingOptions
from optax_muon._src.core.routing import (
    MUON,
    Reason,
    Route,
    RoutedDimensionNumbers,
    decide,
)
from optax_muon._src.core.sharding import (
    LeafSharding,
    is_sharding_value,
    leaf_sharding,
    resolve_param_shardings,
    typed_sharding,
    left_to_the_partitioner_notice,
    manual_axes,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeOptions:
  """The static options of a matrix optimizer's transformation (hashable, no
  arrays).

  ``muon`` and ``dion`` share them; ``MuonOptions`` and Dion's settings add
  their own.

  Attributes:
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf, frozen (or a
      callable).
    param_shardings: the params' shardings, frozen (or a callable), or None.
    sharding: how sharded matrices are exchanged (Muon) and costed (both).
    routing: the full optimizer's routing; ``None`` for a building block (every
      leaf it receives is a matrix leaf).
    scale: the shape factor the full optimizer applies (``"jordan"``,
      ``"spectral"`` or None).
    consistent_rms: k of the RMS-matching factor, ``"injected"`` when it is a
      hyperparameter set at run time, or None.
    cautious_weight_decay: the full optimizer's cautious weight decay.
    qk_clip: the full optimizer's ``QKClip``, or None.
  """

  weight_dimension_numbers: Any = None
  param_shardings: Any = None
  sharding: ShardingOptions = ShardingOptions()
  routing: Routing | None = None
  scale: str | None = None
  consistent_rms: float | str | None = None
  cautious_weight_decay: bool = False
  qk_clip: Any = None

  def __post_init__(self):
    object.__setattr__(
        self,
        "weight_dimension_numbers",
        tree_utils.freeze_prefix(
            self.weight_dimension_numbers,
            is_value=is_dimension_numbers,
            what="weight_dimension_numbers",
        ),
    )
    object.__setattr__(
        self,
        "param_shardings",
        tree_utils.freeze_prefix(
            self.param_shardings,
            is_value=is_sharding_value,
            what="param_shardings",
        ),
    )

  def __repr__(self) -> str:
    return f"{type(self).__name__}(routing={self.routing is not None}, ...)"

  @functools.cached_property
  def _hash(self) -> int:
    return hash(
        (type(self),)
        + tuple(getattr(self, f.name) for f in dataclasses.fields(self))
    )

  def __hash__(
      self,
  ) -> int:  # computed once: the frozen trees inside can be large
    return self._hash


def static_or_injected(value: Any) -> Any:
  """A hyperparameter as ``TreeOptions`` records it: the Python number, or
  ``"injected"`` when it is an array (``optax.inject_hyperparams`` passes
  arrays)."""
  return (
      value if value is None or isinstance(value, (int, float)) else "injected"
  )


def branch_options(options: TreeOptions) -> TreeOptions:
  """``options`` as the stages of a full optimizer's matrix branch apply them:
  every leaf they receive is a matrix leaf (``optax.partition`` masks the
  others), with the dimension numbers the routing gives it."""
  if options.routing is None:
    return options
  return dataclasses.replace(
      options,
      routing=None,
      weight_dimension_numbers=(
          RoutedDimensionNumbers(
              options.routing, options.weight_dimension_numbers
          )
      ),
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafSpec:
  """One array leaf of the tree.

  Attributes:
    path: the leaf's path.
    shape: its global shape (inside ``shard_map`` the leaf itself is a local
      block).
    dtype: its dtype.
    route: where it goes, and why.
    sharding: how it lies on the mesh, or None without sharding information.
    layout: its matrix layout (Muon leaves only).
  """

  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  route: Route
  sharding: LeafSharding | None
  layout: MatrixLayout | None

  @property
  def local_shape(self) -> tuple[int, ...]:
    return (
        self.shape
        if self.sharding is None
        else self.sharding.local_shape(self.shape)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeSpec:
  """The spec of a tree.

  Attributes:
    leaves: per position of ``tree_utils.flatten_positions(tree)``: a
      ``LeafSpec``, or None at placeholders (None, ``optax.MaskedNode``).
    manual_axes: the mesh axes that are manual where the spec was made (inside
      ``shard_map``): the leaves are local blocks along the dimensions these
      axes split, global along the others.
    options: the options it was made under.
    notices: what the user should be warned about (routing surprises, degenerate
      matrices), each naming the leaves and the fix; the transformation's
      ``init`` warns.

  ``muon_positions`` are the positions of the matrix leaves (those with a
  layout, routed to the matrix optimizer: Muon or Dion); ``planned`` gives those
  of them with at least one element, as indices into ``muon_positions``.
  """

  leaves: tuple[LeafSpec | None, ...]
  manual_axes: frozenset[str]
  options: TreeOptions
  notices: tuple[str, ...] = ()

  @property
  def manual(self) -> bool:
    """Whether the leaves are local blocks (inside ``shard_map``)."""
    return bool(self.manual_axes)

  @functools.cached_property
  def muon_positions(self) -> tuple[int, ...]:
    return tuple(
        i
        for i, leaf in enumerate(self.leaves)
        if leaf is not None and leaf.layout is not None
    )

  @functools.cached_property
  def planned(self) -> tuple[int, ...]:
    return tuple(
        k
        for k, i in enumerate(self.muon_positions)
        if math.prod(self.leaves[i].shape)
    )

  @functools.cached_property
  def mesh(self) -> Any:
    """The Muon leaves' mesh, or None when none is sharded."""
    return next(
        (l.sharding.mesh for l in self.muon_leaves if l.sharding is not None),
        None,
    )

  @property
  def muon_leaves(self) -> list[LeafSpec]:
    return [self.leaves[i] for i in self.muon_positions]

  def labels(self, tree: Any) -> Any:
    """``tree`` with each leaf replaced by its optimizer's label (for
    ``optax.partition``)."""
    _, treedef = tree_utils.flatten_positions(tree)
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            None if leaf is None else leaf.route.optimizer
            for leaf in self.leaves
        ],
    )

  def take(self, tree: Any) -> list[Any]:
    """The Muon leaves of ``tree`` (a tree of the spec's structure), in spec
    order."""
    positions, _ = tree_utils.flatten_positions(tree)
    return [positions[i][1] for i in self.muon_positions]

  def put(self, tree: Any, values: list[Any]) -> Any:
    """``tree`` with its Muon leaves replaced by ``values`` (spec order)."""
    positions, treedef = tree_utils.flatten_positions(tree)
    leaves = [leaf for _, leaf in positions]
    for i, value in zip(self.muon_positions, values):
      leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


def degenerate_notice(muon: list[LeafSpec]) -> str | None:
  """A warning for matrix leaves whose matrices have a side shorter than 2 (NS
  of a 1 × n matrix only normalizes it), or None."""
  bad = []
  for leaf in muon:
    m, n = leaf.layout.ns_shape
    if min(m, n) < 2 and m * n > 0:
      shape = "×".join(map(str, leaf.shape))
      bad.append(f"{leaf.path} ({shape} as {leaf.layout.batch} × {m}×{n})")
  if not bad:
    return None
  return (
      "optax_muon: Muon leaves whose matrices have a side shorter than 2:"
      f" {tree_utils.listing(bad)}. Newton–Schulz of a 1 × n matrix only scales"
      " it to unit norm (every entry's sign kept): check their dimension"
      " numbers (an axis marked batch that is a matrix axis?), or route them"
      " to AdamW."
  )


def tree_spec(tree: Any, options: TreeOptions) -> TreeSpec:
  """The spec of ``tree`` under ``options``.

  Args:
    tree: params or updates: arrays, tracers or ``jax.ShapeDtypeStruct``
      objects; inside ``shard_map`` local blocks.
    options: the transformation's static options.

  Returns:
    The ``TreeSpec``.

  Raises:
    ValueError: naming the leaf, for routing, dimension numbers or shardings
      that don't fit the tree, and for leaves Muon can't take.
  """
  return _build(tree, options, manual_axes())


def _build(tree: Any, options: TreeOptions, manual: frozenset[str]) -> TreeSpec:
  positions, _ = tree_utils.flatten_positions(tree)
  paths = [tree_utils.path_str(path) for path, _ in positions]
  dims = tree_utils.resolve_prefix(
      options.weight_dimension_numbers,
      tree,
      is_value=is_dimension_numbers,
      what="weight_dimension_numbers",
  )
  if options.routing is None:
    routes = [
        Route(path, MUON, Reason.GIVEN_TO_SCALE_BY_MUON, ndim=len(leaf.shape))
        if tree_utils.is_array_leaf(leaf)
        else None
        for path, (_, leaf) in zip(paths, positions)
    ]
    notices = []
  else:
    routed = decide(
        tree,
        options.routing,
        None if options.weight_dimension_numbers is None else dims,
    )
    routes, notices = routed.routes, list(routed.notices)
  given = resolve_param_shardings(options.param_shardings, tree)
  if manual and any(
      r is not None and r.optimizer == MUON and s is None
      for r, s in zip(routes, given)
  ):
    raise ValueError(
        "optax_muon: inside shard_map the leaves are local blocks; pass "
        "param_shardings so that Muon knows each leaf's global shape and mesh."
    )
  leaves, unplanned = [], []
  for path, (_, leaf), r, d, s in zip(paths, positions, routes, dims, given):
    if r is None:
      leaves.append(None)
      continue
    shape = tuple(leaf.shape)
    if manual and s is not None:
      shape = LeafSharding.of(s, len(shape)).global_shape(shape, manual)
    typed = None if manual else typed_sharding(leaf)
    sharding = leaf_sharding(
        path, shape, typed, s, split_evenly=r.optimizer == MUON
    )
    layout = None
    if r.optimizer == MUON:
      layout = make_layout(
          path,
          jax.ShapeDtypeStruct(shape, leaf.dtype),
          d if r.dimension_numbers is None else r.dimension_numbers,
      )
      if (
          sharding is None
          and getattr(typed, "mesh", None) is not None
          and not typed.mesh.empty
          and typed.mesh.size > 1
      ):
        unplanned.append(path)
    leaves.append(
        LeafSpec(
            path=path,
            shape=shape,
            dtype=np.dtype(leaf.dtype),
            route=r,
            sharding=sharding,
            layout=layout,
        )
    )
  muon = [l for l in leaves if l is not None and l.layout is not None]
  notices += [
      n
      for n in (
          left_to_the_partitioner_notice(unplanned),
          degenerate_notice(muon),
      )
      if n is not None
  ]
  meshes = {
      tuple(l.sharding.mesh.shape.items())
      for l in muon
      if l.sharding is not None
  }
  if len(meshes) > 1:
    raise ValueError(
        "optax_muon: the Muon leaves live on different meshes: "
        f"{sorted(meshes)}."
    )
  return TreeSpec(
      leaves=tuple(leaves),
      manual_axes=manual,
      options=options,
      notices=tuple(notices),
  )
