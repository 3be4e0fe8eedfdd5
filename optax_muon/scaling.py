"""The scale stage: the shape factor, and ``adaptive``'s dual-norm scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from optax_muon.options import check_number
from optax_muon.sharding import sum_over

SCALE_KINDS = ("jordan", "spectral", None)


def check_shape_scale(scale: str | None, consistent_rms: jax.typing.ArrayLike | None) -> None:
  """Raises ValueError, naming the argument, for an unknown ``scale`` or a Python
  ``consistent_rms`` that is not positive."""
  check_number("consistent_rms", consistent_rms, 0.0, low_open=True)
  if scale not in SCALE_KINDS:
    raise ValueError(f"scale must be one of {SCALE_KINDS}, got {scale!r}.")


def scale_factor(n_in: int, n_out: int, kind: str | None, *,
                 consistent_rms: jax.typing.ArrayLike | None = None):
  """The factor multiplying an orthogonalized update of an n_in × n_out matrix.

  Args:
    n_in: reduction size.
    n_out: output size.
    kind: ``"jordan"`` sqrt(max(1, n_out/n_in)); ``"spectral"`` sqrt(n_out/n_in);
      ``None`` 1. Ignored when ``consistent_rms`` is given.
    consistent_rms: k, for the factor k·sqrt(max(n_in, n_out)): the update's RMS is then
      about k whatever the shape (Moonlight uses 0.2 to match AdamW; DeepSeek-V4's γ is the
      same constant). May be a traced scalar.

  Returns:
    A Python float, or a scalar array when ``consistent_rms`` is traced.

  Raises:
    ValueError: for an unknown kind.

  Examples:
    >>> import optax_muon
    >>> optax_muon.scale_factor(256, 1024, "jordan")
    2.0
    >>> optax_muon.scale_factor(256, 1024, None, consistent_rms=0.2)
    6.4
  """
  if kind not in SCALE_KINDS:
    raise ValueError(f"Unknown update scale {kind!r}; expected one of {SCALE_KINDS}.")
  if consistent_rms is not None:
    return consistent_rms * math.sqrt(max(n_in, n_out))
  if n_in == 0 or kind is None:  # an empty matrix: its update is empty whatever the factor
    return 1.0
  if kind == "jordan":
    return math.sqrt(max(1.0, n_out / n_in))
  return math.sqrt(n_out / n_in)


def dual_norm_scale(o: jax.Array, n: jax.Array, sharding) -> jax.Array:
  """``adaptive``'s factor ⟨n, o⟩ = Σ conj(n)·o over the whole leaf (as ``optax.contrib``).

  Args:
    o: the leaf's orthogonalized update (or its local block inside ``shard_map``).
    n: the NS input (or its local block).
    sharding: the leaf's ``LeafSharding`` (the sum spans its shards), or None.

  Returns:
    The factor, with ``o``'s rank and size 1 on every axis.
  """
  return sum_over(jnp.conj(n).astype(o.dtype) * o, tuple(range(o.ndim)), sharding)
