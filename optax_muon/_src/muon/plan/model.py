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
import math
from typing import Any, NamedTuple

import numpy as np

from optax_muon._src.muon import costs
from optax_muon._src.muon.costs import CostModel, TeamCost
from optax_muon._src.core.matrices import MatrixLayout
from optax_muon._src.core.sharding import LeafSharding


@dataclasses.dataclass(frozen=True)
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

  @property
  def matrix_dims(self) -> tuple[int, ...]:
    """The leaf's reduction and output dimensions, in leaf order."""
    return tuple(sorted(self.layout.reduction_axes + self.layout.output_axes))

  @property
  def dim_axes(self) -> tuple[tuple[str, ...], ...]:
    """Per leaf dimension, the mesh axes splitting it (none without a
    sharding)."""
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
    """Leaves with equal signatures cut their matrices into pieces the same
    way."""
    return (
        tuple(self.layout.shape[d] for d in self.matrix_dims),
        tuple(self.dim_axes[d] for d in self.matrix_dims),
        self.reduction_positions,
        self.output_positions,
        self.layout.transposed,
    )

  @property
  def reduction_positions(self) -> tuple[int, ...]:
    """Where the reduction axes (in the layout's order) sit among
    ``matrix_dims``."""
    return tuple(self.matrix_dims.index(d) for d in self.layout.reduction_axes)

  @property
  def output_positions(self) -> tuple[int, ...]:
    return tuple(self.matrix_dims.index(d) for d in self.layout.output_axes)


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
class Exchange:
  """Buckets that travel in one all-to-all each way, and who orthogonalizes
  their matrices.

  Attributes:
    buckets: the buckets.
    owned: per worker, per bucket, the local matrices (indices into the bucket)
      it orthogonalizes whole, in the order its program runs them.
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


@dataclasses.dataclass(frozen=True)
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


@dataclasses.dataclass(frozen=True)
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

  # The plan's figures per device, counted in ``optax_muon._src.muon.costs``.

  def device_ns_flops(self) -> np.ndarray:
    """NS FLOPs each device runs per step (``costs.device_ns_flops``)."""
    return costs.device_ns_flops(self)

  def device_received_bytes(self, ragged: bool = False) -> np.ndarray:
    """Bytes each device receives per step (``costs.device_received_bytes``)."""
    return costs.device_received_bytes(self, ragged)

  def device_seconds(self, model: CostModel | None = None) -> np.ndarray:
    """Modelled NS and exchange time of each device per step
    (``costs.device_seconds``)."""
    return costs.device_seconds(self, model)

  def critical_seconds(self, model: CostModel | None = None) -> float:
    """Modelled time of the busiest device (``costs.critical_seconds``)."""
    return costs.critical_seconds(self, model)

  def critical_ns_flops(self) -> int:
    """NS FLOPs of the busiest device (``costs.critical_ns_flops``)."""
    return costs.critical_ns_flops(self)

  def ns_flops_bound(self) -> float:
    """The lower bound on the busiest device's NS FLOPs
    (``costs.ns_flops_bound``)."""
    return costs.ns_flops_bound(self)

  def switches(self) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Each ``lax.switch``'s branch FLOPs and the branch every device takes
    (``costs.switches``)."""
    return costs.switches(self)
