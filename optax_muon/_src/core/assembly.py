"""The pieces a full optimizer (``muon``, ``dion``) is assembled from, as
``optax.contrib.muon`` assembles its own: the AdamW (NAdamW) branch
(``adamw``), the weight decay stage (``decayed_weights``), and
``matrices_and_adam``, the routed ``optax.partition`` of the matrix chain the
alias builds and the AdamW branch, QK-clip last.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_muon._src.core.dtypes import moment_dtype
from optax_muon._src.core.options import check_number
from optax_muon._src.core.replicas import (
    averaged_over_replicas,
    without_replica_axis,
)
from optax_muon._src.core.routing import ADAM, MUON
from optax_muon._src.core.scaling import check_shape_scale
from optax_muon._src.core.sharding import inside_shard_map, place_like_params
from optax_muon._src.core.spec import TreeOptions, tree_spec
from optax_muon._src.core.tree_utils import check_same_shapes
from optax_muon._src.core.user_warnings import OncePerTransformation
from optax_muon._src.core.weight_decay import add_cautious_decayed_weights

#: AdamW's epsilon when ``eps`` is not given (optax's default).
ADAM_EPS = 1e-8


def with_float32_moments(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformation:
  """Runs ``inner`` on float32 copies of 16-bit leaves, so that its state is
  float32.

  AdamW in float16 divides by √ν + ε with ε = 1e-8 below float16's smallest
  value (zero gradients give 0/0) and squares gradients above 256 past its
  largest; in float32 neither happens. Updates come back in each leaf's own
  dtype; other leaves pass through as they are.
  """
  widen = lambda tree: jax.tree.map(
      lambda x: x.astype(moment_dtype(x.dtype)), tree
  )

  def init_fn(params):
    return inner.init(widen(params))

  def update_fn(updates, state, params=None, **extra_args):
    dtypes = jax.tree.map(lambda x: x.dtype, updates)
    wide_params = None if params is None else widen(params)
    out, state = inner.update(widen(updates), state, wide_params, **extra_args)
    return jax.tree.map(lambda x, d: x.astype(d), out, dtypes), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def followed_by_stateless(
    tx: optax.GradientTransformation, *stages: optax.GradientTransformation
) -> optax.GradientTransformationExtraArgs:
  """``tx``, then each of ``stages`` (transformations without state), with
  ``tx``'s state.

  ``optax.chain`` would add an empty entry per stage to the state; this keeps
  the state's structure what ``tx`` alone gives, so that QK-clip leaves it as it
  was (and turning QK-clip on or off leaves checkpoints compatible).

  Args:
    tx: the transformation whose state is kept.
    *stages: stateless transformations, applied in order after ``tx``; their
      ``init`` runs too (it validates).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` forwards every
    extra argument to every stage that takes it.
  """
  tx = optax.with_extra_args_support(tx)
  stages = tuple(optax.with_extra_args_support(stage) for stage in stages)

  def init_fn(params):
    for stage in stages:
      stage.init(params)
    return tx.init(params)

  def update_fn(updates, state, params=None, **extra_args):
    updates, state = tx.update(updates, state, params, **extra_args)
    for stage in stages:
      updates, _ = stage.update(
          updates, optax.EmptyState(), params, **extra_args
      )
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_alias_arguments(
    *,
    learning_rate: Any,
    adam_learning_rate: Any,
    adam_b1: Any,
    adam_b2: Any,
    weight_decay: Any,
    adam_weight_decay: Any,
    scale: str | None,
    consistent_rms: Any,
) -> None:
  """Checks the arguments ``muon`` and ``dion`` share.

  Raises:
    ValueError: naming the argument.
  """
  check_number("learning_rate", learning_rate, 0.0)
  check_number("adam_learning_rate", adam_learning_rate, 0.0)
  check_number("adam_b1", adam_b1, 0.0, 1.0)
  check_number("adam_b2", adam_b2, 0.0, 1.0)
  check_number("weight_decay", weight_decay, 0.0)
  check_number("adam_weight_decay", adam_weight_decay, 0.0)
  check_shape_scale(scale, consistent_rms)
  if consistent_rms is not None and scale == "spectral":
    raise ValueError(
        "consistent_rms replaces the shape scale; pass it or "
        "scale='spectral', not both."
    )


def decayed_weights(
    weight_decay: Any, mask: Any, *, cautious: bool
) -> optax.GradientTransformation:
  """The decoupled weight decay stage: ``optax.add_decayed_weights``, or
  ``add_cautious_decayed_weights`` with ``cautious``.

  Both optimizers keep it in their chains even for λ = 0 (as
  ``optax.contrib.muon`` and ``optax.adamw`` do), so that the state's structure
  does not depend on whether λ is a Python number or traced
  (``optax.inject_hyperparams``).
  """
  decay = (
      add_cautious_decayed_weights if cautious else optax.add_decayed_weights
  )
  return decay(weight_decay, mask)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: Any,
    b2: Any,
    eps: float | None,
    eps_root: Any,
    weight_decay: Any,
    weight_decay_mask: Any,
    mu_dtype: Any,
    nesterov: bool,
    cautious: bool,
) -> optax.GradientTransformationExtraArgs:
  """``optax.adamw``'s chain (``scale_by_adam``, the weight decay,
  ``scale_by_learning_rate``) with ``decayed_weights``' decay, on float32
  moments for 16-bit leaves (``with_float32_moments``).

  Its state is ``optax.adamw``'s; ``eps=None`` is ``ADAM_EPS``; ``nesterov``
  makes it NAdamW.
  """
  return with_float32_moments(
      optax.chain(
          optax.scale_by_adam(
              b1=b1,
              b2=b2,
              eps=ADAM_EPS if eps is None else eps,
              eps_root=eps_root,
              mu_dtype=mu_dtype,
              nesterov=nesterov,
          ),
          decayed_weights(weight_decay, weight_decay_mask, cautious=cautious),
          optax.scale_by_learning_rate(learning_rate),
      )
  )


def matrices_and_adam(
    matrices: optax.GradientTransformation,
    adam: optax.GradientTransformation,
    options: TreeOptions,
    *,
    keep: type | tuple[type, ...],
    replica_axes: tuple[str, ...] = (),
) -> optax.GradientTransformationExtraArgs:
  """``optax.partition({"muon": matrices, "adam": adam})`` routed by
  ``options``, then QK-clip (stateless, so the state is the partition's with or
  without it); ``init`` warns about surprising routing and places AdamW's
  moments, ``update`` checks the gradients' shapes.

  Args:
    matrices: the matrices' chain (the direction, the shape factor, the weight
      decay, the learning rate).
    adam: the other leaves' optimizer (``adamw``).
    options: the static options (routing, shapes, shardings, QK-clip).
    keep: the direction's state type(s), placed by the direction itself.
    replica_axes: data-parallel axes whose gradients arrive per replica
      (``core.replicas``): ``matrices`` takes them so, ``adam`` their mean.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is
    ``optax.partition``'s.
  """
  tx = _partition(
      {MUON: matrices, ADAM: adam},
      lambda params: tree_spec(params, options).labels(params),
      replica_axes,
  )
  if options.qk_clip is not None:
    tx = followed_by_stateless(tx, options.qk_clip.transformation())
  return _checked_and_placed(tx, options, keep, replica_axes)


def _partition(
    transforms: dict[str, optax.GradientTransformation],
    labels: Any,
    replica_axes: tuple[str, ...],
) -> optax.GradientTransformationExtraArgs:
  """``optax.partition(transforms, labels)``; with ``replica_axes`` the AdamW
  branch takes the replicas' mean gradient and the labels come from the params,
  whose shapes the per-replica gradients' leading axis would hide."""
  if not replica_axes:
    return optax.partition(transforms, labels)
  transforms = dict(
      transforms,
      **{ADAM: averaged_over_replicas(transforms[ADAM], replica_axes)},
  )
  init = optax.partition(transforms, labels).init

  def update_fn(updates, state, params=None, **extra_args):
    shapes = (
        params
        if params is not None
        else without_replica_axis(updates, replica_axes)
    )
    return optax.partition(transforms, labels(shapes)).update(
        updates, state, params, **extra_args
    )

  return optax.GradientTransformationExtraArgs(init, update_fn)


def _checked_and_placed(
    tx: optax.GradientTransformation,
    options: TreeOptions,
    keep: type | tuple[type, ...],
    replica_axes: tuple[str, ...] = (),
) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``init`` warns (once) about what the routing did that the user
  may not expect and puts AdamW's moments where their params live, and whose
  ``update`` names the leaf whose gradient does not fit its param.

  The direction's state (of a type in ``keep``) is made in place; AdamW's would
  be replicated by ``jax.jit(tx.init)`` on an Auto mesh.
  """
  tx = optax.with_extra_args_support(tx)
  warnings = OncePerTransformation()

  def init_fn(params):
    spec = tree_spec(params, options)
    warnings.warn(spec.notices)
    state = tx.init(params)
    if options.param_shardings is None or inside_shard_map():
      return state
    return place_like_params(
        state,
        params,
        [None if leaf is None else leaf.sharding for leaf in spec.leaves],
        keep=keep,
    )

  def update_fn(updates, state, params=None, **extra_args):
    if params is not None:
      check_same_shapes(
          without_replica_axis(updates, replica_axes), params, "the param"
      )
    return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
