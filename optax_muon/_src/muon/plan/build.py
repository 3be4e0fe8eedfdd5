"""``build_plan``: the plan of a tree's Muon leaves, from grouping to the team
search and the exchange stages."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from optax_muon._src.core.profiles import CostModel, default_cost_model
from optax_muon._src.muon.costs import TeamCost
from optax_muon._src.core.matrices import MatrixLayout
from optax_muon._src.core.options import ShardingOptions
from optax_muon._src.muon.plan.exchanges import make_exchange
from optax_muon._src.muon.plan.grouping import (
    ExchangeBuckets,
    MeshShape,
    group_leaves,
    mesh_shape_of,
    place_leaves,
)
from optax_muon._src.muon.plan.model import Group, LeafPlacement, Plan
from optax_muon._src.muon.plan.owners import ownership, place_matrices
from optax_muon._src.muon.plan.redeal import fewer_programs
from optax_muon._src.muon.plan.stages import choose_stages
from optax_muon._src.muon.plan.teams import TeamSplit, choose_teams
from optax_muon._src.core.sharding import LeafSharding


def _plan_with(
    exchanges: list[ExchangeBuckets],
    splits: dict[int, TeamSplit],
    *,
    placements: list[LeafPlacement],
    groups: list[Group],
    mesh_shape: MeshShape,
    options: ShardingOptions,
    weigh_bytes: bool,
    model: CostModel | None,
    bundle: int = 1,
) -> Plan:
  """The plan of ``exchanges`` whose kinds ``splits`` gives (per exchange index)
  teams orthogonalize, owners chosen for everything else (in bundles of
  ``bundle`` matrices of a kind: ``owners.place_matrices``)."""
  spread = options.exchange == "per_shape"
  matrices, loads = place_matrices(
      groups,
      exchanges,
      mesh_shape,
      spread,
      weigh_bytes,
      placements,
      splits,
      model,
      bundle,
  )
  if weigh_bytes and not spread:
    for m in matrices:
      if not m.team_items:
        fewer_programs(m, loads, bundle)
  made: list[list] = [[] for _ in groups]
  for e, (exchange, m) in enumerate(zip(exchanges, matrices)):
    made[exchange.group].append(
        make_exchange(
            exchange.buckets,
            ownership(m, exchange.buckets),
            placements,
            groups[exchange.group].workers,
            splits.get(e),
        )
    )
  done = [
      dataclasses.replace(
          group,
          buckets=tuple(b for x in mine for b in x.buckets),
          exchanges=tuple(mine),
      )
      for group, mine in zip(groups, made)
  ]
  return Plan(
      mesh_shape=mesh_shape,
      leaves=tuple(placements),
      groups=tuple(done),
      exchange=options.exchange,
      wire_dtype=options.wire_dtype,
      cost_model=model,
  )


def build_plan(
    layouts: Sequence[MatrixLayout],
    shardings: Sequence[LeafSharding | None],
    cost: Callable[[int, int, Any], int],
    options: ShardingOptions = ShardingOptions(),
    *,
    stack: bool = True,
    weigh_bytes: bool = True,
    team_cost: Callable[[int, int, Any, int], TeamCost] | None = None,
) -> Plan:
  """Builds the plan for the Muon leaves.

  Args:
    layouts: the leaves' global layouts.
    shardings: the leaves' shardings (all on one mesh), ``None`` for a leaf
      without.
    cost: the NS FLOPs of one (m, n) matrix of a dtype, ``cost(m, n, dtype)``.
    options: the replica policy, the exchange, the wire dtype and the cost model
      (see ``optax_muon._src.muon.plan.model`` and ``Plan``).
    stack: put same-shape matrices of a group into one bucket (one batched NS
      call per worker); else every leaf is a bucket of its own.
    weigh_bytes: balance each worker's received bytes along with the FLOPs
      (``False``: FLOPs only, plain LPT, the reference the benchmark compares
      against).
    team_cost: one team member's share of one matrix, ``team_cost(m, n, dtype,
      k)``; ``None``: whole matrices only.

  Returns:
    The ``Plan``.
  """
  mesh_shape = mesh_shape_of(shardings)
  placements = place_leaves(layouts, shardings, cost, mesh_shape)
  groups, exchanges = group_leaves(placements, mesh_shape, options, stack)
  model = None
  if team_cost is not None and any(g.sharded and g.workers > 1 for g in groups):
    model = options.cost_model or default_cost_model()
  plan_with = functools.partial(
      _plan_with,
      placements=placements,
      groups=groups,
      mesh_shape=mesh_shape,
      options=options,
      weigh_bytes=weigh_bytes,
      model=model,
  )
  if model is None:
    return plan_with(exchanges, {})
  plan, (exchanges, splits) = choose_teams(
      plan_with(exchanges, {}),
      plan_with,
      groups,
      exchanges,
      placements,
      team_cost,
      model,
  )
  return choose_stages(
      plan,
      model,
      options.exchange_stages,
      lambda bundle: plan_with(exchanges, splits, bundle=bundle),
  )
