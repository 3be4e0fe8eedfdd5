"""Owner choice: which worker orthogonalizes each matrix, longest processing
time first, over the whole tree at once.

Matrices in decreasing order of NS FLOPs; each goes to the worker of its group
whose busiest device has the least load afterwards (a device's load sums over
the groups, so a device idle in one group takes more work in another). With
``weigh_bytes`` a worker's score is max(load ÷ the FLOPs bound, owned elements ÷
the group's fair share), so that no owner's chunk grows far beyond the fair
share. A matrix of a kind that a ``TeamSplit`` gives to teams of k workers is
placed the same way, as a member's share (its collectives included) on the team
of k consecutive workers whose busiest device has the least load afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from optax_muon._src.core.profiles import CostModel
from optax_muon._src.muon.plan.grouping import ExchangeBuckets, MeshShape
from optax_muon._src.muon.plan.model import Bucket, Group, LeafPlacement
from optax_muon._src.muon.plan.teams import Kind, TeamSplit


class MatrixRef(NamedTuple):
  """One local matrix of an exchange.

  Attributes:
    bucket: index into the exchange's buckets.
    matrix: index into the bucket's local matrices.
  """

  bucket: int
  matrix: int


class TeamItem(NamedTuple):
  """A local matrix that a team orthogonalizes, while teams are being chosen.

  Attributes:
    bucket: index into the exchange's buckets.
    matrix: index into the bucket's local matrices.
    cost: a member's share, in effective FLOPs (its collectives included).
  """

  bucket: int
  matrix: int
  cost: float


class _Item(NamedTuple):
  """One matrix to place; items sort into the order they are placed in."""

  neg_cost: float
  neg_elements: int
  exchange: int
  team: bool
  index: int  # into the exchange's whole matrices, or its team items
  count: int = 1  # a bundle: this and the next count − 1 go to one owner


class Ownership(NamedTuple):
  """Who orthogonalizes the local matrices of one exchange.

  Attributes:
    owner: per local matrix (buckets concatenated), its worker; −1 for a matrix
      that a team orthogonalizes.
    teams: per team (workers [t·k, (t+1)·k)), its matrices; empty without teams.
  """

  owner: list[int]
  teams: list[list[MatrixRef]]


@dataclasses.dataclass
class ExchangeMatrices:
  """The matrices of one exchange while owners are being chosen.

  Attributes:
    worker: the worker index of every device (flattened mesh).
    costs, elements, bucket_of: per whole local matrix (buckets concatenated):
      NS FLOPs, size, bucket.
    caps: per bucket, the most matrices one worker may own.
    owner: per whole local matrix, the chosen worker.
    owned_elements: per worker, the elements it owns (its chunk).
    counts: (workers, buckets) matrices owned.
    index: per whole local matrix, where it is in the exchange.
    team_size: k of the split kinds (1: none).
    team_items: the matrices split over teams.
    teams: per team, the matrices it was given.
  """

  worker: np.ndarray
  costs: list[int]
  elements: list[int]
  bucket_of: list[int]
  caps: list[float]
  owner: list[int]
  owned_elements: np.ndarray
  counts: np.ndarray
  index: list[MatrixRef] = dataclasses.field(default_factory=list)
  team_size: int = 1
  team_items: list[TeamItem] = dataclasses.field(default_factory=list)
  teams: list[list[MatrixRef]] = dataclasses.field(default_factory=list)

  @property
  def fair_elements(self) -> float:
    return max(
        sum(self.elements) / len(self.owned_elements),
        max(self.elements, default=1),
    )


def _collect(
    e: int,
    group: Group,
    buckets: tuple[Bucket, ...],
    worker: np.ndarray,
    spread: bool,
    split: TeamSplit | None,
    model: CostModel | None,
    placements: list[LeafPlacement],
    bundle: int,
) -> tuple[ExchangeMatrices, list[_Item]]:
  """Exchange ``e``'s matrices, and the items that place them (bundles of
  ``bundle`` matrices of one kind)."""
  workers = group.workers
  m = ExchangeMatrices(
      worker,
      [],
      [],
      [],
      [],
      [],
      np.zeros(workers),
      np.zeros((workers, len(buckets))),
  )
  m.team_size = split.size if split else 1
  m.teams = [[] for _ in range(workers // m.team_size)] if split else []
  items = []
  for b, bucket in enumerate(buckets):
    signature = [
        placements[i].signature
        for i in bucket.members
        for _ in range(placements[i].local_batch)
    ]
    size = bucket.shape[0] * bucket.shape[1]
    for chunk in _bundles(signature, bundle):
      kind = Kind(b, signature[chunk[0]])
      team = split is not None and kind in split.kinds
      cost = split.effective_flops(kind, model) if team else bucket.flops
      if team:
        items.append(
            _Item(-cost * len(chunk), 0, e, True, len(m.team_items), len(chunk))
        )
        m.team_items += [TeamItem(b, j, cost) for j in chunk]
        continue
      items.append(
          _Item(
              -cost * len(chunk),
              -size * len(chunk),
              e,
              False,
              len(m.costs),
              len(chunk),
          )
      )
      m.costs += [cost] * len(chunk)
      m.elements += [size] * len(chunk)
      m.bucket_of += [b] * len(chunk)
      m.index += [MatrixRef(b, j) for j in chunk]
    whole = m.bucket_of.count(b)
    m.caps.append(-(-whole // workers) if spread else math.inf)
  m.owner = [0] * len(m.costs)
  return m, items


def _bundles(signature: list[tuple], bundle: int) -> list[list[int]]:
  """A bucket's local matrices in bundles: ``bundle`` consecutive matrices of
  one kind (their signature), the last of each kind shorter; one each, in index
  order, for ``bundle`` 1."""
  if bundle == 1:
    return [[j] for j in range(len(signature))]
  kinds: dict[tuple, list[int]] = {}
  for j, sig in enumerate(signature):
    kinds.setdefault(sig, []).append(j)
  return [
      js[start : start + bundle]
      for js in kinds.values()
      for start in range(0, len(js), bundle)
  ]


def _place_on_team(
    m: ExchangeMatrices, j: int, count: int, loads: np.ndarray
) -> None:
  """Gives team items ``j`` … ``j + count − 1`` to the team whose busiest device
  is least loaded."""
  team_of_device = m.worker // m.team_size
  busiest = np.full(len(m.teams), -np.inf)
  np.maximum.at(busiest, team_of_device, loads)
  t = int(np.argmin(busiest))
  for item in m.team_items[j : j + count]:
    m.teams[t].append(MatrixRef(item.bucket, item.matrix))
    loads[team_of_device == t] += item.cost


def _place_whole(
    m: ExchangeMatrices,
    j: int,
    count: int,
    loads: np.ndarray,
    fair_flops: float,
    weigh_bytes: bool,
) -> None:
  """Gives whole matrices ``j`` … ``j + count − 1`` (one bucket) to the worker
  with the least score afterwards."""
  workers = len(m.owned_elements)
  busiest = np.full(workers, -np.inf)
  np.maximum.at(busiest, m.worker, loads)
  cost, elements = sum(m.costs[j : j + count]), sum(m.elements[j : j + count])
  new_load = busiest + cost
  new_elements = m.owned_elements + elements
  score = new_load / fair_flops
  if weigh_bytes:
    score = np.maximum(score, new_elements / m.fair_elements)
  bucket = m.bucket_of[j]
  score[m.counts[:, bucket] + count > max(m.caps[bucket], count)] = np.inf
  w = int(np.lexsort((np.arange(workers), new_elements, new_load, score))[0])
  m.owner[j : j + count] = [w] * count
  m.owned_elements[w] += elements
  m.counts[w, bucket] += count
  loads[m.worker == w] += cost


def ownership(m: ExchangeMatrices, buckets: tuple[Bucket, ...]) -> Ownership:
  """The owners chosen for ``m``, the matrices of an exchange of ``buckets``."""
  starts = np.cumsum([0] + [b.matrices for b in buckets])
  owner = [-1] * int(starts[-1])
  for (b, j), w in zip(m.index, m.owner):
    owner[starts[b] + j] = w
  return Ownership(owner, m.teams)


def place_matrices(
    groups: list[Group],
    exchanges: list[ExchangeBuckets],
    mesh_shape: MeshShape,
    spread: bool,
    weigh_bytes: bool,
    placements: list[LeafPlacement],
    splits: dict[int, TeamSplit] | None = None,
    model: CostModel | None = None,
    bundle: int = 1,
) -> tuple[list[ExchangeMatrices], np.ndarray]:
  """Owners of every local matrix of every exchange (see the module docstring).

  Args:
    groups: the groups (without exchanges yet).
    exchanges: the buckets of every exchange.
    mesh_shape: the mesh.
    spread: cap each bucket at ⌈K / workers⌉ matrices per worker.
    weigh_bytes: weigh the owned elements as well as the FLOPs.
    placements: the leaves.
    splits: per exchange (index into ``exchanges``), its ``TeamSplit``.
    model: the cost model (with ``splits``).
    bundle: place the matrices of each kind in bundles of this many, each to
      one owner (or team), so that every owner's matrices of a kind (but one
      bundle's) cut into ``bundle`` equal stages (``plan.stages``).

  Returns:
    Per exchange, its matrices with their owners; and every device's load (NS
    FLOPs, a team member's in effective FLOPs), flattened.
  """
  splits = splits or {}
  loads = np.zeros(math.prod(size for _, size in mesh_shape), np.float64)
  matrices, items = [], []
  for e, exchange in enumerate(exchanges):
    group = groups[exchange.group]
    m, found = _collect(
        e,
        group,
        exchange.buckets,
        group.worker_of_devices(mesh_shape).reshape(-1),
        spread,
        splits.get(e),
        model,
        placements,
        bundle,
    )
    matrices.append(m)
    items += found
  total = sum(
      (sum(m.costs) + sum(t.cost for t in m.team_items) * m.team_size)
      * loads.size
      / len(m.owned_elements)
      for m in matrices
  )
  fair_flops = max(
      [total / loads.size, 1] + [c for m in matrices for c in m.costs]
  )
  for item in sorted(items):
    if item.team:
      _place_on_team(matrices[item.exchange], item.index, item.count, loads)
    else:
      _place_whole(
          matrices[item.exchange],
          item.index,
          item.count,
          loads,
          fair_flops,
          weigh_bytes,
      )
  return matrices, loads
