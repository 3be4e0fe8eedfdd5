"""The small factorizations of Dion's orthonormalization, blocked so that they
compile in bounded time.

Dion orthonormalizes P through r × r factorizations: Cholesky factors and their
triangular inverses. XLA's own expansions of these on TPUs grow with r and with
the batch: at r = 1024 a Householder QR, a Cholesky factorization and two
triangular inverses take the TPU compiler about 23 CPU seconds, a batch of 32
of them minutes. Here each factorization of a side longer than ``BLOCK`` is a
``lax.fori_loop`` over column (or row) blocks of ``BLOCK``, whose body calls the
library only on ``BLOCK``-sized pieces and otherwise multiplies matrices: the
compiler sees one body per shape, whatever r and the batch. Sides up to
``BLOCK`` call the library directly.

Every function takes a batch of matrices in its leading axes. Sides that are not
a multiple of ``BLOCK`` are padded with an identity block, which every one of
these factorizations keeps apart from the matrix (the padded result is the
result beside an identity).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The side of the pieces the library factorizes (the TPU's matrix unit).
BLOCK = 128

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(subscripts, a, b, precision=_HIGHEST)


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


def cholesky(g: jax.Array) -> jax.Array:
  """The lower Cholesky factor L of a symmetric positive definite ``g``, (…, r,
  r); right-looking by blocks of columns (NaN where ``g`` is not positive
  definite, as the library's)."""
  r = g.shape[-1]
  if r <= BLOCK:
    return jnp.linalg.cholesky(g)
  side, count = _blocks(r)
  g = _padded(g, side - r, side - r)
  rows = jnp.arange(side)[:, None]

  def body(j, carry):
    trailing, lower = carry
    column = jax.lax.dynamic_slice_in_dim(trailing, j * BLOCK, BLOCK, axis=-1)
    diagonal = jnp.linalg.cholesky(
        jax.lax.dynamic_slice_in_dim(column, j * BLOCK, BLOCK, axis=-2)
    )
    # L_ij = A_ij · L_jj⁻ᵀ for the rows below block j.
    below = jax.lax.linalg.triangular_solve(
        diagonal, column, left_side=False, lower=True, transpose_a=True
    )
    below = jnp.where(rows >= (j + 1) * BLOCK, below, 0)
    trailing = trailing - _mm("...ib,...jb->...ij", below, below)
    column = jax.lax.dynamic_update_slice_in_dim(
        below, diagonal, j * BLOCK, axis=-2
    )
    return trailing, jax.lax.dynamic_update_slice_in_dim(
        lower, column, j * BLOCK, axis=-1
    )

  _, lower = jax.lax.fori_loop(0, count, body, (g, jnp.zeros_like(g)))
  return lower[..., :r, :r]


def lower_inverse(lower: jax.Array) -> jax.Array:
  """L⁻¹ of a lower triangular ``lower`` (…, r, r), by blocks of rows: row block
  i of the inverse is −L_ii⁻¹·L_i,<i·X_<i, with X_<i the rows found before."""
  r = lower.shape[-1]
  eye = jnp.eye(min(r, BLOCK), dtype=lower.dtype)
  solve = lambda l: jax.lax.linalg.triangular_solve(
      l, jnp.broadcast_to(eye, l.shape), left_side=True, lower=True
  )
  if r <= BLOCK:
    return solve(lower)
  side, count = _blocks(r)
  lower = _padded(lower, side - r, side - r)
  columns = jnp.arange(side)

  def body(i, inverse):
    row = jax.lax.dynamic_slice_in_dim(lower, i * BLOCK, BLOCK, axis=-2)
    diagonal = solve(
        jax.lax.dynamic_slice_in_dim(row, i * BLOCK, BLOCK, axis=-1)
    )
    left = jnp.where(columns < i * BLOCK, row, 0)
    row = -_mm(
        "...ab,...bj->...aj",
        diagonal,
        _mm("...bc,...cj->...bj", left, inverse),
    )
    row = jax.lax.dynamic_update_slice_in_dim(row, diagonal, i * BLOCK, axis=-1)
    return jax.lax.dynamic_update_slice_in_dim(inverse, row, i * BLOCK, axis=-2)

  inverse = jax.lax.fori_loop(0, count, body, jnp.zeros_like(lower))
  return inverse[..., :r, :r]
