"""How fast a device computes and communicates: the ``CostModel`` (an alpha–beta
model of one device) and the published profiles of device generations, found
from a mesh's devices.

``optax_muon._src.muon.costs`` counts with them (and re-exports these names).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import numpy as np

#: Platforms whose large matrix products run at bfloat16 by default (``"auto"``
#: compute dtypes: Muon's Newton–Schulz, Dion's products).
ACCELERATORS = ("tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class CostModel:
  """How fast one device computes and communicates.

  Attributes:
    flops_per_second: matrix-multiply throughput at the NS compute dtype (for a
      device profile: at bfloat16).
    bytes_per_second: per-device link bandwidth of a collective (``math.inf``:
      free).
    collective_latency: seconds each collective costs before its bytes move (0:
      none).
    f32_flops_per_second: the throughput of float32 products at full precision,
      where it differs (``for_dtype`` picks it); None: ``flops_per_second`` for
      every dtype.
    name: what the profile describes (``summarize`` shows it).
    overlap: whether a collective runs while the device computes (asynchronous
      collectives, as TPUs and GPUs schedule them). Then an exchange may be
      split into stages that pipeline with Newton–Schulz
      (``pipelined_seconds``); XLA:CPU runs collectives in line, so its profile
      says False.

  Examples:
    >>> import math, optax_muon
    >>> free = optax_muon.CostModel(1e12, math.inf, 0.0)
    >>> free.collective_seconds(1e9)
    0.0
  """

  flops_per_second: float
  bytes_per_second: float
  collective_latency: float
  f32_flops_per_second: float | None = None
  name: str = ""
  overlap: bool = True

  def __post_init__(self):
    for name in ("flops_per_second", "bytes_per_second"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(
            f"CostModel.{name} must be a positive number (math.inf allowed),"
            f" got {value!r}."
        )
    if not (
        isinstance(self.collective_latency, (int, float))
        and 0 <= self.collective_latency < math.inf
    ):
      raise ValueError(
          "CostModel.collective_latency must be a finite number ≥ 0, got "
          f"{self.collective_latency!r}."
      )

  @staticmethod
  def profile(name: str) -> CostModel:
    """A built-in profile: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (round figures per
    platform), or a device generation from the vendors' published peak figures
    (``"tpu_v5e"``, ``"tpu_v5p"``, ``"tpu_v6e"``, ``"a100"``, ``"h100"``,
    ``"h200"``, ``"b200"``; not measurements). The plan picks one by the mesh's
    ``device_kind`` when ``ShardingOptions.cost_model`` is None.

    Raises:
      ValueError: for an unknown name, listing the known ones.

    Examples:
      >>> import optax_muon
      >>> optax_muon.CostModel.profile("h100").name
      'H100 SXM'
    """
    if name not in PROFILES:
      raise ValueError(
          f"unknown cost profile {name!r}; known: {sorted(PROFILES)}."
      )
    return PROFILES[name]

  def compute_seconds(self, flops: float) -> float:
    return flops / self.flops_per_second

  def for_dtype(self, dtype: Any) -> CostModel:
    """This model with the throughput of NS products in ``dtype`` (float32 and
    wider: the full-precision rate where the profile has one; 16-bit: the
    bfloat16 rate)."""
    if self.f32_flops_per_second is None or np.dtype(dtype).itemsize <= 2:
      return self
    return dataclasses.replace(
        self,
        flops_per_second=self.f32_flops_per_second,
        f32_flops_per_second=None,
    )

  def collective_seconds(self, received_bytes: float) -> float:
    """One collective in which a device receives ``received_bytes``."""
    if received_bytes == 0:
      return 0.0
    return self.collective_latency + received_bytes / self.bytes_per_second


class _ProfileTable(dict):
  """Named ``CostModel`` profiles. ``"cpu"``, ``"gpu"``, ``"tpu"``: one per
  platform, round figures of what a large product reaches. The others: one per
  device generation, from the vendors' published peak figures (dense matrix
  throughput in bfloat16 and in full float32, link bandwidth per direction), for
  the devices' ``device_kind``; not measurements. Give your own ``CostModel``
  for a measured machine."""


PROFILES = _ProfileTable(
    {
        # A server CPU core group: ~1 TFLOP/s f32, collectives through shared
        # memory.
        "cpu": CostModel(1e12, 20e9, 20e-6, name="cpu", overlap=False),
        # NVIDIA H100/H200 SXM: ~990 TFLOP/s dense bf16 and ~495 TF32 at peak
        # (400: what a large matmul reaches), NVLink 450 GB/s per direction.
        "gpu": CostModel(400e12, 450e9, 10e-6, name="gpu"),
        # TPU v5p: 459 TFLOP/s bf16; ICI ~600 GB/s per chip over its links (300:
        # one direction).
        "tpu": CostModel(459e12, 300e9, 5e-6, name="tpu"),
        # Google Cloud TPU pages (system architecture): v5e 197 TFLOP/s bf16,
        # ICI 1,600 Gbps per chip; v5p 459 TFLOP/s, 4,800 Gbps; v6e (Trillium)
        # 918 TFLOP/s, 3,584 Gbps. The MXU
        # multiplies bf16: float32 at HIGHEST precision takes 6 passes (rate /
        # 6).
        "tpu_v5e": CostModel(197e12, 100e9, 5e-6, 197e12 / 6, "TPU v5e"),
        "tpu_v5p": CostModel(459e12, 300e9, 5e-6, 459e12 / 6, "TPU v5p"),
        "tpu_v6e": CostModel(918e12, 224e9, 5e-6, 918e12 / 6, "TPU v6e"),
        # NVIDIA datasheets: A100 SXM 312 TFLOP/s bf16, 19.5 FP32, NVLink 600
        # GB/s; H100 and H200 SXM 989 TFLOP/s bf16 (dense), 67 FP32, NVLink 900
        # GB/s; B200 2,250 TFLOP/s bf16
        # (dense), 75 FP32 (HGX B200: 600 for 8), NVLink 1.8 TB/s. Bandwidth:
        # half the bidirectional figure. FP32 at full precision (no TF32) is
        # what HIGHEST asks for.
        "a100": CostModel(312e12, 300e9, 10e-6, 19.5e12, "A100 SXM"),
        "h100": CostModel(989e12, 450e9, 10e-6, 67e12, "H100 SXM"),
        "h200": CostModel(989e12, 450e9, 10e-6, 67e12, "H200"),
        "b200": CostModel(2250e12, 900e9, 10e-6, 75e12, "B200"),
    }
)

# device_kind (as JAX reports it) → profile.
_DEVICE_KINDS = (
    (r"TPU v5 ?lite|TPU v5e", "tpu_v5e"),
    (r"TPU v5p?$|TPU v5p", "tpu_v5p"),
    (r"TPU v6", "tpu_v6e"),
    (r"A100", "a100"),
    (r"H100", "h100"),
    (r"H200", "h200"),
    (r"B200", "b200"),
)

# Between GPU hosts a collective crosses the network: one 400 Gb/s NIC per GPU
# (ConnectX-7, as in DGX H100/H200/B200), 50 GB/s per direction; 200 Gb/s (HDR)
# for A100 systems.
_GPU_NETWORK_BYTES_PER_SECOND = {"a100": 25e9}
_DEFAULT_GPU_NETWORK = 50e9
# Between TPU slices a collective crosses the data-center network (Google Cloud
# TPU pages): v5p 50 Gb/s per chip; v5e two 100 Gb/s NICs per host of 8 chips
# (25 Gb/s per chip); per direction.
_TPU_DCN_BYTES_PER_SECOND = {"tpu_v5p": 50e9 / 8, "tpu_v5e": 25e9 / 8}
_DEFAULT_TPU_DCN = 25e9 / 8


def profile_of(devices) -> CostModel:
  """The profile of ``devices``: by ``device_kind`` where ``PROFILES`` has the
  generation, else by platform (``"cpu"`` for a platform without one). GPUs on
  several hosts, and TPUs in several slices, communicate at the network's
  bandwidth (the slowest link an exchange over all of them crosses).

  Args:
    devices: devices of a mesh (concrete, or a topology's for ahead-of-time
      compilation).
  """
  devices = list(devices)
  if not devices:
    return PROFILES["cpu"]
  kind = getattr(devices[0], "device_kind", "")
  name = next(
      (n for pattern, n in _DEVICE_KINDS if re.search(pattern, kind)), None
  )
  if name is None:
    return PROFILES.get(devices[0].platform, PROFILES["cpu"])
  profile = PROFILES[name]
  hosts = {getattr(d, "process_index", 0) for d in devices}
  slices = {getattr(d, "slice_index", 0) for d in devices}
  if devices[0].platform in ("gpu", "cuda", "rocm") and len(hosts) > 1:
    network = _GPU_NETWORK_BYTES_PER_SECOND.get(name, _DEFAULT_GPU_NETWORK)
    profile = dataclasses.replace(
        profile,
        bytes_per_second=network,
        name=f"{profile.name}, {len(hosts)} hosts",
    )
  elif devices[0].platform == "tpu" and len(slices) > 1:
    profile = dataclasses.replace(
        profile,
        bytes_per_second=_TPU_DCN_BYTES_PER_SECOND.get(name, _DEFAULT_TPU_DCN),
        name=f"{profile.name}, {len(slices)} slices",
    )
  return profile


def default_cost_model(devices=None) -> CostModel:
  """The profile of ``devices``, or of the devices JAX runs on.

  Args:
    devices: the devices of the mesh being planned (``jax.devices()`` if None).

  Returns:
    ``profile_of(devices)``.
  """
  return profile_of(jax.devices() if devices is None else devices)


def mesh_devices(mesh: Any) -> list | None:
  """A mesh's devices, or None for an ``AbstractMesh`` (it has none)."""
  if mesh is None or isinstance(mesh, jax.sharding.AbstractMesh):
    return None
  return list(np.asarray(mesh.devices).flat)
