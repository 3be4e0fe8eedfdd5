"""The plan's data model: which device orthogonalizes which matrix, and how they
exchange.

The plan is pure Python at trace time, from the Muon leaves' layouts and
shardings. Per leaf, the mesh axes fall into three sets:

* exchange axes X: they split the leaf's matrix dimensions. The devices along X
  each hold a piece of every local matrix; an all-to-all over X gives each owner
  whole matrices.
* batch axes B: they split the leaf's batch (stack/expert/head) dimensions.
  Devices along B hold different matrices and never talk about this leaf.
* replica axes R: everything else. Devices along R hold the same data; with the
  "split" policy they share the NS work and all-gather the results, with
  "redundant" each computes everything.

Leaves with the same (X, R) form a group; a leaf without sharding information is
a group of its own kind, the trivial one: one device, no exchange. Within a
group, same-shape matrices (canonical orientation, m ≤ n) of one dtype form a
bucket, run as one batched NS call per device. The group's workers are its
devices along X, times those along R with the split policy; every local matrix
gets one worker as its owner.

Owners are chosen for the whole tree at once, longest processing time first:
matrices in decreasing order of their NS FLOPs c_j, each to the worker whose
devices end up least loaded (a device's load sums over all groups, so a device
idle in one group takes more work in another), weighing the bytes the worker
receives as well, because an all-to-all sends equal chunks sized by the busiest
owner. Workers owning the same sequence of matrix kinds run the same program;
distinct programs are the branches of one ``lax.switch`` on the worker index,
each compiled with its own NS code, so an exchange is then re-dealt as two
patterns (plus idle workers) where that costs neither FLOPs on the busiest
device nor chunk size.

Where devices outnumber matrices, one matrix's NS can be shared by a team of k
workers (group NS, ``orthogonalization.MeshTeam``): each member gets about n/k
of its columns, the Gram matrix is all-reduced within the team every step, and
every NS FLOP is divided by k. The teams of an exchange are the blocks of k
consecutive workers; a team's work is a ``lax.switch`` branch all of its members
take, so teams and whole-matrix owners coexist. Which kinds of matrices go to
teams, and each kind's k, come from a ``CostModel``: the critical path of the
whole tree (the busiest device's NS FLOPs, its team collectives and its
all-to-alls) is modelled for every candidate, and whole matrices stay unless
splitting shortens it (see ``optax_muon._src.muon.plan.teams``). An exchange's
teams have one size; kinds given different sizes travel in separate exchanges of
the group, each with the buckets' matrices of its kinds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import numpy as np

from optax_muon._src.core.profiles import CostModel, default_cost_model
from optax_muon._src.muon import costs
from optax_muon._src.muon.costs import TeamCost
from optax_muon._src.core.matrices import MatrixLayout
from optax_muon._src.core.sharding import LeafSharding


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafPlacement:
  """One Muon leaf in the plan.

  Attributes:
    layout: the global matrix layout.
    sharding: how the leaf lies on the mesh; ``None`` for a leaf without
      sharding information (the trivial plan: its global array is its local
      block).
    exchange_axes: X, in mesh order.
    replica_axes: R, in mesh order.
    flops: c, the NS FLOPs of one of its matrices.
  """

  layout: MatrixLayout
  sharding: LeafSharding | None
  exchange_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]
  flops: int

  @functools.cached_property
  def matrix_dims(self) -> tuple[int, ...]:
    """The leaf's reduction and output dimensions, in leaf order."""
    return tuple(sorted(self.layout.reduction_axes + self.layout.output_axes))

  @functools.cached_property
  def dim_axes(self) -> tuple[tuple[str, ...], ...]:
    """Per leaf dimension, the mesh axes splitting it (none without a
    sharding)."""
    if self.sharding is None:
      return ((),) * len(self.layout.shape)
    return self.sharding.dim_axes

  @functools.cached_property
  def local_shape(self) -> tuple[int, ...]:
    if self.sharding is None:
      return self.layout.shape
    return self.sharding.local_shape(self.layout.shape)

  @functools.cached_property
  def local_batch(self) -> int:
    return math.prod(self.local_shape[d] for d in self.layout.batch_axes)

  @functools.cached_property
  def piece_shape(self) -> tuple[int, ...]:
    """One local matrix's block, in leaf order of the matrix dimensions."""
    return tuple(self.local_shape[d] for d in self.matrix_dims)

  @functools.cached_property
  def signature(self) -> tuple:
    """Leaves with equal signatures cut their matrices into pieces the same
    way."""
    return (
        tuple(self.layout.shape[d] for d in self.matrix_dims),
        tuple(self.dim_axes[d] for d in self.matrix_dims),
        self.reduction_positions,
        self.output_positions,
        self.layout.transposed,
    )

  @functools.cached_property
  def reduction_positions(self) -> tuple[int, ...]:
    """Where the reduction axes (in the layout's order) sit among
    ``matrix_dims``."""
    return tuple(self.matrix_dims.index(d) for d in self.layout.reduction_axes)

  @functools.cached_property
  def output_positions(self) -> tuple[int, ...]:
    return tuple(self.matrix_dims.index(d) for d in self.layout.output_axes)


#: A slot of a staged program that holds no matrix: zeros travel and are
#: orthogonalized to zeros (``plan.stages``).
PAD = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bucket:
  """Same-shape, same-dtype matrices of one group: one batched NS call per
  worker.

  Attributes:
    shape: the canonical (m, n), m ≤ n.
    dtype: the leaves' dtype (NS runs in it unless ``NSOptions.compute_dtype``
      says otherwise).
    members: indices into ``Plan.leaves``; local matrix j runs through them in
      order.
    matrices: K, local matrices per device (the same on every device of the
      group).
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


class Run(NamedTuple):
  """Consecutive owned matrices of one bucket whose pieces fit together the same
  way.

  Attributes:
    leaf: the representative leaf (the first of the bucket's members with their
      signature).
    count: how many matrices.
  """

  leaf: int
  count: int


# A worker's program: per bucket of its exchange, its runs.
Program = tuple[tuple[Run, ...], ...]


class TeamRunKey(NamedTuple):
  """What a team's program needs to know of one of its runs.

  Attributes:
    bucket: index into the exchange's buckets.
    leaf: the representative leaf.
    split_dim: the leaf dimension split among the members.
    count: how many matrices.
  """

  bucket: int
  leaf: int
  split_dim: int
  count: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeamRun:
  """Matrices of one kind that one team orthogonalizes together (group NS),
  split k ways.

  Member i of the team receives, from every device along X, the i-th of k blocks
  of its piece of each matrix along ``split_dim`` (⌈e/k⌉ of the local extent e,
  the last ones padded with zero columns, which NS leaves at zero): it holds all
  m rows and about n/k of the columns.

  Attributes:
    bucket: index into the exchange's buckets.
    leaf: the representative leaf (the matrices' pieces are cut this leaf's
      way).
    split_dim: the leaf dimension whose local extent is split among the members.
    matrices: the local matrices (indices into the bucket).
    cost: one member's share of one matrix: FLOPs, collectives, collectives per
      loop step.
    block: elements of one matrix each device sends each member (padding
      included).
  """

  bucket: int
  leaf: int
  split_dim: int
  matrices: tuple[int, ...]
  cost: TeamCost
  block: int

  @property
  def key(self) -> TeamRunKey:
    """What a program needs to know of the run."""
    return TeamRunKey(
        self.bucket, self.leaf, self.split_dim, len(self.matrices)
    )


# A team's program: its runs' keys, in order.
TeamProgram = tuple[TeamRunKey, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exchange:
  """Buckets that travel in one all-to-all each way, and who orthogonalizes
  their matrices.

  Attributes:
    buckets: the buckets.
    owned: per worker, per bucket, the local matrices (indices into the bucket)
      it orthogonalizes whole, in the order its program runs them (``PAD``: a
      staged program's empty slot).
    programs: the distinct programs of whole matrices.
    program_of: per worker, its index into ``programs``.
    team_size: k, the workers of each team (1: no teams).
    teams: per team (workers [t·k, (t+1)·k)), the runs it orthogonalizes split k
      ways.
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
    return [
        sum(
            len(mine) * b.piece_size(exchange_size)
            for mine, b in zip(owned, self.buckets)
        )
        for owned in self.owned
    ]

  def per_worker(self, per_run) -> np.ndarray:
    """Per worker, the sum of ``per_run(run)`` over its team's runs (0 without
    teams)."""
    per_team = [sum(per_run(r) for r in runs) for runs in self.teams] or [0]
    return np.asarray(per_team)[
        np.arange(len(self.owned)) // self.team_size
        if self.teams
        else np.zeros(len(self.owned), np.int64)
    ]

  def team_elements(self, exchange_size: int) -> list[int]:
    """Per worker, the elements each device sends it for its team's runs."""
    del exchange_size  # the runs know their blocks
    return self.per_worker(lambda r: len(r.matrices) * r.block).tolist()

  def owned_elements(self, exchange_size: int) -> list[int]:
    """Per worker, the elements each device sends it."""
    return [
        a + b
        for a, b in zip(
            self.whole_elements(exchange_size),
            self.team_elements(exchange_size),
        )
    ]

  def chunk(self, exchange_size: int) -> int:
    """Elements each device sends to each peer: the busiest worker's blocks and
    pieces."""
    return max(self.owned_elements(exchange_size))

  # The exchange's figures per worker.

  def program_flops(self) -> tuple[int, ...]:
    """NS FLOPs of each program of whole matrices."""
    return tuple(
        sum(
            count * b.flops
            for runs, b in zip(p, self.buckets)
            for _, count in runs
        )
        for p in self.programs
    )

  def team_program_flops(self) -> tuple[int, ...]:
    """NS FLOPs of each team program, on each member."""
    flops = {}
    for runs in self.teams:
      flops[tuple(r.key for r in runs)] = sum(
          len(r.matrices) * r.cost.flops for r in runs
      )
    return tuple(flops[p] for p in self.team_programs)

  def worker_team_flops(self) -> np.ndarray:
    """Per worker, its NS FLOPs in its team."""
    return self.per_worker(lambda r: len(r.matrices) * r.cost.flops).astype(
        np.int64
    )

  def worker_team_collective_seconds(self, model: CostModel) -> np.ndarray:
    """Per worker, the modelled time of its team's collectives (each carries all
    of a run's matrices)."""
    return self.per_worker(
        lambda r: r.cost.collective_seconds(model, len(r.matrices))
    ).astype(np.float64)

  def worker_flops(self) -> np.ndarray:
    """Per worker, its NS FLOPs (whole matrices and team share)."""
    whole = np.asarray(self.program_flops(), np.int64)
    return whole[np.asarray(self.program_of)] + self.worker_team_flops()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Group:
  """Leaves sharing exchange and replica axes.

  Attributes:
    exchange_axes: X.
    replica_axes: R.
    exchange_size: g = Π |X|.
    replica_size: r = Π |R|.
    split: whether replicas split the NS work (then all-gather over R).
    sharded: whether its leaves carry shardings (else: the trivial plan, run
      outside ``shard_map``).
    buckets: its buckets.
    exchanges: one (``exchange="combined"``) or one per bucket
      (``"per_shape"``).
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

  def worker_of_devices(
      self, mesh_shape: tuple[tuple[str, int], ...]
  ) -> np.ndarray:
    """The worker index of every device, as an array of the mesh's shape."""
    sizes = [size for _, size in mesh_shape]
    coords = dict(zip([name for name, _ in mesh_shape], np.indices(sizes)))

    def linear(axes):
      out = np.zeros(sizes, np.int64)
      for a in axes:
        out = out * dict(mesh_shape)[a] + coords[a]
      return out

    x = linear(self.exchange_axes)
    return (
        x * self.replica_size + linear(self.replica_axes) if self.split else x
    )

  def stages(self) -> list[tuple[Exchange, ...]]:
    """The exchanges, consecutive ones of the same buckets together: the
    stages of one exchange split by matrix so that its all-to-alls pipeline
    with NS (``plan.stages``; a bucket belongs to one exchange)."""
    runs: list[list[Exchange]] = []
    for ex in self.exchanges:
      if runs and runs[-1][-1].buckets == ex.buckets:
        runs[-1].append(ex)
      else:
        runs.append([ex])
    return [tuple(r) for r in runs]

  def received_bytes(
      self,
      ex: Exchange,
      itemsize: int,
      ragged: bool = False,
      chunk: int | None = None,
  ) -> np.ndarray:
    """Per worker, the bytes each of its devices receives in the exchange ``ex``
    of ``itemsize``-byte elements (see ``Plan.device_received_bytes``);
    ``chunk``: the elements sent to each peer, if not ``ex``'s own (the stages
    of a loop send their longest)."""
    g, replicas = self.exchange_size, self.workers // self.exchange_size
    # Elements one device sends each worker: its piece of every matrix the
    # worker owns.
    owned = np.array(ex.owned_elements(g), np.float64)
    if (
        ragged
    ):  # its own matrices' pieces in, its pieces of everyone else's back
      per_worker = (g - 1) * owned + owned.sum() - owned
    else:
      per_worker = np.full(
          self.workers,
          (2 * (g - 1) + (replicas - 1) * g) * (chunk or ex.chunk(g)),
      )
    return itemsize * per_worker

  def stage_seconds(
      self,
      ex: Exchange,
      itemsize: int,
      model: CostModel,
      chunk: int | None = None,
  ) -> tuple[np.ndarray, float, float]:
    """One stage ``ex`` of a pipelined exchange: each worker's NS time (team
    collectives included), the all-to-all out and the way back (with the
    replicas' all-gather); ``chunk`` as in ``received_bytes``."""
    compute = (
        ex.worker_flops() / model.flops_per_second
        + ex.worker_team_collective_seconds(model)
    )
    out, back = self.transfer_seconds(
        itemsize * (chunk or ex.chunk(self.exchange_size)), model
    )
    return compute, out, back

  def transfer_seconds(
      self, chunk_bytes: float, model: CostModel
  ) -> tuple[float, float]:
    """The all-to-all out and the way back (with the replicas' all-gather) of a
    stage that sends each peer ``chunk_bytes``."""
    g, replicas = self.exchange_size, self.workers // self.exchange_size
    one_way = model.collective_seconds((g - 1) * chunk_bytes) if g > 1 else 0.0
    gather = (
        model.collective_seconds((replicas - 1) * g * chunk_bytes)
        if self.split
        else 0.0
    )
    return one_way, one_way + gather


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """The whole tree's orthogonalization plan.

  Attributes:
    mesh_shape: axis name → size, in mesh order; empty when no leaf is sharded.
    leaves: one placement per Muon leaf.
    groups: the groups.
    exchange: ``"combined"``: one all-to-all each way per group, owners balanced
      over all of its buckets at once (for FSDP and FSDP × TP that is one
      exchange for the whole tree); ``"per_shape"``: one each way per bucket,
      each bucket spread evenly (at most ⌈K/workers⌉ matrices per worker) so
      that its chunk stays small; less temp memory (one bucket's buffers alive
      at a time), less balance.
    wire_dtype: dtype of the all-to-all buffers; ``None`` keeps the leaves'.
    cost_model: the model the plan was chosen by (``None``: whole matrices
      only).
    stage_notes: why exchanges that could overlap NS on the model's devices
      stay in one stage (``plan.stages``), for ``summarize``.
  """

  mesh_shape: tuple[tuple[str, int], ...]
  leaves: tuple[LeafPlacement, ...]
  groups: tuple[Group, ...]
  exchange: str = "combined"
  wire_dtype: Any = None
  cost_model: CostModel | None = None
  stage_notes: tuple[str, ...] = ()

  @property
  def device_count(self) -> int:
    return math.prod(size for _, size in self.mesh_shape)

  @property
  def sharded(self) -> bool:
    return any(g.sharded for g in self.groups)

  # The plan's figures per device, as arrays of the mesh's shape.

  def wire_itemsize(self, ex: Exchange) -> int:
    """Bytes per element of ``ex``'s all-to-all buffers."""
    dtype = self.wire_dtype or np.result_type(*(b.dtype for b in ex.buckets))
    return np.dtype(dtype).itemsize

  def device_ns_flops(self) -> np.ndarray:
    """NS FLOPs each device runs per step."""
    loads = np.zeros([size for _, size in self.mesh_shape], np.int64)
    for group in self.groups:
      worker = group.worker_of_devices(self.mesh_shape)
      for ex in group.exchanges:
        loads = loads + ex.worker_flops()[worker]
    return loads

  def device_received_bytes(self, ragged: bool = False) -> np.ndarray:
    """Bytes each device receives per step.

    Args:
      ragged: count only the pieces each device needs, as
        ``jax.lax.ragged_all_to_all`` would send them, instead of the equal
        chunks of ``jax.lax.all_to_all`` (which is what runs: XLA:CPU does not
        implement the ragged collective).

    Returns:
      Per device: the all-to-all over X each way (chunks of the busiest worker's
      size from each of the g − 1 peers), plus the all-gather of the replicas'
      results when they split the work.
    """
    received = np.zeros([size for _, size in self.mesh_shape], np.float64)
    for group in self.groups:
      if group.workers == 1:
        continue
      worker = group.worker_of_devices(self.mesh_shape)
      for stages in group.stages():
        chunks = stage_chunks(stages, group.exchange_size)
        moved = stages if ragged else _moved(stages)
        for ex, chunk in zip(moved, chunks + chunks[:1]):
          received += group.received_bytes(
              ex, self.wire_itemsize(ex), ragged, chunk
          )[worker]
    return received

  def device_seconds(self, model: CostModel | None = None) -> np.ndarray:
    """Modelled NS and exchange time of each device per step: its whole
    matrices' FLOPs, its team's (FLOPs and collectives), and its all-to-alls
    (and replica all-gathers); an exchange in stages takes its pipelined time
    (``costs.pipelined_seconds``) on each of its group's devices.

    Args:
      model: the cost model; ``None`` takes the plan's (or, if none, the default
        profile).
    """
    model = model or self.cost_model or default_cost_model()
    flops = np.zeros([size for _, size in self.mesh_shape], np.int64)
    received = np.zeros(flops.shape, np.float64)
    single, staged = [], []
    for group in self.groups:
      worker = group.worker_of_devices(self.mesh_shape)
      for stages in group.stages():
        if len(stages) > 1:
          staged.append((group, stages))
          continue
        ex = stages[0]
        single.append((group, worker, ex))
        flops = flops + ex.worker_flops()[worker]
        if group.workers > 1:
          itemsize = self.wire_itemsize(ex)
          received = received + group.received_bytes(ex, itemsize)[worker]
    seconds = flops / model.flops_per_second + received / model.bytes_per_second
    for group, worker, ex in single:
      if group.workers > 1:
        latencies = 2 * (group.exchange_size > 1) + group.split
        seconds = (
            seconds
            + latencies * model.collective_latency
            + ex.worker_team_collective_seconds(model)[worker]
        )
    for group, stages in staged:
      chunks = stage_chunks(stages, group.exchange_size)
      ns, out, back = zip(
          *(
              group.stage_seconds(ex, self.wire_itemsize(ex), model, chunk)
              for ex, chunk in zip(stages, chunks)
          )
      )
      seconds = seconds + costs.pipelined_seconds(
          ns, out, back, looped=not in_line(stages)
      )
    return seconds

  def critical_seconds(self, model: CostModel | None = None) -> float:
    """Modelled time of the busiest device (see ``device_seconds``)."""
    return float(self.device_seconds(model).max())

  def critical_ns_flops(self) -> int:
    """NS FLOPs of the busiest device."""
    return int(self.device_ns_flops().max())

  def ns_flops_bound(self) -> float:
    """The lower bound max(Σ_j c_j / N, max_j c_j) on the busiest device's NS
    FLOPs."""
    flops = [(p.layout.batch, p.flops) for p in self.leaves]
    return max(
        sum(k * c for k, c in flops) / self.device_count,
        max(c for _, c in flops),
    )

  def switches(self) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Per ``lax.switch`` (an exchange with several programs of whole matrices,
    or with several team programs; the stages of an exchange share theirs):
    each branch's NS FLOPs, and the branch every device takes in each stage
    (an array of the mesh's shape plus a stage axis)."""
    out = []
    for group in self.groups:
      worker = group.worker_of_devices(self.mesh_shape)
      for stages in group.stages():
        self._add_switches(out, group, worker, stages)
    return out

  def _add_switches(self, out: list, group: Group, worker, stages) -> None:
    """``switches``' entries of one exchange: one per loop, or per stage of
    stages in line (each has its own branches)."""
    if in_line(stages):
      for ex in stages:
        self._add_switches(out, group, worker, (ex,))
      return
    table = stage_programs(stages, group.exchange_size)
    if len(table.programs) > 1:
      out.append(
          (
              table.program_flops,
              np.moveaxis(table.program_of[:, worker], 0, -1),
          )
      )
    if len(table.team_programs) > 1:
      team = worker // stages[0].team_size
      out.append(
          (
              table.team_program_flops,
              np.moveaxis(table.team_program_of[:, team], 0, -1),
          )
      )


class StagePrograms(NamedTuple):
  """The programs of an exchange's stages, as its loop looks them up.

  Attributes:
    programs, team_programs: every distinct program over the stages (one switch
      branch each), in order of appearance.
    program_flops, team_program_flops: each one's NS FLOPs (a team member's).
    program_of: (stages, workers) each worker's whole-matrix branch.
    team_program_of: (stages, teams) each team's branch.
    team_elements: (stages, workers) elements each device sends each worker for
      its team's blocks (where its whole matrices start in the row).
    team_width, whole_width: the longest team part and whole part of a row.
  """

  programs: tuple[Program, ...]
  team_programs: tuple[TeamProgram, ...]
  program_flops: tuple[int, ...]
  team_program_flops: tuple[int, ...]
  program_of: np.ndarray
  team_program_of: np.ndarray
  team_elements: np.ndarray
  team_width: int
  whole_width: int


def stage_programs(stages: tuple[Exchange, ...], g: int) -> StagePrograms:
  """The programs of ``stages`` (one exchange's), for an exchange of ``g``
  devices."""
  programs, flops = {}, {}
  for ex in stages:
    flops.update(zip(ex.programs, ex.program_flops()))
    programs.update(dict.fromkeys(ex.programs))
  team_flops = {}
  for ex in stages:
    team_flops.update(zip(ex.team_programs, ex.team_program_flops()))
  whole, team = list(programs), list(team_flops)
  team_elements = np.array([ex.team_elements(g) for ex in stages], np.int32)
  return StagePrograms(
      programs=tuple(whole),
      team_programs=tuple(team),
      program_flops=tuple(flops[p] for p in whole),
      team_program_flops=tuple(team_flops[p] for p in team),
      program_of=np.array(
          [
              [whole.index(ex.programs[i]) for i in ex.program_of]
              for ex in stages
          ],
          np.int32,
      ),
      team_program_of=np.array(
          [
              [team.index(ex.team_programs[i]) for i in ex.team_program_of]
              for ex in stages
          ],
          np.int32,
      ).reshape(len(stages), -1),
      team_elements=team_elements,
      team_width=int(team_elements.max()),
      whole_width=max(max(ex.whole_elements(g)) for ex in stages),
  )


def in_line(stages: tuple[Exchange, ...]) -> bool:
  """Whether an exchange's stages run in line rather than as a loop: S > 1 and
  no program with a matrix (whole or a team's) runs in two stages, so that
  each stage's NS code is its own and the in-line stages compile no more of it
  than a loop; each stage then moves its own chunk, and nothing more."""
  if len(stages) < 2:
    return False
  seen: set = set()
  for ex in stages:
    programs = {p for p in ex.programs + ex.team_programs if any(p)}
    if seen & programs:
      return False
    seen |= programs
  return True


def stage_chunks(stages: tuple[Exchange, ...], g: int) -> list[int]:
  """Per stage, the elements each device sends each peer: its own chunk in line,
  the longest stage's in a loop."""
  chunks = [ex.chunk(g) for ex in stages]
  return chunks if in_line(stages) else [max(chunks)] * len(stages)


def _moved(stages: tuple[Exchange, ...]) -> tuple[Exchange, ...]:
  """The exchanges whose chunks move: the stages, and in a loop of S > 1 one
  more (the loop moves a stage each way on every iteration; the first
  iteration's way back and the last one's way out carry nothing the step
  needs)."""
  if len(stages) == 1 or in_line(stages):
    return stages
  return stages + stages[:1]
