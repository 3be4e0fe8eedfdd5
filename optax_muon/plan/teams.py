"""The team search: which kinds of matrices teams of devices orthogonalize, and how large the
teams are.

A kind is the matrices of one bucket whose pieces are cut the same way (one signature).
Per exchange, for every team size k (a divisor of the workers) and every prefix of the kinds
in decreasing order of NS FLOPs (those that a long-side dimension of the local block lets
split k ways), the plan is built (the owner choice places whole matrices and team matrices
together) and its whole-tree critical path modelled; the shortest is kept, and whole
matrices unless splitting shortens it by more than ``SPLIT_MARGIN``. Candidates whose lower
bound (the busiest device's share of all work, or the slowest single piece of work) is no
better are not built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from optax_muon.costs import CostModel, TeamCost, critical_seconds
from optax_muon.plan.grouping import ExchangeBuckets
from optax_muon.plan.model import Bucket, Group, LeafPlacement, Plan

#: A split must shorten the modelled critical path by more than this fraction to be taken.
SPLIT_MARGIN = 0.02


class Kind(NamedTuple):
  """Matrices of one bucket whose pieces are cut the same way.

  Attributes:
    bucket: index into the exchange's buckets.
    signature: the leaves' ``LeafPlacement.signature``.
  """

  bucket: int
  signature: tuple


class KindStats(NamedTuple):
  """What the search needs to know of a kind.

  Attributes:
    leaf: the representative leaf (the first of the kind).
    matrices: its local matrices.
    flops: c, the NS FLOPs of one of them on one device.
  """

  leaf: int
  matrices: int
  flops: int


class ColumnSplit(NamedTuple):
  """How a leaf's local blocks split among the members of a team.

  Attributes:
    dim: the leaf dimension (a long-side one) whose local extent is split.
    padded: that extent, padded to a multiple of the team size.
  """

  dim: int
  padded: int


class SplitKind(NamedTuple):
  """A kind that teams orthogonalize.

  Attributes:
    leaf: the representative leaf.
    split_dim: the leaf dimension whose local extent is split among the members.
    cost: one member's share of one matrix.
    block: elements of one matrix each device sends each member.
  """

  leaf: int
  split_dim: int
  cost: TeamCost
  block: int


@dataclasses.dataclass(frozen=True)
class TeamSplit:
  """The kinds of one exchange that teams of ``size`` workers orthogonalize.

  Attributes:
    size: k.
    kinds: the split kinds, in decreasing order of NS FLOPs.
  """

  size: int
  kinds: dict[Kind, SplitKind]

  def effective_flops(self, kind: Kind, model: CostModel) -> float:
    """A member's time for one matrix of ``kind``, in FLOPs (its collectives included)."""
    return self.kinds[kind].cost.seconds(model) * model.flops_per_second


def split_dim(p: LeafPlacement, size: int) -> ColumnSplit | None:
  """How ``p``'s matrices split ``size`` ways: a long-side dimension and its local extent
  padded to a multiple of ``size``, the least padding first, then the largest extent; None
  if every long-side dimension's local extent is below ``size``."""
  layout = p.layout
  long_side = layout.reduction_axes if layout.transposed else layout.output_axes
  options = [(-(-p.local_shape[d] // size) * size, d) for d in long_side
             if p.local_shape[d] >= size]
  if not options:
    return None
  padded, dim = min(options, key=lambda o: (o[0] - p.local_shape[o[1]], -o[0]))
  return ColumnSplit(dim, padded)


def _kinds(buckets: tuple[Bucket, ...], placements: list[LeafPlacement]
           ) -> dict[Kind, KindStats]:
  """The kinds of an exchange's buckets, in bucket and member order."""
  kinds: dict[Kind, KindStats] = {}
  for b, bucket in enumerate(buckets):
    for i in bucket.members:
      kind = Kind(b, placements[i].signature)
      stats = kinds.get(kind, KindStats(i, 0, bucket.flops))
      kinds[kind] = stats._replace(matrices=stats.matrices + placements[i].local_batch)
  return kinds


def _splittable(order: list[Kind], kinds: dict[Kind, KindStats], buckets: tuple[Bucket, ...],
                placements: list[LeafPlacement],
                team_cost: Callable[[int, int, Any, int], TeamCost], size: int
                ) -> dict[Kind, SplitKind]:
  """The kinds of ``order`` that teams of ``size`` can split, in that order."""
  out = {}
  for kind in order:
    leaf = placements[kinds[kind].leaf]
    cut = split_dim(leaf, size)
    if cut is None:
      continue
    bucket, extent = buckets[kind.bucket], leaf.local_shape[cut.dim]
    m, n = bucket.shape
    block = math.prod(leaf.piece_shape) // extent * cut.padded // size
    out[kind] = SplitKind(kinds[kind].leaf, cut.dim,
                          team_cost(m, n // extent * cut.padded, bucket.dtype, size), block)
  return out


def _lower_bound(split: TeamSplit, kinds: dict[Kind, KindStats], order: list[Kind],
                 workers: int, model: CostModel) -> float:
  """Seconds no plan with ``split`` can beat: the busiest device's share of all the work,
  or the slowest single piece of it."""
  whole = [kind for kind in order if kind not in split.kinds]
  team_work = sum(kinds[kind].matrices * split.effective_flops(kind, model) * split.size
                  for kind in split.kinds)
  whole_work = sum(kinds[kind].matrices * kinds[kind].flops for kind in whole)
  slowest = max([split.effective_flops(kind, model) for kind in split.kinds]
                + [kinds[kind].flops for kind in whole])
  return max((team_work + whole_work) / workers, slowest) / model.flops_per_second


def choose_teams(whole: Plan, plan_with: Callable[[dict[int, TeamSplit]], Plan],
                 groups: list[Group], exchanges: list[ExchangeBuckets],
                 placements: list[LeafPlacement],
                 team_cost: Callable[[int, int, Any, int], TeamCost],
                 model: CostModel) -> Plan:
  """The plan with the shortest modelled critical path (see the module docstring).

  Args:
    whole: the whole-matrix plan.
    plan_with: the plan given each exchange's ``TeamSplit`` (by index into ``exchanges``).
    groups: the groups.
    exchanges: the buckets of every exchange.
    placements: the leaves.
    team_cost: one team member's share of one matrix, ``team_cost(m, n, dtype, k)``.
    model: the cost model.

  Returns:
    The chosen plan.
  """
  best_plan, best_seconds = whole, critical_seconds(whole, model)
  limit = best_seconds * (1 - SPLIT_MARGIN)
  splits: dict[int, TeamSplit] = {}
  for e, exchange in enumerate(exchanges):
    group = groups[exchange.group]
    if not group.sharded or group.workers == 1:
      continue
    kinds = _kinds(exchange.buckets, placements)
    order = sorted(kinds, key=lambda kind: -kinds[kind].flops)
    found = None
    for size in range(2, group.workers + 1):
      if group.workers % size:
        continue
      feasible = list(_splittable(order, kinds, exchange.buckets, placements, team_cost,
                                  size).items())
      for j in range(1, len(feasible) + 1):
        split = TeamSplit(size, dict(feasible[:j]))
        if _lower_bound(split, kinds, order, group.workers, model) >= min(best_seconds, limit):
          continue
        plan = plan_with({**splits, e: split})
        seconds = critical_seconds(plan, model)
        if seconds < min(best_seconds, limit):
          best_plan, best_seconds, found = plan, seconds, split
    if found is not None:
      splits[e] = found
  return best_plan
