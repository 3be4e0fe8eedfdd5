"""Dion's orthonormalization of P for every matrix of a step at once, as each
device runs it (local blocks, collectives by mesh-axis name), from P's partial
sums.

Shifted Cholesky-QR, three passes (Fukaya et al. 2020): each pass forms G =
PᵀP, factorizes G + s·I = LLᵀ and replaces P by P·L⁻ᵀ. The first pass's shift
(``FIRST_SHIFT``·tr G) lets the factorization succeed for any P, rank-deficient
or ill conditioned, and brings P's condition number within reach of the two
plain passes that follow (their shift, ``SHIFT``·tr G per nonzero column of P,
only guards against rank deficiency; zero columns factorize as an identity
block). The result is P·T with T upper triangular and P·T
orthonormal: P's Gram–Schmidt basis, whatever the shifts. The passes are one
``lax.fori_loop`` body, so the compiler sees each product and factorization
once.

P = M·Q arrives as partial sums over the column axes (and, for a compressed
matrix, the replica axes): the *sum axes*. The matrices of a class (equal rows,
rank and axes, stacked from every leaf) are orthonormalized by the devices of
their *group*, each device doing a share of them, never all of them:

* rows split over row axes: the sums are all-reduced; the group is the row
  axes;
* rows whole: the sums are reduce-scattered along the rows over the sum axes,
  which become the group, and the rows are all-gathered at the end (together
  the bytes of the all-reduce they replace);
* neither: the device alone (its group is itself).

Within its group a class is orthonormalized in one of two ways, whichever moves
fewer bytes:

* exchanged: an all-to-all over the group gives each device whole P's of its
  share of the stack, which it orthonormalizes alone; a second all-to-all
  returns the rows (2·m·r values per matrix: the usual choice);
* summed: each device multiplies its rows and the Gram matrices are
  all-reduced over the group in each pass (3·r² values per matrix: the better
  choice at low rank on few row shards); every device of the group factorizes
  them all.

Exchanged classes of the same group share one *bucket*, where it costs at most
``MERGE_SLACK`` times the products of orthonormalizing them apart: the bucket's
matrices are dealt round the group's devices, each device's share zero-padded
to the bucket's largest rows and rank and stacked into ``slots`` matrices, so
that the compiler sees one Cholesky-QR whatever the shapes. Zero rows leave a
Gram matrix unchanged, and padded columns get an identity block, which the
factorization keeps apart, so each matrix comes out as it would alone.

The factorizations are ``dion.factorizations``' blocked ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import jax
import jax.numpy as jnp

from optax_muon._src.dion import factorizations
from optax_muon._src.dion.matrix import DionMatrix

#: Cholesky-QR passes (the first shifted).
PASSES = 3
#: The first pass factorizes G + FIRST_SHIFT·tr(G)·I: above the rounding
#: errors of a float32 Gram matrix, so that the factorization succeeds.
FIRST_SHIFT = 1e-4
#: The other passes factorize G + SHIFT·(tr G / k)·I, k the nonzero columns of
#: P (its zero columns: an identity block).
SHIFT = 1e-6
#: Classes share a bucket where its products cost at most this many times
#: theirs apart (one Cholesky-QR to compile instead of one per class).
MERGE_SLACK = 1.25


def pass_flops(m: int, r: int) -> float:
  """One Cholesky-QR pass of an m × r P: the Gram matrix and P·L⁻ᵀ (2·m·r²
  each), the Cholesky factor and its inverse (r³ each, leading terms)."""
  return 4 * m * r * r + 2 * r**3


# ---------------------------------------------------------------- the plan


def sum_axes(matrix: DionMatrix) -> tuple[str, ...]:
  """The mesh axes P's partial sums run over: the column axes, and the replica
  axes of a compressed matrix."""
  return matrix.col_axes + (matrix.replica_axes if matrix.compressed else ())


@dataclasses.dataclass(frozen=True)
class Class:
  """Matrices orthonormalized alike: the same rows (sizes and axes), rank and
  sum axes.

  Attributes:
    members: the leaves' positions.
    matrices: their facts.
    count: matrices on a device (Σ of the leaves' local batches).
    group: the mesh axes whose devices share the work (see the module).
    scattered: rows whole, the sums reduce-scattered along them over the group.
    exchanged: whole P's to their owners (else the Gram matrices are summed);
      True without a group.
  """

  members: tuple[int, ...]
  matrices: tuple[DionMatrix, ...]
  count: int
  group: tuple[str, ...]
  scattered: bool
  exchanged: bool

  @property
  def first(self) -> DionMatrix:
    return self.matrices[0]

  @property
  def size(self) -> int:
    """The group's devices."""
    return self.first.size(self.group) if self.first.mesh is not None else 1

  @property
  def m(self) -> int:
    """Rows per matrix (padded to a multiple of the group where scattered)."""
    m = self.first.m
    return -(-m // self.size) * self.size if self.scattered else m

  @property
  def rank(self) -> int:
    return self.first.rank


def local_count(matrix: DionMatrix) -> int:
  """The leaf's matrices on one device."""
  return matrix.local_batch if matrix.mesh is not None else matrix.count


def exchange_pays(m: int, rank: int, group: int, count: int) -> bool:
  """Whether exchanging whole P's moves no more bytes than summing the Gram
  matrices, for ``count`` m × ``rank`` matrices on a device shared out over
  ``group`` devices (ring model)."""
  if group == 1:
    return True
  # Both ring bytes carry the factor (group − 1)/group: all-to-all 2·m·r per
  # matrix this device owns, all-reduces 2·r² per matrix and pass.
  return math.ceil(count / group) * m <= PASSES * count * rank


def classes(matrices: list[DionMatrix]) -> list[Class]:
  """The leaves grouped by how they are orthonormalized."""
  grouped = defaultdict(list)
  for k, mx in enumerate(matrices):
    rows = tuple((mx.view[d], mx.dim_axes[d]) for d in mx.row_dims)
    grouped[(rows, mx.rank, sum_axes(mx), mx.replicas)].append(k)
  out = []
  for members in grouped.values():
    chosen = tuple(matrices[k] for k in members)
    first = chosen[0]
    count = sum(local_count(mx) for mx in chosen)
    split = first.mesh is not None and first.size(first.row_axes) > 1
    summing = first.mesh is not None and first.size(sum_axes(first)) > 1
    group = first.row_axes if split else sum_axes(first) if summing else ()
    c = Class(tuple(members), chosen, count, group, summing and not split, True)
    exchanged = exchange_pays(c.m, c.rank, c.size, count)
    out.append(dataclasses.replace(c, exchanged=exchanged))
  return out


@dataclasses.dataclass(frozen=True)
class Bucket:
  """Classes orthonormalized together (one class where its Gram matrices are
  summed).

  The bucket's matrices, class after class, are numbered i = 0, 1, …; matrix i
  goes to device i mod g of the group (g devices), into slot i // g.
  """

  classes: tuple[Class, ...]

  @property
  def size(self) -> int:
    return self.classes[0].size

  @property
  def exchanged(self) -> bool:
    return self.classes[0].exchanged

  @property
  def total(self) -> int:
    return sum(c.count for c in self.classes)

  @property
  def slots(self) -> int:
    """Matrices each device of the group orthonormalizes."""
    return -(-self.total // self.size)

  @property
  def m(self) -> int:
    return max(c.m for c in self.classes)

  @property
  def rank(self) -> int:
    return max(c.rank for c in self.classes)

  def flops(self) -> float:
    """The products of one device's Cholesky-QR passes."""
    if not self.exchanged:
      (c,) = self.classes
      return c.count * PASSES * pass_flops(c.m // c.size, c.rank)
    return self.slots * PASSES * pass_flops(self.m, self.rank)

  def start(self, index: int) -> int:
    """The number of the first matrix of class ``index``."""
    return sum(c.count for c in self.classes[:index])

  def dealt(self, index: int, stack: jax.Array) -> jax.Array:
    """Class ``index``'s stack (count, …) as a device sends it: (g·slots, …),
    matrix i at (i mod g)·slots + i // g, zeros elsewhere."""
    start, count = self.start(index), self.classes[index].count
    whole = self.slots * self.size
    rest = [(0, 0)] * (stack.ndim - 1)
    x = jnp.pad(stack, [(start, whole - start - count)] + rest)
    x = x.reshape((self.slots, self.size) + stack.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape((whole,) + stack.shape[1:])

  def collected(self, index: int, dealt: jax.Array) -> jax.Array:
    """The inverse of ``dealt``: class ``index``'s matrices from a stack laid
    out like it."""
    start, count = self.start(index), self.classes[index].count
    x = dealt.reshape((self.size, self.slots) + dealt.shape[1:])
    x = jnp.swapaxes(x, 0, 1).reshape(dealt.shape)
    return x[start : start + count]

  def returns(self) -> list[tuple[int, ...]]:
    """The classes (by index) whose rows go back by the same all-to-alls: the
    same whole rows, rank and exchanges (one return moves them all)."""
    same = defaultdict(list)
    for k, c in enumerate(self.classes):
      same[(_whole_rows(c), c.rank, tuple(_row_exchanges(c)))].append(k)
    return [tuple(ks) for ks in same.values()]


def _separate_flops(chosen: list[Class]) -> float:
  return sum(Bucket((c,)).flops() for c in chosen)


def buckets(matrices: list[DionMatrix]) -> list[Bucket]:
  """The classes of ``matrices`` in buckets: exchanged classes of a group
  together where that costs at most ``MERGE_SLACK`` times their products
  apart (the costliest matrices first), the others alone."""
  out, open_ = [], defaultdict(list)
  ranked = sorted(
      classes(matrices),
      key=lambda c: -pass_flops(c.m, c.rank),
  )
  for c in ranked:
    if not c.exchanged:
      out.append([c])
      continue
    for bucket in open_[c.group]:
      merged = Bucket(tuple(bucket) + (c,))
      if merged.flops() <= MERGE_SLACK * _separate_flops(bucket + [c]):
        bucket.append(c)
        break
    else:
      open_[c.group].append([c])
      out.append(open_[c.group][-1])
  return [Bucket(tuple(b)) for b in out]


# ------------------------------------------------------------ the arithmetic


def _mm(subscripts: str, a: jax.Array, b: jax.Array, precision: Any):
  return jnp.einsum(subscripts, a, b, precision=precision)


def gram_inverse(
    gram: jax.Array,
    first: jax.Array | bool,
    precision: Any = jax.lax.Precision.HIGHEST,
) -> jax.Array:
  """L⁻ᵀ with LLᵀ = G + s·I over P's nonzero columns (s by the pass: ``first``
  or not; the later passes' s per nonzero column) and an identity block over
  its zero columns (zero padding among them), which the factorization keeps
  apart: each matrix comes out as it would without padding. (batch, r, r) →
  (batch, r, r)."""
  diagonal = jnp.diagonal(gram, axis1=-2, axis2=-1)
  live = diagonal > 0
  trace = jnp.sum(diagonal, axis=-1)[..., None]
  columns = jnp.maximum(jnp.sum(live, axis=-1), 1)[..., None]
  shift = jnp.where(first, FIRST_SHIFT * trace, SHIFT * trace / columns)
  added = jnp.where(live, shift, 1.0)
  inverse = factorizations.inverse_cholesky(
      gram + added[..., None] * jnp.eye(gram.shape[-1], dtype=gram.dtype),
      precision,
  )
  return jnp.swapaxes(inverse, -1, -2)


def cholesky_qr(
    p: jax.Array,
    row_axes: tuple[str, ...] = (),
    precision: Any = jax.lax.Precision.HIGHEST,
) -> jax.Array:
  """Shifted Cholesky-QR of a stack (c, rows, r) of P's: each device's rows of
  them, their Gram matrices summed over ``row_axes`` (none: the rows are
  whole). Whole rows loop over the passes (one body to compile); summed ones
  take them one after the other, so that no collective sits inside a loop."""

  def one_pass(k, p):
    gram = _mm("cmr,cms->crs", p, p, precision)
    if row_axes:
      gram = jax.lax.psum(gram, row_axes)
    inverse = gram_inverse(gram, k == 0, precision)
    return _mm("cmr,crs->cms", p, inverse, precision)

  if not row_axes:
    return jax.lax.fori_loop(0, PASSES, one_pass, p)
  for k in range(PASSES):
    p = one_pass(k, p)
  return p


# ------------------------------------------------------------ the movements


def _stacked(c: Class, partials: list[jax.Array]) -> jax.Array:
  """A class's P's stacked: (count, local rows…, r); where scattered, summed
  and reduce-scattered along the (zero-padded) rows: (count, m / g, r)."""
  first = c.first
  rows = tuple(first.local(d) for d in first.row_dims)
  stack = jnp.concatenate(
      [
          p.reshape((local_count(mx),) + rows + (c.rank,))
          for mx, p in zip(c.matrices, partials)
      ]
  )
  axes = sum_axes(first) if first.mesh is not None else ()
  if c.scattered:
    stack = stack.reshape(c.count, first.m, c.rank)
    stack = jnp.pad(stack, [(0, 0), (0, c.m - first.m), (0, 0)])
    stack = jax.lax.psum_scatter(stack, axes, scatter_dimension=1, tiled=True)
  elif axes:
    stack = jax.lax.psum(stack, axes)
  if first.compressed:
    stack = stack / first.replicas
  return stack


def _unstacked(
    c: Class, done: jax.Array, partials: list[jax.Array]
) -> list[jax.Array]:
  """The inverse of ``_stacked`` (rows all-gathered where scattered)."""
  if c.scattered:
    done = _all_gather_replicated(done, c.group, 1)[:, : c.first.m]
  out, start = [], 0
  for mx, p in zip(c.matrices, partials):
    size = local_count(mx)
    out.append(done[start : start + size].reshape(p.shape))
    start += size
  return out


def _all_gather_replicated(
    x: jax.Array, axes: tuple[str, ...], axis: int
) -> jax.Array:
  """``x`` all-gathered along ``axis`` over ``axes``, typed as the same on
  every device of them (inside a ``shard_map`` that checks replication)."""
  if hasattr(jax.lax, "all_gather_invariant"):  # jax < 0.8
    return jax.lax.all_gather_invariant(x, axes, axis=axis, tiled=True)
  return jax.lax.all_gather(x, axes, axis=axis, tiled=True, to="invarying")


def _row_exchanges(c: Class) -> list[tuple[int, tuple[str, ...]]]:
  """(stack axis of a row, mesh axes) of the all-to-alls that make rows
  whole."""
  if c.scattered:
    return [(1, c.group)]
  first = c.first
  return [
      (1 + j, first.dim_axes[d])
      for j, d in enumerate(first.row_dims)
      if first.mesh is not None and first.dim_axes[d]
  ]


def _run_exchanged(
    bucket: Bucket, partials: list[list[jax.Array]], precision: Any
) -> list[list[jax.Array]]:
  """One bucket: each device's share of whole P's, stacked and padded to the
  bucket's shape, orthonormalized in one Cholesky-QR, and their rows back."""
  slots, m, rank = bucket.slots, bucket.m, bucket.rank
  sent = [_stacked(c, ps) for c, ps in zip(bucket.classes, partials)]
  owned = jnp.zeros((slots, m, rank), sent[0].dtype)
  for k, (c, stack) in enumerate(zip(bucket.classes, sent)):
    placed = bucket.dealt(k, stack)
    for axis, axes in _row_exchanges(c):
      placed = jax.lax.all_to_all(placed, axes, 0, axis, tiled=True)
    placed = placed.reshape(slots, c.m, c.rank)
    owned = owned + jnp.pad(
        placed.astype(owned.dtype), [(0, 0), (0, m - c.m), (0, rank - c.rank)]
    )
  done = cholesky_qr(owned, precision=precision)
  out = [None] * len(bucket.classes)
  for ks in bucket.returns():
    c = bucket.classes[ks[0]]
    back = done[:, : c.m, : c.rank].astype(sent[ks[0]].dtype)
    back = back.reshape((slots,) + _whole_rows(c) + (c.rank,))
    for axis, axes in reversed(_row_exchanges(c)):
      back = jax.lax.all_to_all(back, axes, axis, 0, tiled=True)
    for k in ks:
      c = bucket.classes[k]
      out[k] = _unstacked(c, bucket.collected(k, back), partials[k])
  return out


def _whole_rows(c: Class) -> tuple[int, ...]:
  """A P's rows as the all-to-alls make them whole."""
  if c.scattered:
    return (c.m,)
  return tuple(c.first.view[d] for d in c.first.row_dims)


def _run_summed(
    bucket: Bucket, partials: list[list[jax.Array]], precision: Any
) -> list[list[jax.Array]]:
  """One class: each device multiplies its rows, the Gram matrices are
  all-reduced over the group, every device of the group factorizes them
  all."""
  (c,), (ps,) = bucket.classes, partials
  stack = _stacked(c, ps)
  done = cholesky_qr(
      stack.reshape(c.count, c.m // c.size, c.rank),
      row_axes=c.group,
      precision=precision,
  )
  return [_unstacked(c, done.reshape(stack.shape), ps)]


def orthonormalize(
    matrices: list[DionMatrix], partials: list[jax.Array]
) -> list[jax.Array]:
  """Orthonormal columns spanning those of each P, by shifted Cholesky-QR.

  Args:
    matrices: the leaves' static facts.
    partials: per leaf, this device's block of P's partial sums over
      ``sum_axes`` (batch…, local rows…, r) in view order.

  Returns:
    Per leaf P·T (T upper triangular) with P summed (averaged over the
    replicas for a compressed matrix), this device's block (rows split like
    the param's, whole along the sum axes), with (P·T)ᵀ(P·T) = I for
    full-rank P; finite for any finite P (columns beyond P's rank come out
    small or zero).
  """
  out = [None] * len(partials)
  for bucket in buckets(matrices):
    run = _run_exchanged if bucket.exchanged else _run_summed
    chosen = [[partials[k] for k in c.members] for c in bucket.classes]
    precision = bucket.classes[0].first.orthonormal_precision
    for c, ps in zip(bucket.classes, run(bucket, chosen, precision)):
      for k, p in zip(c.members, ps):
        out[k] = p
  return out
