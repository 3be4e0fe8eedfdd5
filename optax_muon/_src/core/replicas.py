"""Data-parallel replicas whose gradients are kept apart: the replica axis of a
gradient, its mean, and ``per_replica``, which makes such gradients.

With a compressed replica sync (``dion(..., replica_axes=...)``) the optimizer
receives each replica's own gradient. Under ``jax.jit`` a gradient leaf then
carries a leading *replica axis*: ``(replicas, *param_shape)``, split over the
replica mesh axes, entry i the gradient of replica i's share of the batch.
Inside a ``shard_map`` whose manual axes include the replica axes a device's
gradient is simply its replica's, shaped like the param's block, and sums over
replicas are ``psum``s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from optax_muon._src.core import tree_utils
from optax_muon._src.core.sharding import manual_axes, typed_sharding


def check_replica_mesh(
    mesh: Any, replica_axes: tuple[str, ...], where: str, fix: str
) -> None:
  """Raises: ValueError (starting with ``where``) unless ``mesh`` is a mesh
  with every replica axis; ``fix`` says how to give one."""
  if mesh is None or mesh.empty:
    raise ValueError(f"{where}: replica_axes={replica_axes} needs {fix}.")
  missing = [a for a in replica_axes if a not in mesh.shape]
  if missing:
    raise ValueError(
        f"{where}: replica axes {missing} are not axes of the mesh"
        f" {dict(mesh.shape)}."
    )


def replicas_are_manual(replica_axes: tuple[str, ...]) -> bool:
  """Whether the replica axes are manual here (inside ``shard_map`` over them),
  so that each device holds its own replica's gradient without a replica
  axis."""
  return bool(replica_axes) and set(replica_axes) <= manual_axes()


def replica_mean(x: jax.Array, replica_axes: tuple[str, ...]) -> jax.Array:
  """The mean over the replicas of one gradient leaf: over its leading replica
  axis under ``jax.jit``, a ``psum`` where the replica axes are manual."""
  if replicas_are_manual(replica_axes):
    return jax.lax.psum(x, replica_axes) / jax.lax.psum(1, replica_axes)
  return jnp.mean(x, axis=0)


def without_replica_axis(
    tree: Any, replica_axes: tuple[str, ...], what: str = "gradient"
) -> Any:
  """``tree``'s array leaves as ``jax.ShapeDtypeStruct`` s without their leading
  replica axis (their typed sharding without its first entry); ``tree`` itself
  where the replica axes are manual.

  Raises:
    ValueError: naming the leaf, for a leaf with no leading axis.
  """
  if not replica_axes or replicas_are_manual(replica_axes):
    return tree

  def strip(path, x):
    if not tree_utils.is_array_leaf(x):
      return x
    if x.ndim == 0:
      raise ValueError(
          f"{tree_utils.path_str(path)}: with replica_axes={replica_axes} each"
          f" {what} leaf has a leading replica axis (replicas, *param shape);"
          f" got a scalar. See optax_muon.per_replica."
      )
    sharding = typed_sharding(x)
    if isinstance(sharding, NamedSharding):
      spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
      sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))
    else:
      sharding = None
    return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)

  return jax.tree_util.tree_map_with_path(
      strip, tree, is_leaf=tree_utils.is_placeholder
  )


def check_replica_count(
    tree: Any, replica_axes: tuple[str, ...], mesh: Any
) -> None:
  """Raises: ValueError naming the leaf whose leading axis is not the replica
  count of ``mesh`` (nothing to check where the replica axes are manual)."""
  if not replica_axes or replicas_are_manual(replica_axes) or mesh is None:
    return
  replicas = math.prod(mesh.shape[a] for a in replica_axes)
  for path, x in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=tree_utils.is_placeholder
  ):
    if tree_utils.is_array_leaf(x) and x.shape[0] != replicas:
      raise ValueError(
          f"{tree_utils.path_str(path)}: with replica_axes={replica_axes} each"
          f" gradient leaf is (replicas, *param shape) with {replicas} replicas"
          f" (mesh {dict(mesh.shape)}); got shape {x.shape}. See"
          " optax_muon.per_replica."
      )


def averaged_over_replicas(
    inner: optax.GradientTransformation, replica_axes: tuple[str, ...]
) -> optax.GradientTransformationExtraArgs:
  """``inner`` applied to the replicas' mean gradient, with ``inner``'s state
  (the AdamW leaves of a compressed sync: their gradients are all-reduced as in
  plain data parallelism)."""
  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, **extra_args):
    mean = jax.tree.map(lambda x: replica_mean(x, replica_axes), updates)
    return inner.update(mean, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)


def per_replica(
    fn: Callable[..., Any],
    replica_axes: str | Sequence[str],
    *,
    batch_argnums: int | Sequence[int] = 1,
    mesh: Any = None,
) -> Callable[..., Any]:
  """``fn`` run once per data-parallel replica, on that replica's share of the
  batch, its outputs stacked along a new leading replica axis.

  The gradients a compressed replica sync takes under ``jax.jit``: with
  ``loss(params, batch)``, ``per_replica(jax.value_and_grad(loss), "data")``
  returns each replica's loss and gradient, shaped (replicas, …) and split over
  the replica axes. The batch arguments are split along their first axis over
  the replica axes; the other arguments (the params) are taken whole, as they
  lie along the other mesh axes (FSDP, tensor parallel), which stay under the
  compiler's control.

  Args:
    fn: the per-replica function, e.g. ``jax.value_and_grad(loss)``.
    replica_axes: the data-parallel mesh axis name(s).
    batch_argnums: which positional arguments are split over the replicas.
    mesh: the mesh; default: the one set with ``jax.set_mesh``.

  Returns:
    A function of ``fn``'s arguments whose every output leaf has a leading
    replica axis.

  Raises:
    ValueError: without a mesh, or for replica axes the mesh lacks.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((2, 4), ("data", "fsdp"))
    >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
    >>> w = jax.device_put(jnp.ones((8, 4)), jax.NamedSharding(mesh, P("fsdp")))
    >>> x = jax.device_put(jnp.ones((16, 8)),
    ...                    jax.NamedSharding(mesh, P(("data", "fsdp"))))
    >>> with jax.set_mesh(mesh):
    ...   losses, grads = jax.jit(
    ...       optax_muon.per_replica(jax.value_and_grad(loss), "data"))(w, x)
    >>> losses.shape, grads.shape
    ((2,), (2, 8, 4))
  """
  axes = (
      (replica_axes,) if isinstance(replica_axes, str) else tuple(replica_axes)
  )
  split = (
      {batch_argnums} if isinstance(batch_argnums, int) else set(batch_argnums)
  )

  def wrapped(*args):
    where = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    check_replica_mesh(
        where,
        axes,
        "per_replica",
        "a mesh: call it under `with jax.set_mesh(mesh):` or pass mesh=",
    )
    in_specs = tuple(
        PartitionSpec(axes) if k in split else PartitionSpec()
        for k in range(len(args))
    )

    def body(*local):
      return jax.tree.map(lambda x: jnp.asarray(x)[None], fn(*local))

    # check_vma=False: with JAX's replication types, differentiating ``fn``
    # by arguments that are the same on every replica would sum the gradient
    # over the replicas; each replica's own is wanted here.
    return jax.shard_map(
        body,
        mesh=where,
        in_specs=in_specs,
        out_specs=PartitionSpec(axes),
        axis_names=frozenset(axes),
        check_vma=False,
    )(*args)

  return wrapped
