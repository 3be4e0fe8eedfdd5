"""The dtype optimizer state is kept in."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def moment_dtype(dtype: Any, mu_dtype: Any = None) -> jnp.dtype:
  """The dtype optimizer moments are kept in: ``mu_dtype`` if given, else
  float32 for 16-bit floating leaves (their sums and squares lose too much in 16
  bits), else the leaf's own."""
  if mu_dtype is not None:
    return jnp.dtype(mu_dtype)
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype
