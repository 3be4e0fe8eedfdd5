"""One Dion step on one leaf, where the leaf lies: every product on the local
blocks.

A leaf is seen as ``batch`` matrices of ``rows × cols`` (the layout's
Newton–Schulz orientation: rows the short side), without reshaping: it is
transposed to the axis order (batch axes, row axes, column axes), which moves
nothing between devices, and every product is an ``einsum`` over those axes.
With r the rank, per matrix::

  M = B + G                (rows × cols, sharded like the param)
  P = M·Q                  (rows × r: sharded like the rows)
  P ← orthonormalize(P)    (randomized Cholesky-QR)
  R = Mᵀ·P                 (cols × r: sharded like the columns)
  B ← M − (1 − μ)·P·Rᵀ     (error feedback)
  Q ← R, unit columns      (the state keeps the old Q for zero columns)
  direction = P·Qᵀ         (zero columns of R contribute nothing)

Each product's output sharding is stated (``out_sharding`` on Explicit meshes, a
sharding constraint on Auto meshes), so the partitioner contracts local blocks
and sums the small partial results (P and R, the r × r Grams, the column norms)
instead of gathering M. Inside a ``shard_map`` the leaves are the local blocks
and the same sums are ``psum``s by axis name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax_muon._src.core.matrices import MatrixLayout
from optax_muon._src.core.sharding import LeafSharding

#: Sketch rows per unit of rank in the randomized Cholesky-QR (microsoft/dion's
#: default).
OVERSAMPLE = 1.25
#: Diagonal entries of the sketch's R below this fraction of its largest are
#: raised to it:
#: a rank-deficient P then gives finite (zero or bounded) columns instead of
#: infinities.
DIAGONAL_FLOOR = 1e-6
#: The Cholesky factorization of the Gram matrix G is taken of G + ε·(tr G /
#: r)·I.
CHOLESKY_SHIFT = 1e-6

_BATCH, _ROWS, _COLS = "abcdefg", "hijkl", "mnopq"
_HIGHEST = jax.lax.Precision.HIGHEST


def rank_of(fraction: float, layout: MatrixLayout) -> int:
  """The rank for a matrix: ``ceil(fraction · min(m, n))``, at least 1 (0 for
  empty)."""
  short = min(layout.n_in, layout.n_out)
  if short == 0:
    return 0
  return min(short, max(1, math.ceil(fraction * short - 1e-9)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DionMatrix:
  """Static facts of one leaf for Dion: its axes, its rank and where its
  products live.

  Attributes:
    path: the leaf's path, for messages.
    perm: the leaf's axes in the order (batch axes, row axes, column axes).
    view: the leaf's shape in that order.
    batch, rows, cols: how many axes of each kind.
    rank: r.
    sketch: rows of the random sketch, ``ceil(oversample · r)``.
    dim_axes: per axis of ``view``, the mesh axes that split it (empty without
      sharding).
    mesh: the mesh, or None without sharding.
    manual: whether the arrays are local blocks (inside ``shard_map``).
    product_dtype: the operands' dtype of the four m × n × r products
      (accumulated in the state's dtype), or None: the state's dtype at full
      precision.
    power_iterations: subspace-iteration steps per optimizer step (Dion: 1).
  """

  path: str
  perm: tuple[int, ...]
  view: tuple[int, ...]
  batch: int
  rows: int
  cols: int
  rank: int
  sketch: int
  dim_axes: tuple[tuple[str, ...], ...]
  mesh: Any = None
  manual: bool = False
  product_dtype: Any = None
  power_iterations: int = 1

  @classmethod
  def of(
      cls,
      layout: MatrixLayout,
      sharding: LeafSharding | None,
      rank: int,
      *,
      oversample: float = OVERSAMPLE,
      manual: bool = False,
      product_dtype: Any = None,
      power_iterations: int = 1,
  ) -> DionMatrix:
    rows, cols = layout.reduction_axes, layout.output_axes
    if layout.transposed:
      rows, cols = cols, rows
    perm = layout.batch_axes + rows + cols
    if len(layout.batch_axes) > len(_BATCH) or max(len(rows), len(cols)) > len(
        _ROWS
    ):
      raise ValueError(
          f"{layout.path}: Dion takes up to {len(_BATCH)} batch axes and "
          f"{len(_ROWS)} axes per matrix side; got shape {layout.shape}."
      )
    dim_axes = tuple(
        () if sharding is None else sharding.dim_axes[a] for a in perm
    )
    return cls(
        path=layout.path,
        perm=perm,
        view=tuple(layout.shape[a] for a in perm),
        batch=len(layout.batch_axes),
        rows=len(rows),
        cols=len(cols),
        rank=rank,
        sketch=math.ceil(oversample * rank),
        dim_axes=dim_axes,
        mesh=None if sharding is None else sharding.mesh,
        manual=manual and sharding is not None,
        product_dtype=product_dtype,
        power_iterations=power_iterations,
    )

  @property
  def b(self) -> str:
    return _BATCH[: self.batch]

  @property
  def i(self) -> str:
    return _ROWS[: self.rows]

  @property
  def o(self) -> str:
    return _COLS[: self.cols]

  @property
  def m(self) -> int:
    """Rows per matrix."""
    return math.prod(self.view[self.batch : self.batch + self.rows])

  @property
  def n(self) -> int:
    """Columns per matrix."""
    return math.prod(self.view[self.batch + self.rows :])

  @property
  def row_dims(self) -> tuple[int, ...]:
    return tuple(range(self.batch, self.batch + self.rows))

  @property
  def col_dims(self) -> tuple[int, ...]:
    return tuple(range(self.batch + self.rows, len(self.view)))

  @property
  def q_shape(self) -> tuple[int, ...]:
    """The right factor Q: (batch…, cols…, r)."""
    return (
        self.view[: self.batch]
        + self.view[self.batch + self.rows :]
        + (self.rank,)
    )

  def spec(
      self, dims: tuple[int, ...], extra: int = 0, lead: int = 0
  ) -> PartitionSpec:
    """The PartitionSpec of an array with ``lead`` unsharded axes, then the view
    axes ``dims``, then ``extra`` unsharded axes."""
    entries = [()] * lead + [self.dim_axes[d] for d in dims] + [()] * extra
    return PartitionSpec(
        *[None if not a else a[0] if len(a) == 1 else a for a in entries]
    )

  @property
  def batch_dims(self) -> tuple[int, ...]:
    return tuple(range(self.batch))

  @property
  def explicit(self) -> bool:
    return self.mesh is not None and all(
        t == AxisType.Explicit for t in self.mesh.axis_types
    )

  def axes_of(self, dims: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh axes that split any of the view's ``dims``."""
    return tuple(sorted({a for d in dims for a in self.dim_axes[d]}))

  def _dims_of(self, letters: str) -> tuple[int, ...]:
    """The view dims that ``einsum`` letters name (r, s, t name none)."""
    starts = (
        (_BATCH, 0, self.batch),
        (_ROWS, self.batch, self.rows),
        (_COLS, self.batch + self.rows, self.cols),
    )
    return tuple(
        start + group.index(c)
        for c in letters
        for group, start, n in starts
        if c in group[:n]
    )

  def summed(self, x: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """Inside ``shard_map``: the sum of the partial results ``x`` over the
    devices that split the view's ``dims``; otherwise ``x``."""
    axes = self.axes_of(dims) if self.manual else ()
    return jax.lax.psum(x, axes) if axes else x

  def local_block(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """Inside ``shard_map``: this device's block of the whole array ``x`` laid
    out by ``spec``; otherwise ``x``."""
    if not self.manual:
      return x
    for axis, entry in enumerate(spec):
      if entry is None:
        continue
      names = (entry,) if isinstance(entry, str) else tuple(entry)
      size = x.shape[axis] // math.prod(self.mesh.shape[a] for a in names)
      x = jax.lax.dynamic_slice_in_dim(
          x, jax.lax.axis_index(names) * size, size, axis
      )
    return x

  def gathered(self, x: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    """Inside ``shard_map``: ``x`` whole along the view's ``dims`` (which must
    be ``x``'s axes of the same index); otherwise ``x``."""
    if not self.manual:
      return x
    for dim in dims:
      if self.dim_axes[dim]:
        x = jax.lax.all_gather(x, self.dim_axes[dim], axis=dim, tiled=True)
    return x

  def placed(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """``x`` laid out by ``spec`` (a no-op without a mesh or inside
    ``shard_map``)."""
    if self.mesh is None or self.manual:
      return x
    if self.explicit:
      return jax.sharding.reshard(x, NamedSharding(self.mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def einsum(
      self,
      subscripts: str,
      a: jax.Array,
      b: jax.Array,
      spec: PartitionSpec,
      large: bool = False,
  ) -> jax.Array:
    """``jnp.einsum`` whose output lies by ``spec``: contracted sharded axes are
    summed over their devices, nothing is gathered. ``large``: one of the four m
    × n × r products, whose operands go in at ``product_dtype`` where one is
    set."""
    kwargs = dict(precision=_HIGHEST)
    if large and self.product_dtype is not None:
      kwargs = dict(preferred_element_type=a.dtype)
      a, b = a.astype(self.product_dtype), b.astype(self.product_dtype)
    if self.mesh is None:
      return jnp.einsum(subscripts, a, b, **kwargs)
    if self.manual:
      inputs, output = subscripts.split("->")
      contracted = "".join(sorted(set(inputs.replace(",", "")) - set(output)))
      return self.summed(
          jnp.einsum(subscripts, a, b, **kwargs), self._dims_of(contracted)
      )
    if self.explicit:
      return jnp.einsum(
          subscripts,
          a,
          b,
          out_sharding=NamedSharding(self.mesh, spec),
          **kwargs,
      )
    return self.placed(jnp.einsum(subscripts, a, b, **kwargs), spec)

  def per_block(self, fn, x: jax.Array) -> jax.Array:
    """``fn`` of a (batch…, a, b) array that is whole on every device but for
    its batch axes, run on each device's batch block (``shard_map``): the
    partitioner then never has to split or gather a decomposition."""
    if self.mesh is None or self.manual:
      return fn(x)
    spec = self.spec(self.batch_dims, 2)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=spec, out_specs=spec)(x)

  def normal(
      self,
      key: jax.Array,
      shape: tuple[int, ...],
      dtype: Any,
      spec: PartitionSpec,
  ) -> jax.Array:
    """Standard normal values of the whole ``shape`` laid out by ``spec``
    (inside ``shard_map``: this device's block); the same values on any mesh."""
    if self.manual:
      return self.local_block(jax.random.normal(key, shape, dtype), spec)
    if self.explicit:
      return jax.random.normal(
          key, shape, dtype, out_sharding=NamedSharding(self.mesh, spec)
      )
    return self.placed(jax.random.normal(key, shape, dtype), spec)


def initial_q(matrix: DionMatrix, key: jax.Array, dtype: Any) -> jax.Array:
  """A random Q with unit columns, laid out like the param's columns."""
  q = matrix.normal(key, matrix.q_shape, dtype, _q_spec(matrix))
  return q / column_norms(q, matrix)


def column_norms(q: jax.Array, matrix: DionMatrix) -> jax.Array:
  """The Euclidean norm of each column of a (batch…, cols…, r) array, keeping
  its dims."""
  return jnp.sqrt(
      matrix.summed(
          jnp.sum(q * q, axis=_q_col_dims(matrix), keepdims=True),
          matrix.col_dims,
      )
  )


def _q_col_dims(matrix: DionMatrix) -> tuple[int, ...]:
  return tuple(range(matrix.batch, matrix.batch + matrix.cols))


def _q_spec(matrix: DionMatrix) -> PartitionSpec:
  return matrix.spec(matrix.batch_dims + matrix.col_dims, 1)


def _inverse_upper(r: jax.Array) -> jax.Array:
  """R⁻¹ of a batch of upper-triangular r × r matrices."""
  eye = jnp.broadcast_to(jnp.eye(r.shape[-1], dtype=r.dtype), r.shape)
  return jax.scipy.linalg.solve_triangular(r, eye, lower=False)


def _sketch_inverse(sp: jax.Array) -> jax.Array:
  """T₁ = R₁⁻¹ with R₁ the QR factor of S·P (its tiny diagonal entries raised),
  so that P·T₁ is well conditioned. (batch…, k, r) → (batch…, r, r)."""
  scale = jnp.max(jnp.abs(sp), axis=(-2, -1), keepdims=True)
  scale = jnp.where(scale > 0, scale, 1)
  r1 = jnp.linalg.qr(sp / scale, mode="r")
  diag = jnp.diagonal(r1, axis1=-2, axis2=-1)
  floor = DIAGONAL_FLOOR * jnp.max(jnp.abs(diag), axis=-1, keepdims=True)
  floor = jnp.where(floor > 0, floor, 1)
  raised = jnp.where(
      jnp.abs(diag) < floor, jnp.where(diag < 0, -floor, floor), diag
  )
  r1 = r1 + (raised - diag)[..., None] * jnp.eye(r1.shape[-1], dtype=r1.dtype)
  return _inverse_upper(r1) / scale


def _cholesky_inverse(gram: jax.Array) -> jax.Array:
  """L⁻ᵀ with LLᵀ = G + ε·(tr G / r)·I. (batch…, r, r) → (batch…, r, r)."""
  trace = jnp.mean(jnp.diagonal(gram, axis1=-2, axis2=-1), axis=-1)[
      ..., None, None
  ]
  shift = CHOLESKY_SHIFT * jnp.where(trace > 0, trace, 1)
  lower = jnp.linalg.cholesky(
      gram + shift * jnp.eye(gram.shape[-1], dtype=gram.dtype)
  )
  return _inverse_upper(jnp.swapaxes(lower, -1, -2))


def orthonormalize(
    p: jax.Array, key: jax.Array, matrix: DionMatrix
) -> jax.Array:
  """Orthonormal columns spanning those of ``p``, by randomized Cholesky-QR.

  Where P has no more rows than the sketch would (m ≤ k), P's rows are gathered
  and its Householder QR taken instead. Otherwise a Gaussian sketch S (k × rows,
  k = oversample·r) gives S·P, whose QR factor R₁ makes P₁ = P·R₁⁻¹ well
  conditioned whatever P's conditioning; one Cholesky-QR of P₁ then
  orthonormalizes it. Only k × r and r × r values cross devices (m × r with the
  QR).

  Args:
    p: (batch…, rows…, r), laid out like the param's rows.
    key: the sketch's key.
    matrix: the leaf's static facts.

  Returns:
    P₂ = P·T (T upper triangular) with P₂ᵀP₂ = I for full-rank P; finite for any
    finite P (columns beyond P's rank come out small or zero).
  """
  b, i = matrix.b, matrix.i
  small = matrix.spec(matrix.batch_dims, 2)
  p_spec = matrix.spec(matrix.batch_dims + matrix.row_dims, 1)
  if matrix.m <= matrix.sketch:
    # A sketch would be no shorter than P: gather P's rows (m·r values) and take
    # its QR.
    whole = matrix.gathered(
        matrix.placed(p, matrix.spec(matrix.batch_dims, matrix.rows + 1)),
        matrix.row_dims,
    )
    flat = whole.reshape(whole.shape[: matrix.batch] + (matrix.m, matrix.rank))
    q = matrix.per_block(lambda x: jnp.linalg.qr(x)[0], flat).reshape(
        whole.shape
    )
    return matrix.placed(
        matrix.local_block(q, matrix.spec(matrix.row_dims, 1, matrix.batch)),
        p_spec,
    )
  # 1. Sketch: S·P, summed over the row blocks.
  sketch = matrix.normal(
      key,
      (matrix.sketch,) + matrix.view[matrix.batch :][: matrix.rows],
      p.dtype,
      matrix.spec(matrix.row_dims, lead=1),
  )
  sp = matrix.einsum(f"t{i},{b}{i}r->{b}tr", sketch, p, small)
  # 2. P₁ = P·R₁⁻¹, R₁ the QR factor of S·P.
  p1 = matrix.einsum(
      f"{b}{i}r,{b}rs->{b}{i}s",
      p,
      matrix.per_block(_sketch_inverse, sp),
      p_spec,
  )
  # 3. Cholesky-QR of P₁: G = P₁ᵀP₁ = LLᵀ, P₂ = P₁·L⁻ᵀ.
  gram = matrix.einsum(f"{b}{i}r,{b}{i}s->{b}rs", p1, p1, small)
  return matrix.einsum(
      f"{b}{i}r,{b}rs->{b}{i}s",
      p1,
      matrix.per_block(_cholesky_inverse, gram),
      p_spec,
  )


def dion_step(
    grad: jax.Array,
    momentum: jax.Array,
    q: jax.Array,
    beta: Any,
    key: jax.Array,
    matrix: DionMatrix,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One Dion step of one leaf.

  Args:
    grad: the gradient, the leaf's shape.
    momentum: the buffer B, the leaf's shape and the state's dtype.
    q: the right factor, ``matrix.q_shape``.
    beta: μ, the momentum decay; may be traced.
    key: the sketch's key for this step and leaf.
    matrix: the leaf's static facts.

  Returns:
    (direction P·Qᵀ in the leaf's shape and the state's dtype, new B, new Q).
  """
  b, i, o = matrix.b, matrix.i, matrix.o
  back = tuple(sorted(range(len(matrix.perm)), key=lambda a: matrix.perm[a]))
  m_spec = matrix.spec(tuple(range(len(matrix.view))))
  p_spec = matrix.spec(matrix.batch_dims + matrix.row_dims, 1)
  q_spec = _q_spec(matrix)
  m = jnp.transpose(momentum, matrix.perm) + jnp.transpose(
      grad, matrix.perm
  ).astype(momentum.dtype)
  r = q
  for k in range(
      matrix.power_iterations
  ):  # P = orth(M·R), R = Mᵀ·P; R starts from Q
    p = matrix.einsum(f"{b}{i}{o},{b}{o}r->{b}{i}r", m, r, p_spec, large=True)
    p = orthonormalize(p, jax.random.fold_in(key, k) if k else key, matrix)
    r = matrix.einsum(f"{b}{i}{o},{b}{i}r->{b}{o}r", m, p, q_spec, large=True)
  new_m = m - (1 - beta) * matrix.einsum(
      f"{b}{i}r,{b}{o}r->{b}{i}{o}", p, r, m_spec, large=True
  )
  norms = column_norms(r, matrix)
  unit = r / jnp.where(norms > 0, norms, 1)  # a zero column stays zero
  direction = matrix.einsum(
      f"{b}{i}r,{b}{o}r->{b}{i}{o}", p, unit, m_spec, large=True
  )
  new_q = jnp.where(norms > 0, unit, q)
  return (
      jnp.transpose(direction, back),
      jnp.transpose(new_m, back).astype(momentum.dtype),
      new_q,
  )
