"""Test helpers: matrices with prescribed spectra and singular-value checks."""

import numpy as np


def matrix_with_spectrum(rng: np.random.Generator, m: int, n: int,
                         singular_values: np.ndarray) -> np.ndarray:
  """A random m × n float64 matrix whose singular values are ``singular_values``."""
  k = min(m, n)
  u, _ = np.linalg.qr(rng.standard_normal((m, k)))
  v, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return (u * singular_values) @ v.T


def singular_values(x) -> np.ndarray:
  """Singular values of each matrix of a (..., m, n) array, in float64."""
  return np.linalg.svd(np.asarray(x, dtype=np.float64), compute_uv=False)


def rel_err(a, b) -> float:
  wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
  a, b = np.asarray(a, wide), np.asarray(b, wide)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
