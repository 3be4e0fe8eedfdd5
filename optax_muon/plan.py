"""The static orthogonalization plan: which device orthogonalizes which whole matrix.

Pure Python at trace time, from the Muon leaves' layouts and shardings. Per leaf, the mesh
axes fall into three sets:

* exchange axes X: they split the leaf's matrix dimensions. The devices along X each hold a
  piece of every local matrix; an all-to-all over X gives each owner whole matrices.
* batch axes B: they split the leaf's batch (stack/expert/head) dimensions. Devices along B
  hold different matrices and never talk about this leaf.
* replica axes R: everything else. Devices along R hold the same data; with the "split"
  policy they share the NS work and all-gather the results, with "redundant" each computes
  everything.

Leaves with the same (X, R) form a group; a leaf without sharding information is a group of
its own kind, the trivial one: one device, no exchange. Within a group, same-shape matrices
(canonical orientation, m ≤ n) of one dtype form a bucket, run as one batched NS call per
device. The group's workers are its devices along X, times those along R with the split
policy; every local matrix gets one worker as its owner.

Owners are chosen for the whole tree at once, longest processing time first: matrices in
decreasing order of their NS FLOPs c_j, each to the worker whose devices end up least loaded
(a device's load sums over all groups, so a device idle in one group takes more work in
another), weighing the bytes the worker receives as well, because an all-to-all sends equal
chunks sized by the busiest owner. Workers owning the same sequence of matrix kinds run the
same program; distinct programs are the branches of one ``lax.switch`` on the worker index,
each compiled with its own NS code, so an exchange is then re-dealt as two patterns (plus
idle workers) where that costs neither FLOPs on the busiest device nor chunk size.

Where devices outnumber matrices, one matrix's NS can be shared by a team of k workers
(group NS, ``newton_schulz.MeshTeam``): each member gets about n/k of its columns, the
Gram matrix is all-reduced within the team every step, and every NS FLOP is divided by k.
The teams of an exchange are the blocks of k consecutive workers; a team's work is a
``lax.switch`` branch all of its members take, so teams and whole-matrix owners coexist.
Which kinds of matrices go to teams, and k, come from a ``CostModel``: the critical path
of the whole tree (the busiest device's NS FLOPs, its team collectives and its
all-to-alls) is modelled for every candidate, and whole matrices stay unless splitting
shortens it (see ``_choose_teams``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from optax_muon.cost_model import CostModel, default_cost_model
from optax_muon.layout import MatrixLayout
from optax_muon.options import ShardingOptions, TeamCost
from optax_muon.sharding import LeafSharding


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
  """One Muon leaf in the plan.

  Attributes:
    layout: the global matrix layout.
    sharding: how the leaf lies on the mesh; ``None`` for a leaf without sharding
      information (the trivial plan: its global array is its local block).
    exchange_axes: X, in mesh order.
    replica_axes: R, in mesh order.
    flops: c, the NS FLOPs of one of its matrices.
  """

  layout: MatrixLayout
  sharding: LeafSharding | None
  exchange_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]
  flops: int

  @property
  def matrix_dims(self) -> tuple[int, ...]:
    """The leaf's reduction and output dimensions, in leaf order."""
    return tuple(sorted(self.layout.reduction_axes + self.layout.output_axes))

  @property
  def dim_axes(self) -> tuple[tuple[str, ...], ...]:
    """Per leaf dimension, the mesh axes splitting it (none without a sharding)."""
    if self.sharding is None:
      return ((),) * len(self.layout.shape)
    return self.sharding.dim_axes

  @property
  def local_shape(self) -> tuple[int, ...]:
    if self.sharding is None:
      return self.layout.shape
    return self.sharding.local_shape(self.layout.shape)

  @property
  def local_batch(self) -> int:
    return math.prod(self.local_shape[d] for d in self.layout.batch_axes)

  @property
  def piece_shape(self) -> tuple[int, ...]:
    """One local matrix's block, in leaf order of the matrix dimensions."""
    return tuple(self.local_shape[d] for d in self.matrix_dims)

  @property
  def signature(self) -> tuple:
    """Leaves with equal signatures cut their matrices into pieces the same way."""
    return (tuple(self.layout.shape[d] for d in self.matrix_dims),
            tuple(self.dim_axes[d] for d in self.matrix_dims),
            self.reduction_positions, self.output_positions, self.layout.transposed)

  @property
  def reduction_positions(self) -> tuple[int, ...]:
    """Where the reduction axes (in the layout's order) sit among ``matrix_dims``."""
    return tuple(self.matrix_dims.index(d) for d in self.layout.reduction_axes)

  @property
  def output_positions(self) -> tuple[int, ...]:
    return tuple(self.matrix_dims.index(d) for d in self.layout.output_axes)


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Same-shape, same-dtype matrices of one group: one batched NS call per worker.

  Attributes:
    shape: the canonical (m, n), m ≤ n.
    dtype: the leaves' dtype (NS runs in it unless ``NSOptions.compute_dtype`` says otherwise).
    members: indices into ``Plan.leaves``; local matrix j runs through them in order.
    matrices: K, local matrices per device (the same on every device of the group).
    flops: c, the NS FLOPs of one matrix.
  """

  shape: tuple[int, int]
  dtype: Any
  members: tuple[int, ...]
  matrices: int
  flops: int

  def piece_size(self, exchange_size: int) -> int:
    """Elements of one matrix's piece on each of the exchange devices."""
    return self.shape[0] * self.shape[1] // exchange_size


# A worker's program: per bucket of its exchange, runs of (representative leaf, count) —
# consecutive owned matrices whose pieces fit together the same way.
Program = tuple[tuple[tuple[int, int], ...], ...]


@dataclasses.dataclass(frozen=True)
class TeamRun:
  """Matrices of one kind that one team orthogonalizes together (group NS), split k ways.

  Member i of the team receives, from every device along X, the i-th of k blocks of its
  piece of each matrix along ``split_dim`` (⌈e/k⌉ of the local extent e, the last ones
  padded with zero columns, which NS leaves at zero): it holds all m rows and about n/k of
  the columns.

  Attributes:
    bucket: index into the exchange's buckets.
    leaf: the representative leaf (the matrices' pieces are cut this leaf's way).
    split_dim: the leaf dimension whose local extent is split among the members.
    matrices: the local matrices (indices into the bucket).
    cost: one member's share of one matrix: FLOPs, collectives, collectives per loop step.
    block: elements of one matrix each device sends each member (padding included).
  """

  bucket: int
  leaf: int
  split_dim: int
  matrices: tuple[int, ...]
  cost: TeamCost
  block: int

  @property
  def key(self) -> tuple[int, int, int, int]:
    """What a program needs to know of the run: (bucket, leaf, split dim, count)."""
    return self.bucket, self.leaf, self.split_dim, len(self.matrices)

  @property
  def flops(self) -> int:
    return len(self.matrices) * self.cost.flops

  def collective_seconds(self, model: CostModel) -> float:
    """Modelled time of its collectives (each carries all of the run's matrices)."""
    return self.cost.collective_seconds(model, len(self.matrices))


# A team's program: its runs' keys, in order.
TeamProgram = tuple[tuple[int, int, int, int], ...]


@dataclasses.dataclass(frozen=True)
class Exchange:
  """Buckets that travel in one all-to-all each way, and who orthogonalizes their matrices.

  Attributes:
    buckets: the buckets.
    owned: per worker, per bucket, the local matrices (indices into the bucket) it
      orthogonalizes whole, in the order its program runs them.
    programs: the distinct programs of whole matrices.
    program_of: per worker, its index into ``programs``.
    team_size: k, the workers of each team (1: no teams).
    teams: per team (workers [t·k, (t+1)·k)), the runs it orthogonalizes split k ways.
    team_programs: the distinct team programs.
    team_program_of: per team, its index into ``team_programs``.
  """

  buckets: tuple[Bucket, ...]
  owned: tuple[tuple[tuple[int, ...], ...], ...]
  programs: tuple[Program, ...]
  program_of: tuple[int, ...]
  team_size: int = 1
  teams: tuple[tuple[TeamRun, ...], ...] = ()
  team_programs: tuple[TeamProgram, ...] = ()
  team_program_of: tuple[int, ...] = ()

  def whole_elements(self, exchange_size: int) -> list[int]:
    """Per worker, the elements each device sends it for its whole matrices."""
    return [sum(len(mine) * b.piece_size(exchange_size) for mine, b in zip(owned, self.buckets))
            for owned in self.owned]

  def _per_worker(self, per_run) -> np.ndarray:
    """Per worker, the sum of ``per_run(run)`` over its team's runs (0 without teams)."""
    per_team = [sum(per_run(r) for r in runs) for runs in self.teams] or [0]
    return np.asarray(per_team)[np.arange(len(self.owned)) // self.team_size
                                if self.teams else np.zeros(len(self.owned), np.int64)]

  def team_elements(self, exchange_size: int) -> list[int]:
    """Per worker, the elements each device sends it for its team's runs."""
    del exchange_size  # the runs know their blocks
    return self._per_worker(lambda r: len(r.matrices) * r.block).tolist()

  def owned_elements(self, exchange_size: int) -> list[int]:
    """Per worker, the elements each device sends it."""
    return [a + b for a, b in zip(self.whole_elements(exchange_size),
                                  self.team_elements(exchange_size))]

  def chunk(self, exchange_size: int) -> int:
    """Elements each device sends to each peer: the busiest worker's blocks and pieces."""
    return max(self.owned_elements(exchange_size))

  def program_flops(self) -> tuple[int, ...]:
    """NS FLOPs of each program of whole matrices."""
    return tuple(sum(count * b.flops for runs, b in zip(p, self.buckets) for _, count in runs)
                 for p in self.programs)

  def team_program_flops(self) -> tuple[int, ...]:
    """NS FLOPs of each team program, on each member."""
    flops = {}
    for runs in self.teams:
      flops[tuple(r.key for r in runs)] = sum(r.flops for r in runs)
    return tuple(flops[p] for p in self.team_programs)

  def worker_team_flops(self) -> np.ndarray:
    """Per worker, its NS FLOPs in its team."""
    return self._per_worker(lambda r: r.flops).astype(np.int64)

  def worker_team_collective_seconds(self, model: CostModel) -> np.ndarray:
    """Per worker, the modelled time of its team's collectives."""
    return self._per_worker(lambda r: r.collective_seconds(model)).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves sharing exchange and replica axes.

  Attributes:
    exchange_axes: X.
    replica_axes: R.
    exchange_size: g = Π |X|.
    replica_size: r = Π |R|.
    split: whether replicas split the NS work (then all-gather over R).
    sharded: whether its leaves carry shardings (else: the trivial plan, run outside
      ``shard_map``).
    buckets: its buckets.
    exchanges: one (``exchange="combined"``) or one per bucket (``"per_shape"``).
  """

  exchange_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]
  exchange_size: int
  replica_size: int
  split: bool
  sharded: bool
  buckets: tuple[Bucket, ...]
  exchanges: tuple[Exchange, ...]

  @property
  def workers(self) -> int:
    """Devices along X, times those along R when replicas split the work."""
    return self.exchange_size * (self.replica_size if self.split else 1)

  def worker_of_devices(self, mesh_shape: tuple[tuple[str, int], ...]) -> np.ndarray:
    """The worker index of every device, as an array of the mesh's shape."""
    sizes = [size for _, size in mesh_shape]
    coords = dict(zip([name for name, _ in mesh_shape], np.indices(sizes)))

    def linear(axes):
      out = np.zeros(sizes, np.int64)
      for a in axes:
        out = out * dict(mesh_shape)[a] + coords[a]
      return out

    x = linear(self.exchange_axes)
    return x * self.replica_size + linear(self.replica_axes) if self.split else x


@dataclasses.dataclass(frozen=True)
class Plan:
  """The whole tree's orthogonalization plan.

  Attributes:
    mesh_shape: axis name → size, in mesh order; empty when no leaf is sharded.
    leaves: one placement per Muon leaf.
    groups: the groups.
    exchange: ``"combined"``: one all-to-all each way per group, owners balanced over all
      of its buckets at once (for FSDP and FSDP × TP that is one exchange for the whole
      tree); ``"per_shape"``: one each way per bucket, each bucket spread evenly (at most
      ⌈K/workers⌉ matrices per worker) so that its chunk stays small; less temp memory (one
      bucket's buffers alive at a time), less balance.
    wire_dtype: dtype of the all-to-all buffers; ``None`` keeps the leaves'.
    cost_model: the model the plan was chosen by (``None``: whole matrices only).
  """

  mesh_shape: tuple[tuple[str, int], ...]
  leaves: tuple[LeafPlacement, ...]
  groups: tuple[Group, ...]
  exchange: str = "combined"
  wire_dtype: Any = None
  cost_model: CostModel | None = None

  @property
  def device_count(self) -> int:
    return math.prod(size for _, size in self.mesh_shape)

  @property
  def sharded(self) -> bool:
    return any(g.sharded for g in self.groups)

  def device_ns_flops(self) -> np.ndarray:
    """NS FLOPs each device runs per step, as an array of the mesh's shape."""
    loads = np.zeros([size for _, size in self.mesh_shape], np.int64)
    for group in self.groups:
      worker = group.worker_of_devices(self.mesh_shape)
      for ex in group.exchanges:
        flops = np.asarray(ex.program_flops(), np.int64)[np.asarray(ex.program_of)]
        loads = loads + (flops + ex.worker_team_flops())[worker]
    return loads

  def device_received_bytes(self, ragged: bool = False) -> np.ndarray:
    """Bytes each device receives per step, as an array of the mesh's shape.

    Args:
      ragged: count only the pieces each device needs, as ``jax.lax.ragged_all_to_all``
        would send them, instead of the equal chunks of ``jax.lax.all_to_all`` (which is
        what runs: XLA:CPU does not implement the ragged collective).

    Returns:
      Per device: the all-to-all over X each way (chunks of the busiest worker's size from
      each of the g − 1 peers), plus the all-gather of the replicas' results when they
      split the work.
    """
    received = np.zeros([size for _, size in self.mesh_shape], np.float64)
    for group in self.groups:
      if group.workers == 1:
        continue
      worker = group.worker_of_devices(self.mesh_shape)
      g, replicas = group.exchange_size, group.workers // group.exchange_size
      for ex in group.exchanges:
        wire = self.wire_dtype or np.result_type(*(b.dtype for b in ex.buckets))
        itemsize = np.dtype(wire).itemsize
        # Elements one device sends each worker: its piece of every matrix the worker owns.
        owned = np.array(ex.owned_elements(g), np.float64)
        if ragged:  # its own matrices' pieces in, its pieces of everyone else's back
          per_worker = (g - 1) * owned + owned.sum() - owned
        else:
          chunk = ex.chunk(g)
          per_worker = np.full(group.workers, (2 * (g - 1) + (replicas - 1) * g) * chunk)
        received += itemsize * per_worker[worker]
    return received

  def switches(self) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Per ``lax.switch`` (an exchange with several programs of whole matrices, or with
    several team programs): each branch's NS FLOPs, and the branch every device takes (an
    array of the mesh's shape)."""
    out = []
    for group in self.groups:
      worker = group.worker_of_devices(self.mesh_shape)
      for ex in group.exchanges:
        if len(ex.programs) > 1:
          out.append((ex.program_flops(), np.asarray(ex.program_of)[worker]))
        if len(ex.team_programs) > 1:
          out.append((ex.team_program_flops(),
                      np.asarray(ex.team_program_of)[worker // ex.team_size]))
    return out

  def device_seconds(self, model: CostModel | None = None) -> np.ndarray:
    """Modelled NS and exchange time of each device per step, as an array of the mesh's
    shape: its whole matrices' FLOPs, its team's (FLOPs and collectives), and its
    all-to-alls (and replica all-gathers).

    Args:
      model: the cost model; ``None`` takes the plan's (or, if none, the default profile).
    """
    model = model or self.cost_model or default_cost_model()
    seconds = self.device_ns_flops() / model.flops_per_second
    seconds = seconds + self.device_received_bytes() / model.bytes_per_second
    for group in self.groups:
      if group.workers == 1:
        continue
      worker = group.worker_of_devices(self.mesh_shape)
      for ex in group.exchanges:
        seconds = seconds + (2 * (group.exchange_size > 1) + group.split) * (
            model.collective_latency) + ex.worker_team_collective_seconds(model)[worker]
    return seconds

  def critical_seconds(self, model: CostModel | None = None) -> float:
    """Modelled time of the busiest device (see ``device_seconds``)."""
    return float(self.device_seconds(model).max())

  def critical_ns_flops(self) -> int:
    """NS FLOPs of the busiest device."""
    return int(self.device_ns_flops().max())

  def ns_flops_bound(self) -> float:
    """The lower bound max(Σ_j c_j / N, max_j c_j) on the busiest device's NS FLOPs."""
    costs = [(p.layout.batch, p.flops) for p in self.leaves]
    return max(sum(k * c for k, c in costs) / self.device_count, max(c for _, c in costs))


def build_plan(layouts: list[MatrixLayout], shardings: list[LeafSharding | None],
               cost: Callable[[int, int, Any], int],
               options: ShardingOptions = ShardingOptions(), *, stack: bool = True,
               weigh_bytes: bool = True,
               team_cost: Callable[[int, int, Any, int], TeamCost] | None = None) -> Plan:
  """Builds the plan for the Muon leaves.

  Args:
    layouts: the leaves' global layouts.
    shardings: the leaves' shardings (all on one mesh), ``None`` for a leaf without.
    cost: the NS FLOPs of one (m, n) matrix of a dtype, ``cost(m, n, dtype)``.
    options: the replica policy, the exchange, the wire dtype and the cost model (see the
      module docstring and ``Plan``).
    stack: put same-shape matrices of a group into one bucket (one batched NS call per
      worker); else every leaf is a bucket of its own.
    weigh_bytes: balance each worker's received bytes along with the FLOPs (``False``:
      FLOPs only, plain LPT, the reference the benchmark compares against).
    team_cost: one team member's share of one matrix, ``team_cost(m, n, dtype, k)``;
      ``None``: whole matrices only.

  Returns:
    The ``Plan``.
  """
  replica_policy, exchange = options.replica_policy, options.exchange
  mesh = next((s.mesh for s in shardings if s is not None), None)
  mesh_shape = tuple(mesh.shape.items()) if mesh is not None else ()
  order = [name for name, _ in mesh_shape]
  placements = []
  for layout, sharding in zip(layouts, shardings):
    flops = cost(*layout.ns_shape, layout.dtype)
    if sharding is None:
      placements.append(LeafPlacement(layout, None, (), (), flops))
      continue
    matrix_axes = {a for d in layout.reduction_axes + layout.output_axes
                   for a in sharding.dim_axes[d]}
    placements.append(LeafPlacement(
        layout, sharding, tuple(a for a in order if a in matrix_axes),
        tuple(a for a in order if a not in sharding.used_axes), flops))
  size = lambda axes: math.prod(dict(mesh_shape)[a] for a in axes)
  group_members: dict[tuple, list[int]] = {}
  for i, p in enumerate(placements):
    key = (p.exchange_axes, p.replica_axes, p.sharding is not None)
    group_members.setdefault(key, []).append(i)
  groups, units = [], []
  for (exchange_axes, replica_axes, sharded), members in group_members.items():
    by_kind: dict[tuple, list[int]] = {}
    for i in members:
      layout = placements[i].layout
      key = layout.ns_shape + (np.dtype(layout.dtype),)
      by_kind.setdefault(key if stack else key + (i,), []).append(i)
    buckets = []
    for key, idx in by_kind.items():
      # Members sorted by how their pieces fit together, so that a worker's runs of one
      # kind are contiguous in the stack (no reordering on a single device).
      kinds = list(dict.fromkeys(placements[i].signature for i in idx))
      idx = sorted(idx, key=lambda i: kinds.index(placements[i].signature))
      buckets.append(Bucket(key[:2], key[2], tuple(idx),
                            sum(placements[i].local_batch for i in idx),
                            placements[idx[0]].flops))
    buckets = tuple(buckets)
    r = size(replica_axes)
    groups.append(Group(exchange_axes, replica_axes, size(exchange_axes), r,
                        replica_policy == "split" and r > 1, sharded, buckets, ()))
    units.append([buckets] if exchange == "combined" else [(b,) for b in buckets])

  def plan_with(splits: dict) -> Plan:
    owners, teams = _balance(groups, units, mesh_shape, exchange == "per_shape", weigh_bytes,
                             splits, model, placements)
    done = [dataclasses.replace(group, exchanges=tuple(
        _make_exchange(unit, owner, placements, group.workers, splits.get((k, e)), team)
        for e, (unit, owner, team) in enumerate(zip(group_units, group_owners, group_teams))))
            for k, (group, group_units, group_owners, group_teams)
            in enumerate(zip(groups, units, owners, teams))]
    return Plan(mesh_shape, tuple(placements), tuple(done), exchange, options.wire_dtype,
                model)

  model = None
  if team_cost is not None and any(g.sharded and g.workers > 1 for g in groups):
    model = options.cost_model or default_cost_model()
  whole = plan_with({})
  if model is None:
    return whole
  return _choose_teams(whole, plan_with, groups, units, placements, team_cost, model)


@dataclasses.dataclass(frozen=True)
class _Split:
  """The kinds of one exchange that teams of ``size`` workers orthogonalize.

  Attributes:
    size: k.
    kinds: (bucket index, signature) → (representative leaf, split dim, ``TeamCost``,
      elements of one matrix each device sends each member).
  """

  size: int
  kinds: dict

  def effective_flops(self, kind: tuple, model: CostModel) -> float:
    """A member's time for one matrix of ``kind``, in FLOPs (its collectives included)."""
    return self.kinds[kind][2].seconds(model) * model.flops_per_second


# A split must shorten the modelled critical path by more than this fraction to be taken.
_SPLIT_MARGIN = 0.02


def _choose_teams(whole: Plan, plan_with: Callable[[dict], Plan], groups: list[Group],
                  units: list[list[tuple[Bucket, ...]]], placements: list[LeafPlacement],
                  team_cost: Callable[[int, int, Any, int], TeamCost],
                  model: CostModel) -> Plan:
  """Which matrices teams orthogonalize, and how large the teams are.

  A kind is the matrices of one bucket whose pieces are cut the same way. Per exchange, for
  every team size k (a divisor of the workers) and every prefix of the kinds in decreasing
  order of NS FLOPs (those that a long-side dimension of the local block lets split k
  ways), the plan is built (``_balance`` places whole matrices and team matrices together)
  and its whole-tree critical path (``Plan.critical_seconds``) modelled; the shortest is
  kept, and whole matrices unless splitting shortens it by more than ``_SPLIT_MARGIN``.
  Candidates whose lower bound (the busiest device's share of all work, or the slowest
  single piece of work) is no better are not built.
  """
  best_plan, best_seconds = whole, whole.critical_seconds(model)
  limit = best_seconds * (1 - _SPLIT_MARGIN)
  splits: dict[tuple, _Split] = {}
  rate = model.flops_per_second
  for k, (group, group_units) in enumerate(zip(groups, units)):
    if not group.sharded or group.workers == 1:
      continue
    for e, buckets in enumerate(group_units):
      kinds = {}  # (bucket, signature) → (representative leaf, matrices, c)
      for b, bucket in enumerate(buckets):
        for i in bucket.members:
          key = (b, placements[i].signature)
          leaf, count, c = kinds.get(key, (i, 0, bucket.flops))
          kinds[key] = (leaf, count + placements[i].local_batch, c)
      order = sorted(kinds, key=lambda key: -kinds[key][2])
      found = None
      for size in range(2, group.workers + 1):
        if group.workers % size:
          continue
        feasible = {}
        for key in order:
          leaf = kinds[key][0]
          cut = _split_dim(placements[leaf], size)
          if cut is not None:
            dim, padded = cut
            (m, n), extent = buckets[key[0]].shape, placements[leaf].local_shape[dim]
            block = math.prod(placements[leaf].piece_shape) // extent * padded // size
            feasible[key] = (leaf, dim, team_cost(m, n // extent * padded, buckets[key[0]].dtype,
                                                  size), block)
        chosen = [key for key in order if key in feasible]
        for j in range(1, len(chosen) + 1):
          split = _Split(size, {key: feasible[key] for key in chosen[:j]})
          team_work = sum(kinds[key][1] * split.effective_flops(key, model) * size
                          for key in split.kinds)
          whole_work = sum(kinds[key][1] * kinds[key][2] for key in order
                           if key not in split.kinds)
          slowest = max([split.effective_flops(key, model) for key in split.kinds]
                        + [kinds[key][2] for key in order if key not in split.kinds])
          bound = max((team_work + whole_work) / group.workers, slowest) / rate
          if bound >= min(best_seconds, limit):
            continue
          plan = plan_with({**splits, (k, e): split})
          seconds = plan.critical_seconds(model)
          if seconds < min(best_seconds, limit):
            best_plan, best_seconds, found = plan, seconds, split
      if found is not None:
        splits[(k, e)] = found
  return best_plan


def _split_dim(p: LeafPlacement, size: int) -> tuple[int, int] | None:
  """How ``p``'s matrices split ``size`` ways: (a long-side dimension, its local extent
  padded to a multiple of ``size``), the least padding first, then the largest extent; None
  if every long-side dimension's local extent is below ``size``."""
  layout = p.layout
  long_side = layout.reduction_axes if layout.transposed else layout.output_axes
  options = [(-(-p.local_shape[d] // size) * size, d) for d in long_side
             if p.local_shape[d] >= size]
  if not options:
    return None
  padded, dim = min(options, key=lambda o: (o[0] - p.local_shape[o[1]], -o[0]))
  return dim, padded


@dataclasses.dataclass
class _Matrices:
  """The matrices of one exchange while owners are being chosen.

  Attributes:
    worker: the worker index of every device (flattened mesh).
    costs, elements, kinds: per local matrix (buckets concatenated): NS FLOPs, size, bucket.
    caps: per bucket, the most matrices one worker may own.
    index: per whole local matrix, (bucket, index in the bucket).
    team_size: k of the split kinds (1: none).
    team_items: per matrix split over a team: (bucket, index in the bucket, a member's
      share in effective FLOPs).
    teams: per team, the (bucket, index) pairs it was given.
    owner: per local matrix, the chosen worker.
    owned_elements: per worker, the elements it owns (its chunk).
    counts: (workers, buckets) matrices owned.
  """

  worker: np.ndarray
  costs: list[int]
  elements: list[int]
  kinds: list[int]
  caps: list[float]
  owner: list[int]
  owned_elements: np.ndarray
  counts: np.ndarray
  index: list[tuple[int, int]] = dataclasses.field(default_factory=list)
  team_size: int = 1
  team_items: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
  teams: list[list[tuple[int, int]]] = dataclasses.field(default_factory=list)

  @property
  def fair_elements(self) -> float:
    return max(sum(self.elements) / len(self.owned_elements), max(self.elements, default=1))


def _balance(groups: list[Group], units: list[list[tuple[Bucket, ...]]], mesh_shape: tuple,
             spread: bool, weigh_bytes: bool, splits: dict | None = None,
             model: CostModel | None = None, placements: list[LeafPlacement] | None = None
             ) -> tuple[list[list[list[int]]], list[list[list[list[tuple[int, int]]]]]]:
  """Owners of every local matrix of every exchange: LPT over the whole tree.

  Matrices in decreasing order of NS FLOPs; each goes to the worker of its group whose
  busiest device has the least load afterwards (a device's load sums over the groups).
  With ``weigh_bytes`` a worker's score is max(load ÷ the FLOPs bound, owned elements ÷
  the group's fair share), so that no owner's chunk grows far beyond the fair share. A
  matrix of a kind that ``splits`` gives to teams of k workers is placed the same way, as
  a member's share (its collectives included) on the team of k consecutive workers whose
  busiest device has the least load afterwards.

  Args:
    groups: the groups (without exchanges yet).
    units: per group, the buckets of each of its exchanges.
    mesh_shape: the mesh.
    spread: cap each bucket at ⌈K / workers⌉ matrices per worker.
    weigh_bytes: weigh the owned elements as well as the FLOPs.
    splits: per (group, exchange), its ``_Split``.
    model: the cost model (with ``splits``).
    placements: the leaves (with ``splits``).

  Returns:
    Per group, per exchange: the worker of each local matrix (buckets concatenated; −1 for
    matrices split over teams), and per team the (bucket, matrix) pairs it orthogonalizes.
  """
  splits = splits or {}
  loads = np.zeros(math.prod(size for _, size in mesh_shape), np.float64)
  exchanges, items = [], []
  for k, (group, group_units) in enumerate(zip(groups, units)):
    worker = group.worker_of_devices(mesh_shape).reshape(-1)
    for e, buckets in enumerate(group_units):
      split = splits.get((k, e))
      m = _Matrices(worker, [], [], [], [], [], np.zeros(group.workers),
                    np.zeros((group.workers, len(buckets))))
      m.team_size = split.size if split else 1
      m.teams = [[] for _ in range(group.workers // m.team_size)] if split else []
      for kind, b in enumerate(buckets):
        signature = [placements[i].signature for i in b.members
                     for _ in range(placements[i].local_batch)] if split else []
        mine = []
        for j in range(b.matrices):
          if split and (kind, signature[j]) in split.kinds:
            cost = split.effective_flops((kind, signature[j]), model)
            items.append((-cost, 0, len(exchanges), 1, len(m.team_items)))
            m.team_items.append((kind, j, cost))
          else:
            mine.append(j)
        m.costs += [b.flops] * len(mine)
        m.elements += [b.shape[0] * b.shape[1]] * len(mine)
        m.kinds += [kind] * len(mine)
        m.caps.append(-(-len(mine) // group.workers) if spread else math.inf)
        m.index += [(kind, j) for j in mine]
      m.owner = [0] * len(m.costs)
      items += [(-c, -e, len(exchanges), 0, j) for j, (c, e) in enumerate(zip(m.costs, m.elements))]
      exchanges.append((k, m))
  total = sum((sum(m.costs) + sum(c for _, _, c in m.team_items) * m.team_size)
              * loads.size / len(m.owned_elements) for _, m in exchanges)
  fair_flops = max([total / loads.size, 1] + [c for _, m in exchanges for c in m.costs])
  for _, _, e, is_team, j in sorted(items):
    m = exchanges[e][1]
    if is_team:
      team_of_device = m.worker // m.team_size
      busiest = np.full(len(m.teams), -np.inf)
      np.maximum.at(busiest, team_of_device, loads)
      kind, matrix, cost = m.team_items[j]
      t = int(np.argmin(busiest))
      m.teams[t].append((kind, matrix))
      loads[team_of_device == t] += cost
      continue
    workers = len(m.owned_elements)
    busiest = np.full(workers, -np.inf)
    np.maximum.at(busiest, m.worker, loads)
    new_load = busiest + m.costs[j]
    new_elements = m.owned_elements + m.elements[j]
    score = new_load / fair_flops
    if weigh_bytes:
      score = np.maximum(score, new_elements / m.fair_elements)
    score[m.counts[:, m.kinds[j]] >= m.caps[m.kinds[j]]] = np.inf
    w = int(np.lexsort((np.arange(workers), new_elements, new_load, score))[0])
    m.owner[j] = w
    m.owned_elements[w] += m.elements[j]
    m.counts[w, m.kinds[j]] += 1
    loads[m.worker == w] += m.costs[j]
  if weigh_bytes and not spread:
    for _, m in exchanges:
      if not m.team_items:
        _fewer_programs(m, loads)
  owners, teams = [[] for _ in groups], [[] for _ in groups]
  for (k, m), buckets in zip(exchanges, [b for u in units for b in u]):
    starts = np.cumsum([0] + [b.matrices for b in buckets])
    owner = [-1] * int(starts[-1])
    for (kind, j), w in zip(m.index, m.owner):
      owner[starts[kind] + j] = w
    owners[k].append(owner)
    teams[k].append(m.teams)
  return owners, teams


# Beyond this many workers _fewer_programs is not tried (its search would take seconds).
_DEAL_WORKERS = 1024


def _fewer_programs(m: _Matrices, loads: np.ndarray) -> None:
  """Re-deals one exchange's matrices as two per-worker patterns (and idle workers), if free.

  A pattern is how many matrices of each bucket a worker owns; each distinct pattern is a
  ``lax.switch`` branch with its own NS code, so fewer patterns compile faster. The greedy
  assignment often ends with four or five patterns where two reach the same busiest
  device: u workers take pattern p, v workers pattern q and the rest nothing, with
  u·p_b + v·q_b = K_b for every bucket b. A deal is taken only if it has fewer patterns and
  neither the busiest device's load nor the largest owned size (the all-to-all chunk)
  grows. Applies when the devices' loads from other exchanges are equal across workers
  (otherwise a pattern's cost would depend on the worker), and up to ``_DEAL_WORKERS``
  workers (the search is quadratic in them); updates ``m`` and ``loads``.
  """
  workers = len(m.owned_elements)
  patterns = len({tuple(row) for row in m.counts})
  if workers < 3 or patterns <= 2 or workers > _DEAL_WORKERS:
    return
  mine = np.zeros(workers)
  np.add.at(mine, m.owner, m.costs)
  others = loads - mine[m.worker]
  base = np.full(workers, -np.inf)
  np.maximum.at(base, m.worker, others)
  if not np.allclose(base, base[0]):
    return
  kinds = m.counts.shape[1]
  totals = [int(t) for t in m.counts.sum(axis=0)]
  cost = [next((c for c, k in zip(m.costs, m.kinds) if k == b), 0) for b in range(kinds)]
  size = [next((e for e, k in zip(m.elements, m.kinds) if k == b), 0) for b in range(kinds)]
  load_cap = float(loads.max()) - base[0]
  size_cap = float(m.owned_elements.max())
  best = None
  for u in range(1, workers + 1):
    for v in range(0, workers - u + 1):
      count = 1 + (v > 0) + (u + v < workers)  # distinct patterns, the idle one included
      if count >= patterns:
        continue
      options = []
      for t in totals:
        if v == 0:
          opts = [(t // u, 0)] if t % u == 0 else []
        else:
          opts = [(p, (t - u * p) // v) for p in range(t // u + 1) if (t - u * p) % v == 0]
        if not opts:
          break
        options.append(opts)
      if len(options) < kinds:
        continue

      def search(b, p_load, q_load, p_size, q_size, chosen):
        nonlocal best
        if max(p_load, q_load) > load_cap or max(p_size, q_size) > size_cap:
          return
        if b == kinds:
          key = (count, max(p_load, q_load), max(p_size, q_size))
          if best is None or key < best[0]:
            best = (key, u, v, list(chosen))
          return
        for p, q in options[b]:
          search(b + 1, p_load + p * cost[b], q_load + q * cost[b], p_size + p * size[b],
                 q_size + q * size[b], chosen + [(p, q)])

      search(0, 0.0, 0.0, 0.0, 0.0, [])
  if best is None:
    return
  _, u, v, chosen = best
  loads -= mine[m.worker]
  m.counts[:] = 0
  m.owned_elements[:] = 0
  for b, (p, q) in enumerate(chosen):
    quota = [w for w in range(u) for _ in range(p)] + [u + w for w in range(v) for _ in range(q)]
    for w, j in zip(quota, [j for j, k in enumerate(m.kinds) if k == b], strict=True):
      m.owner[j] = w
      m.owned_elements[w] += m.elements[j]
      m.counts[w, b] += 1
  mine = np.zeros(workers)
  np.add.at(mine, m.owner, m.costs)
  loads += mine[m.worker]


def _make_exchange(buckets: tuple[Bucket, ...], owner: list[int],
                   leaves: list[LeafPlacement], workers: int, split: _Split | None = None,
                   teams: list[list[tuple[int, int]]] | None = None) -> Exchange:
  """The ``Exchange`` of ``buckets`` given the worker of each local matrix (−1: split over
  a team) and each team's (bucket, matrix) pairs."""
  # Per bucket, the leaf of each local matrix.
  leaf_of = [[i for i in b.members for _ in range(leaves[i].local_batch)] for b in buckets]
  owned = [[[] for _ in buckets] for _ in range(workers)]
  start = 0
  for k, b in enumerate(buckets):
    signatures = list(dict.fromkeys(leaves[i].signature for i in b.members))
    order = sorted(range(b.matrices),
                   key=lambda j: (signatures.index(leaves[leaf_of[k][j]].signature), j))
    for j in order:
      if owner[start + j] >= 0:
        owned[owner[start + j]][k].append(j)
    start += b.matrices
  # Per bucket, the first leaf of each signature: the one a program names.
  representative = [{} for _ in buckets]
  for k, b in enumerate(buckets):
    for i in b.members:
      representative[k].setdefault(leaves[i].signature, i)
  programs, program_of = [], []
  for mine in owned:
    program = []
    for k in range(len(buckets)):
      runs: list[list[int]] = []
      for j in mine[k]:
        rep = representative[k][leaves[leaf_of[k][j]].signature]
        if runs and runs[-1][0] == rep:
          runs[-1][1] += 1
        else:
          runs.append([rep, 1])
      program.append(tuple(tuple(run) for run in runs))
    program = tuple(program)
    if program not in programs:
      programs.append(program)
    program_of.append(programs.index(program))
  exchange = Exchange(buckets, tuple(tuple(tuple(m) for m in mine) for mine in owned),
                      tuple(programs), tuple(program_of))
  if split is None:
    return exchange
  kinds = list(split.kinds)  # runs in the same order on every team: fewer programs
  team_runs = []
  for pairs in teams:
    runs: dict[tuple, list[int]] = {}
    for b, j in sorted(pairs):
      runs.setdefault((b, leaves[leaf_of[b][j]].signature), []).append(j)
    team_runs.append(tuple(TeamRun(b, *split.kinds[(b, sig)][:2], tuple(js),
                                   *split.kinds[(b, sig)][2:])
                           for (b, sig), js in sorted(runs.items(),
                                                      key=lambda kv: kinds.index(kv[0]))))
  keys = [tuple(r.key for r in runs) for runs in team_runs]
  team_programs = list(dict.fromkeys(keys))
  return dataclasses.replace(exchange, team_size=split.size, teams=tuple(team_runs),
                             team_programs=tuple(team_programs),
                             team_program_of=tuple(team_programs.index(p) for p in keys))
