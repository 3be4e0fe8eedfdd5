"""Executing a ``Plan``: whole matrices to their owners, Newton–Schulz there, and back.

``orthogonalize_local`` is the per-device program (local blocks in, local blocks out,
collectives by mesh-axis name); ``orthogonalize_sharded`` wraps it in ``jax.shard_map`` for
jit-compiled (pjit) code. Inside a user's own ``shard_map`` the local program is called
directly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon.orthogonalize import NSOptions
from optax_muon.plan import Group, LeafPlacement, Plan


def _local_matrices(p: LeafPlacement, block: jax.Array) -> jax.Array:
  """Local block → (local_batch, piece size): one flattened piece per local matrix."""
  perm = p.layout.batch_axes + p.matrix_dims
  return jnp.transpose(block, perm).reshape(p.local_batch, -1)


def _local_block(p: LeafPlacement, pieces: jax.Array) -> jax.Array:
  """Inverse of ``_local_matrices``."""
  perm = p.layout.batch_axes + p.matrix_dims
  shaped = pieces.reshape(tuple(p.local_shape[d] for d in perm))
  return jnp.transpose(shaped, tuple(np.argsort(perm)))


def _assemble(p: LeafPlacement, group: Group, mesh: dict, pieces: jax.Array) -> jax.Array:
  """(g, S, L) pieces from the g devices along X → (S, m, n) canonical matrices."""
  x_axes, slots = group.exchange_axes, pieces.shape[1]
  t = pieces.reshape(*(mesh[a] for a in x_axes), slots, *p.piece_shape)
  order = [len(x_axes)]
  for i, d in enumerate(p.matrix_dims):  # global index = (shard coordinates, local index)
    order += [x_axes.index(a) for a in p.sharding.dim_axes[d]] + [len(x_axes) + 1 + i]
  t = jnp.transpose(t, order).reshape(slots, *(p.layout.shape[d] for d in p.matrix_dims))
  grouped = p.reduction_positions + p.output_positions
  t = jnp.transpose(t, (0, *(1 + k for k in grouped)))
  t = t.reshape(slots, p.layout.n_in, p.layout.n_out)
  return jnp.swapaxes(t, 1, 2) if p.layout.n_in > p.layout.n_out else t


def _disassemble(p: LeafPlacement, group: Group, mesh: dict, mats: jax.Array) -> jax.Array:
  """Inverse of ``_assemble``: (S, m, n) → (g, S, L)."""
  slots = mats.shape[0]
  if p.layout.n_in > p.layout.n_out:
    mats = jnp.swapaxes(mats, 1, 2)
  grouped = p.reduction_positions + p.output_positions
  dims = p.matrix_dims
  t = mats.reshape(slots, *(p.layout.shape[dims[k]] for k in grouped))
  t = jnp.transpose(t, (0, *(1 + grouped.index(i) for i in range(len(dims)))))
  split_shape, position = [slots], {}
  for i, d in enumerate(dims):
    for a in p.sharding.dim_axes[d]:
      position[a] = len(split_shape)
      split_shape.append(mesh[a])
    position[i] = len(split_shape)
    split_shape.append(p.piece_shape[i])
  t = t.reshape(split_shape)
  order = [position[a] for a in group.exchange_axes] + [0] + [position[i]
                                                              for i in range(len(dims))]
  return jnp.transpose(t, order).reshape(group.exchange_size, slots, -1)


def _all_to_all(buffer: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """all-to-all of a (g, T) buffer over ``axes``; 16-bit data travels packed in uint32.

  Packing keeps bf16 at 2 bytes per value on backends (such as XLA:CPU) that would
  otherwise widen 16-bit collectives to float32.
  """
  if buffer.dtype.itemsize != 2:
    return jax.lax.all_to_all(buffer, axes, 0, 0, tiled=True)
  g, size = buffer.shape
  padded = jnp.pad(buffer, ((0, 0), (0, size % 2)))
  packed = jax.lax.bitcast_convert_type(padded.reshape(g, -1, 2), jnp.uint32)
  packed = jax.lax.all_to_all(packed, axes, 0, 0, tiled=True)
  unpacked = jax.lax.bitcast_convert_type(packed, buffer.dtype).reshape(g, -1)
  return unpacked[:, :size]


def _index(axes: tuple[str, ...]):
  return jax.lax.axis_index(axes) if axes else 0


def _by_signature(group: Group, bucket, leaves, owner, slot_axis: int, build):
  """Builds this device's slots, each with the piece layout of the matrix it holds.

  A slot holds a matrix of one leaf, whose signature says how its pieces fit together.
  Devices whose slots hold the same sequence of signatures run the same code; when devices
  differ (a (d, 4d) and a (4d, d) matrix sharing a bucket), one ``lax.switch`` on this
  device's index picks its sequence, so only the layouts it needs are built.

  Args:
    group, bucket, leaves: where the slots come from.
    owner: this device's index along the exchange axes.
    slot_axis: the slot axis of ``build``'s output.
    build: ``(LeafPlacement, slot slice) -> array`` for the slots of that slice.

  Returns:
    All slots, concatenated along ``slot_axis``.
  """
  masks = group.owner_masks(bucket, leaves)
  signatures = list(masks)
  representative = [next(leaves[i] for i in bucket.members if leaves[i].signature == sig)
                    for sig in signatures]
  kind = np.zeros((group.exchange_size, bucket.slots), np.int32)  # padded slots: any kind
  for k, sig in enumerate(signatures):
    kind[masks[sig]] = k
  rows = sorted({tuple(row) for row in kind.tolist()})

  def build_row(row):
    parts, start = [], 0
    for stop in range(1, len(row) + 1):  # consecutive slots of one kind: one slice
      if stop == len(row) or row[stop] != row[start]:
        parts.append(build(representative[row[start]], slice(start, stop)))
        start = stop
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=slot_axis)

  if len(rows) == 1:
    return build_row(rows[0])
  which = np.array([rows.index(tuple(row)) for row in kind.tolist()], np.int32)
  return jax.lax.switch(jnp.asarray(which)[owner],
                        [functools.partial(build_row, row) for row in rows])


def _run_ns(group: Group, bucket, x: jax.Array, ns: NSOptions) -> jax.Array:
  """NS on the owner's (S, m, n) slots; replicas split them with the split policy."""
  if not group.split:
    return ns.run(x)
  per_replica = bucket.replica_slots
  padded = jnp.pad(x, ((0, per_replica * group.replica_size - x.shape[0]), (0, 0), (0, 0)))
  mine = jax.lax.dynamic_slice_in_dim(padded, _index(group.replica_axes) * per_replica,
                                      per_replica, axis=0)
  gathered = jax.lax.all_gather(ns.run(mine), group.replica_axes, axis=0, tiled=True)
  return gathered[:x.shape[0]]


def orthogonalize_local(blocks: list[jax.Array], plan: Plan) -> list[jax.Array]:
  """The per-device program: NS of every matrix of every leaf, each on one owner.

  Args:
    blocks: this device's local block of each Muon leaf (``plan.leaves`` order).
    plan: the plan.

  Returns:
    The local blocks of the orthogonalized leaves.
  """
  out: list[jax.Array | None] = [None] * len(blocks)
  for group in plan.groups:
    units = [group.buckets] if plan.exchange == "group" else [(b,) for b in group.buckets]
    for buckets in units:
      _exchange(blocks, plan, group, buckets, out)
  return out


def _exchange(blocks: list[jax.Array], plan: Plan, group: Group, buckets: tuple,
              out: list) -> None:
  """Orthogonalizes ``buckets`` of ``group`` with one all-to-all each way; fills ``out``."""
  mesh = dict(plan.mesh_shape)
  g, x_axes = group.exchange_size, group.exchange_axes
  dtype = jnp.result_type(*(blocks[i].dtype for b in buckets for i in b.members))
  wire = jnp.dtype(plan.wire_dtype or dtype)
  # 1. Pieces of every local matrix, in slot order: matrix j → device j // S, slot j % S.
  sends = []
  for b in buckets:
    stacked = jnp.concatenate([_local_matrices(plan.leaves[i], blocks[i])
                               for i in b.members]).astype(wire)  # (K, L)
    stacked = jnp.pad(stacked, ((0, g * b.slots - b.matrices), (0, 0)))
    sends.append(stacked.reshape(g, -1))
  sizes = [s.shape[1] for s in sends]
  buffer = jnp.concatenate(sends, axis=1)  # (g, Σ S·L)
  # 2. All-to-all over X: each device receives the pieces of the matrices it owns.
  if g > 1:
    buffer = _all_to_all(buffer, x_axes)
  owner = _index(x_axes)
  replies = []
  for b, chunk in zip(buckets, jnp.split(buffer, np.cumsum(sizes)[:-1], axis=1)):
    pieces = chunk.reshape(g, b.slots, -1)
    # 3. Whole matrices, NS (split over replicas or not), and pieces again; the casts
    # between wire and compute dtype sit inside the layout code so that they fuse.
    mats = _by_signature(
        group, b, plan.leaves, owner, 0,
        lambda p, slots: _assemble(p, group, mesh, pieces[:, slots].astype(dtype)))
    result = _run_ns(group, b, mats, plan.ns)
    reply = _by_signature(
        group, b, plan.leaves, owner, 1,
        lambda p, slots: _disassemble(p, group, mesh, result[slots]).astype(wire))
    replies.append(reply.reshape(g, -1))
  # 4. All-to-all back: each device receives its pieces of every local matrix.
  buffer = jnp.concatenate(replies, axis=1)
  if g > 1:
    buffer = _all_to_all(buffer, x_axes)
  for b, chunk in zip(buckets, jnp.split(buffer, np.cumsum(sizes)[:-1], axis=1)):
    pieces = chunk.reshape(g * b.slots, -1)[:b.matrices]
    start = 0
    for i in b.members:
      count = plan.leaves[i].local_batch
      out[i] = _local_block(plan.leaves[i], pieces[start:start + count]).astype(
          blocks[i].dtype)
      start += count


def orthogonalize_sharded(leaves: list[jax.Array], plan: Plan) -> list[jax.Array]:
  """``orthogonalize_local`` under ``jax.shard_map`` over the plan's mesh, for jit code."""
  mesh = plan.leaves[0].sharding.mesh
  specs = tuple(p.sharding.spec for p in plan.leaves)
  body = lambda *blocks: tuple(orthogonalize_local(list(blocks), plan))
  # check_vma=False: an all-gather's result is the same on every replica (as the out_specs
  # say), but JAX's type system marks it as varying.
  return list(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs,
                            check_vma=False)(*leaves))

