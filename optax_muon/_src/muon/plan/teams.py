"""The team search: which kinds of matrices teams of devices orthogonalize, and
how large the teams are.

A kind is the matrices of one bucket whose pieces are cut the same way (one
signature). A kind can be split over teams of k workers, k a divisor of its
group's workers that a long-side dimension of the local block allows, each
member then running f(k) NS FLOPs of each matrix (``SplitKind.cost``). A level
T, a per-device FLOP budget, sets k for every kind of the tree: whole matrices
(k = 1) if their c ≤ T, else the smallest k with f(k) ≤ T (the cheapest k if
none reaches it). Kinds of one exchange with different k travel in separate
exchanges, one per k (an exchange's teams have one size), the whole matrices
with the first.

The candidates are the whole-matrix plan and one plan per level, the levels
being every c and f(k) of every kind. The set does not depend on the cost model,
which only picks among them: the plan chosen under a model is, under that model,
no slower than the whole-matrix plan, nor (up to ``SPLIT_MARGIN``) than the plan
chosen with free communication. Candidates are built in increasing order of a
lower bound on their modelled time (the busiest device's share of its group's
work, its slowest piece of work and its all-to-alls' latency) until the bound
reaches the best one built; whole matrices stay unless teams shorten the
modelled critical path by more than ``SPLIT_MARGIN``.

With communication prohibitive the whole-matrix plan stays wherever a team's
collectives (the standard iteration: 3 per step, (k − 1)/k·m² elements each)
outweigh what the team takes off the busiest all-to-all chunk (at most 2·(k −
1)/k·m·n for an m × n matrix), that is unless some matrix on the busiest chunk
is more than about 7.5 times as long as wide: then the model prefers, and the
planner takes, the team.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from optax_muon._src.core.profiles import CostModel
from optax_muon._src.muon.costs import TeamCost
from optax_muon._src.muon.plan.grouping import ExchangeBuckets
from optax_muon._src.muon.plan.model import Bucket, Group, LeafPlacement, Plan

#: A split must shorten the modelled critical path by more than this fraction to
#: be taken.
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
    """A member's time for one matrix of ``kind``, in FLOPs (its collectives
    included)."""
    return self.kinds[kind].cost.seconds(model) * model.flops_per_second


def split_dim(p: LeafPlacement, size: int) -> ColumnSplit | None:
  """How ``p``'s matrices split ``size`` ways: a long-side dimension and its
  local extent padded to a multiple of ``size``, the least padding first, then
  the largest extent; None if every long-side dimension's local extent e is at
  most ``size``/2 (at ``size`` ≥ e each member holds one of the e columns, or
  only padding, so a larger team saves nothing)."""
  layout = p.layout
  long_side = layout.reduction_axes if layout.transposed else layout.output_axes
  options = [
      (-(-p.local_shape[d] // size) * size, d)
      for d in long_side
      if 2 * p.local_shape[d] > size
  ]
  if not options:
    return None
  padded, dim = min(options, key=lambda o: (o[0] - p.local_shape[o[1]], -o[0]))
  return ColumnSplit(dim, padded)


def _kinds(
    buckets: tuple[Bucket, ...], placements: list[LeafPlacement]
) -> dict[Kind, KindStats]:
  """The kinds of an exchange's buckets, in bucket and member order."""
  kinds: dict[Kind, KindStats] = {}
  for b, bucket in enumerate(buckets):
    for i in bucket.members:
      kind = Kind(b, placements[i].signature)
      stats = kinds.get(kind, KindStats(i, 0, bucket.flops))
      kinds[kind] = stats._replace(
          matrices=stats.matrices + placements[i].local_batch
      )
  return kinds


def _split_kind(
    kind: Kind,
    leaf: int,
    buckets: tuple[Bucket, ...],
    placements: list[LeafPlacement],
    team_cost: Callable[[int, int, Any, int], TeamCost],
    size: int,
) -> SplitKind | None:
  """How teams of ``size`` split the matrices of ``kind``; None if they
  cannot."""
  p = placements[leaf]
  cut = split_dim(p, size)
  if cut is None:
    return None
  bucket, extent = buckets[kind.bucket], p.local_shape[cut.dim]
  m, n = bucket.shape
  block = math.prod(p.piece_shape) // extent * cut.padded // size
  return SplitKind(
      leaf,
      cut.dim,
      team_cost(m, n // extent * cut.padded, bucket.dtype, size),
      block,
  )


@dataclasses.dataclass(frozen=True)
class ExchangeKinds:
  """The kinds of one exchange and the ways each can split.

  Attributes:
    workers: the group's workers.
    kinds: per kind, its stats, in decreasing order of NS FLOPs.
    splits: per kind, per feasible team size k, the split.
  """

  workers: int
  kinds: dict[Kind, KindStats]
  splits: dict[Kind, dict[int, SplitKind]]

  def member_flops(self, kind: Kind, size: int) -> int:
    """A member's NS FLOPs of one matrix of ``kind`` on teams of ``size`` (1:
    whole)."""
    return (
        self.kinds[kind].flops
        if size == 1
        else self.splits[kind][size].cost.flops
    )

  def sizes_at(self, level: float) -> dict[Kind, int]:
    """Per kind, its team size at FLOP level ``level`` (see the module
    docstring)."""
    out = {}
    for kind in self.kinds:
      options = [1] + sorted(self.splits[kind])
      fits = [k for k in options if self.member_flops(kind, k) <= level]
      out[kind] = (
          fits[0]
          if fits
          else min(options, key=lambda k: (self.member_flops(kind, k), k))
      )
    return out

  def seconds(self, kind: Kind, size: int, model: CostModel) -> float:
    """A lower bound on a member's time for one matrix: its FLOPs and its
    collectives' bytes (a batch of matrices shares each collective's
    latency)."""
    if size == 1:
      return model.compute_seconds(self.kinds[kind].flops)
    cost = self.splits[kind][size].cost
    return (
        model.compute_seconds(cost.flops)
        + sum(cost.collective_bytes) / model.bytes_per_second
    )


def exchange_kinds(
    exchange: ExchangeBuckets,
    group: Group,
    placements: list[LeafPlacement],
    team_cost: Callable[[int, int, Any, int], TeamCost],
) -> ExchangeKinds:
  """The kinds of ``exchange`` and every team size that can split each."""
  stats = _kinds(exchange.buckets, placements)
  kinds = dict(sorted(stats.items(), key=lambda item: -item[1].flops))
  splits: dict[Kind, dict[int, SplitKind]] = {kind: {} for kind in kinds}
  for size in range(2, group.workers + 1):
    if group.workers % size:
      continue
    for kind, kind_stats in kinds.items():
      found = _split_kind(
          kind, kind_stats.leaf, exchange.buckets, placements, team_cost, size
      )
      if found is not None:
        splits[kind][size] = found
  return ExchangeKinds(group.workers, kinds, splits)


def _sub_bucket(
    bucket: Bucket, b: int, kinds: list[Kind], placements: list[LeafPlacement]
) -> Bucket | None:
  """The matrices of ``bucket`` (index ``b``) of the kinds ``kinds``; None if
  none."""
  signatures = {kind.signature for kind in kinds if kind.bucket == b}
  members = tuple(
      i for i in bucket.members if placements[i].signature in signatures
  )
  if not members:
    return None
  return dataclasses.replace(
      bucket,
      members=members,
      matrices=sum(placements[i].local_batch for i in members),
  )


def split_exchange(
    exchange: ExchangeBuckets,
    sizes: dict[Kind, int],
    found: ExchangeKinds,
    placements: list[LeafPlacement],
) -> list[tuple[ExchangeBuckets, TeamSplit | None]]:
  """``exchange`` cut into one exchange per team size of ``sizes``, largest
  first, each with the kinds of that size (and the first with the whole ones),
  and each one's split."""
  team_sizes = sorted({k for k in sizes.values() if k > 1}, reverse=True)
  if not team_sizes:
    return [(exchange, None)]
  out = []
  for n, size in enumerate(team_sizes):
    mine = [
        kind for kind, k in sizes.items() if k == size or (n == 0 and k == 1)
    ]
    buckets, kinds = [], {}
    for b, bucket in enumerate(exchange.buckets):
      sub = _sub_bucket(bucket, b, mine, placements)
      if sub is None:
        continue
      for kind in found.kinds:  # decreasing NS FLOPs
        if kind.bucket == b and sizes[kind] == size:
          kinds[Kind(len(buckets), kind.signature)] = found.splits[kind][size]
      buckets.append(sub)
    out.append(
        (
            ExchangeBuckets(exchange.group, tuple(buckets)),
            TeamSplit(size, kinds),
        )
    )
  return out


def _layout(
    exchanges: list[ExchangeBuckets],
    found: dict[int, ExchangeKinds],
    sizes: dict[int, dict[Kind, int]],
    placements: list[LeafPlacement],
) -> tuple[list[ExchangeBuckets], dict[int, TeamSplit]]:
  """The exchanges of the tree with each one's kinds at ``sizes``, and their
  splits (by index into the new exchanges)."""
  out, splits = [], {}
  for e, exchange in enumerate(exchanges):
    parts = (
        split_exchange(exchange, sizes[e], found[e], placements)
        if e in sizes
        else [(exchange, None)]
    )
    for part, split in parts:
      if split is not None:
        splits[len(out)] = split
      out.append(part)
  return out, splits


def _lower_bound(
    sizes: dict[int, dict[Kind, int]],
    found: dict[int, ExchangeKinds],
    exchanges: list[ExchangeBuckets],
    groups: list[Group],
    model: CostModel,
) -> float:
  """Seconds no plan with ``sizes`` can beat: per group, the busiest device's
  share of its work or its slowest piece of work, plus its all-to-alls'
  latency."""
  work = [0.0] * len(groups)
  slowest = [0.0] * len(groups)
  for e, per_kind in sizes.items():
    g = exchanges[e].group
    for kind, k in per_kind.items():
      seconds = found[e].seconds(kind, k, model)
      work[g] += found[e].kinds[kind].matrices * k * seconds
      slowest[g] = max(slowest[g], seconds)
  bound = 0.0
  for g, group in enumerate(groups):
    parts = sum(
        len({k for k in sizes[e].values() if k > 1}) or 1
        for e in sizes
        if exchanges[e].group == g
    )
    latency = (
        parts
        * (2 * (group.exchange_size > 1) + group.split)
        * model.collective_latency
    )
    bound = max(bound, max(work[g] / group.workers, slowest[g]) + latency)
  return bound


def choose_teams(
    whole: Plan,
    plan_with: Callable[..., Plan],
    groups: list[Group],
    exchanges: list[ExchangeBuckets],
    placements: list[LeafPlacement],
    team_cost: Callable[[int, int, Any, int], TeamCost],
    model: CostModel,
) -> tuple[Plan, tuple]:
  """The plan with the shortest modelled critical path (see the module
  docstring).

  Args:
    whole: the whole-matrix plan.
    plan_with: the plan of given exchanges and their ``TeamSplit`` (by index),
      ``plan_with(exchanges, splits)``.
    groups: the groups.
    exchanges: the buckets of every exchange.
    placements: the leaves.
    team_cost: one team member's share of one matrix, ``team_cost(m, n, dtype,
      k)``.
    model: the cost model.

  Returns:
    The chosen plan, and the arguments of ``plan_with`` that made it.
  """
  found = {
      e: exchange_kinds(x, groups[x.group], placements, team_cost)
      for e, x in enumerate(exchanges)
      if groups[x.group].sharded and groups[x.group].workers > 1
  }
  levels = sorted(
      {
          f.member_flops(kind, k)
          for f in found.values()
          for kind in f.kinds
          for k in [1, *f.splits[kind]]
      },
      reverse=True,
  )
  candidates = {}
  for level in levels:
    sizes = {e: f.sizes_at(level) for e, f in found.items()}
    key = tuple(tuple(s.items()) for s in sizes.values())
    if (
        any(k > 1 for s in sizes.values() for k in s.values())
        and key not in candidates
    ):
      candidates[key] = (
          _lower_bound(sizes, found, exchanges, groups, model),
          -level,
          sizes,
      )
  whole_seconds = whole.critical_seconds(model)
  unsplit = (whole, (exchanges, {}))
  best, best_seconds = unsplit, whole_seconds
  for bound, _, sizes in sorted(candidates.values(), key=lambda c: c[:2]):
    if bound >= best_seconds:
      break
    layout = _layout(exchanges, found, sizes, placements)
    plan = plan_with(*layout)
    seconds = plan.critical_seconds(model)
    if seconds < best_seconds:
      best, best_seconds = (plan, layout), seconds
  return best if best_seconds < whole_seconds * (1 - SPLIT_MARGIN) else unsplit
