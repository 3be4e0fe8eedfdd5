"""The small factorizations of Dion's orthonormalization, blocked so that they
compile in bounded time.

Dion orthonormalizes P through an r × r factorization: the inverse of a
Cholesky factor. XLA's own expansions of these on TPUs grow with r and with the
batch: at r = 1024 a Householder QR, a Cholesky factorization and two
triangular inverses take the TPU compiler about 23 CPU seconds, a batch of 32
of them minutes. Here a side longer than ``BLOCK`` is factorized and inverted
in one ``lax.fori_loop`` over column blocks of ``BLOCK``, whose body calls the
library only on ``BLOCK``-sized pieces and otherwise multiplies matrices: the
compiler sees one body per shape, whatever r and the batch. Sides up to
``BLOCK`` call the library directly.

It takes a batch of matrices in its leading axes. Sides that are not a multiple
of ``BLOCK`` are padded with an identity block, which the factorization keeps
apart from the matrix (the padded result is the result beside an identity).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

#: The side of the pieces the library factorizes (the TPU's matrix unit).
BLOCK = 128

_HIGHEST = jax.lax.Precision.HIGHEST


def _padded(x: jax.Array, rows: int, cols: int) -> jax.Array:
  """``x`` beside an identity block: (…, a, b) → (…, a + rows, b + cols), with
  ``rows`` == ``cols`` ones on the new diagonal."""
  if not rows and not cols:
    return x
  batch = x.shape[:-2]
  a, b = x.shape[-2:]
  out = jnp.zeros(batch + (a + rows, b + cols), x.dtype)
  out = out.at[..., :a, :b].set(x)
  eye = jnp.eye(rows, cols, dtype=x.dtype)
  return out.at[..., a:, b:].set(jnp.broadcast_to(eye, batch + eye.shape))


def _blocks(side: int) -> tuple[int, int]:
  """(padded side, number of blocks) for a side longer than ``BLOCK``."""
  count = -(-side // BLOCK)
  return count * BLOCK, count


def inverse_cholesky(g: jax.Array, precision: Any = _HIGHEST) -> jax.Array:
  """L⁻¹ for the lower Cholesky factor L of a symmetric positive definite
  ``g``, (…, r, r) (NaN where ``g`` is not positive definite, as the
  library's); ``precision``: its products'.

  Right-looking by blocks of columns, one loop for both factors: block j
  factorizes the trailing block, L_jj = chol(S_jj), and sets L's rows below
  it, L_ij = S_ij·L_jj⁻ᵀ (S: the trailing matrix, then S ← S − L_·j·L_·jᵀ), and
  row block j of the inverse, X_j = L_jj⁻¹·[−L_j,<j·X_<j, I] (the rows of L left
  of the diagonal are final by then).
  """
  r = g.shape[-1]
  eye = jnp.eye(min(r, BLOCK), dtype=g.dtype)
  invert = lambda lower: jax.lax.linalg.triangular_solve(
      lower, jnp.broadcast_to(eye, lower.shape), left_side=True, lower=True
  )
  if r <= BLOCK:
    return invert(jnp.linalg.cholesky(g))
  mm = functools.partial(jnp.einsum, precision=precision)
  side, count = _blocks(r)
  g = _padded(g, side - r, side - r)
  index = jnp.arange(side)

  def body(j, carry):
    trailing, lower, inverse = carry
    column = jax.lax.dynamic_slice_in_dim(trailing, j * BLOCK, BLOCK, axis=-1)
    diagonal_inverse = invert(
        jnp.linalg.cholesky(
            jax.lax.dynamic_slice_in_dim(column, j * BLOCK, BLOCK, axis=-2)
        )
    )
    below = mm("...ib,...cb->...ic", column, diagonal_inverse)
    below = jnp.where(index[:, None] >= (j + 1) * BLOCK, below, 0)
    trailing = trailing - mm("...ib,...jb->...ij", below, below)
    lower = jax.lax.dynamic_update_slice_in_dim(
        lower, below, j * BLOCK, axis=-1
    )
    left = jax.lax.dynamic_slice_in_dim(lower, j * BLOCK, BLOCK, axis=-2)
    left = jnp.where(index < j * BLOCK, left, 0)
    row = -mm(
        "...ab,...bj->...aj",
        diagonal_inverse,
        mm("...bc,...cj->...bj", left, inverse),
    )
    row = jax.lax.dynamic_update_slice_in_dim(
        row, diagonal_inverse, j * BLOCK, axis=-1
    )
    inverse = jax.lax.dynamic_update_slice_in_dim(
        inverse, row, j * BLOCK, axis=-2
    )
    return trailing, lower, inverse

  zeros = jnp.zeros_like(g)
  _, _, inverse = jax.lax.fori_loop(0, count, body, (g, zeros, zeros))
  return inverse[..., :r, :r]
