"""One Dion step of every matrix leaf, as each device runs it: local blocks in,
local blocks out, every sum a collective by mesh-axis name.

Per matrix (rows × cols in view order, see ``dion.matrix``), with r the rank::

  M = B + G                 (rows × cols, sharded like the param)
  P = M·Q                   (rows × r: sharded like the rows, summed over the
                            column axes by the orthonormalization)
  P ← orthonormalize(P)     (``dion.orthonormalization``)
  R = Mᵀ·P                  (cols × r: summed over the row axes, scattered over
                            them where Q is split over them)
  B ← M − (1 − μ)·P·Rᵀ      (error feedback)
  Q ← R, unit columns       (the state keeps the old Q for zero columns)
  direction = P·Qᵀ          (zero columns of R contribute nothing)

With replicas (data parallelism) each replica's G is its own. A compressed
matrix keeps a buffer per replica and P's and R's sums run over the replica
axes too, divided by the replica count: P = mean(Mᵢ)·Q and R = mean(Mᵢ)ᵀ·P are
linear in the mean, so the step equals Dion's on the averaged gradient and the
mean of the buffers follows the averaged buffer's recursion. Other matrices
average the gradient over the replicas and keep equal buffers.

``run_step`` runs the step under ``jax.shard_map`` over the mesh axes that are
not manual yet (all of them under ``jax.jit``, none inside a user's
``shard_map`` over every axis).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from optax_muon._src.dion.matrix import DionMatrix
from optax_muon._src.dion.orthonormalization import orthonormalize

_HIGHEST = jax.lax.Precision.HIGHEST


def _product(
    matrix: DionMatrix, subscripts: str, a: jax.Array, b: jax.Array
) -> jax.Array:
  """One of the four m × n × r products, its operands at ``product_dtype``
  (accumulated in the state's dtype) where one is set."""
  if matrix.product_dtype is None:
    return jnp.einsum(subscripts, a, b, precision=_HIGHEST)
  return jnp.einsum(
      subscripts,
      a.astype(matrix.product_dtype),
      b.astype(matrix.product_dtype),
      preferred_element_type=a.dtype,
  )


def _psum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return jax.lax.psum(x, axes) if axes else x


def _q_col_dims(matrix: DionMatrix) -> tuple[int, ...]:
  return tuple(range(matrix.batch, matrix.batch + matrix.cols))


def _norm_axes(matrix: DionMatrix) -> tuple[str, ...]:
  """The mesh axes that split Q's columns (R's column norms sum over them)."""
  return tuple(a for d in _q_col_dims(matrix) for a in matrix.q_dim_axes[d])


def _gathered(matrix: DionMatrix, shard: jax.Array) -> jax.Array:
  """Q or R (batch…, cols…, r) whole over the row axes (as the param's columns
  lie)."""
  if matrix.q_split is None:
    return shard
  return jax.lax.all_gather(
      shard, matrix.row_axes, axis=matrix.q_axis, tiled=True
  )


def _r_shard(matrix: DionMatrix, part: jax.Array) -> jax.Array:
  """R's partial sums (batch…, cols…, r) summed over the row axes (and the
  replicas, averaged, for a compressed matrix), laid out like Q."""
  if matrix.q_split is not None:
    part = jax.lax.psum_scatter(
        part, matrix.row_axes, scatter_dimension=matrix.q_axis, tiled=True
    )
  else:
    part = _psum(part, matrix.row_axes)
  if matrix.compressed:
    part = jax.lax.psum(part, matrix.replica_axes) / matrix.replicas
  return part


def _p(matrix: DionMatrix, m: jax.Array, r: jax.Array) -> jax.Array:
  """P = M·R's partial sums (over the column axes, and the replicas for a
  compressed matrix: ``orthonormalization.sum_axes``)."""
  b, i, o = matrix.b, matrix.i, matrix.o
  return _product(matrix, f"{b}{i}{o},{b}{o}r->{b}{i}r", m, r)


def local_step(
    matrices: list[DionMatrix],
    grads: list[jax.Array],
    momenta: list[jax.Array],
    qs: list[jax.Array],
    beta: Any,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
  """Dion's step of every leaf on this device's blocks.

  Every mesh axis a leaf's step runs over must be manual here.

  Args:
    matrices: the leaves' static facts.
    grads: per leaf this device's block of G in the leaf's axis order (with a
      leading replica axis of size 1 where the leaf has replicas).
    momenta: the buffers B, the same (the state's dtype; the leading replica
      axis only where the leaf is compressed: the others keep one buffer).
    qs: this device's blocks of Q (``DionMatrix.q_shape``, laid out by
      ``q_spec``).
    beta: μ, the momentum decay; may be traced.

  Returns:
    Per leaf (direction P·Qᵀ in the leaf's axis order and the state's dtype,
    new B, new Q), as local blocks.
  """
  ms = []
  for matrix, g, b in zip(matrices, grads, momenta):
    if matrix.replica_axes:
      g = g[0]
    if matrix.compressed:
      b = b[0]
    g = jnp.transpose(g, matrix.perm).astype(b.dtype)
    if matrix.replica_axes and not matrix.compressed:
      g = jax.lax.psum(g, matrix.replica_axes) / matrix.replicas
    ms.append(jnp.transpose(b, matrix.perm) + g)
  rs = [_gathered(mx, q) for mx, q in zip(matrices, qs)]
  iterations = max((mx.power_iterations for mx in matrices), default=0)
  for _ in range(iterations):
    ps = [_p(mx, m, r) for mx, m, r in zip(matrices, ms, rs)]
    ps = orthonormalize(matrices, ps)
    shards = [
        _r_shard(
            mx,
            _product(
                mx, f"{mx.b}{mx.i}{mx.o},{mx.b}{mx.i}r->{mx.b}{mx.o}r", m, p
            ),
        )
        for mx, m, p in zip(matrices, ms, ps)
    ]
    rs = [_gathered(mx, s) for mx, s in zip(matrices, shards)]
  directions, new_momenta, new_qs = [], [], []
  for matrix, m, p, r, shard, q, b in zip(
      matrices, ms, ps, rs, shards, qs, momenta
  ):
    b_, i, o = matrix.b, matrix.i, matrix.o
    norms = jnp.sqrt(
        _psum(
            jnp.sum(shard * shard, axis=_q_col_dims(matrix), keepdims=True),
            _norm_axes(matrix),
        )
    )
    safe = jnp.where(norms > 0, norms, 1)  # a zero column stays zero
    # P·Rᵀ and P·(R / norms)ᵀ as one (batched) product.
    feedback, direction = _product(
        matrix,
        f"z{b_}{i}r,z{b_}{o}r->z{b_}{i}{o}",
        jnp.broadcast_to(p, (2,) + p.shape),
        jnp.stack([r, r / safe]),
    )
    new_m = m - (1 - beta) * feedback
    new_m = jnp.transpose(new_m, matrix.back).astype(b.dtype)
    directions.append(jnp.transpose(direction, matrix.back))
    new_momenta.append(new_m[None] if matrix.compressed else new_m)
    new_qs.append(jnp.where(norms > 0, shard / safe, q))
  return directions, new_momenta, new_qs


def _restricted(spec: PartitionSpec, axes: frozenset[str]) -> PartitionSpec:
  """``spec`` naming only ``axes`` (the others are already manual, or not
  there)."""
  entries = []
  for entry in spec:
    names = (
        () if entry is None else (entry,) if isinstance(entry, str) else entry
    )
    kept = tuple(a for a in names if a in axes)
    entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return PartitionSpec(*entries)


def run_step(
    matrices: list[DionMatrix],
    grads: list[jax.Array],
    momenta: list[jax.Array],
    qs: list[jax.Array],
    beta: Any,
    manual: frozenset[str],
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
  """``local_step`` of every leaf, under ``jax.shard_map`` over the mesh axes
  its leaves run over that are not ``manual`` yet.

  Args:
    matrices, momenta, qs, beta: as ``local_step``'s (global arrays
      along the axes that are not manual).
    grads: per leaf G: with replicas, under ``jax.jit`` a leading replica axis
      of the replica count; where the replica axes are manual, the replica's
      own block, shaped like the param's.
    manual: the mesh axes that are manual here.

  Returns:
    As ``local_step``.
  """
  if not matrices:
    return [], [], []
  grads = [
      g[None] if mx.replica_axes and g.ndim == len(mx.perm) else g
      for mx, g in zip(matrices, grads)
  ]
  sharded = [k for k, mx in enumerate(matrices) if mx.mesh is not None]
  todo = frozenset().union(*(matrices[k].used_axes for k in sharded)) - manual
  if not todo:
    return local_step(matrices, grads, momenta, qs, beta)
  unsharded = [k for k in range(len(matrices)) if k not in sharded]
  out = [[None] * len(matrices) for _ in range(3)]
  if unsharded:
    pick = lambda xs, ks: [xs[k] for k in ks]
    for k, d, b, q in zip(
        unsharded,
        *local_step(
            pick(matrices, unsharded),
            pick(grads, unsharded),
            pick(momenta, unsharded),
            pick(qs, unsharded),
            beta,
        ),
    ):
      out[0][k], out[1][k], out[2][k] = d, b, q
  chosen = [matrices[k] for k in sharded]
  mesh = jax.sharding.get_abstract_mesh() if manual else chosen[0].mesh
  leaf = [_restricted(mx.leaf_spec(), todo) for mx in chosen]
  grad = [
      _restricted(mx.leaf_spec(bool(mx.replica_axes)), todo) for mx in chosen
  ]
  state = [_restricted(mx.leaf_spec(mx.compressed), todo) for mx in chosen]
  q = [_restricted(mx.q_spec, todo) for mx in chosen]

  def body(grads, momenta, qs, beta):
    return tuple(map(tuple, local_step(chosen, grads, momenta, qs, beta)))

  # check_vma=False: the direction and Q are the same on every device of the
  # axes their out_specs leave out (sums by psum, gathers by all_gather), which
  # JAX's type system cannot tell for the results of the factorizations.
  directions, new_momenta, new_qs = jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(
          tuple(grad),
          tuple(state),
          tuple(q),
          PartitionSpec(),
      ),
      out_specs=(tuple(leaf), tuple(state), tuple(q)),
      axis_names=todo,
      check_vma=False,
  )(
      tuple(grads[k] for k in sharded),
      tuple(momenta[k] for k in sharded),
      tuple(qs[k] for k in sharded),
      jnp.asarray(beta, jnp.float32),
  )
  for j, k in enumerate(sharded):
    out[0][k], out[1][k], out[2][k] = directions[j], new_momenta[j], new_qs[j]
  return out[0], out[1], out[2]


# ------------------------------------------------------------------ the state


def _place(x: jax.Array, mesh: Any, spec: PartitionSpec) -> jax.Array:
  """``x`` laid out by ``spec`` under a trace (a type on Explicit meshes, a
  constraint on Auto ones), or put there when concrete."""
  sharding = NamedSharding(mesh, spec)
  if not isinstance(x, jax.core.Tracer):
    if isinstance(mesh, jax.sharding.Mesh):
      return jax.device_put(x, sharding)
    return x
  if all(t == AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _local_block(
    x: jax.Array,
    dim_axes: tuple[tuple[str, ...], ...],
    mesh: Any,
    manual: frozenset[str],
) -> jax.Array:
  """This device's block of the whole array ``x`` along the ``manual`` axes
  that split it."""
  for dim, axes in enumerate(dim_axes):
    axes = tuple(a for a in axes if a in manual)
    if not axes:
      continue
    size = x.shape[dim] // math.prod(mesh.shape[a] for a in axes)
    x = jax.lax.dynamic_slice_in_dim(
        x, jax.lax.axis_index(axes) * size, size, dim
    )
  return x


def initial_q(
    matrix: DionMatrix, key: jax.Array, dtype: Any, manual: frozenset[str]
) -> jax.Array:
  """A random Q with unit columns, laid out by ``matrix.q_spec``: the same
  values on any mesh (inside ``shard_map``, this device's block of them)."""
  q = jax.random.normal(key, matrix.q_shape, dtype)
  if matrix.mesh is not None and manual:
    q = _local_block(q, matrix.q_dim_axes, matrix.mesh, manual)
  elif matrix.mesh is not None:
    q = _place(q, matrix.mesh, matrix.q_spec)
  squares = jnp.sum(q * q, axis=_q_col_dims(matrix), keepdims=True)
  axes = tuple(a for a in _norm_axes(matrix) if a in manual)
  return q / jnp.sqrt(_psum(squares, axes if matrix.mesh is not None else ()))


def initial_momentum(
    matrix: DionMatrix,
    shape: tuple[int, ...],
    dtype: Any,
    manual: frozenset[str],
) -> jax.Array:
  """Zeros for the buffer B: the leaf's (local) ``shape``, after a replica axis
  where the leaf's replicas keep their own (compressed; its local size 1 where
  the replica axes are manual)."""
  if not matrix.compressed:
    shape_, spec = shape, matrix.leaf_spec()
  else:
    lead = 1 if set(matrix.replica_axes) <= manual else matrix.replicas
    shape_, spec = (lead,) + shape, matrix.leaf_spec(True)
  zeros = jnp.zeros(shape_, dtype)
  if matrix.mesh is None or manual:
    return zeros
  return _place(zeros, matrix.mesh, spec)
