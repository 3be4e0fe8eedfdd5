"""The static spec of a tree: computed from shapes, dtypes, shardings and options.

``tree_spec(tree, options)`` is the one place that decides, per leaf, where it goes (Muon or
AdamW, and why), how it is seen as matrices (its layout, with the side Newton–Schulz runs
on), how it lies on the mesh, and, for the Muon leaves, the orthogonalization plan. It is a
pure function of Python values (no arrays, nothing remembered between calls); ``init``,
``update``, ``summarize`` and ``diagnostics`` each call it, and nothing downstream
re-derives any of it. The plan is built only where it is read (once per trace of
``update``, once per ``summarize``).

``MuonOptions`` is what the spec depends on, and what ``summarize`` shows besides: the
static options of one Muon transformation. Tools find them with ``reporting_options``
(see there for why they are not found anywhere simpler).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from optax_muon import costs, tree_utils
from optax_muon.layout import MatrixLayout, is_dimension_numbers, make_layout
from optax_muon.options import NorMuon, NSOptions, Routing, ShardingOptions
from optax_muon.plan.build import build_plan
from optax_muon.plan.model import Plan
from optax_muon.plan.stages import choose_stages
from optax_muon.routing import MUON, Reason, Route, decide, degenerate_notice
from optax_muon.sharding import (LeafSharding, inside_shard_map, is_sharding_value,
                                 leaf_sharding, resolve_param_shardings, typed_sharding,
                                 left_to_the_partitioner_notice)


@dataclasses.dataclass(frozen=True)
class MuonOptions:
  """The static options of one Muon transformation (hashable, no arrays).

  Attributes:
    ns_steps: Newton–Schulz steps (the resolved count).
    ns: how NS runs.
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf, frozen (or a callable).
    param_shardings: the params' shardings, frozen (or a callable), or None.
    sharding: how sharded matrices are exchanged.
    routing: ``muon``'s routing; ``None`` for ``scale_by_muon`` (every leaf it receives is a
      Muon leaf).
    normalization: NorMuon, or None.
    scale: the shape factor the transformation applies (``"jordan"``, ``"spectral"`` or
      None).
    consistent_rms: k of the RMS-matching factor, ``"injected"`` when it is a
      hyperparameter set at run time, or None.
    cautious_weight_decay: ``muon``'s cautious weight decay.
    qk_clip: ``muon``'s ``QKClip``, or None.
  """

  ns_steps: int
  ns: NSOptions = NSOptions()
  weight_dimension_numbers: Any = None
  param_shardings: Any = None
  sharding: ShardingOptions = ShardingOptions()
  routing: Routing | None = None
  normalization: NorMuon | None = None
  scale: str | None = None
  consistent_rms: float | str | None = None
  cautious_weight_decay: bool = False
  qk_clip: Any = None

  def __post_init__(self):
    object.__setattr__(self, "weight_dimension_numbers", tree_utils.freeze_prefix(
        self.weight_dimension_numbers, is_value=is_dimension_numbers,
        what="weight_dimension_numbers"))
    object.__setattr__(self, "param_shardings", tree_utils.freeze_prefix(
        self.param_shardings, is_value=is_sharding_value, what="param_shardings"))

  def __repr__(self) -> str:
    return f"MuonOptions(ns_steps={self.ns_steps}, routing={self.routing is not None}, ...)"

  @functools.cached_property
  def _hash(self) -> int:
    return hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))

  def __hash__(self) -> int:  # computed once: the frozen trees inside can be large
    return self._hash


_REPORTED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "optax_muon_reported_options", default=None)


@contextlib.contextmanager
def reporting_options() -> Iterator[list[MuonOptions]]:
  """Collects the options every Muon transformation's ``init`` reports inside the block.

  ``summarize(params, tx)`` traces ``tx.init`` (``jax.eval_shape``) inside this block, so
  it finds Muon's options wherever ``tx`` holds it: ``optax.chain``, ``optax.partition``,
  ``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.apply_if_finite``, an
  ``nnx.Optimizer``. Nothing simpler reaches them: the caller holds only ``tx``, whose
  options live in closures; attributes set on a transformation vanish inside those
  wrappers; and the state could carry them only as a static pytree node, which changes the
  state's structure and which ``flax.serialization`` (linen ``TrainState`` checkpoints)
  cannot serialize. Outside the block ``init`` reports to no one: the context variable is
  set only while a tool asks.

  Yields:
    The list the reported options are appended to.
  """
  found: list[MuonOptions] = []
  token = _REPORTED.set(found)
  try:
    yield found
  finally:
    _REPORTED.reset(token)


def report_options(options: Any) -> None:
  """Called by ``init``: hands ``options`` (``MuonOptions``, or Dion's settings that hold
  them) to an active ``reporting_options``."""
  found = _REPORTED.get()
  if found is not None:
    found.append(options)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One array leaf of the tree.

  Attributes:
    path: the leaf's path.
    shape: its global shape (inside ``shard_map`` the leaf itself is a local block).
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
    return self.shape if self.sharding is None else self.sharding.local_shape(self.shape)


@dataclasses.dataclass(frozen=True)
class TreeSpec:
  """The spec of a tree.

  Attributes:
    leaves: per position of ``tree_utils.flatten_positions(tree)``: a ``LeafSpec``, or None
      at placeholders (None, ``optax.MaskedNode``).
    manual: whether the tree's leaves are local blocks (inside ``shard_map``).
    options: the options it was made under.
    notices: what the user should be warned about (routing surprises, degenerate
      matrices), each naming the leaves and the fix; the transformation's ``init`` warns.

  ``plan`` is the orthogonalization plan of the Muon leaves with at least one element (None
  when there are none); ``planned`` gives, for each of ``plan.leaves``, its index among the
  Muon leaves (``muon_positions``).
  """

  leaves: tuple[LeafSpec | None, ...]
  manual: bool
  options: MuonOptions
  notices: tuple[str, ...] = ()

  @functools.cached_property
  def muon_positions(self) -> tuple[int, ...]:
    return tuple(i for i, leaf in enumerate(self.leaves)
                 if leaf is not None and leaf.layout is not None)

  @functools.cached_property
  def planned(self) -> tuple[int, ...]:
    return tuple(k for k, i in enumerate(self.muon_positions)
                 if math.prod(self.leaves[i].shape))

  @functools.cached_property
  def plan(self) -> Plan | None:
    """Built on first use (``scale_by_shape`` and the placement of state never need it)."""
    if not self.planned:
      return None
    muon = [self.leaves[self.muon_positions[k]] for k in self.planned]
    cost = functools.partial(costs.matrix_flops, self.ns, steps=self.options.ns_steps)
    team_cost = functools.partial(costs.team_cost, self.ns, steps=self.options.ns_steps)
    sharding = dataclasses.replace(self.options.sharding, cost_model=self.cost_model)
    plan = build_plan([l.layout for l in muon], [l.sharding for l in muon], cost, sharding,
                      stack=self.options.ns.stack_same_shape, team_cost=team_cost)
    return choose_stages(plan, self.cost_model, sharding.exchange_stages)

  @functools.cached_property
  def mesh(self) -> Any:
    """The Muon leaves' mesh, or None when none is sharded."""
    return next((l.sharding.mesh for l in self.muon_leaves if l.sharding is not None), None)

  @functools.cached_property
  def ns(self) -> NSOptions:
    """``options.ns`` settled for the devices the NS runs on: those of the mesh (concrete
    or a topology's), else the default backend's."""
    devices = costs.mesh_devices(self.mesh)
    return self.options.ns.resolved(devices[0].platform if devices else
                                    jax.default_backend())

  @functools.cached_property
  def cost_model(self) -> costs.CostModel:
    """The plan's cost model: ``ShardingOptions.cost_model``, else the profile of the
    devices of the Muon leaves' mesh (``costs.profile_of``; of ``jax.devices()`` for an
    abstract mesh, which has none), at the NS compute dtype's throughput."""
    model = self.options.sharding.cost_model or costs.default_cost_model(
        costs.mesh_devices(self.mesh))
    dtypes = [l.dtype for l in self.muon_leaves]
    compute = self.ns.compute_dtype or (max(dtypes, key=lambda d: d.itemsize)
                                        if dtypes else np.float32)
    return model.for_dtype(compute)

  @property
  def muon_leaves(self) -> list[LeafSpec]:
    return [self.leaves[i] for i in self.muon_positions]

  def labels(self, tree: Any) -> Any:
    """``tree`` with each leaf replaced by its optimizer's label (for ``optax.partition``)."""
    _, treedef = tree_utils.flatten_positions(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [None if leaf is None else leaf.route.optimizer for leaf in self.leaves])

  def take(self, tree: Any) -> list[Any]:
    """The Muon leaves of ``tree`` (a tree of the spec's structure), in spec order."""
    positions, _ = tree_utils.flatten_positions(tree)
    return [positions[i][1] for i in self.muon_positions]

  def put(self, tree: Any, values: list[Any]) -> Any:
    """``tree`` with its Muon leaves replaced by ``values`` (spec order)."""
    positions, treedef = tree_utils.flatten_positions(tree)
    leaves = [leaf for _, leaf in positions]
    for i, value in zip(self.muon_positions, values):
      leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


def tree_spec(tree: Any, options: MuonOptions) -> TreeSpec:
  """The spec of ``tree`` under ``options``.

  Args:
    tree: params or updates: arrays, tracers or ``jax.ShapeDtypeStruct`` objects; inside
      ``shard_map`` local blocks.
    options: the transformation's static options.

  Returns:
    The ``TreeSpec``.

  Raises:
    ValueError: naming the leaf, for routing, dimension numbers or shardings that don't fit
      the tree, and for leaves Muon can't take.
  """
  return _build(tree, options, inside_shard_map())


def _build(tree: Any, options: MuonOptions, manual: bool) -> TreeSpec:
  positions, _ = tree_utils.flatten_positions(tree)
  paths = [tree_utils.path_str(path) for path, _ in positions]
  dims = tree_utils.resolve_prefix(options.weight_dimension_numbers, tree,
                                   is_value=is_dimension_numbers,
                                   what="weight_dimension_numbers")
  if options.routing is None:
    routes = [Route(path, MUON, Reason.GIVEN_TO_SCALE_BY_MUON, ndim=len(leaf.shape))
              if tree_utils.is_array_leaf(leaf) else None
              for path, (_, leaf) in zip(paths, positions)]
    notices = []
  else:
    routed = decide(tree, options.routing,
                    None if options.weight_dimension_numbers is None else dims)
    routes, notices = routed.routes, list(routed.notices)
  given = resolve_param_shardings(options.param_shardings, tree)
  if manual and any(r is not None and r.optimizer == MUON and s is None
                    for r, s in zip(routes, given)):
    raise ValueError("optax_muon: inside shard_map the leaves are local blocks; pass "
                     "param_shardings so that Muon knows each leaf's global shape and mesh.")
  leaves, unplanned = [], []
  for path, (_, leaf), r, d, s in zip(paths, positions, routes, dims, given):
    if r is None:
      leaves.append(None)
      continue
    shape = tuple(leaf.shape)
    if manual and s is not None:
      shape = LeafSharding.of(s, len(shape)).global_shape(shape)
    typed = None if manual else typed_sharding(leaf)
    sharding = leaf_sharding(path, shape, typed, s, split_evenly=r.optimizer == MUON)
    layout = None
    if r.optimizer == MUON:
      layout = make_layout(path, jax.ShapeDtypeStruct(shape, leaf.dtype),
                           d if r.dimension_numbers is None else r.dimension_numbers)
      if sharding is None and getattr(typed, "mesh", None) is not None and not typed.mesh.empty:
        unplanned.append(path)
    leaves.append(LeafSpec(path, shape, np.dtype(leaf.dtype), r, sharding, layout))
  muon = [l for l in leaves if l is not None and l.layout is not None]
  degenerate = [(l.path, l.shape, l.layout.batch, l.layout.ns_shape) for l in muon]
  notices += [n for n in (left_to_the_partitioner_notice(unplanned),
                          degenerate_notice(degenerate)) if n is not None]
  meshes = {tuple(l.sharding.mesh.shape.items()) for l in muon if l.sharding is not None}
  if len(meshes) > 1:
    raise ValueError(f"optax_muon: the Muon leaves live on different meshes: "
                     f"{sorted(meshes)}.")
  return TreeSpec(tuple(leaves), manual, options, tuple(notices))
