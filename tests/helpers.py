"""Test helpers: matrices with prescribed spectra, singular-value checks,
references."""

import inspect
import math

import numpy as np
import optax
import pytest

#: Tests that compare against optax.contrib.muon need its 0.2.8 API
#: (preconditioning, consistent_rms, MuonDimensionNumbers); with an older optax
#: (the declared minimum is 0.2.5) they are skipped, everything else runs.
requires_contrib_api = pytest.mark.skipif(
    "preconditioning" not in inspect.signature(optax.contrib.muon).parameters,
    reason=(
        f"optax {optax.__version__}: optax.contrib.muon predates the 0.2.8 API"
        " compared with"
    ),
)


def matrix_with_spectrum(
    rng: np.random.Generator, m: int, n: int, singular_values: np.ndarray
) -> np.ndarray:
  """A random m × n float64 matrix whose singular values are
  ``singular_values``."""
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return (u * singular_values) @ v.T


def singular_values(x) -> np.ndarray:
  """Singular values of each matrix of a (..., m, n) array, in float64."""
  return np.linalg.svd(np.asarray(x, dtype=np.float64), compute_uv=False)


def rel_err(a, b) -> float:
  wide = (
      np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
  )
  a, b = np.asarray(a, wide), np.asarray(b, wide)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def numpy_newton_schulz(x, table) -> np.ndarray:
  """Newton–Schulz in float64 NumPy, written out: the reference for
  ``newton_schulz``.

  Args:
    x: one (m, n) matrix.
    table: an ``NSCoefficients`` (its rows, safety and eps), or a list of (a, b,
      c) rows (no safety, eps 1e-7).
  """
  rows = getattr(table, "rows", table)
  safety, eps = getattr(table, "safety", 0.0), getattr(table, "eps", 1e-7)
  x = np.asarray(x, np.float64)
  transposed = x.shape[0] > x.shape[1]
  x = x.T if transposed else x
  x = x / (np.linalg.norm(x) * (1 + safety) + eps)
  for a, b, c in rows:
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x.T if transposed else x


def normal(key, shape, dtype=None):
  """``jax.random.normal(key, shape, dtype)``, the same values, from one
  compiled program per power of two of the size instead of one per shape.

  With threefry's partitionable bits (JAX's default), element i of a draw does
  not depend on the draw's size: a longer draw, cut and reshaped on the host,
  holds the same values.
  """
  import jax  # noqa: PLC0415  (helpers stay importable without JAX for NumPy-only tests)
  import jax.numpy as jnp  # noqa: PLC0415

  dtype = jnp.float32 if dtype is None else dtype
  if not jax.config.jax_threefry_partitionable:
    return jax.random.normal(key, shape, dtype)
  size = math.prod(shape)
  drawn = jax.random.normal(key, (1 << max(size - 1, 0).bit_length(),), dtype)
  return jnp.asarray(np.asarray(drawn)[:size].reshape(shape))


def random_like(params, seed: int):
  """Standard-normal values shaped like ``params``, a key per leaf from
  ``seed``: ``trees.random_like``'s values, drawn with ``normal``."""
  import jax  # noqa: PLC0415

  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(
      treedef, [normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  )


def random_grads(params, step: int, dtype=None):
  """Standard-normal gradients shaped like ``params``, a different draw per
  ``step``."""
  import jax  # noqa: PLC0415  (helpers stay importable without JAX for NumPy-only tests)

  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(100 + step), len(leaves))
  return jax.tree.unflatten(
      treedef,
      [normal(k, x.shape, dtype or x.dtype) for k, x in zip(keys, leaves)],
  )
