"""Dion's orthonormalization of P for every matrix of a step at once, as each
device runs it (local blocks, collectives by mesh-axis name).

Shifted Cholesky-QR, three passes (Fukaya et al. 2020): each pass forms G =
PᵀP, factorizes G + s·I = LLᵀ and replaces P by P·L⁻ᵀ. The first pass's shift
(``FIRST_SHIFT``·tr G) lets the factorization succeed for any P, rank-deficient
or ill conditioned, and brings P's condition number within reach of the two
plain passes that follow (their shift, ``SHIFT``·tr G / r, only guards against
rank deficiency). The result is P·T with T upper triangular and P·T
orthonormal: P's Gram–Schmidt basis, whatever the shifts. The passes are one
``lax.fori_loop`` body, so the compiler sees each product and factorization
once.

Matrices whose rows are split over devices are orthonormalized in one of two
ways, per class of matrices of the same shape, rank and row axes (stacked from
every leaf, so that nothing is repeated per leaf), whichever moves fewer bytes:

* exchanged: an all-to-all over the row axes gives each device of the row
  group whole P's of its share of the stack, which it orthonormalizes alone;
  a second all-to-all returns the rows (2·m·r values per matrix, shared out
  over the group: the usual choice);
* summed: each device multiplies its rows and the Gram matrices are
  all-reduced over the row axes in each pass (3·r² values per matrix: the
  better choice at low rank on few row shards); every device of the group
  factorizes them all.

The factorizations are ``dion.factorizations``' blocked ones.
"""

from __future__ import annotations

import math
from collections import defaultdict

import jax
import jax.numpy as jnp

from optax_muon._src.dion import factorizations
from optax_muon._src.dion.matrix import DionMatrix

#: Cholesky-QR passes (the first shifted).
PASSES = 3
#: The first pass factorizes G + FIRST_SHIFT·tr(G)·I: above the rounding
#: errors of a float32 Gram matrix, so that the factorization succeeds.
FIRST_SHIFT = 1e-4
#: The other passes factorize G + SHIFT·(tr G / r)·I (an exactly zero G: I).
SHIFT = 1e-6

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(subscripts, a, b, precision=_HIGHEST)


def gram_inverse(gram: jax.Array, first: jax.Array | bool) -> jax.Array:
  """L⁻ᵀ with LLᵀ = G + s·I (s by the pass: ``first`` or not).
  (batch, r, r) → (batch, r, r)."""
  trace = jnp.sum(jnp.diagonal(gram, axis1=-2, axis2=-1), axis=-1)[
      ..., None, None
  ]
  trace = jnp.where(trace > 0, trace, gram.shape[-1])
  shift = jnp.where(first, FIRST_SHIFT, SHIFT / gram.shape[-1]) * trace
  lower = factorizations.cholesky(
      gram + shift * jnp.eye(gram.shape[-1], dtype=gram.dtype)
  )
  return jnp.swapaxes(factorizations.lower_inverse(lower), -1, -2)


def cholesky_qr(p: jax.Array, row_axes: tuple[str, ...] = ()) -> jax.Array:
  """Shifted Cholesky-QR of a stack (c, rows, r) of P's: each device's rows of
  them, their Gram matrices summed over ``row_axes`` (none: the rows are
  whole). Whole rows loop over the passes (one body to compile); summed ones
  take them one after the other, so that no collective sits inside a loop."""

  def one_pass(k, p):
    gram = _mm("cmr,cms->crs", p, p)
    if row_axes:
      gram = jax.lax.psum(gram, row_axes)
    return _mm("cmr,crs->cms", p, gram_inverse(gram, k == 0))

  if not row_axes:
    return jax.lax.fori_loop(0, PASSES, one_pass, p)
  for k in range(PASSES):
    p = one_pass(k, p)
  return p


def _rows(matrix: DionMatrix, local: bool) -> tuple[int, ...]:
  return tuple(
      matrix.local(d) if local else matrix.view[d] for d in matrix.row_dims
  )


def _stacked(matrices: list[DionMatrix], ps: list[jax.Array]) -> jax.Array:
  """One class's P's stacked: (Σ local batch, local rows…, r)."""
  first = matrices[0]
  return jnp.concatenate(
      [
          p.reshape((mx.local_batch,) + _rows(first, True) + (mx.rank,))
          for mx, p in zip(matrices, ps)
      ]
  )


def _unstacked(
    done: jax.Array, matrices: list[DionMatrix], ps: list[jax.Array]
) -> list[jax.Array]:
  out, start = [], 0
  for mx, p in zip(matrices, ps):
    out.append(done[start : start + mx.local_batch].reshape(p.shape))
    start += mx.local_batch
  return out


def _exchanged(
    matrices: list[DionMatrix], ps: list[jax.Array]
) -> list[jax.Array]:
  """One class of matrices, their rows split: whole P's to the devices of the
  row group by all-to-all, orthonormalized there, and their rows back."""
  first = matrices[0]
  stack = _stacked(matrices, ps)
  count = stack.shape[0]
  group = first.size(first.row_axes)
  padded = math.ceil(count / group) * group
  stack = jnp.pad(stack, [(0, padded - count)] + [(0, 0)] * (stack.ndim - 1))
  split = [(j, first.dim_axes[d]) for j, d in enumerate(first.row_dims)]
  for j, axes in split:
    if axes:
      stack = jax.lax.all_to_all(stack, axes, 0, 1 + j, tiled=True)
  # stack: (padded / group, rows…, r): this device's share, whole.
  done = cholesky_qr(stack.reshape(padded // group, first.m, first.rank))
  done = done.reshape(stack.shape)
  for j, axes in reversed(split):
    if axes:
      done = jax.lax.all_to_all(done, axes, 1 + j, 0, tiled=True)
  return _unstacked(done[:count], matrices, ps)


def _summed(matrices: list[DionMatrix], ps: list[jax.Array]) -> list[jax.Array]:
  """One class of matrices: each device multiplies its rows, the Gram matrices
  are all-reduced over the row axes, every device factorizes them all."""
  first = matrices[0]
  stack = _stacked(matrices, ps)
  done = cholesky_qr(
      stack.reshape(stack.shape[0], first.local_m, first.rank), first.row_axes
  )
  return _unstacked(done.reshape(stack.shape), matrices, ps)


def classes(matrices: list[DionMatrix]) -> list[list[int]]:
  """The leaves' positions grouped by what their orthonormalization stacks:
  the same rows (sizes and mesh axes) and rank."""
  grouped = defaultdict(list)
  for k, mx in enumerate(matrices):
    rows = tuple((mx.view[d], mx.dim_axes[d]) for d in mx.row_dims)
    grouped[(rows, mx.rank)].append(k)
  return list(grouped.values())


def exchange_pays(matrix: DionMatrix, count: int) -> bool:
  """Whether exchanging whole P's moves no more bytes than summing the Gram
  matrices, for ``count`` such matrices on a device (ring model)."""
  group = matrix.size(matrix.row_axes)
  if group == 1:
    return False
  # Both ring bytes carry the factor (group − 1)/group: all-to-all 2·m·r per
  # matrix this device owns, all-reduces 2·r² per matrix and pass.
  owned = math.ceil(count / group)
  return owned * matrix.m <= PASSES * count * matrix.rank


def orthonormalize(
    matrices: list[DionMatrix], ps: list[jax.Array]
) -> list[jax.Array]:
  """Orthonormal columns spanning those of each P, by shifted Cholesky-QR.

  Args:
    matrices: the leaves' static facts.
    ps: per leaf, this device's block of P, (batch…, rows…, r) in view order.

  Returns:
    Per leaf P·T (T upper triangular), this device's block, with (P·T)ᵀ(P·T) =
    I for full-rank P; finite for any finite P (columns beyond P's rank come
    out small or zero).
  """
  out = [None] * len(ps)
  for members in classes(matrices):
    chosen = [matrices[k] for k in members]
    count = sum(mx.local_batch for mx in chosen)
    run = _exchanged if exchange_pays(chosen[0], count) else _summed
    for k, p in zip(members, run(chosen, [ps[k] for k in members])):
      out[k] = p
  return out
