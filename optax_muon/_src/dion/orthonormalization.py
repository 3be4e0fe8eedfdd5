"""Dion's orthonormalization of P for every matrix of a step at once, as each
device runs it (local blocks, collectives by mesh-axis name).

Randomized Cholesky-QR: a sketch S·P (k × r, k = oversample·r rows of a
Gaussian S; P's own rows where P has no more rows than that) gives R₁, the R
factor of its QR, and P₁ = P·R₁⁻¹ is well conditioned whatever P's conditioning;
one Cholesky-QR finishes: G = P₁ᵀP₁ = LLᵀ, P₂ = P₁·L⁻ᵀ. P₂ = P·T with T upper
triangular, so P₂ is P's Gram–Schmidt basis up to column signs.

Matrices whose rows are split over devices are orthonormalized in one of two
ways, per class of matrices of the same shape, rank and row axes (stacked from
every leaf), whichever moves fewer bytes:

* exchanged: an all-to-all over the row axes gives each device of the row
  group whole P's of its share of the stack, which it orthonormalizes alone;
  a second all-to-all returns the rows (2·m·r values per matrix, shared out
  over the group: the better choice unless the rank is low and the row group
  small);
* summed: each device multiplies its rows, the sketches and Gram matrices (k·r
  and r² values per matrix) are all-reduced over the row axes, and every device
  of the group factorizes them all.

The sketch S of a leaf is drawn whole from the leaf's key on every path, so
the result does not depend on the mesh. The factorizations are
``dion.factorizations``' blocked ones.
"""

from __future__ import annotations

import math
from collections import defaultdict

import jax
import jax.numpy as jnp

from optax_muon._src.dion import factorizations
from optax_muon._src.dion.matrix import DionMatrix

#: Diagonal entries of the sketch's R below this fraction of its largest are
#: raised to it: a rank-deficient P then gives finite (zero or bounded) columns
#: instead of infinities.
DIAGONAL_FLOOR = 1e-6
#: The Cholesky factorization of the Gram matrix G is taken of G + ε·(tr G /
#: r)·I.
CHOLESKY_SHIFT = 1e-6

_HIGHEST = jax.lax.Precision.HIGHEST


def _mm(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(subscripts, a, b, precision=_HIGHEST)


def _whole_rows(matrix: DionMatrix, p: jax.Array) -> jax.Array:
  """P's local rows (batch…, rows…, r) placed in zeros of all of P's rows:
  summed over the row axes, P itself."""
  whole = tuple(matrix.local(d) for d in matrix.batch_dims) + tuple(
      matrix.view[d] for d in matrix.row_dims
  )
  return jax.lax.dynamic_update_slice(
      jnp.zeros(whole + (matrix.rank,), p.dtype),
      p,
      [0] * matrix.batch + _row_offsets(matrix) + [0],
  )


def _rows(matrix: DionMatrix, local: bool) -> tuple[int, ...]:
  return tuple(
      matrix.local(d) if local else matrix.view[d] for d in matrix.row_dims
  )


def _row_offsets(matrix: DionMatrix) -> list[jax.Array | int]:
  """Where this device's block starts along each row axis of the view."""
  return [
      jax.lax.axis_index(matrix.dim_axes[d]) * matrix.local(d)
      if matrix.dim_axes[d]
      else 0
      for d in matrix.row_dims
  ]


def _sketch_matrix(matrix: DionMatrix, key: jax.Array, dtype) -> jax.Array:
  """The leaf's Gaussian sketch S, (k, rows…), whole."""
  return jax.random.normal(key, (matrix.sketch,) + _rows(matrix, False), dtype)


def _whole(p: jax.Array, sketches: jax.Array | None) -> jax.Array:
  """Orthonormalized whole P's (c, m, r), each with its sketch (c, k, m) (None:
  the identity)."""
  sp = p if sketches is None else _mm("ctm,cmr->ctr", sketches, p)
  p1 = _mm("cmr,crs->cms", p, sketch_inverse(sp))
  gram = _mm("cmr,cms->crs", p1, p1)
  return _mm("cmr,crs->cms", p1, cholesky_inverse(gram))


def sketch_inverse(sp: jax.Array) -> jax.Array:
  """T₁ = R₁⁻¹ with R₁ the R factor of S·P (its tiny diagonal entries raised),
  so that P·T₁ is well conditioned. (batch, k, r) → (batch, r, r)."""
  scale = jnp.max(jnp.abs(sp), axis=(-2, -1), keepdims=True)
  scale = jnp.where(scale > 0, scale, 1)
  r1 = factorizations.r_factor(sp / scale)
  diag = jnp.diagonal(r1, axis1=-2, axis2=-1)
  floor = DIAGONAL_FLOOR * jnp.max(jnp.abs(diag), axis=-1, keepdims=True)
  floor = jnp.where(floor > 0, floor, 1)
  raised = jnp.where(
      jnp.abs(diag) < floor, jnp.where(diag < 0, -floor, floor), diag
  )
  r1 = r1 + (raised - diag)[..., None] * jnp.eye(r1.shape[-1], dtype=r1.dtype)
  return factorizations.upper_inverse(r1) / scale


def cholesky_inverse(gram: jax.Array) -> jax.Array:
  """L⁻ᵀ with LLᵀ = G + ε·(tr G / r)·I. (batch, r, r) → (batch, r, r)."""
  trace = jnp.mean(jnp.diagonal(gram, axis1=-2, axis2=-1), axis=-1)[
      ..., None, None
  ]
  shift = CHOLESKY_SHIFT * jnp.where(trace > 0, trace, 1)
  lower = factorizations.cholesky(
      gram + shift * jnp.eye(gram.shape[-1], dtype=gram.dtype)
  )
  return jnp.swapaxes(factorizations.lower_inverse(lower), -1, -2)


def _exchanged(
    matrices: list[DionMatrix], ps: list[jax.Array], keys: list[jax.Array]
) -> list[jax.Array]:
  """One class of matrices, their rows split: whole P's to the devices of the
  row group by all-to-all, orthonormalized there, and their rows back."""
  first = matrices[0]
  local_rows, rows = _rows(first, True), _rows(first, False)
  stack = jnp.concatenate(
      [
          p.reshape((mx.local_batch,) + local_rows + (mx.rank,))
          for mx, p in zip(matrices, ps)
      ]
  )
  key_data = jnp.concatenate(
      [
          jnp.broadcast_to(
              jax.random.key_data(key), (mx.local_batch,) + key.shape + (2,)
          ).reshape(mx.local_batch, -1)
          for mx, key in zip(matrices, keys)
      ]
  )
  count = stack.shape[0]
  group = first.size(first.row_axes)
  padded = math.ceil(count / group) * group
  stack = jnp.pad(stack, [(0, padded - count)] + [(0, 0)] * (stack.ndim - 1))
  key_data = jnp.pad(key_data, [(0, padded - count), (0, 0)])
  chunk, split = 0, [
      (j, first.dim_axes[d]) for j, d in enumerate(first.row_dims)
  ]
  for j, axes in split:
    if axes:
      stack = jax.lax.all_to_all(stack, axes, 0, 1 + j, tiled=True)
      chunk = chunk * first.size(axes) + jax.lax.axis_index(axes)
  owned = padded // group
  # stack: (owned, rows…, r), these devices' matrices whole.
  sketches = None
  if not first.identity_sketch:
    mine = jax.lax.dynamic_slice_in_dim(key_data, chunk * owned, owned)
    keys_data = mine.reshape((owned,) + jax.random.key_data(keys[0]).shape)
    sketches = jax.vmap(
        lambda data: _sketch_matrix(
            first, jax.random.wrap_key_data(data), stack.dtype
        ).reshape(first.sketch, first.m)
    )(keys_data)
  done = _whole(stack.reshape(owned, first.m, first.rank), sketches)
  done = done.reshape((owned,) + rows + (first.rank,))
  for j, axes in reversed(split):
    if axes:
      done = jax.lax.all_to_all(done, axes, 1 + j, 0, tiled=True)
  out, start = [], 0
  for mx, p in zip(matrices, ps):
    out.append(done[start : start + mx.local_batch].reshape(p.shape))
    start += mx.local_batch
  return out


def _summed(
    matrices: list[DionMatrix], ps: list[jax.Array], keys: list[jax.Array]
) -> list[jax.Array]:
  """One class of matrices: each device multiplies its rows, the sketches' and
  Gram matrices' sums are all-reduced over the row axes and every device takes
  the factorizations of them all."""
  axes = matrices[0].row_axes
  per_matrix = lambda mx, t: t.reshape(
      tuple(mx.local(d) for d in mx.batch_dims) + t.shape[1:]
  )

  def factorized(parts, factorize):
    stacked = jnp.concatenate(parts)
    result = factorize(jax.lax.psum(stacked, axes) if axes else stacked)
    out, start = [], 0
    for part in parts:
      out.append(result[start : start + part.shape[0]])
      start += part.shape[0]
    return out

  sketches = []
  for mx, p, key in zip(matrices, ps, keys):
    if mx.identity_sketch:
      whole = jax.lax.dynamic_update_slice(
          jnp.zeros(
              tuple(mx.local(d) for d in mx.batch_dims)
              + _rows(mx, False)
              + (mx.rank,),
              p.dtype,
          ),
          p,
          [0] * mx.batch + _row_offsets(mx) + [0],
      )
      sketches.append(whole.reshape(mx.local_batch, mx.m, mx.rank))
      continue
    s = jax.lax.dynamic_slice(
        _sketch_matrix(mx, key, p.dtype),
        [0] + _row_offsets(mx),
        (mx.sketch,) + _rows(mx, True),
    )
    sketches.append(
        _mm(f"t{mx.i},{mx.b}{mx.i}r->{mx.b}tr", s, p).reshape(
            mx.local_batch, mx.sketch, mx.rank
        )
    )
  apply = lambda mx, p, t: _mm(
      f"{mx.b}{mx.i}r,{mx.b}rs->{mx.b}{mx.i}s", p, per_matrix(mx, t)
  )
  t1 = factorized(sketches, sketch_inverse)
  p1 = [apply(mx, p, t) for mx, p, t in zip(matrices, ps, t1)]
  grams = [
      _mm(f"{mx.b}{mx.i}r,{mx.b}{mx.i}s->{mx.b}rs", p, p).reshape(
          mx.local_batch, mx.rank, mx.rank
      )
      for mx, p in zip(matrices, p1)
  ]
  t2 = factorized(grams, cholesky_inverse)
  return [apply(mx, p, t) for mx, p, t in zip(matrices, p1, t2)]


def classes(matrices: list[DionMatrix]) -> list[list[int]]:
  """The leaves' positions grouped by what their orthonormalization stacks:
  the same rows (sizes and mesh axes), rank and sketch."""
  grouped = defaultdict(list)
  for k, mx in enumerate(matrices):
    rows = tuple((mx.view[d], mx.dim_axes[d]) for d in mx.row_dims)
    grouped[(rows, mx.rank, mx.sketch)].append(k)
  return list(grouped.values())


def exchange_pays(matrix: DionMatrix, count: int) -> bool:
  """Whether exchanging whole P's moves no more bytes than summing the sketches
  and Grams, for ``count`` such matrices on a device (ring model)."""
  group = matrix.size(matrix.row_axes)
  if group == 1:
    return False
  owned = math.ceil(count / group)
  exchanged = 2 * owned * matrix.m * matrix.rank * (group - 1) / group
  summed = 2 * count * (matrix.sketch + matrix.rank) * matrix.rank
  return exchanged <= summed * (group - 1) / group


def orthonormalize(
    matrices: list[DionMatrix], ps: list[jax.Array], keys: list[jax.Array]
) -> list[jax.Array]:
  """Orthonormal columns spanning those of each P, by randomized Cholesky-QR.

  Args:
    matrices: the leaves' static facts.
    ps: per leaf, this device's block of P, (batch…, rows…, r) in view order.
    keys: per leaf, the sketch's key for this step.

  Returns:
    Per leaf P₂ = P·T (T upper triangular), this device's block, with P₂ᵀP₂ = I
    for full-rank P; finite for any finite P (columns beyond P's rank come out
    small or zero).
  """
  out = [None] * len(ps)
  for members in classes(matrices):
    chosen = [matrices[k] for k in members]
    count = sum(mx.local_batch for mx in chosen)
    run = _exchanged if exchange_pays(chosen[0], count) else _summed
    for k, p in zip(
        members,
        run(chosen, [ps[k] for k in members], [keys[k] for k in members]),
    ):
      out[k] = p
  return out
