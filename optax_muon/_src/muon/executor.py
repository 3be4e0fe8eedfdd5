"""The orthogonalize stage: runs the plan, whole matrices to their owners (or
column blocks to the members of a team), NS there, back.

The one way NS is run on a tree. ``orthogonalize`` takes every Muon leaf: the
trivial group (leaves without shardings: one worker, no exchange) runs on the
arrays as they are; the sharded groups run the per-device program (local blocks
in, local blocks out, collectives by mesh-axis name) under ``jax.shard_map``, or
directly inside a user's own ``shard_map``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.muon.newton_schulz import MeshTeam
from optax_muon._src.muon.plan.model import (
    PAD,
    Exchange,
    Group,
    LeafPlacement,
    Plan,
    Program,
    TeamProgram,
    in_line,
    stage_chunks,
    stage_programs,
)
from optax_muon._src.muon.spec import MuonTreeSpec

# Newton–Schulz of a (batch, m, n) stack of canonical matrices (m ≤ n), or, with
# ``team=``, of each team member's columns of them
# (``orthogonalization.orthogonalize_block``).
NSFunction = Callable[..., jax.Array]


def _local_matrices(p: LeafPlacement, block: jax.Array) -> jax.Array:
  """Local block → (local_batch, piece size): one flattened piece per local
  matrix."""
  perm = p.layout.batch_axes + p.matrix_dims
  return jnp.transpose(block, perm).reshape(p.local_batch, -1)


def _local_block(p: LeafPlacement, pieces: jax.Array) -> jax.Array:
  """Inverse of ``_local_matrices``."""
  perm = p.layout.batch_axes + p.matrix_dims
  shaped = pieces.reshape(tuple(p.local_shape[d] for d in perm))
  return jnp.transpose(shaped, tuple(np.argsort(perm)))


def _member_view(p: LeafPlacement, split_dim: int, size: int) -> LeafPlacement:
  """The leaf as one of ``size`` team members sees it: ⌈e/size⌉ of every local
  block's extent e along ``split_dim``."""
  shape = list(p.layout.shape)
  extent = p.local_shape[split_dim]
  shape[split_dim] = shape[split_dim] // extent * -(-extent // size)
  return dataclasses.replace(
      p, layout=dataclasses.replace(p.layout, shape=tuple(shape))
  )


def _member_slice(
    p: LeafPlacement, split_dim: int, size: int, member: int
) -> np.ndarray:
  """Where member ``member``'s block lies in a flattened local piece of ``p``;
  −1 where the block is padded (the last members' blocks when ``size`` does not
  divide the extent)."""
  axis = p.matrix_dims.index(split_dim)
  extent = p.piece_shape[axis]
  rows = -(-extent // size)
  index = np.arange(math.prod(p.piece_shape)).reshape(p.piece_shape)
  index = np.pad(
      index,
      [
          (0, rows * size - extent if a == axis else 0)
          for a in range(index.ndim)
      ],
      constant_values=-1,
  )
  return np.take(
      index, np.arange(member * rows, (member + 1) * rows), axis=axis
  ).reshape(-1)


def _assemble(
    p: LeafPlacement,
    group: Group,
    mesh: dict,
    pieces: jax.Array,
    transposed: bool | None = None,
) -> jax.Array:
  """(g, S, L) pieces from the g devices along X → (S, m, n) canonical matrices.

  ``transposed`` overrides the layout's orientation (a team member's view keeps
  the orientation of the whole matrix)."""
  x_axes, slots = group.exchange_axes, pieces.shape[1]
  t = pieces.reshape(*(mesh[a] for a in x_axes), slots, *p.piece_shape)
  order = [len(x_axes)]
  for i, d in enumerate(
      p.matrix_dims
  ):  # global index = (shard coordinates, local index)
    order += [x_axes.index(a) for a in p.dim_axes[d]] + [len(x_axes) + 1 + i]
  t = jnp.transpose(t, order).reshape(
      slots, *(p.layout.shape[d] for d in p.matrix_dims)
  )
  grouped = p.reduction_positions + p.output_positions
  t = jnp.transpose(t, (0, *(1 + k for k in grouped)))
  t = t.reshape(slots, p.layout.n_in, p.layout.n_out)
  transposed = p.layout.transposed if transposed is None else transposed
  return jnp.swapaxes(t, 1, 2) if transposed else t


def _disassemble(
    p: LeafPlacement,
    group: Group,
    mesh: dict,
    mats: jax.Array,
    transposed: bool | None = None,
) -> jax.Array:
  """Inverse of ``_assemble``: (S, m, n) → (g, S, L)."""
  slots = mats.shape[0]
  if p.layout.transposed if transposed is None else transposed:
    mats = jnp.swapaxes(mats, 1, 2)
  grouped = p.reduction_positions + p.output_positions
  dims = p.matrix_dims
  t = mats.reshape(slots, *(p.layout.shape[dims[k]] for k in grouped))
  t = jnp.transpose(t, (0, *(1 + grouped.index(i) for i in range(len(dims)))))
  split_shape, position = [slots], {}
  for i, d in enumerate(dims):
    for a in p.dim_axes[d]:
      position[a] = len(split_shape)
      split_shape.append(mesh[a])
    position[i] = len(split_shape)
    split_shape.append(p.piece_shape[i])
  t = t.reshape(split_shape)
  order = (
      [position[a] for a in group.exchange_axes]
      + [0]
      + [position[i] for i in range(len(dims))]
  )
  return jnp.transpose(t, order).reshape(group.exchange_size, slots, -1)


def _all_to_all(buffer: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """all-to-all of a (g, T) buffer over ``axes``; 16-bit data travels packed in
  uint32.

  Packing keeps bf16 at 2 bytes per value on backends (such as XLA:CPU) that
  would otherwise widen 16-bit collectives to float32.
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


def _run_program(
    program: Program,
    ex: Exchange,
    group: Group,
    plan: Plan,
    ns: NSFunction,
    pieces: list[jax.Array],
) -> list[jax.Array]:
  """NS of the matrices one worker owns.

  Args:
    program: the worker's program.
    ex: its exchange.
    group: its group.
    plan: the plan.
    ns: Newton–Schulz of a stack of matrices.
    pieces: per bucket, (g, n, L): the g pieces of each of the worker's n
      matrices.

  Returns:
    Per bucket, (g, n, L): the pieces of the orthogonalized matrices, in
    ``pieces``' dtype.
  """
  mesh = dict(plan.mesh_shape)
  out = []
  for runs, bucket, x in zip(program, ex.buckets, pieces):
    if not runs:
      out.append(x)
      continue
    starts = np.cumsum([0] + [count for _, count in runs])
    # Casts between wire and compute dtype sit inside the layout code so that
    # they fuse.
    mats = jnp.concatenate(
        [
            _assemble(
                plan.leaves[i], group, mesh, x[:, a:b].astype(bucket.dtype)
            )
            for (i, _), a, b in zip(runs, starts[:-1], starts[1:])
        ]
    )  # (n, m, n')
    result = ns(mats)
    out.append(
        jnp.concatenate(
            [
                _disassemble(plan.leaves[i], group, mesh, result[a:b]).astype(
                    x.dtype
                )
                for (i, _), a, b in zip(runs, starts[:-1], starts[1:])
            ],
            axis=1,
        )
    )
  return out


def _exchange_unit(ex: Exchange, plan: Plan, g: int) -> int:
  """The elements that step 2 always moves together: the gcd of every piece's
  size and of the row runs that make up a team member's blocks (a member holds
  ⌈e/k⌉ of a local extent e, each of its rows ``tail`` contiguous elements)."""
  sizes = [b.piece_size(g) for b in ex.buckets]
  for runs in ex.teams:
    for run in runs:
      leaf = plan.leaves[run.leaf]
      axis = leaf.matrix_dims.index(run.split_dim)
      tail, extent = (
          math.prod(leaf.piece_shape[axis + 1 :]),
          leaf.piece_shape[axis],
      )
      sizes += [tail * -(-extent // ex.team_size), tail * extent]
  return math.gcd(*sizes)


def buffer_units(
    ex: Exchange,
    plan: Plan,
    g: int,
    unit: int | None = None,
    chunk: int | None = None,
) -> tuple[np.ndarray, int]:
  """Where each unit of the (workers, chunk) buffer comes from, and the unit.

  Row w holds this device's blocks (member w mod k's) of the matrices of worker
  w's team, run by run; then its pieces of worker w's whole matrices, in the
  order its program runs them; then padding. The buckets' stacks of local pieces
  (bucket order, each (K, L) flattened, concatenated) are cut into units of
  ``_exchange_unit`` elements; the index points at units, and padding one past
  the last, at a unit of zeros. (An index per element would be a constant of the
  size of the device's Muon params in the compiled program.)

  ``unit``: a divisor of ``_exchange_unit``'s (the stages of an exchange share
  the gcd of theirs); None: that unit. ``chunk``: the row length (the stages of
  an exchange share their longest); None: ``ex.chunk(g)``.

  Returns:
    ((workers, chunk // unit) unit indices, unit).
  """
  unit = unit or _exchange_unit(ex, plan, g)
  starts = (
      np.cumsum([0] + [b.matrices * b.piece_size(g) for b in ex.buckets])
      // unit
  )
  zero = starts[-1]
  index = np.full(
      (len(ex.owned), (chunk or ex.chunk(g)) // unit), zero, np.int64
  )
  for w, owned in enumerate(ex.owned):
    parts = []
    for run in ex.teams[w // ex.team_size] if ex.teams else ():
      size = ex.buckets[run.bucket].piece_size(g) // unit
      block = _member_slice(
          plan.leaves[run.leaf], run.split_dim, ex.team_size, w % ex.team_size
      )[::unit]
      parts += [
          np.where(
              (block < 0) | (j == PAD),
              zero,
              starts[run.bucket] + j * size + block // unit,
          )
          for j in run.matrices
      ]
    for mine, b, start in zip(owned, ex.buckets, starts):
      mine = np.asarray(mine, np.int64)[:, None]
      size = b.piece_size(g) // unit
      parts.append(
          np.where(
              mine == PAD, zero, start + mine * size + np.arange(size)
          ).reshape(-1)
      )
    row = np.concatenate(parts)
    index[w, : row.size] = row
  return index.astype(np.int32), unit


def _take_rows(x: jax.Array, order: np.ndarray) -> jax.Array:
  """x[order] along axis 0; no gather when ``order`` is the identity."""
  if np.array_equal(order, np.arange(len(order))):
    return x
  return jnp.take(x, order, axis=0)


def _owner_program(
    ex: Exchange,
    group: Group,
    plan: Plan,
    ns: NSFunction,
    program,
    received: jax.Array,
) -> jax.Array:
  """One worker's branch: (g, chunk) received pieces → (g, chunk) pieces of the
  results."""
  g, offset, pieces = group.exchange_size, 0, []
  for runs, b in zip(program, ex.buckets):
    n = sum(count for _, count in runs)
    size = n * b.piece_size(g)
    pieces.append(
        received[:, offset : offset + size].reshape(g, n, b.piece_size(g))
    )
    offset += size
  results = _run_program(program, ex, group, plan, ns, pieces)
  reply = jnp.concatenate([r.reshape(g, -1) for r in results], axis=1)
  return jnp.pad(reply, ((0, 0), (0, received.shape[1] - reply.shape[1])))


def _team_program(
    ex: Exchange,
    group: Group,
    plan: Plan,
    ns: NSFunction,
    program: TeamProgram,
    received: jax.Array,
) -> jax.Array:
  """One team's branch, the same on each member: (g, T) received blocks → (g, T)
  blocks of the results. The team's collectives run over X (and R when replicas
  split the work), grouped in teams of k consecutive workers."""
  mesh, g, k = dict(plan.mesh_shape), group.exchange_size, ex.team_size
  team = MeshTeam(
      group.exchange_axes + (group.replica_axes if group.split else ()),
      devices=group.workers,
      size=k,
  )
  out, offset = [], 0
  for bucket_index, leaf_index, split_dim, count in program:
    bucket, leaf = ex.buckets[bucket_index], plan.leaves[leaf_index]
    view = _member_view(leaf, split_dim, k)
    size = count * math.prod(view.piece_shape)
    blocks = received[:, offset : offset + size].reshape(g, count, -1)
    mats = _assemble(
        view, group, mesh, blocks.astype(bucket.dtype), leaf.layout.transposed
    )
    result = ns(mats, team=team)
    out.append(
        _disassemble(view, group, mesh, result, leaf.layout.transposed)
        .astype(received.dtype)
        .reshape(g, -1)
    )
    offset += size
  out.append(jnp.zeros((g, received.shape[1] - offset), received.dtype))
  return jnp.concatenate(out, axis=1)


def _switch(index, branches, operand):
  """``branches[index](operand)``; no ``lax.switch`` for a single branch."""
  if len(branches) == 1:
    return branches[0](operand)
  return jax.lax.switch(index, branches, operand)


def _outgoing(units: jax.Array, index: jax.Array, group: Group) -> jax.Array:
  """Step 2: row x holds this device's pieces of the matrices of worker (x,
  rep), padded to the busiest worker's; replicas hold the same data, so each
  sends its own workers' only.

  Args:
    units: the exchange's stacks in the wire dtype as (units, unit) rows, then
      a unit of zeros.
    index: (workers, chunk // unit): ``buffer_units`` of one stage.
    group: the exchange's group.

  Returns:
    (g, chunk).
  """
  g = group.exchange_size
  replicas = group.workers // g
  rep = _index(group.replica_axes) if group.split else 0
  send = units[index.reshape(g, replicas, -1)].reshape(g, replicas, -1)
  return jax.lax.dynamic_index_in_dim(send, rep, axis=1, keepdims=False)


def _exchange(buffer: jax.Array, group: Group) -> jax.Array:
  """Steps 3 and 6: the all-to-all over X (row p to and from peer p)."""
  if group.exchange_size == 1:
    return buffer
  return _all_to_all(buffer, group.exchange_axes)


def _lookup(table: np.ndarray, stage, index) -> jax.Array:
  """``table[stage, index]``; a constant row when ``stage`` is a Python int."""
  row = table[stage] if isinstance(stage, int) else jnp.asarray(table)[stage]
  return jnp.asarray(row)[index]


def _orthogonalize_received(
    buffer: jax.Array,
    plan: Plan,
    ns: NSFunction,
    group: Group,
    stages: tuple[Exchange, ...],
    stage,
) -> jax.Array:
  """Steps 4–5: NS of this worker's matrices of one stage (team blocks first,
  then whole matrices), each distinct program one switch branch: (g, chunk)
  received pieces → (g, chunk) pieces of the results.

  ``stage``: its index into ``stages`` (traced inside the stages' loop).
  """
  ex, g = stages[0], group.exchange_size
  replicas = group.workers // g
  rep = _index(group.replica_axes) if group.split else 0
  worker = _index(group.exchange_axes) * replicas + rep
  table = stage_programs(stages, g)
  team_width, whole_width = table.team_width, table.whole_width
  reply = jnp.zeros_like(buffer)
  # 4. Matrices split over teams: each member's columns, NS with its team; each
  # distinct team program is one switch branch, taken by all of the team's
  # members.
  if team_width:
    team = _switch(
        _lookup(table.team_program_of, stage, worker // ex.team_size),
        [
            functools.partial(_team_program, ex, group, plan, ns, p)
            for p in table.team_programs
        ],
        buffer[:, :team_width],
    )
    reply = reply.at[:, :team_width].set(team)
  # 5. Whole matrices, NS, pieces again. They follow the worker's team blocks.
  if whole_width:
    offset = _lookup(table.team_elements, stage, worker) if team_width else 0
    padded = (
        jnp.pad(buffer, ((0, 0), (0, whole_width))) if team_width else buffer
    )
    whole = jax.lax.dynamic_slice_in_dim(padded, offset, whole_width, axis=1)
    whole = _switch(
        _lookup(table.program_of, stage, worker),
        [
            functools.partial(_owner_program, ex, group, plan, ns, p)
            for p in table.programs
        ],
        whole,
    )
    if team_width:
      reply = jax.lax.dynamic_update_slice_in_dim(
          jnp.pad(reply, ((0, 0), (0, whole_width))), whole, offset, axis=1
      )
      reply = reply[:, : buffer.shape[1]]
    else:
      reply = whole
  return reply


def _returned(reply: jax.Array, group: Group, unit: int) -> jax.Array:
  """Step 6 after the all-to-all: row x = worker (x, rep)'s pieces of this
  device's matrices; the replicas' all-gathered; as (rows, unit)."""
  if group.split:
    reply = jax.lax.all_gather(
        reply, group.replica_axes, axis=1
    )  # (g, r, chunk)
  return reply.reshape(-1, unit)


def _in_line(
    units: jax.Array,
    plan: Plan,
    ns: NSFunction,
    group: Group,
    stages: tuple[Exchange, ...],
    tables: list[np.ndarray],
) -> jax.Array:
  """Steps 2–6 of stages that run in line (one stage, or stages with no program
  in common: ``plan.model.in_line``), each with its own chunk and its own
  switch: stage s is orthogonalized while one all-to-all carries stage s + 1
  out and stage s − 1 back.

  Returns:
    The results of every stage, their rows (of ``unit``) in the order of
    ``tables``' rows.
  """
  unit = units.shape[1]
  received, _ = _both_ways(_outgoing(units, tables[0], group), None, group)
  results, previous = [], None
  for s, ex in enumerate(stages):
    reply = _orthogonalize_received(received, plan, ns, group, (ex,), 0)
    following = (
        _outgoing(units, tables[s + 1], group) if s + 1 < len(stages) else None
    )
    if following is not None or previous is not None:
      received, back = _both_ways(following, previous, group)
      if back is not None:
        results.append(_returned(back, group, unit))
    previous = reply
  _, back = _both_ways(None, previous, group)
  results.append(_returned(back, group, unit))
  return jnp.concatenate(results) if len(results) > 1 else results[0]


def _both_ways(
    outgoing: jax.Array | None, previous: jax.Array | None, group: Group
) -> tuple[jax.Array | None, jax.Array | None]:
  """One all-to-all that carries ``outgoing`` (a stage's pieces) out and
  ``previous`` (a stage's results) back, either of them None: one latency, and
  one collective in flight beside the NS.

  Returns:
    (the pieces received, the results received), None where nothing went.
  """
  parts = [x for x in (outgoing, previous) if x is not None]
  both = _exchange(
      jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0], group
  )
  width = 0 if outgoing is None else outgoing.shape[1]
  return (
      None if outgoing is None else both[:, :width],
      None if previous is None else both[:, width:],
  )


def _run_stages(
    units: jax.Array,
    plan: Plan,
    ns: NSFunction,
    group: Group,
    stages: tuple[Exchange, ...],
) -> jax.Array:
  """Steps 2–7 for every stage: out, NS, back, every piece to its place.

  One stage runs in line, and so do stages with no program in common
  (``_in_line``). Other stages (``plan.stages``) run as a loop whose
  iteration s orthogonalizes stage s while stage s + 1 moves out and stage s − 1
  comes back: none depends on another, so a scheduler with asynchronous
  collectives overlaps them. Each worker looks its stage's program up among the
  stages' distinct ones (switch branches), so each one's NS code is compiled
  once.
  Each stage's results overwrite its own pieces in ``units``, which no later
  stage reads.

  Args:
    units: the exchange's stacks in the wire dtype as (units, unit) rows, then
      a unit of zeros.

  Returns:
    The orthogonalized stacks, as ``units`` without its unit of zeros.
  """
  g, unit = group.exchange_size, units.shape[1]
  size = units.shape[0] - 1
  tables = [
      buffer_units(ex, plan, g, unit, chunk)[0]
      for ex, chunk in zip(stages, stage_chunks(stages, g))
  ]
  if len(stages) == 1 or in_line(stages):
    results = _in_line(units, plan, ns, group, stages, tables)
    # 7. The inverse of step 2's gathers.
    index = np.concatenate([t.reshape(-1) for t in tables])
    inverse = np.full(size, -1, np.int64)
    valid = index < size
    inverse[index[valid]] = np.flatnonzero(valid)
    assert (inverse >= 0).all(), "every matrix is orthogonalized"
    return results[inverse.astype(np.int32)]
  count = len(stages)
  # Where each stage's results go; padding (and iteration 0's way back, which
  # carries no stage) past the end, dropped.
  stacked = np.stack(tables)
  dropped = np.full_like(tables[0], size + 1)
  places = np.where(stacked < size, stacked, size + 1)
  covered = np.zeros(size + 2, np.int64)
  np.add.at(covered, places.reshape(-1), 1)
  assert (covered[:size] == 1).all(), "each piece in exactly one stage"
  sources = jnp.asarray(stacked)
  targets = jnp.asarray(
      np.concatenate([dropped[None], places]).reshape(count + 1, -1)
  )

  def place(units, s, returned):
    return units.at[targets[s]].set(returned, mode="drop")

  def iteration(s, carry):
    received, previous, units = carry
    reply = _orthogonalize_received(received, plan, ns, group, stages, s)
    received, back = _both_ways(
        _outgoing(units, sources[jnp.minimum(s + 1, count - 1)], group),
        previous,
        group,
    )
    units = place(units, s, _returned(back, group, unit))
    return received, reply, units

  first, _ = _both_ways(_outgoing(units, sources[0], group), None, group)
  _, last, units = jax.lax.fori_loop(
      0, count, iteration, (first, jnp.zeros_like(first), units)
  )
  _, back = _both_ways(None, last, group)
  return place(units, count, _returned(back, group, unit))[:size]


def _run_exchange(
    blocks: list[jax.Array],
    plan: Plan,
    ns: NSFunction,
    group: Group,
    stages: tuple[Exchange, ...],
    out: list,
) -> None:
  """Orthogonalizes the matrices of an exchange (in one stage, or in
  ``stages``, in line or as a loop: ``_run_stages``); fills ``out``."""
  ex = stages[0]
  # 1. Each bucket's local matrices, one piece each: (K, L).
  stacks = [
      jnp.concatenate(
          [_local_matrices(plan.leaves[i], blocks[i]) for i in b.members]
      )
      for b in ex.buckets
  ]
  if (
      group.workers == 1
  ):  # the trivial plan: every matrix whole, here, in its program's order
    order = [np.asarray(owned, np.int64) for owned in ex.owned[0]]
    results = _run_program(
        ex.programs[0],
        ex,
        group,
        plan,
        ns,
        [_take_rows(s, o)[None] for s, o in zip(stacks, order)],
    )
    rows = [_take_rows(r[0], np.argsort(o)) for r, o in zip(results, order)]
  else:
    # 2.–7. The stacks in the wire dtype, cut into units, and a unit of zeros
    # for padding.
    wire = jnp.dtype(plan.wire_dtype or jnp.result_type(*stacks))
    unit = math.gcd(
        *(_exchange_unit(s, plan, group.exchange_size) for s in stages)
    )
    units = jnp.concatenate(
        [s.astype(wire).reshape(-1) for s in stacks]
        + [jnp.zeros((unit,), wire)]
    ).reshape(-1, unit)
    pieces = _run_stages(units, plan, ns, group, stages).reshape(-1)
    starts = np.cumsum([0] + [s.size for s in stacks])
    rows = [
        pieces[a:b].reshape(s.shape)
        for s, a, b in zip(stacks, starts[:-1], starts[1:])
    ]
  # 8. The leaves' local blocks.
  for b, r in zip(ex.buckets, rows):
    start = 0
    for i in b.members:
      count = plan.leaves[i].local_batch
      out[i] = _local_block(plan.leaves[i], r[start : start + count]).astype(
          blocks[i].dtype
      )
      start += count


def _orthogonalize_local(
    blocks: list[jax.Array], plan: Plan, ns: NSFunction, groups: list[Group]
) -> list[jax.Array | None]:
  """The per-device program of ``groups``.

  Args:
    blocks: this device's local block of each Muon leaf (``plan.leaves`` order);
      only those of ``groups`` are read.
    plan: the plan.
    ns: Newton–Schulz of a stack of matrices.
    groups: the groups to run.

  Returns:
    The local blocks of the orthogonalized leaves of ``groups``, None for the
    others.
  """
  out: list[jax.Array | None] = [None] * len(blocks)
  for group in groups:
    for stages in group.stages():
      _run_exchange(blocks, plan, ns, group, stages, out)
  return out


def orthogonalize(
    xs: list[jax.Array], spec: MuonTreeSpec, ns: NSFunction
) -> list[jax.Array]:
  """NS of every matrix of every Muon leaf, by the spec's plan.

  Args:
    xs: the NS inputs, one per Muon leaf (``spec.muon_positions`` order): global
      arrays, or local blocks inside ``shard_map``.
    spec: the tree's spec.
    ns: Newton–Schulz of a (batch, m, n) stack, m ≤ n.

  Returns:
    The orthogonalized leaves (or local blocks), same shapes and dtypes as
    ``xs``; leaves with no elements come back as they are.
  """
  out = list(xs)
  if spec.plan is None:  # no Muon leaf with an element
    return out
  planned = [xs[k] for k in spec.planned]
  for k, y in zip(spec.planned, _run_plan(planned, spec.plan, ns, spec.manual)):
    out[k] = y
  return out


def _run_plan(
    xs: list[jax.Array], plan: Plan, ns: NSFunction, manual: bool
) -> list[jax.Array]:
  """NS of the leaves ``xs`` (``plan.leaves`` order) by ``plan``; ``manual``:
  inside a ``shard_map`` (collectives by axis name on local blocks)."""
  trivial = [g for g in plan.groups if not g.sharded]
  sharded = [g for g in plan.groups if g.sharded]
  out = _orthogonalize_local(xs, plan, ns, trivial)
  if sharded and manual:
    done = _orthogonalize_local(xs, plan, ns, sharded)
  elif sharded:
    index = [i for g in sharded for b in g.buckets for i in b.members]
    mesh = plan.leaves[index[0]].sharding.mesh
    specs = tuple(plan.leaves[i].sharding.spec for i in index)

    def body(*blocks):
      local = [None] * len(xs)
      for i, block in zip(index, blocks):
        local[i] = block
      result = _orthogonalize_local(local, plan, ns, sharded)
      return tuple(result[i] for i in index)

    # check_vma=False: an all-gather's result is the same on every replica (as
    # the out_specs say), but JAX's type system marks it as varying.
    results = jax.shard_map(
        body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False
    )(*(xs[i] for i in index))
    done = [None] * len(xs)
    for i, y in zip(index, results):
      done[i] = y
  else:
    done = out
  return [a if a is not None else b for a, b in zip(out, done)]
