"""Dion's static options (``DionSettings``): the options shared with Muon and
Dion's own, checked once; and each matrix leaf's ``DionMatrix`` under them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from optax_muon._src.core import profiles, tree_utils
from optax_muon._src.core.replicas import check_replica_mesh
from optax_muon._src.core.spec import TreeOptions, TreeSpec
from optax_muon._src.dion.matrix import DionMatrix, rank_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class DionSettings:
  """The static options of one Dion transformation: those shared with Muon, and
  Dion's own.

  Attributes:
    options: the routing, dimension numbers, shardings and the other options
      shared with ``muon``.
    rank_fraction: the frozen per-leaf rank fractions.
    product_dtype: the dtype of the large products' operands, ``"auto"``
      (bfloat16 on TPUs and GPUs, else None) or None (the state's).
    power_iterations: subspace-iteration steps per optimizer step.
    replica_axes: the data-parallel mesh axes whose replicas sync only rank-r
      factors (empty: the gradients come averaged).
  """

  options: TreeOptions
  rank_fraction: Any
  product_dtype: Any = "auto"
  power_iterations: int = 1
  replica_axes: tuple[str, ...] = ()

  def matrices(self, spec: TreeSpec, tree: Any) -> list[DionMatrix]:
    """Each Muon leaf's ``DionMatrix`` (``spec`` built from ``options``)."""
    return _matrices(
        spec,
        tree,
        self.rank_fraction,
        self.product_dtype,
        self.power_iterations,
        self.replica_axes,
    )


def _is_fraction(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_fraction(value: Any, where: str) -> None:
  if not _is_fraction(value) or not 0 < value <= 1:
    raise ValueError(
        f"{where}: rank_fraction must be a number in (0, 1], got {value!r}."
    )


def _matrices(
    spec: TreeSpec,
    tree: Any,
    rank_fraction: Any,
    product_dtype: Any = "auto",
    power_iterations: int = 1,
    replica_axes: tuple[str, ...] = (),
) -> list[DionMatrix]:
  """Each Muon leaf's ``DionMatrix``, its rank from ``rank_fraction``.

  Raises:
    ValueError: for a complex leaf, a rank fraction outside (0, 1], or replica
      axes on a leaf without a mesh or that split it, naming the leaf.
  """
  if (
      not spec.muon_positions
  ):  # nothing to resolve a fraction for (an empty tree too)
    return []
  fractions = tree_utils.resolve_prefix(
      rank_fraction, tree, is_value=_is_fraction, what="rank_fraction"
  )
  out = []
  for i in spec.muon_positions:
    leaf = spec.leaves[i]
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
      raise ValueError(
          f"{leaf.path}: Dion takes real matrices; got dtype {leaf.dtype} "
          f"(shape {leaf.shape}). Route it to AdamW with `labels`."
      )
    fraction = 1.0 if fractions[i] is None else fractions[i]
    _check_fraction(fraction, leaf.path)
    if replica_axes:
      _check_replica_axes(leaf, replica_axes)
    platform = _platform(leaf.sharding)
    dtype = _resolved_dtype(product_dtype, platform)
    out.append(
        DionMatrix.of(
            leaf.layout,
            leaf.sharding,
            rank_of(fraction, leaf.layout),
            replica_axes=replica_axes,
            product_dtype=dtype,
            power_iterations=power_iterations,
            orthonormal_precision=_orthonormal_precision(dtype, platform),
        )
    )
  return out


def _platform(sharding: Any) -> str:
  """The platform of the devices a leaf lies on (the default backend's for a
  leaf without a concrete mesh)."""
  devices = profiles.mesh_devices(None if sharding is None else sharding.mesh)
  return devices[0].platform if devices else jax.default_backend()


def _resolved_dtype(product_dtype: Any, platform: str) -> Any:
  """``product_dtype`` for devices of ``platform`` (``"auto"``: bfloat16 on
  TPUs and GPUs, else None)."""
  if isinstance(product_dtype, str):
    return (
        jnp.dtype(jnp.bfloat16) if platform in profiles.ACCELERATORS else None
    )
  return product_dtype


def _orthonormal_precision(product_dtype: Any, platform: str) -> Any:
  """The orthonormalization's products: float32 at full precision, but on
  TPUs with 16-bit large products three bfloat16 passes (``Precision.HIGH``,
  about 1e-5 relative, far below those products' error), which the TPU compiler
  compiles in a fraction of the time. (On GPUs ``HIGH`` may mean TF32, too
  coarse for a Gram matrix.)"""
  if (
      platform == "tpu"
      and product_dtype is not None
      and (jnp.dtype(product_dtype).itemsize < 4)
  ):
    return jax.lax.Precision.HIGH
  return jax.lax.Precision.HIGHEST


def _check_replica_axes(leaf: Any, replica_axes: tuple[str, ...]) -> None:
  """Raises: ValueError unless the leaf lies on a mesh with every replica
  axis."""
  check_replica_mesh(
      None if leaf.sharding is None else leaf.sharding.mesh,
      replica_axes,
      leaf.path,
      "the params' mesh: give the params a NamedSharding (Explicit meshes) or"
      " pass param_shardings",
  )


def make_settings(
    options: TreeOptions,
    rank_fraction: Any,
    product_dtype: Any,
    power_iterations: Any,
    replica_axes: Any = None,
) -> DionSettings:
  """``DionSettings`` from the user's arguments, checked.

  Raises:
    ValueError: for a rank fraction, product dtype, iteration count or replica
      axes out of range.
  """
  return DionSettings(
      options=options,
      rank_fraction=_freeze_fraction(rank_fraction),
      product_dtype=_product_dtype(product_dtype),
      power_iterations=_power_iterations(power_iterations),
      replica_axes=replica_axes_of(replica_axes),
  )


def replica_axes_of(axes: Any) -> tuple[str, ...]:
  """``replica_axes`` as a tuple of names (None: none).

  Raises:
    ValueError: for anything but a name, a sequence of distinct names or None.
  """
  if axes is None:
    return ()
  names = (axes,) if isinstance(axes, str) else axes
  try:
    names = tuple(names)
  except TypeError:
    names = None
  if (
      names is None
      or not all(isinstance(a, str) for a in names)
      or len(set(names)) != len(names)
  ):
    raise ValueError(
        "replica_axes must be a mesh axis name, a sequence of distinct names or"
        f" None, got {axes!r}."
    )
  return names


def _product_dtype(dtype: Any) -> Any:
  """``dtype`` as a NumPy dtype (None and ``"auto"`` stay).

  Raises:
    ValueError: for a dtype that is not a real floating-point one.
  """
  if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
    return dtype
  try:
    resolved = jnp.dtype(dtype)
  except TypeError:
    resolved = None
  if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(
        "product_dtype must be 'auto', a floating-point dtype such as "
        f"'bfloat16' or None, got {dtype!r}."
    )
  return resolved


def _power_iterations(count: Any) -> int:
  """Raises: ValueError unless ``count`` is an int ≥ 1."""
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"power_iterations must be an int ≥ 1, got {count!r}.")
  return count


def _freeze_fraction(rank_fraction: Any) -> Any:
  if _is_fraction(rank_fraction):
    _check_fraction(rank_fraction, "rank_fraction")
  return tree_utils.freeze_prefix(
      rank_fraction, is_value=_is_fraction, what="rank_fraction"
  )
