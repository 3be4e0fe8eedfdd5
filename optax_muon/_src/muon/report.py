"""Muon's routing summary: per leaf its Newton–Schulz matrix, FLOPs and, for
sharded leaves, where the plan orthogonalizes it and the modelled time; the
``Report`` that ``scale_by_muon`` and ``muon`` hand to the tools."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from optax_muon._src.core import profiles
from optax_muon._src.core.dtypes import moment_dtype
from optax_muon._src.core.reporting import (
    SHARED_HEADER,
    LeafSummary,
    RoutingSummary,
    format_table,
    leaf_rows,
    option_notes,
    plural,
    shared_cells,
)
from optax_muon._src.core.routing import ADAM, MUON
from optax_muon._src.muon import costs
from optax_muon._src.muon.options import MuonOptions
from optax_muon._src.muon.plan.model import PAD, Exchange, Plan, TeamRun
from optax_muon._src.muon.spec import MuonTreeSpec, muon_tree_spec


def _placement(plan: Plan, index: int, team_run) -> str:
  """Where plan leaf ``index``'s matrices are orthogonalized, in words;
  ``team_run`` is ``_team_run_of(plan, index)``."""
  group = next(
      g for g in plan.groups if any(index in b.members for b in g.buckets)
  )
  bucket = next(b for b in group.buckets if index in b.members)
  stages = next(s for s in group.stages() if bucket in s[0].buckets)
  k = stages[0].buckets.index(bucket)
  sizes = dict(plan.mesh_shape)
  # Axes of size 1 (MaxText's meshes name twelve) move nothing: not listed.
  exchange_axes = [a for a in group.exchange_axes if sizes.get(a, 2) > 1]
  replica_axes = [a for a in group.replica_axes if sizes.get(a, 2) > 1]
  parts = [
      f"all-to-all over {'×'.join(exchange_axes)}"
      if group.exchange_size > 1
      else "local"
  ]
  if group.replica_size > 1:
    parts.append(
        f"{'split' if group.split else 'redundant'} over "
        f"{'×'.join(replica_axes)}"
    )
  head = (
      f"{', '.join(parts)}; bucket {bucket.shape[0]}×{bucket.shape[1]}: "
      f"{plural(bucket.matrices, 'matrix', 'matrices')}, "
  )
  if team_run is not None:
    ex, run = team_run.exchange, team_run.run
    return head + (
        f"split over teams of {ex.team_size} ({len(ex.teams)} teams among "
        f"{group.workers} workers; {'Gram' if run.cost.gram else 'standard'} "
        f"iteration, every product split){_stage_words(stages, k, True)}"
    )
  counts = sorted(
      {
          sum(j != PAD for ex in stages for j in ex.owned[w][k])
          for w in range(len(stages[0].owned))
      }
  )
  spread = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
  return (
      head
      + f"{spread} whole per worker of {group.workers}"
      + _stage_words(stages, k, False)
  )


def _stage_words(stages: tuple, k: int, team: bool) -> str:
  """Which of the exchange's stages carry bucket ``k``'s whole matrices (or,
  ``team``, its team runs), in words; empty for one stage."""
  if len(stages) == 1:
    return ""
  if team:
    carrying = [
        s
        for s, ex in enumerate(stages)
        if any(r.bucket == k for runs in ex.teams for r in runs)
    ]
    padded = sum(
        r.matrices.count(PAD)
        for ex in stages
        for runs in ex.teams
        for r in runs
        if r.bucket == k
    )
  else:
    carrying = [s for s, ex in enumerate(stages) if any(o[k] for o in ex.owned)]
    # Slots of equal stages' programs that hold no matrix (zeros run NS).
    padded = sum(o[k].count(PAD) for ex in stages for o in ex.owned)
  if len(carrying) == 1:
    where = f"in stage {carrying[0] + 1} of {len(stages)}"
  else:
    where = f"in {len(stages)} stages"
  return f", exchanged {where}" + (
      f" ({plural(padded, 'padded slot', 'padded slots')})" if padded else ""
  )


class TeamPlacement(NamedTuple):
  """Where teams orthogonalize a leaf's matrices: the exchange, and one of its
  runs."""

  exchange: Exchange
  run: TeamRun


def _team_run_of(plan: Plan, index: int) -> TeamPlacement | None:
  """Where teams orthogonalize plan leaf ``index``'s matrices, or None if they
  don't."""
  signature = plan.leaves[index].signature
  return next(
      (
          TeamPlacement(ex, r)
          for g in plan.groups
          for ex in g.exchanges
          for runs in ex.teams
          for r in runs
          if index in ex.buckets[r.bucket].members
          and plan.leaves[r.leaf].signature == signature
      ),
      None,
  )


def _matrix_seconds(
    plan: Plan, index: int, team_run, model: profiles.CostModel
) -> float:
  """Modelled NS time of one of the leaf's matrices on the device(s)
  orthogonalizing it; ``team_run`` is ``_team_run_of(plan, index)``."""
  if team_run is None:
    return model.compute_seconds(plan.leaves[index].flops)
  return team_run.run.cost.seconds(model)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonLeafSummary(LeafSummary):
  """One row of Muon's summary: the shared fields and Muon's own.

  Attributes:
    ns_flops: NS FLOPs per step for the whole leaf.
    placement: where its matrices are orthogonalized (sharded leaves only).
    team: how many devices orthogonalize each of its matrices together (sharded
      leaves).
    ns_seconds: modelled NS time of one of its matrices there (sharded leaves;
      the cost model of ``ShardingOptions``).
  """

  ns_flops: int | None = None
  placement: str = ""
  team: int | None = None
  ns_seconds: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonSummary(RoutingSummary):
  """Muon's routing summary.

  Attributes:
    plan: the orthogonalization plan of the Muon leaves, if any.
    cost_model: the model the plan's figures come from (its ``name`` says which
      profile).

  and every attribute of ``RoutingSummary``; the notes also name the precision
  Newton–Schulz's products run at.
  """

  plan: Plan | None = None
  cost_model: profiles.CostModel | None = None

  @property
  def total_ns_flops(self) -> int:
    """NS FLOPs per step of every Muon leaf."""
    return sum(r.ns_flops or 0 for r in self.rows)

  def table(self) -> str:
    header = SHARED_HEADER + ("NS GFLOP", "k", "NS ms (model)", "NS placement")
    body = [
        shared_cells(r, "Muon")
        + (
            f"{r.ns_flops / 1e9:.3f}" if r.ns_flops else "",
            str(r.team or ""),
            f"{r.ns_seconds * 1e3:.3g}" if r.ns_seconds is not None else "",
            r.placement,
        )
        for r in self.rows
    ]
    n_muon, n_adam = len(self.by_optimizer(MUON)), len(self.by_optimizer(ADAM))
    footer = (
        f"{plural(n_muon, 'leaf', 'leaves')} on Muon, {n_adam} on AdamW; NS "
        f"{self.total_ns_flops / 1e9:.3f} GFLOP per step."
    )
    if self.plan is not None and self.plan.sharded:
      footer += (
          f" Sharded leaves on {self.plan.device_count} devices: NS"
          f" {self.plan.critical_ns_flops() / 1e9:.3f} GFLOP on the"
          " busiest device (whole-matrix lower bound"
          f" {self.plan.ns_flops_bound() / 1e9:.3f}); modelled NS and"
          " exchange time"
          f" {self.plan.critical_seconds(self.cost_model) * 1e3:.3g} ms"
          " on the busiest device (cost profile:"
          f" {self.cost_model.name or 'given'})."
      )
      footer += (
          "\nk: devices that orthogonalize each matrix together (1: the whole"
          " matrix on one device); NS ms (model): the cost model's time for one"
          " matrix there."
      )
    else:  # no sharded leaves: no placement columns
      header, body = header[:-3], [row[:-3] for row in body]
    if any(r.qk_clip for r in self.rows):
      header, body = header + ("QK-clip",), [
          (*row, r.qk_clip) for row, r in zip(body, self.rows)
      ]
    return format_table(header, body, footer, self.notes)


def _precision(spec: MuonTreeSpec) -> str:
  """What Newton–Schulz's products run at, in words: the compute dtype settled
  for the devices (``MuonTreeSpec.ns``), else the momentum's dtype (float32 for
  16-bit params, unless ``mu_dtype`` says otherwise)."""
  kinds = []
  for dtype in dict.fromkeys(
      np.dtype(spec.ns.compute_dtype or moment_dtype(l.dtype))
      for l in spec.muon_leaves
  ):
    kinds.append(
        f"{dtype} at full precision (Precision.HIGHEST)"
        if dtype.itemsize > 2
        else f"{dtype} operands accumulated in float32"
    )
  return "Newton–Schulz products: " + "; ".join(kinds) + "."


def _notes(
    spec: MuonTreeSpec, rows: list[MuonLeafSummary], params: Any
) -> tuple[str, ...]:
  options = spec.options
  notes = []
  if options.normalization is not None:
    n_muon = sum(r.optimizer == MUON for r in rows)
    notes.append(
        f"NorMuon (β₂ = {options.normalization.beta:g}) on "
        f"{plural(n_muon, 'Muon leaf', 'Muon leaves')}: updates normalized per "
        "output neuron after NS."
    )
  return (
      tuple(notes)
      + option_notes(options, params)
      + (_precision(spec),) * bool(spec.muon_leaves)
      + (spec.plan.stage_notes if spec.plan is not None else ())
      + spec.notices
  )


@dataclasses.dataclass(frozen=True)
class MuonReport:
  """What ``scale_by_muon``'s ``init`` reports (a ``reporting.Report``).

  Attributes:
    options: the transformation's static options.
  """

  options: MuonOptions

  def summarize(self, params: Any) -> MuonSummary:
    """Muon's summary of ``params``."""
    return muon_summary(params, muon_tree_spec(params, self.options))


def muon_summary(params: Any, spec: MuonTreeSpec) -> MuonSummary:
  """Muon's summary of ``params``, whose spec is ``spec``."""
  plan = spec.plan
  plan_index = {spec.muon_positions[k]: j for j, k in enumerate(spec.planned)}
  rows = []
  for i, leaf_spec, row in leaf_rows(params, spec):
    layout = leaf_spec.layout
    if layout is not None:
      m, n = layout.ns_shape
      sharded = (
          i in plan_index and plan.leaves[plan_index[i]].sharding is not None
      )
      team_run = _team_run_of(plan, plan_index[i]) if sharded else None
      row = MuonLeafSummary(
          **vars(row),
          ns_flops=layout.batch
          * costs.matrix_flops(
              spec.ns, m, n, layout.dtype, spec.options.ns_steps
          ),
          placement=_placement(plan, plan_index[i], team_run)
          if sharded
          else "",
          team=(1 if team_run is None else team_run.exchange.team_size)
          if sharded
          else None,
          ns_seconds=(
              _matrix_seconds(plan, plan_index[i], team_run, spec.cost_model)
              if sharded
              else None
          ),
      )
    else:
      row = MuonLeafSummary(**vars(row))
    rows.append(row)
  return MuonSummary(
      rows=tuple(rows),
      notes=_notes(spec, rows, params),
      plan=plan,
      cost_model=spec.cost_model,
  )
