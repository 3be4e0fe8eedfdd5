"""What one Dion step costs per device, leaf by leaf: FLOPs, the collectives'
received bytes (those over the replica axes apart) and the modelled time (the
``CostModel`` Muon's plan uses).

Every product of ``dion.step`` runs on local blocks, so a device does 1/s of a
leaf's products (s: the devices that split the leaf; replicas repeat them); the
orthonormalization is shared out over each class's group, by bucket (a leaf
counts its share of its bucket's FLOPs and of its class's exchange). The
collectives are
those of ``dion.step`` and ``dion.orthonormalization``. Ring model, as
``benchmarks/hlo_cost.py`` counts the compiled program: over g devices, an
all-reduce of B bytes receives 2·B·(g − 1)/g per device, an all-gather of B
bytes in all B·(g − 1)/g, a reduce-scatter to B bytes B·(g − 1). Of a
collective over replicas × other devices, the replica axes carry the share
(replicas − 1)/(g − 1) of its bytes, what the collective moves across the
replica axes when it runs over the other devices first; of an all-to-all, the
share of its peers on other replicas.
"""

from __future__ import annotations

import dataclasses

from optax_muon._src.core.profiles import CostModel
from optax_muon._src.dion.matrix import DionMatrix
from optax_muon._src.dion.orthonormalization import (
    PASSES,
    Bucket,
    buckets,
    local_count,
)


@dataclasses.dataclass(frozen=True)
class DionCost:
  """One leaf's Dion step on one device.

  Attributes:
    flops: FLOPs per device (products as 2·m·n·k; factorizations by their
      leading terms).
    collectives: per collective, the bytes a device receives.
    replica_bytes: of those, the bytes that cross the replica axes.
  """

  flops: float
  collectives: tuple[float, ...]
  replica_bytes: float = 0.0

  @property
  def received_bytes(self) -> float:
    """Bytes one device receives per step."""
    return sum(self.collectives)

  def seconds(self, model: CostModel) -> float:
    """Modelled time on one device: its products, then each collective in
    turn."""
    return model.compute_seconds(self.flops) + sum(
        model.collective_seconds(b) for b in self.collectives
    )


class _Traffic:
  """The collectives of one leaf's step as they are added up."""

  def __init__(self):
    self.collectives: list[float] = []
    self.replica = 0.0

  def add(
      self, received: float, group: int, replicas: int = 1, peers: bool = False
  ) -> None:
    """A collective receiving ``received`` bytes per device over ``group``
    devices, ``replicas`` of them along the replica axes; of it the share
    (replicas − 1)/(group − 1) crosses them, or with ``peers`` (an
    all-to-all: a part from each peer) the share of peers on other
    replicas."""
    if received and group > 1:
      self.collectives.append(received)
      crossing = group - group / replicas if peers else replicas - 1
      self.replica += received * crossing / (group - 1)

  def all_reduce(self, nbytes: float, group: int, replicas: int = 1) -> None:
    self.add(2 * nbytes * (group - 1) / group, group, replicas)

  def all_gather(self, nbytes: float, group: int, replicas: int = 1) -> None:
    self.add(nbytes * (group - 1) / group, group, replicas)

  def reduce_scatter(
      self, nbytes: float, group: int, replicas: int = 1
  ) -> None:
    """To ``nbytes`` per device."""
    self.add(nbytes * (group - 1), group, replicas)

  def all_to_all(self, nbytes: float, group: int, replicas: int = 1) -> None:
    """Of ``nbytes`` per device."""
    self.add(nbytes * (group - 1) / group, group, replicas, peers=True)


def step_costs(
    matrices: list[DionMatrix], itemsizes: list[int] | None = None
) -> list[DionCost]:
  """The cost of one Dion step of each leaf on one device (the matrices of a
  step together: their orthonormalization is shared per bucket, see
  ``dion.orthonormalization``).

  Args:
    matrices: the leaves' static facts (views, ranks and shardings).
    itemsizes: per leaf, bytes per value of its state (default float32's 4).

  Returns:
    A ``DionCost`` per leaf.
  """
  costs = [None] * len(matrices)
  for bucket in buckets(matrices):
    for index, c in enumerate(bucket.classes):
      for k, mx in zip(c.members, c.matrices):
        costs[k] = _leaf_cost(
            mx, 4 if itemsizes is None else itemsizes[k], bucket, index
        )
  return costs


def _orthonormalization(
    traffic: _Traffic,
    matrix: DionMatrix,
    bucket: Bucket,
    index: int,
    itemsize: int,
) -> float:
  """The bytes of one leaf's part in its P's sums and orthonormalization
  (into ``traffic``), and its share of the bucket's FLOPs; the leaf is of the
  bucket's class ``index``."""
  c = bucket.classes[index]
  size = matrix.size if matrix.mesh is not None else (lambda axes: 1)
  batch, r = local_count(matrix), matrix.rank
  replicas = matrix.replicas if matrix.compressed else 1
  sums = size(matrix.col_axes) * replicas
  g = c.size
  if c.scattered:  # reduce-scattered along the rows, all-gathered at the end
    traffic.reduce_scatter(batch * c.m / g * r * itemsize, g, replicas)
  else:
    traffic.all_reduce(batch * matrix.local_m * r * itemsize, sums, replicas)
  # Over a scattered class's group the replicas (of a compressed matrix) too.
  spanned = replicas if c.scattered else 1
  if bucket.exchanged:  # whole P's there and back: the class's slots
    exchanged = bucket.slots * c.m * r * itemsize
    traffic.all_to_all(batch / c.count * exchanged, g, spanned)
    (back,) = [ks for ks in bucket.returns() if index in ks]
    returned = sum(bucket.classes[k].count for k in back)
    traffic.all_to_all(batch / returned * exchanged, g, spanned)
  else:  # Grams summed in each pass; every device factorizes them all
    for _ in range(PASSES):
      traffic.all_reduce(batch * r * r * itemsize, g, spanned)
  if c.scattered:
    traffic.all_gather(batch * c.m * r * itemsize, g, replicas)
  share = batch / (bucket.total if bucket.exchanged else c.count)
  return share * bucket.flops()


def _leaf_cost(
    matrix: DionMatrix, itemsize: int, bucket: Bucket, index: int
) -> DionCost:
  """One leaf's step on one device, its P's orthonormalized in ``bucket`` as
  part of its class ``index``."""
  size = matrix.size if matrix.mesh is not None else (lambda axes: 1)
  g_r, g_c = size(matrix.row_axes), size(matrix.col_axes)
  replicas = matrix.replicas
  batch = local_count(matrix)
  m, n, r = matrix.m, matrix.n, matrix.rank
  m_local, n_local = m / g_r, n / g_c
  split = matrix.q_split is not None
  traffic = _Traffic()
  if matrix.replica_axes and not matrix.compressed:  # the averaged gradient
    traffic.all_reduce(batch * m_local * n_local * itemsize, replicas, replicas)
  if split:  # Q whole over the row axes
    traffic.all_gather(batch * n_local * r * itemsize, g_r)
  # P·Rᵀ (error feedback) and P·Qᵀ (the direction); per power iteration M·Q,
  # Mᵀ·P and the orthonormalization.
  flops = 2 * 2 * m_local * n_local * r * batch
  for _ in range(matrix.power_iterations):
    flops += 2 * 2 * m_local * n_local * r * batch
    flops += _orthonormalization(traffic, matrix, bucket, index, itemsize)
    r_bytes = batch * n_local * r * itemsize
    if split:
      traffic.reduce_scatter(r_bytes / g_r, g_r)
      if matrix.compressed:
        traffic.all_reduce(r_bytes / g_r, replicas, replicas)
      traffic.all_gather(r_bytes, g_r)
    elif matrix.compressed:
      traffic.all_reduce(r_bytes, g_r * replicas, replicas)
    else:
      traffic.all_reduce(r_bytes, g_r)
  traffic.all_reduce(batch * r * itemsize, g_c * (g_r if split else 1))
  return DionCost(flops, tuple(traffic.collectives), traffic.replica)


def step_seconds(leaf_costs: list[DionCost], model: CostModel) -> float:
  """Modelled time of one step of all the leaves on one device, with each
  collective of a kind combined over the leaves (as XLA's combiners do): every
  leaf's products and bytes, but one latency per collective of the leaf with the
  most."""
  if not leaf_costs:
    return 0.0
  latency = model.collective_latency * max(
      len(c.collectives) for c in leaf_costs
  )
  moved = sum(c.received_bytes for c in leaf_costs)
  return (
      model.compute_seconds(sum(c.flops for c in leaf_costs))
      + latency
      + (moved / model.bytes_per_second if moved else 0.0)
  )
