"""Orthogonalizing many leaves at once: same-shape matrices share one batched NS call."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from optax_muon.coefficients import NSCoefficients
from optax_muon.layout import MatrixLayout
from optax_muon.newton_schulz import (GRAM_RESTART, PRECONDITIONINGS, newton_schulz, ns_flops,
                                      uses_gram)


@dataclasses.dataclass(frozen=True)
class NSOptions:
  """How Newton–Schulz runs.

  Attributes:
    coefficients: the resolved schedule.
    compute_dtype: dtype of the NS matrix products; ``None`` keeps the input's.
    method: ``"standard"``, ``"gram"`` or ``"auto"`` (see ``newton_schulz``).
    gram_restart: steps between Gram restarts.
    bucket: stack same-shape matrices (in canonical orientation, short side first) into one
      batched NS call instead of one call per leaf.
    preconditioning: the scaling before the first step (see ``newton_schulz``).
  """

  coefficients: NSCoefficients
  compute_dtype: jnp.dtype | None = None
  method: str = "auto"
  gram_restart: int = GRAM_RESTART
  bucket: bool = True
  preconditioning: str = "frobenius"

  def __post_init__(self):
    uses_gram(self.method, 1, 1, 1, self.gram_restart)  # Validates both.
    if self.preconditioning not in PRECONDITIONINGS:
      raise ValueError(f"preconditioning must be one of {PRECONDITIONINGS}, got "
                       f"{self.preconditioning!r}.")

  def flops(self, m: int, n: int, dtype=jnp.float32) -> int:
    """NS FLOPs of one m × n matrix of ``dtype`` under these options."""
    steps = self.coefficients.steps
    gram = uses_gram(self.method, min(m, n), max(m, n), steps, self.gram_restart,
                     self.compute_dtype or dtype)
    return ns_flops(m, n, steps, gram, self.gram_restart)

  def run(self, x: jax.Array) -> jax.Array:
    """``newton_schulz`` of a (..., m, n) array under these options."""
    return newton_schulz(x, self.coefficients, compute_dtype=self.compute_dtype,
                         preconditioning=self.preconditioning, method=self.method,
                         gram_restart=self.gram_restart)


def canonical_shape(layout: MatrixLayout) -> tuple[int, int]:
  """The (m, n) matrix NS iterates on: short side first."""
  return min(layout.n_in, layout.n_out), max(layout.n_in, layout.n_out)


def _to_canonical(layout: MatrixLayout, x: jax.Array) -> jax.Array:
  x = layout.to_matrices(x)
  return jnp.swapaxes(x, -1, -2) if layout.n_in > layout.n_out else x


def _from_canonical(layout: MatrixLayout, y: jax.Array) -> jax.Array:
  if layout.n_in > layout.n_out:
    y = jnp.swapaxes(y, -1, -2)
  return layout.from_matrices(y)


def orthogonalize(leaves: list[jax.Array], layouts: list[MatrixLayout],
                  options: NSOptions) -> list[jax.Array]:
  """Applies Newton–Schulz to every matrix of every leaf.

  Args:
    leaves: arrays, one per layout, each of its layout's shape.
    layouts: how each leaf splits into matrices.
    options: the NS configuration.

  Returns:
    The orthogonalized leaves, same shapes and dtypes as ``leaves``.
  """
  if not options.bucket:
    return [layout.from_matrices(options.run(layout.to_matrices(x)))
            for x, layout in zip(leaves, layouts)]

  buckets = collections.defaultdict(list)  # (m, n, dtype) -> leaf indices
  for i, (x, layout) in enumerate(zip(leaves, layouts)):
    buckets[canonical_shape(layout) + (jnp.dtype(x.dtype),)].append(i)
  out = [None] * len(leaves)
  for indices in buckets.values():
    stacked = jnp.concatenate([_to_canonical(layouts[i], leaves[i]) for i in indices])
    result = options.run(stacked)  # (Σ batch, m, n)
    offsets = [0]
    for i in indices:
      offsets.append(offsets[-1] + layouts[i].batch)
    for i, start, stop in zip(indices, offsets[:-1], offsets[1:]):
      out[i] = _from_canonical(layouts[i], result[start:stop])
  return out
