"""An alpha–beta cost model of one device, for choosing how many devices orthogonalize one
matrix together.

time = FLOPs / flops_per_second + Σ over collectives (collective_latency + bytes received /
bytes_per_second). A matrix of c FLOPs of Newton–Schulz takes c / rate on one device; on a
team of k devices about c / (k·rate) on each, plus per step the all-reduce of the m × m Gram
matrix (a reduce-scatter and an all-gather) and the all-gather of the polynomial's rows,
each receiving (k − 1)/k·m² elements. Splitting pays when the compute it saves exceeds the
collectives it adds; the plan decides that for the whole tree (``optax_muon.plan``).
"""

from __future__ import annotations

import dataclasses
import math

import jax


@dataclasses.dataclass(frozen=True)
class CostModel:
  """How fast one device computes and communicates.

  Attributes:
    flops_per_second: matrix-multiply throughput at the NS compute dtype.
    bytes_per_second: per-device link bandwidth of a collective (``math.inf``: free).
    collective_latency: seconds each collective costs before its bytes move (0: none).

  Examples:
    >>> import math, optax_muon
    >>> free = optax_muon.CostModel(1e12, math.inf, 0.0)
    >>> free.collective_seconds(1e9)
    0.0
  """

  flops_per_second: float
  bytes_per_second: float
  collective_latency: float

  def __post_init__(self):
    for name in ("flops_per_second", "bytes_per_second"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"CostModel.{name} must be a positive number (math.inf allowed), got "
                         f"{value!r}.")
    if not (isinstance(self.collective_latency, (int, float))
            and 0 <= self.collective_latency < math.inf):
      raise ValueError(f"CostModel.collective_latency must be a finite number ≥ 0, got "
                       f"{self.collective_latency!r}.")

  def compute_seconds(self, flops: float) -> float:
    return flops / self.flops_per_second

  def collective_seconds(self, received_bytes: float) -> float:
    """One collective in which a device receives ``received_bytes``."""
    if received_bytes == 0:
      return 0.0
    return self.collective_latency + received_bytes / self.bytes_per_second


class _ProfileTable(dict):
  """Named ``CostModel`` profiles: ``"cpu"``, ``"gpu"``, ``"tpu"``. Round public peak
  figures (dense matmul throughput, per-device collective bandwidth, a typical
  small-collective latency), not measurements; give your own ``CostModel`` for a measured
  machine."""


PROFILES = _ProfileTable({
    # A server CPU core group: ~1 TFLOP/s f32, collectives through shared memory.
    "cpu": CostModel(1e12, 20e9, 20e-6),
    # NVIDIA H100/H200 SXM: ~990 TFLOP/s dense bf16 and ~495 TF32 at peak (400: what a
    # large matmul reaches), NVLink 450 GB/s per direction.
    "gpu": CostModel(400e12, 450e9, 10e-6),
    # TPU v5p: 459 TFLOP/s bf16; ICI ~600 GB/s per chip over its links (300: one direction).
    "tpu": CostModel(459e12, 300e9, 5e-6),
})


def default_cost_model(devices=None) -> CostModel:
  """The profile of the devices JAX runs on.

  Args:
    devices: the devices (``jax.devices()`` by default); their platform picks the profile
      (``"cpu"`` for a platform without one).

  Returns:
    One of ``PROFILES``.
  """
  devices = jax.devices() if devices is None else devices
  platform = devices[0].platform if devices else "cpu"
  return PROFILES.get(platform, PROFILES["cpu"])
