"""The static orthogonalization plan: which device orthogonalizes which whole matrix.

Pure Python at trace time, from the Muon leaves' layouts and shardings. Per leaf, the mesh
axes fall into three sets:

* exchange axes X: they split the leaf's matrix dimensions. The devices along X each hold a
  piece of every local matrix; an all-to-all over X gives each of them whole matrices.
* batch axes B: they split the leaf's batch (stack/expert/head) dimensions. Devices along B
  hold different matrices and never talk about this leaf.
* replica axes R: everything else. Devices along R hold the same data; with the "split"
  policy they share the NS work and all-gather the results, with "redundant" each computes
  everything.

Leaves with the same (X, R) form a group; all matrices of a group move in one all-to-all
each way. Within a group, same-shape matrices (canonical orientation, m ≤ n) form a bucket;
the bucket's K local matrices fill S = ⌈K/g⌉ slots on each of the g devices along X
(matrix j → device j // S, slot j % S), and with the split policy each of the r replicas
takes ⌈S/r⌉ of those slots. Every device runs the same slots: the padding is the only waste.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from optax_muon.layout import MatrixLayout
from optax_muon.orthogonalize import NSOptions, canonical_shape
from optax_muon.sharding import LeafSharding

REPLICA_POLICIES = ("split", "redundant")
EXCHANGES = ("bucket", "group")


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
  """One Muon leaf in the plan.

  Attributes:
    layout: the global matrix layout.
    sharding: how the leaf lies on the mesh.
    exchange_axes: X, in mesh order.
    replica_axes: R, in mesh order.
  """

  layout: MatrixLayout
  sharding: LeafSharding
  exchange_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]

  @property
  def matrix_dims(self) -> tuple[int, ...]:
    """The leaf's reduction and output dimensions, in leaf order."""
    return tuple(sorted(self.layout.reduction_axes + self.layout.output_axes))

  @property
  def local_shape(self) -> tuple[int, ...]:
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
            tuple(self.sharding.dim_axes[d] for d in self.matrix_dims),
            self.reduction_positions, self.output_positions,
            self.layout.n_in > self.layout.n_out)

  @property
  def reduction_positions(self) -> tuple[int, ...]:
    """Where the reduction axes (in the layout's order) sit among ``matrix_dims``."""
    return tuple(self.matrix_dims.index(d) for d in self.layout.reduction_axes)

  @property
  def output_positions(self) -> tuple[int, ...]:
    return tuple(self.matrix_dims.index(d) for d in self.layout.output_axes)


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Same-shape matrices of one group.

  Attributes:
    shape: the canonical (m, n), m ≤ n.
    members: indices into ``Plan.leaves``; local matrix j runs through them in order.
    matrices: K, local matrices per device (the same on every device).
    slots: S = ⌈K / g⌉ slots per device along the exchange axes.
    replica_slots: slots each replica computes (S, or ⌈S / r⌉ with the split policy).
  """

  shape: tuple[int, int]
  members: tuple[int, ...]
  matrices: int
  slots: int
  replica_slots: int


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves sharing exchange and replica axes: one all-to-all each way.

  Attributes:
    exchange_axes: X.
    replica_axes: R.
    exchange_size: g = Π |X|.
    replica_size: r = Π |R|.
    split: whether replicas split the NS work (then all-gather over R).
    buckets: its buckets.
  """

  exchange_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]
  exchange_size: int
  replica_size: int
  split: bool
  buckets: tuple[Bucket, ...]

  def owner_masks(self, bucket: Bucket, leaves: tuple[LeafPlacement, ...]
                  ) -> dict[tuple, np.ndarray]:
    """Per piece signature, a (g, S) bool table: does device o's slot s hold such a matrix."""
    leaf_of = [i for i in bucket.members for _ in range(leaves[i].local_batch)]
    masks = {}
    for j, i in enumerate(leaf_of):
      mask = masks.setdefault(leaves[i].signature,
                              np.zeros((self.exchange_size, bucket.slots), bool))
      mask[j // bucket.slots, j % bucket.slots] = True
    return masks


@dataclasses.dataclass(frozen=True)
class Plan:
  """The whole tree's orthogonalization plan.

  Attributes:
    mesh_shape: axis name → size, in mesh order.
    leaves: one placement per Muon leaf.
    groups: the groups.
    ns: the NS options.
    exchange: ``"bucket"``: one all-to-all each way per bucket (less temp memory: only one
      bucket's buffers are alive at a time); ``"group"``: one each way for all buckets of a
      group (fewest collectives; for FSDP and FSDP × TP that is one for the whole tree).
    wire_dtype: dtype of the all-to-all buffers; ``None`` keeps the leaves'.
  """

  mesh_shape: tuple[tuple[str, int], ...]
  leaves: tuple[LeafPlacement, ...]
  groups: tuple[Group, ...]
  ns: NSOptions
  exchange: str = "bucket"
  wire_dtype: Any = None

  @property
  def device_count(self) -> int:
    return math.prod(size for _, size in self.mesh_shape)

  def ns_flops_per_device(self) -> int:
    """NS FLOPs each device runs per step (every device runs the same program)."""
    return sum(b.replica_slots * self.ns.flops(*b.shape)
               for g in self.groups for b in g.buckets)

  def ideal_ns_flops_per_device(self) -> float:
    """Σ over all matrices of their NS FLOPs, ÷ device count."""
    total = sum(p.layout.batch * self.ns.flops(*canonical_shape(p.layout))
                for p in self.leaves)
    return total / self.device_count

  def leaf_placement(self, index: int) -> str:
    """Where leaf ``index``'s matrices are orthogonalized, in words."""
    group = next(g for g in self.groups if any(index in b.members for b in g.buckets))
    bucket = next(b for b in group.buckets if index in b.members)
    parts = []
    if group.exchange_size > 1:
      parts.append(f"all-to-all over {'×'.join(group.exchange_axes)}")
    else:
      parts.append("local")
    if group.replica_size > 1:
      parts.append(f"{'split' if group.split else 'redundant'} over "
                   f"{'×'.join(group.replica_axes)}")
    return (f"{', '.join(parts)}; bucket {bucket.shape[0]}×{bucket.shape[1]}: "
            f"{bucket.matrices} matrices, {bucket.replica_slots} slot(s) per device")


def build_plan(layouts: list[MatrixLayout], shardings: list[LeafSharding], ns: NSOptions,
               replica_policy: str = "split", exchange: str = "bucket",
               wire_dtype: Any = None) -> Plan:
  """Builds the plan for the Muon leaves.

  Args:
    layouts: the leaves' global layouts.
    shardings: the leaves' shardings (all on one mesh).
    ns: NS options.
    replica_policy: ``"split"`` or ``"redundant"`` (see the module docstring).
    exchange: ``"bucket"`` or ``"group"`` (see ``Plan``).
    wire_dtype: see ``Plan``.

  Returns:
    The ``Plan``.

  Raises:
    ValueError: for an unknown policy or exchange.
  """
  validate_options(replica_policy, exchange)
  mesh = shardings[0].mesh
  mesh_shape = tuple(mesh.shape.items())
  order = [name for name, _ in mesh_shape]
  placements = []
  for layout, sharding in zip(layouts, shardings):
    matrix_axes = {a for d in layout.reduction_axes + layout.output_axes
                   for a in sharding.dim_axes[d]}
    replica = [a for a in order if a not in sharding.used_axes]
    placements.append(LeafPlacement(layout, sharding,
                                    tuple(a for a in order if a in matrix_axes),
                                    tuple(replica)))
  size = lambda axes: math.prod(mesh.shape[a] for a in axes)
  group_members: dict[tuple, list[int]] = {}
  for i, p in enumerate(placements):
    group_members.setdefault((p.exchange_axes, p.replica_axes), []).append(i)
  groups = []
  for (exchange_axes, replica_axes), members in group_members.items():
    g, r = size(exchange_axes), size(replica_axes)
    split = replica_policy == "split" and r > 1
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i in members:
      by_shape.setdefault(canonical_shape(placements[i].layout), []).append(i)
    buckets = []
    for shape, idx in by_shape.items():
      k = sum(placements[i].local_batch for i in idx)
      slots = -(-k // g)
      buckets.append(Bucket(shape, tuple(idx), k, slots, -(-slots // r) if split else slots))
    groups.append(Group(exchange_axes, replica_axes, g, r, split, tuple(buckets)))
  return Plan(mesh_shape, tuple(placements), tuple(groups), ns, exchange, wire_dtype)


def validate_options(replica_policy: str, exchange: str) -> None:
  """Raises ValueError for an unknown replica policy or exchange granularity."""
  if replica_policy not in REPLICA_POLICIES:
    raise ValueError(f"replica_policy must be one of {REPLICA_POLICIES}, got "
                     f"{replica_policy!r}.")
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}.")
