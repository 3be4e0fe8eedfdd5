"""``summarize``: a table of where every leaf goes and what Newton–Schulz (or Dion's
power iteration, beside what Muon's plan would cost) costs there."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from optax_muon import costs, tree_utils
from optax_muon.coefficients import resolve_coefficients
from optax_muon.dion_costs import dion_cost, step_seconds
from optax_muon.dion_transform import DionSettings
from optax_muon.momentum import moment_dtype
from optax_muon.plan.model import Plan
from optax_muon.qk_clipping import ROLES, resolve_projections
from optax_muon.routing import ADAM, MUON
from optax_muon.scaling import scale_factor
from optax_muon.spec import MuonOptions, TreeSpec, reporting_options, tree_spec


def find_muon_options(tx: Any, params: Any) -> MuonOptions:
  """The static options of the Muon (or Dion) transformation inside ``tx``: its routing,
  dimension numbers and shardings (see ``find_reported``)."""
  found = find_reported(tx, params)
  return found.options if isinstance(found, DionSettings) else found


def find_reported(tx: Any, params: Any) -> MuonOptions | DionSettings:
  """What the Muon or Dion transformation inside ``tx`` reports at ``init``.

  Args:
    tx: an optax transformation that contains one from ``muon``, ``scale_by_muon``,
      ``dion`` or ``scale_by_dion`` (also inside ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
      ``optax.apply_if_finite``, ...), or an ``nnx.Optimizer``.
    params: the params (``tx.init`` is traced with ``jax.eval_shape``: nothing is
      computed).

  Returns:
    ``MuonOptions`` for Muon, ``DionSettings`` for Dion.

  Raises:
    ValueError: if ``tx`` holds no Muon or Dion transformation, or several different ones.
  """
  tx = getattr(tx, "tx", tx)  # an nnx.Optimizer holds its transformation as .tx
  init = getattr(tx, "init", None)
  if not callable(init):
    raise ValueError(f"expected an optax transformation or an nnx.Optimizer, got "
                     f"{type(tx).__name__}.")
  with reporting_options() as found:
    # A new function each time: eval_shape caches traces by function, and a cached trace
    # would not run init (nor report) again.
    jax.eval_shape(lambda p: init(p), params)  # noqa: PLW0108
  if not found:
    raise ValueError(f"no optax_muon transformation found in {type(tx).__name__}: pass the "
                     "transformation that muon, scale_by_muon, dion or scale_by_dion is "
                     "part of.")
  if any(options != found[0] for options in found[1:]):
    raise ValueError(f"{type(tx).__name__} holds {len(found)} different Muon or Dion "
                     "transformations; summarize each on its own.")
  return found[0]


def _plural(count: int, one: str, many: str) -> str:
  return f"{count} {one if count == 1 else many}"


def _placement(plan: Plan, index: int, team_run) -> str:
  """Where plan leaf ``index``'s matrices are orthogonalized, in words; ``team_run`` is
  ``_team_run_of(plan, index)``."""
  group = next(g for g in plan.groups if any(index in b.members for b in g.buckets))
  bucket = next(b for b in group.buckets if index in b.members)
  stages = next(s for s in costs.exchange_stages(group.exchanges) if bucket in s[0].buckets)
  k = stages[0].buckets.index(bucket)
  parts = [f"all-to-all over {'×'.join(group.exchange_axes)}" if group.exchange_size > 1
           else "local"]
  if group.replica_size > 1:
    parts.append(f"{'split' if group.split else 'redundant'} over "
                 f"{'×'.join(group.replica_axes)}")
  head = (f"{', '.join(parts)}; bucket {bucket.shape[0]}×{bucket.shape[1]}: "
          f"{_plural(bucket.matrices, 'matrix', 'matrices')}, ")
  if team_run is not None:
    ex, run = team_run
    return head + (f"split over teams of {ex.team_size} ({len(ex.teams)} teams among "
                   f"{group.workers} workers; {'Gram' if run.cost.gram else 'standard'} "
                   f"iteration, every product split)")
  counts = sorted({sum(len(ex.owned[w][k]) for ex in stages)
                   for w in range(len(stages[0].owned))})
  spread = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
  staged = f", exchanged in {len(stages)} stages" if len(stages) > 1 else ""
  return head + f"{spread} whole per worker of {group.workers}{staged}"


def _team_run_of(plan: Plan, index: int):
  """(exchange, a ``TeamRun``) of plan leaf ``index``'s matrices if teams orthogonalize
  them, else None."""
  signature = plan.leaves[index].signature
  return next(((ex, r) for g in plan.groups for ex in g.exchanges for runs in ex.teams
               for r in runs if index in ex.buckets[r.bucket].members
               and plan.leaves[r.leaf].signature == signature), None)


def _matrix_seconds(plan: Plan, index: int, team_run, model: costs.CostModel) -> float:
  """Modelled NS time of one of the leaf's matrices on the device(s) orthogonalizing it;
  ``team_run`` is ``_team_run_of(plan, index)``."""
  if team_run is None:
    return model.compute_seconds(plan.leaves[index].flops)
  return team_run[1].cost.seconds(model)


@dataclasses.dataclass(frozen=True)
class LeafSummary:
  """One row of the routing summary.

  Attributes:
    path, shape, dtype: the leaf.
    optimizer: ``"muon"`` or ``"adam"``.
    reason: why it was routed there, in words.
    ns_matrix: the (m, n) matrix NS iterates on (m ≤ n), Muon leaves only.
    batch: how many such matrices the leaf holds.
    scale: the shape factor (None when it is a hyperparameter set at run time).
    ns_flops: NS FLOPs per step for the whole leaf.
    placement: where its matrices are orthogonalized (sharded leaves only).
    team: how many devices orthogonalize each of its matrices together (sharded leaves).
    ns_seconds: modelled NS time of one of its matrices there (sharded leaves; the cost
      model of ``ShardingOptions``).
    qk_clip: its QK-clip role and heads (query and key projections only).
    rank: Dion's rank r (Dion's Muon leaves only; then ``ns_flops`` is None and the
      figures below are Dion's).
    flops_per_device: Dion's FLOPs per step on one device.
    received_bytes: the bytes one device receives per step for this leaf (Dion's
      collectives).
    seconds: Dion's modelled time for this leaf on one device (cost model of
      ``RoutingSummary.cost_model``).
    muon_bytes: the bytes Muon's plan moves for this leaf per step (the matrix to the
      device(s) that orthogonalize it and back), all devices together.
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  optimizer: str
  reason: str
  ns_matrix: tuple[int, int] | None = None
  batch: int | None = None
  scale: float | None = None
  ns_flops: int | None = None
  placement: str = ""
  team: int | None = None
  ns_seconds: float | None = None
  qk_clip: str = ""
  rank: int | None = None
  flops_per_device: float | None = None
  received_bytes: float | None = None
  seconds: float | None = None
  muon_bytes: float | None = None


@dataclasses.dataclass(frozen=True)
class RoutingSummary:
  """The routing summary: ``rows``, and a table via ``str()``.

  Attributes:
    rows: one per leaf.
    plan: the orthogonalization plan of the Muon leaves, if any (for Dion: the plan that
      ``muon`` with the same arguments would follow, for comparison).
    notes: footer lines naming the precision Newton–Schulz's products run at, the options
      that change the update (NorMuon, cautious weight decay, QK-clip) and the leaves they
      apply to, and the warnings ``init`` gives for this tree (routing surprises,
      degenerate matrices).
    cost_model: the model the plan's figures come from (its ``name`` says which profile).
    dion: whether the rows' figures are Dion's.
    dion_seconds: Dion's modelled step time on one device (``dion_costs.step_seconds``).
  """

  rows: tuple[LeafSummary, ...]
  plan: Plan | None = None
  notes: tuple[str, ...] = ()
  cost_model: costs.CostModel | None = None
  dion: bool = False
  dion_seconds: float | None = None

  def by_optimizer(self, optimizer: str) -> list[LeafSummary]:
    return [r for r in self.rows if r.optimizer == optimizer]

  @property
  def total_ns_flops(self) -> int:
    return sum(r.ns_flops or 0 for r in self.rows)

  def __str__(self) -> str:
    if self.dion:
      return self._dion_table()
    header = ("path", "shape", "dtype", "optimizer", "reason", "NS matrix", "batch", "scale",
              "NS GFLOP", "k", "NS ms (model)", "NS placement")
    body = [(r.path, "×".join(map(str, r.shape)) or "()", r.dtype,
             "Muon" if r.optimizer == MUON else "AdamW", r.reason,
             f"{r.ns_matrix[0]}×{r.ns_matrix[1]}" if r.ns_matrix else "",
             str(r.batch or ""), f"{r.scale:.3g}" if r.scale is not None else "",
             f"{r.ns_flops / 1e9:.3f}" if r.ns_flops else "", str(r.team or ""),
             f"{r.ns_seconds * 1e3:.3g}" if r.ns_seconds is not None else "", r.placement)
            for r in self.rows]
    n_muon, n_adam = len(self.by_optimizer(MUON)), len(self.by_optimizer(ADAM))
    footer = (f"{_plural(n_muon, 'leaf', 'leaves')} on Muon, {n_adam} on AdamW; NS "
              f"{self.total_ns_flops / 1e9:.3f} GFLOP per step.")
    if self.plan is not None and self.plan.sharded:
      footer += (f" Sharded leaves on {self.plan.device_count} devices: NS "
                 f"{costs.critical_ns_flops(self.plan) / 1e9:.3f} GFLOP on the busiest "
                 f"device (whole-matrix lower bound {costs.ns_flops_bound(self.plan) / 1e9:.3f}); "
                 f"modelled NS and exchange time "
                 f"{costs.critical_seconds(self.plan, self.cost_model) * 1e3:.3g} ms on the "
                 f"busiest device (cost profile: {self.cost_model.name or 'given'}).")
      footer += ("\nk: devices that orthogonalize each matrix together (1: the whole matrix on "
                 "one device); NS ms (model): the cost model's time for one matrix there.")
    else:  # no sharded leaves: no placement columns
      header, body = header[:-3], [row[:-3] for row in body]
    if any(r.qk_clip for r in self.rows):
      header, body = header + ("QK-clip",), [(*row, r.qk_clip) for row, r in zip(body, self.rows)]
    return _table(header, body, footer, self.notes)

  def _dion_table(self) -> str:
    sharded = self.plan is not None and self.plan.sharded
    header = ("path", "shape", "dtype", "optimizer", "reason", "matrix", "batch", "scale", "r",
              "GFLOP/device", "MB/device", "ms (model)", "Muon MB", "Muon NS ms")
    mb = lambda x: f"{x / 1e6:.3g}" if x is not None else ""
    body = [(r.path, "×".join(map(str, r.shape)) or "()", r.dtype,
             "Dion" if r.optimizer == MUON else "AdamW", r.reason,
             f"{r.ns_matrix[0]}×{r.ns_matrix[1]}" if r.ns_matrix else "",
             str(r.batch or ""), f"{r.scale:.3g}" if r.scale is not None else "",
             str(r.rank or ""),
             f"{r.flops_per_device / 1e9:.3g}" if r.flops_per_device is not None else "",
             mb(r.received_bytes),
             f"{r.seconds * 1e3:.3g}" if r.seconds is not None else "",
             mb(r.muon_bytes) if sharded else "",
             f"{r.ns_seconds * 1e3:.3g}" if r.ns_seconds is not None else "")
            for r in self.rows]
    dion = self.by_optimizer(MUON)
    footer = (f"{_plural(len(dion), 'leaf', 'leaves')} on Dion, "
              f"{len(self.by_optimizer(ADAM))} on AdamW. Dion per step on each device: "
              f"{sum(r.flops_per_device for r in dion) / 1e9:.3g} GFLOP, receives "
              f"{sum(r.received_bytes for r in dion) / 1e6:.3g} MB, modelled "
              f"{self.dion_seconds * 1e3:.3g} ms (each kind of collective combined over "
              "the leaves)")
    if sharded:
      footer += (f"; Muon's plan for the same tree and mesh (muon with the same arguments): "
                 f"{costs.critical_seconds(self.plan, self.cost_model) * 1e3:.3g} ms and "
                 f"{costs.device_received_bytes(self.plan).max() / 1e6:.3g} MB received on "
                 f"the busiest device")
    footer += (f" (cost profile: {self.cost_model.name or 'given'}).\n"
               "MB/device: what one device receives for the leaf (ring model); Muon MB: "
               "what Muon's exchange moves for it, all devices together; Muon NS ms: "
               "Newton–Schulz of one of its matrices where the plan puts it.")
    if not sharded:
      header, body = header[:-2], [row[:-2] for row in body]
    return _table(header, body, footer, self.notes)


def _table(header: tuple[str, ...], body: list[tuple[str, ...]], footer: str,
           notes: tuple[str, ...]) -> str:
  widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
  fmt = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
  rule = "  ".join("-" * w for w in widths)
  return "\n".join([fmt(header), rule, *map(fmt, body), rule, footer, *notes])


def _precision(spec: TreeSpec) -> str:
  """What Newton–Schulz's products run at, in words: the compute dtype settled for the
  devices (``TreeSpec.ns``), else the momentum's dtype (float32 for 16-bit params, unless
  ``mu_dtype`` says otherwise)."""
  kinds = []
  for dtype in dict.fromkeys(np.dtype(spec.ns.compute_dtype or moment_dtype(l.dtype))
                             for l in spec.muon_leaves):
    kinds.append(f"{dtype} at full precision (Precision.HIGHEST)" if dtype.itemsize > 2
                 else f"{dtype} operands accumulated in float32")
  return "Newton–Schulz products: " + "; ".join(kinds) + "."


def _notes(options: MuonOptions, rows: list[LeafSummary], roles: list[str]) -> tuple[str, ...]:
  notes = []
  n_muon = sum(r.optimizer == MUON for r in rows)
  if options.normalization is not None:
    notes.append(f"NorMuon (β₂ = {options.normalization.beta:g}) on "
                 f"{_plural(n_muon, 'Muon leaf', 'Muon leaves')}: updates normalized per "
                 "output neuron after NS.")
  if options.consistent_rms == "injected":
    notes.append("Scale: consistent_rms·√max(n_in, n_out), consistent_rms set at run time.")
  if options.cautious_weight_decay:
    notes.append("Cautious weight decay: Muon and AdamW leaves are decayed only where the "
                 "parameter and the update agree in sign.")
  if options.qk_clip is not None:
    notes.append(f"QK-clip (τ = {options.qk_clip.threshold:g}, α = {options.qk_clip.alpha:g}) "
                 "on " + ", ".join(f"{roles.count(role)} {role}" for role in ROLES
                                   if role in roles) + " projections.")
  return tuple(notes)


def summarize(params: Any, tx: Any, *, print_table: bool = False) -> RoutingSummary:
  """Shows, per leaf, which optimizer ``tx`` applies and what NS costs there.

  For Dion (``dion``, ``scale_by_dion``) the rows give each matrix's rank and Dion's
  FLOPs, received bytes and modelled time per device, beside what Muon's plan would move
  and compute for it (``muon`` with the same arguments).

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct`` objects).
    tx: a transformation that contains ``muon``, ``scale_by_muon``, ``dion`` or
      ``scale_by_dion`` (directly or inside
      ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
      ``optax.apply_if_finite``, ...), or an ``nnx.Optimizer``.
    print_table: also print the table.

  Returns:
    A ``RoutingSummary``.

  Raises:
    ValueError: if ``tx`` holds no Muon transformation, or its routing does not fit
      ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_muon
    >>> params = {"embed": jnp.zeros((256, 64)), "w": jnp.zeros((64, 256))}
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax_muon.muon(0.02))
    >>> summary = optax_muon.summarize(params, tx)
    >>> print(summary.rows[1].path, summary.rows[1].reason, summary.rows[1].scale)
    w 2-D 2.0
    >>> for line in str(summary).splitlines()[-2:]:
    ...   print(line)
    1 leaf on Muon, 1 on AdamW; NS 0.016 GFLOP per step.
    Newton–Schulz products: float32 at full precision (Precision.HIGHEST).
  """
  found = find_reported(tx, params)
  if isinstance(found, DionSettings):
    return _dion_summary(params, found, print_table)
  spec = tree_spec(params, found)
  return _summary(params, spec, print_table)


#: Muon's default Newton–Schulz steps: the comparison in Dion's summary.
_MUON_NS_STEPS = resolve_coefficients("jordan", None, None).steps


def _dion_summary(params: Any, settings: DionSettings, print_table: bool) -> RoutingSummary:
  """Muon's summary of the same tree with Dion's figures in the Muon leaves' rows."""
  muon = _summary(params, tree_spec(params, dataclasses.replace(
      settings.options, ns_steps=_MUON_NS_STEPS)), False)
  spec = tree_spec(params, settings.options)
  matrices = dict(zip(spec.muon_positions, settings.matrices(spec, params)))
  base = settings.options.sharding.cost_model or costs.default_cost_model(
      costs.mesh_devices(spec.mesh))
  model = base.for_dtype(settings.product_dtype or np.float32)
  leaf_rows = iter(muon.rows)
  rows, leaf_costs = [], []
  for i, leaf in enumerate(spec.leaves):
    if leaf is None:
      continue
    row = next(leaf_rows)
    if i in matrices:
      cost = dion_cost(matrices[i], np.dtype(moment_dtype(leaf.dtype)).itemsize)
      leaf_costs.append(cost)
      wire = np.dtype(spec.ns.compute_dtype or moment_dtype(leaf.dtype)).itemsize
      shards = (math.prod(leaf.sharding.shards(d) for d in range(len(leaf.shape)))
                if leaf.sharding is not None else 1)
      row = dataclasses.replace(
          row, ns_flops=None, rank=matrices[i].rank, flops_per_device=cost.flops,
          received_bytes=cost.received_bytes, seconds=cost.seconds(model),
          muon_bytes=2 * math.prod(leaf.shape) * wire * (shards - 1) / shards)
    rows.append(row)
  notes = tuple(n for n in muon.notes if not n.startswith("Newton–Schulz products"))
  summary = RoutingSummary(tuple(rows), muon.plan, notes, muon.cost_model, dion=True,
                           dion_seconds=step_seconds(leaf_costs, model))
  if print_table:
    print(summary)
  return summary


def _summary(params: Any, spec: TreeSpec, print_table: bool) -> RoutingSummary:
  options = spec.options
  positions, _ = tree_utils.flatten_positions(params)
  projections = ([None] * len(positions) if options.qk_clip is None
                 else resolve_projections(options.qk_clip.heads, params))
  plan = spec.plan
  plan_index = {spec.muon_positions[k]: j for j, k in enumerate(spec.planned)}
  consistent_rms = (None if options.consistent_rms == "injected" else options.consistent_rms)
  rows = []
  for i, ((_, leaf), leaf_spec, p) in enumerate(zip(positions, spec.leaves, projections)):
    if leaf_spec is None:
      continue
    r = leaf_spec.route
    row = LeafSummary(r.path, tuple(leaf.shape), str(np.dtype(leaf.dtype)), r.optimizer,
                      r.describe(),
                      qk_clip=p.describe() if p is not None else "")
    layout = leaf_spec.layout
    if layout is not None:
      m, n = layout.ns_shape
      sharded = i in plan_index and plan.leaves[plan_index[i]].sharding is not None
      team_run = _team_run_of(plan, plan_index[i]) if sharded else None
      row = dataclasses.replace(
          row, ns_matrix=(m, n), batch=layout.batch,
          scale=(None if options.consistent_rms == "injected" else float(scale_factor(
              layout.n_in, layout.n_out, options.scale, consistent_rms=consistent_rms))),
          ns_flops=layout.batch * costs.matrix_flops(spec.ns, m, n, layout.dtype,
                                                     options.ns_steps),
          placement=_placement(plan, plan_index[i], team_run) if sharded else "",
          team=(1 if team_run is None else team_run[0].team_size) if sharded else None,
          ns_seconds=(_matrix_seconds(plan, plan_index[i], team_run, spec.cost_model)
                      if sharded else None))
    rows.append(row)
  notes = (_notes(options, rows, [p.role for p in projections if p is not None])
           + (_precision(spec),) * bool(spec.muon_leaves) + spec.notices)
  summary = RoutingSummary(tuple(rows), plan, notes, spec.cost_model)
  if print_table:
    print(summary)
  return summary
