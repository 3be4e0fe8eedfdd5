"""Dion's per-replica buffers and the checkpoint: ``average_replicas`` and
``spread_replicas``.

With a compressed replica sync each replica keeps its own buffer Bᵢ
(``DionReplicaState``). Their mean follows Dion's recursion on averaged
gradients exactly, so the averaged state (a ``DionState``) is a lossless
checkpoint: it continues on any replica count once spread back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding

from optax_muon._src.core.sharding import typed_sharding
from optax_muon._src.dion.transform import DionReplicaState, DionState

_is_replica_state = lambda x: isinstance(x, DionReplicaState)
_is_state = lambda x: isinstance(x, (DionReplicaState, DionState))


def average_replicas(state: Any) -> Any:
  """The optimizer state with every replica's Dion buffer replaced by their
  mean.

  Every ``DionReplicaState`` in ``state`` (a ``dion`` or ``scale_by_dion`` state
  with ``replica_axes``, wherever it sits in a chain) becomes the ``DionState``
  of Dion on averaged gradients, the buffers' replica axis averaged away; the
  rest is left as it is. Save this (an orbax checkpoint) and restore it onto
  any replica count with ``spread_replicas``. Call it on global arrays (eagerly
  or under ``jax.jit``): the mean is an all-reduce over the replica axes.

  Args:
    state: an optimizer state.

  Returns:
    The state, averaged.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    >>> w = jax.device_put(jnp.zeros((16, 64)),
    ...                    jax.NamedSharding(mesh, jax.P("fsdp")))
    >>> tx = optax_muon.scale_by_dion(0.25, replica_axes="data")
    >>> state = tx.init({"w": w})
    >>> state.momentum["w"].shape            # a buffer per replica
    (2, 16, 64)
    >>> optax_muon.average_replicas(state).momentum["w"].shape
    (16, 64)
  """

  def averaged(node):
    if not _is_replica_state(node):
      return node
    return DionState(
        node.count,
        jax.tree.map(lambda b: jnp.mean(b, axis=0), node.momentum),
        node.q,
    )

  return jax.tree.map(averaged, state, is_leaf=_is_replica_state)


def spread_replicas(averaged: Any, like: Any) -> Any:
  """An averaged state (``average_replicas``) for a run of ``like``'s replica
  count: every replica starts from the averaged buffer.

  Args:
    averaged: the averaged state, e.g. restored from a checkpoint.
    like: the new run's state or its shapes: ``tx.init(params)``, or
      ``jax.eval_shape(tx.init, params)`` (with shardings, Explicit meshes).
      Its ``DionReplicaState`` s give the replica count and where each array
      lies.

  Returns:
    ``like``'s structure, with ``averaged``'s values (the averaged buffers
    repeated on every replica).

  Raises:
    ValueError: if the two states' structures differ beyond the Dion states.
  """
  like_nodes, like_def = jax.tree.flatten(like, is_leaf=_is_state)
  nodes, definition = jax.tree.flatten(averaged, is_leaf=_is_state)
  if definition != like_def:
    raise ValueError(
        "spread_replicas: the averaged state and `like` differ in structure"
        f" beyond their Dion states:\n{definition}\nagainst\n{like_def}."
    )
  out = []
  for node, target in zip(nodes, like_nodes):
    if not _is_replica_state(target):
      out.append(node)
      continue
    if not isinstance(node, DionState):
      raise ValueError(
          "spread_replicas: expected a DionState (average_replicas' output)"
          f" where `like` has a DionReplicaState; got {type(node).__name__}."
      )
    momentum = jax.tree.map(
        lambda b, t: _placed(jnp.broadcast_to(b, t.shape), t),
        node.momentum,
        target.momentum,
    )
    q = jax.tree.map(_placed, node.q, target.q)
    out.append(DionReplicaState(_placed(node.count, target.count), momentum, q))
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
  return jax.device_put(x, sharding)
