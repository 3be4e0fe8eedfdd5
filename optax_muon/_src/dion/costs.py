"""What one Dion step costs per device, leaf by leaf: FLOPs, the collectives'
received bytes (those over the replica axes apart) and the modelled time (the
``CostModel`` Muon's plan uses).

Every product of ``dion.step`` runs on local blocks, so a device does 1/s of a
leaf's products (s: the devices that split the leaf; replicas repeat them); the
small factorizations are shared out over the row group. The collectives are
those of ``dion.step`` and ``dion.orthonormalization``. Ring model, as
``benchmarks/hlo_cost.py`` counts the compiled program: over g devices, an
all-reduce of B bytes receives 2·B·(g − 1)/g per device, an all-gather of B
bytes in all B·(g − 1)/g, a reduce-scatter to B bytes B·(g − 1). Of a
collective over replicas × other devices, the replica axes carry the share
(replicas − 1)/(g − 1) of its bytes, what the collective moves across the
replica axes when it runs over the other devices first.
"""

from __future__ import annotations

import dataclasses
import math

from optax_muon._src.core.profiles import CostModel
from optax_muon._src.dion.matrix import DionMatrix


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

  def add(self, received: float, group: int, replicas: int = 1) -> None:
    """A collective receiving ``received`` bytes per device over ``group``
    devices, ``replicas`` of them along the replica axes."""
    if received and group > 1:
      self.collectives.append(received)
      self.replica += received * (replicas - 1) / (group - 1)

  def all_reduce(self, nbytes: float, group: int, replicas: int = 1) -> None:
    self.add(2 * nbytes * (group - 1) / group, group, replicas)

  def all_gather(self, nbytes: float, group: int) -> None:
    self.add(nbytes * (group - 1) / group, group)

  def reduce_scatter(self, nbytes: float, group: int) -> None:
    """To ``nbytes`` per device."""
    self.add(nbytes * (group - 1), group)


def dion_cost(matrix: DionMatrix, itemsize: int = 4) -> DionCost:
  """The cost of one Dion step of ``matrix``'s leaf on one device.

  Args:
    matrix: the leaf's static facts (its view, rank and sharding).
    itemsize: bytes per value of the state (float32: 4).

  Returns:
    A ``DionCost``.
  """
  size = matrix.size if matrix.mesh is not None else (lambda axes: 1)
  g_r, g_c = size(matrix.row_axes), size(matrix.col_axes)
  replicas = matrix.replicas
  batch = matrix.local_batch if matrix.mesh is not None else matrix.count
  m, n, r, k = matrix.m, matrix.n, matrix.rank, matrix.sketch
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
  owned = math.ceil(batch / g_r)  # factorizations shared over the row group
  for _ in range(matrix.power_iterations):
    flops += 2 * 2 * m_local * n_local * r * batch
    p_bytes = batch * m_local * r * itemsize
    if matrix.compressed:
      traffic.all_reduce(p_bytes, g_c * replicas, replicas)
    else:
      traffic.all_reduce(p_bytes, g_c)
    # sketch S·P (none for the identity), P·T₁, its Gram, P₁·T₂; the R factor
    # (blocked Gram–Schmidt twice over) and the three r × r factorizations of
    # the matrices this device owns.
    sketching = 0 if matrix.identity_sketch else 2 * k * m_local * r
    flops += batch * (sketching + 3 * 2 * m_local * r * r)
    flops += owned * (4 * k * r * r + 3 * r**3)
    traffic.reduce_scatter(owned * k * r * itemsize, g_r)
    traffic.all_gather(owned * g_r * r * r * itemsize, g_r)
    traffic.reduce_scatter(owned * r * r * itemsize, g_r)
    traffic.all_gather(owned * g_r * r * r * itemsize, g_r)
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
