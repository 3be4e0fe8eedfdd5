"""Dion's per-replica buffers and the checkpoint: ``average_replicas``.

With a compressed replica sync each replica keeps its own buffer Bᵢ
(``DionReplicaState``). Their mean follows Dion's recursion on averaged
gradients exactly, so the averaged state (a ``DionState``) is a lossless
checkpoint: it continues on any replica count once laid out for it again.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding

from optax_muon._src.core import tree_utils
from optax_muon._src.core.sharding import typed_sharding
from optax_muon._src.dion.transform import DionReplicaState, DionState

_is_replica_state = lambda x: isinstance(x, DionReplicaState)
_is_state = lambda x: isinstance(x, (DionReplicaState, DionState))


def average_replicas(state: Any, like: Any = None) -> Any:
  """The optimizer state with every replica's Dion buffer replaced by their
  mean; with ``like``, laid out for ``like``'s replicas.

  Every per-replica Dion state in ``state`` (a ``dion`` or ``scale_by_dion``
  state with ``replica_axes``, wherever it sits in a chain) becomes the
  ``DionState`` of Dion on averaged gradients, the buffers' replica axis
  averaged away; the rest is left as it is. That is a lossless checkpoint:
  save it (orbax), and restore it onto any replica count by passing the new
  run's state as ``like``, which repeats each averaged buffer on every
  replica. Call it on global arrays (eagerly or under ``jax.jit``): the mean is
  an all-reduce over the replica axes.

  Args:
    state: an optimizer state (averaged ones pass through).
    like: the new run's state (``tx.init(params)``) or its shapes with
      shardings: the replica count and where each array lies. None: return
      the averaged state.

  Returns:
    The averaged state; with ``like``, ``like``'s structure holding the
    averaged values.

  Raises:
    ValueError: if ``state`` and ``like`` differ in structure beyond their Dion
      states.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"),
    ...                      axis_types=(AxisType.Explicit,) * 2)
    >>> w = jax.device_put(jnp.zeros((16, 64)), NamedSharding(mesh, P("fsdp")))
    >>> tx = optax_muon.scale_by_dion(0.25, replica_axes="data")
    >>> state = tx.init({"w": w})
    >>> state.replica_momentum["w"].shape    # a buffer per replica
    (2, 16, 64)
    >>> averaged = optax_muon.average_replicas(state)
    >>> averaged.momentum["w"].shape
    (16, 64)
    >>> optax_muon.average_replicas(averaged, like=state).replica_momentum[
    ...     "w"].shape
    (2, 16, 64)
  """
  averaged = jax.tree.map(_averaged, state, is_leaf=_is_replica_state)
  return averaged if like is None else _spread(averaged, like)


def _averaged(node: Any) -> Any:
  if not _is_replica_state(node):
    return node
  shared, treedef = tree_utils.flatten_positions(node.momentum)
  own, _ = tree_utils.flatten_positions(node.replica_momentum)
  merged = [
      jnp.mean(r, axis=0) if tree_utils.is_array_leaf(r) else b
      for (_, b), (_, r) in zip(shared, own)
  ]
  return DionState(
      node.count, jax.tree_util.tree_unflatten(treedef, merged), node.q
  )


def _spread(averaged: Any, like: Any) -> Any:
  """``averaged`` in ``like``'s structure: each averaged buffer repeated on
  ``like``'s replicas, every array placed as ``like``'s."""
  like_nodes, like_def = jax.tree.flatten(like, is_leaf=_is_state)
  nodes, definition = jax.tree.flatten(averaged, is_leaf=_is_state)
  if definition != like_def:
    raise ValueError(
        "average_replicas: the state and `like` differ in structure beyond"
        f" their Dion states:\n{definition}\nagainst\n{like_def}."
    )
  out = []
  for node, target in zip(nodes, like_nodes):
    if not _is_replica_state(target):
      out.append(node)
      continue
    averaged_buffers, treedef = tree_utils.flatten_positions(node.momentum)
    shared, _ = tree_utils.flatten_positions(target.momentum)
    own, _ = tree_utils.flatten_positions(target.replica_momentum)
    masked = optax.MaskedNode()
    spread = lambda b, t: _placed(jnp.broadcast_to(b, t.shape), t)
    fields = [
        [
            masked if tree_utils.is_placeholder(t) else spread(b, t)
            for (_, b), (_, t) in zip(averaged_buffers, targets)
        ]
        for targets in (shared, own)
    ]
    out.append(
        DionReplicaState(
            _placed(node.count, target.count),
            jax.tree_util.tree_unflatten(treedef, fields[0]),
            jax.tree_util.tree_unflatten(treedef, fields[1]),
            jax.tree.map(_placed, node.q, target.q),
        )
    )
  return jax.tree.unflatten(like_def, out)


def _placed(x: jax.Array, like: Any) -> jax.Array:
  """``x`` where ``like`` (an array or a struct) lies, when it says."""
  sharding = typed_sharding(like)
  if not isinstance(sharding, NamedSharding):
    return x
  if isinstance(x, jax.core.Tracer):
    if all(t == AxisType.Explicit for t in sharding.mesh.axis_types):
      return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)
  if not isinstance(sharding.mesh, jax.sharding.Mesh):
    return x  # an abstract mesh (jax.eval_shape's) names no devices
  return jax.device_put(x, sharding)
