"""What one Dion step costs per device, leaf by leaf: FLOPs, the collectives'
received bytes and the modelled time (the ``CostModel`` Muon's plan uses).

Every product of ``dion_step`` runs on local blocks, so a device does 1/s of a
leaf's products (s: the devices that split the leaf; replicas repeat them). The
collectives are the partial sums of ``dion_step`` (all-reduces) and, where P has
no more rows than the sketch, the all-gather of P's rows. Ring model, as
``benchmarks/hlo_cost.py`` counts the compiled program: an all-reduce of B bytes
over g devices receives 2·B·(g − 1)/g per device, an all-gather of B bytes in
all B·(g − 1)/g.
"""

from __future__ import annotations

import dataclasses
import math

from optax_muon._src.dion.step import DionMatrix
from optax_muon._src.core.profiles import CostModel


@dataclasses.dataclass(frozen=True)
class DionCost:
  """One leaf's Dion step on one device.

  Attributes:
    flops: FLOPs per device (products as 2·m·n·k; decompositions by their
      leading term).
    collectives: per collective, the bytes a device receives.
  """

  flops: float
  collectives: tuple[float, ...]

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


def _all_reduce(nbytes: float, group: int) -> float:
  return 2 * nbytes * (group - 1) / group


def _all_gather(nbytes: float, group: int) -> float:
  return nbytes * (group - 1) / group


def dion_cost(matrix: DionMatrix, itemsize: int = 4) -> DionCost:
  """The cost of one Dion step of ``matrix``'s leaf on one device.

  Args:
    matrix: the leaf's static facts (its view, rank and sharding).
    itemsize: bytes per value of the state (float32: 4).

  Returns:
    A ``DionCost``.
  """
  shards = (
      lambda dims: math.prod(matrix.mesh.shape[a] for a in matrix.axes_of(dims))
      if matrix.mesh is not None
      else 1
  )
  g_b, g_r, g_c = (
      shards(matrix.batch_dims),
      shards(matrix.row_dims),
      shards(matrix.col_dims),
  )
  batch = math.prod(matrix.view[: matrix.batch]) / g_b
  m, n, r, k = matrix.m, matrix.n, matrix.rank, matrix.sketch
  m_local, n_local = m / g_r, n / g_c
  # Per power iteration M·Q and Mᵀ·P with P's orthonormalization; then P·Rᵀ
  # (error feedback) and P·Qᵀ (the direction). Products on local blocks.
  flops, collectives = 2 * 2 * m_local * n_local * r, [
      _all_reduce(batch * r * itemsize, g_c)
  ]
  for _ in range(matrix.power_iterations):  # (R's column norms above)
    flops += 2 * 2 * m_local * n_local * r
    collectives += [
        _all_reduce(batch * m_local * r * itemsize, g_c),  # P = M·Q
        _all_reduce(batch * n_local * r * itemsize, g_r),
    ]  # R = Mᵀ·P
    if m <= k:  # P's rows gathered, Householder QR on every device
      flops += 4 * m * r * r
      collectives.append(_all_gather(batch * m * r * itemsize, g_r))
    # sketch S·P, P·R₁⁻¹, Gram, P₁·L⁻ᵀ; the k × r QR and r × r factorizations
    else:
      flops += (
          2 * k * m_local * r
          + 3 * 2 * m_local * r * r
          + 2 * k * r * r
          + 3 * r**3
      )
      collectives += [
          _all_reduce(batch * k * r * itemsize, g_r),
          _all_reduce(batch * r * r * itemsize, g_r),
      ]
  return DionCost(batch * flops, tuple(b for b in collectives if b))


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
