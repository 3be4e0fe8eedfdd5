"""``muon``: the full optimizer, Muon on matrices and AdamW (NAdamW) on everything else."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

from optax_muon import tree_utils
from optax_muon.coefficients import CoefficientsLike
from optax_muon.layout import is_dimension_numbers
from optax_muon.momentum import moment_dtype
from optax_muon.options import (NorMuon, NSOptions, Routing, ShardingOptions, check_number,
                                check_option)
from optax_muon.qk_clipping import QKClip
from optax_muon.routing import ADAM, MUON
from optax_muon.scaling import check_shape_scale
from optax_muon.sharding import inside_shard_map, place_like_params
from optax_muon.spec import MuonOptions, tree_spec
from optax_muon.tree_utils import check_same_shapes
from optax_muon.user_warnings import OncePerTransformation
from optax_muon.transform import (MuonHyperparams, MuonState, branch_options, muon_direction,
                                  resolve_muon_arguments, shape_scaling, static_or_injected)
from optax_muon.weight_decay import add_cautious_decayed_weights

#: AdamW's epsilon when ``eps`` is not given (optax's default).
ADAM_EPS = 1e-8


def with_float32_moments(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Runs ``inner`` on float32 copies of 16-bit leaves, so that its state is float32.

  AdamW in float16 divides by √ν + ε with ε = 1e-8 below float16's smallest value (zero
  gradients give 0/0) and squares gradients above 256 past its largest; in float32 neither
  happens. Updates come back in each leaf's own dtype; other leaves pass through as they
  are.
  """
  widen = lambda tree: jax.tree.map(lambda x: x.astype(moment_dtype(x.dtype)), tree)

  def init_fn(params):
    return inner.init(widen(params))

  def update_fn(updates, state, params=None, **extra_args):
    dtypes = jax.tree.map(lambda x: x.dtype, updates)
    wide_params = None if params is None else widen(params)
    out, state = inner.update(widen(updates), state, wide_params, **extra_args)
    return jax.tree.map(lambda x, d: x.astype(d), out, dtypes), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def followed_by_stateless(tx: optax.GradientTransformation,
                          *stages: optax.GradientTransformation
                          ) -> optax.GradientTransformationExtraArgs:
  """``tx``, then each of ``stages`` (transformations without state), with ``tx``'s state.

  ``optax.chain`` would add an empty entry per stage to the state; this keeps the state's
  structure what ``tx`` alone gives, so that the shape factor and QK-clip leave it as it
  was (and turning QK-clip on or off leaves checkpoints compatible).

  Args:
    tx: the transformation whose state is kept.
    *stages: stateless transformations, applied in order after ``tx``; their ``init`` runs
      too (it validates).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` forwards every extra argument
    to every stage that takes it.
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
      updates, _ = stage.update(updates, optax.EmptyState(), params, **extra_args)
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: CoefficientsLike = "jordan",
    ns_steps: int | None = None,
    beta: jax.typing.ArrayLike = 0.95,
    eps: float | None = None,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    adam_eps_root: jax.typing.ArrayLike = 0.0,
    adam_weight_decay: jax.typing.ArrayLike = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: jax.typing.ArrayLike | None = None,
    momentum: str = "ema",
    scale: str | None = "jordan",
    ns_options: NSOptions | None = None,
    normalization: NorMuon | None = None,
    routing: Routing | None = None,
    param_shardings: Any = None,
    sharding: ShardingOptions | None = None,
    adam_weight_decay_mask: Any = None,
    cautious_weight_decay: bool = False,
    qk_clip: QKClip | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Muon for the network's matrices, AdamW (NAdamW with ``nesterov``) for the rest.

  Takes every argument of ``optax.contrib.muon``, in its order and with its meaning; the
  options after ``consistent_rms`` are this package's. Where the two differ by design
  (which leaves go to AdamW by default, the coefficient-table slicing), the README's
  "Coming from optax.contrib.muon" says so.

  Muon leaves: W ← W − η·(scale(n_in, n_out)·NS(momentum) + λ·W) (decoupled decay λ): the
  direction of ``scale_by_muon``, then ``scale_by_shape``, then the weight decay, then the
  learning rate, as ``optax.contrib.muon`` chains them.
  AdamW leaves: ``optax.adamw`` with optax's ``nesterov`` (NAdamW by default, as
  ``optax.contrib.muon``), with float32 moments for 16-bit leaves.
  Routing (see ``Routing``, ``route`` and ``summarize``): ``routing.labels`` if given,
  else ``muon_weight_dimension_numbers`` if given (``None`` entries → AdamW, as in
  ``optax.contrib.muon``), else 2-D leaves whose path does not match
  ``routing.adam_pattern`` (embeddings and output heads go to AdamW).

  Args:
    learning_rate: Muon's learning rate η, a scalar or an ``optax.Schedule``.
    ns_coeffs, ns_steps: Newton–Schulz coefficients and steps (see ``scale_by_muon``).
    beta: Muon's momentum decay, in [0, 1).
    eps: the NS normalization epsilon (``None``: the preset's) and AdamW's epsilon
      (``None``: 1e-8), as ``optax.contrib.muon``'s ``eps`` (an ``NSCoefficients``
      passed as ``ns_coeffs`` carries an NS epsilon of its own).
    weight_decay: λ for Muon leaves (multiplied by the learning rate, as in AdamW).
    weight_decay_mask: tree, prefix tree or callable of bools selecting decayed Muon leaves.
    mu_dtype: dtype of Muon's momentum and AdamW's first moment; ``None`` keeps the
      params' dtype, except float32 for 16-bit params.
    nesterov: Nesterov momentum for Muon, and NAdamW rather than AdamW on the other leaves
      (optax.contrib's meaning).
    adaptive, preconditioning: see ``scale_by_muon``.
    adam_b1, adam_b2, adam_eps_root: AdamW's moments.
    adam_weight_decay: AdamW's decoupled weight decay.
    adam_learning_rate: AdamW's learning rate; ``None`` uses ``learning_rate``.
    muon_weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf (tree, prefix tree or
      callable); describes ≥3-D leaves (stacked layers, conv kernels, experts, heads).
    consistent_rms: k: scale Muon's updates by k·sqrt(max(n_in, n_out)) instead of
      ``scale`` (RMS ≈ k for every shape; 0.2 matches AdamW).
    momentum: Muon's momentum form, see ``scale_by_muon``.
    scale: the shape factor: ``"jordan"`` sqrt(max(1, n_out/n_in)) (optax's),
      ``"spectral"`` sqrt(n_out/n_in), or ``None`` (1).
    ns_options: how NS runs (``NSOptions``).
    normalization: ``NorMuon(beta)`` on the Muon leaves, or None.
    routing: which leaf goes where (``Routing``: labels, adam_pattern (embeddings, heads, norms)).
    param_shardings, sharding: for sharded params, see ``scale_by_muon``.
    adam_weight_decay_mask: tree, prefix tree or callable of bools selecting decayed AdamW
      leaves.
    cautious_weight_decay: apply both weight decays only where the parameter and the
      update (before the learning rate) agree in sign: W ← W − η·λ·W·[W ⊙ U ≥ 0] − η·U
      (see ``add_cautious_decayed_weights``).
    qk_clip: ``QKClip(threshold, heads, alpha)`` for QK-clip (MuonClip), applied last, to
      the new parameters; ``update`` then takes ``attn_logit_max=``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``summarize(params, tx)`` shows where
    every leaf goes.

  Raises:
    ValueError: for invalid options (naming the argument), and at ``init`` for routing
      trees that don't match the params or leaves Muon can't take (naming the leaf).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> params = {"embed": jnp.zeros((100, 16)), "w": jnp.zeros((16, 16)),
    ...           "b": jnp.zeros(16)}
    >>> tx = optax_muon.muon(0.02, adam_learning_rate=3e-3)
    >>> [(r.path, r.optimizer) for r in optax_muon.summarize(params, tx).rows]
    [('b', 'adam'), ('embed', 'adam'), ('w', 'muon')]
    >>> state = tx.init(params)
    >>> updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.

    Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_,
    2025.

    DeepSeek-AI, `DeepSeek-V4 technical report`, 2026 (hybrid Newton–Schulz schedule:
    ``ns_coeffs="deepseek_v4"``).

    Chen et al., `Cautious Weight Decay <https://arxiv.org/abs/2510.12402>`_, 2025.
  """
  coefficients = resolve_muon_arguments(ns_coeffs, ns_steps, beta, eps, momentum,
                                        preconditioning)
  check_alias_arguments(learning_rate=learning_rate, adam_learning_rate=adam_learning_rate,
                        adam_b1=adam_b1, adam_b2=adam_b2, weight_decay=weight_decay,
                        adam_weight_decay=adam_weight_decay, scale=scale,
                        consistent_rms=consistent_rms)
  options = MuonOptions(
      coefficients.steps, check_option("ns_options", ns_options, NSOptions, NSOptions()),
      tree_utils.freeze_prefix(muon_weight_dimension_numbers, is_value=is_dimension_numbers,
                               what="muon_weight_dimension_numbers"),
      param_shardings,
      check_option("sharding", sharding, ShardingOptions, ShardingOptions()),
      check_option("routing", routing, Routing, Routing()),
      check_option("normalization", normalization, NorMuon), scale,
      static_or_injected(consistent_rms), cautious_weight_decay,
      check_option("qk_clip", qk_clip, QKClip))
  direction = muon_direction(options, MuonHyperparams(
      coefficients, preconditioning, beta, momentum, nesterov, mu_dtype, adaptive))
  return matrices_and_adam(
      direction, options, learning_rate=learning_rate, consistent_rms=consistent_rms,
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
      adam=AdamBranch(adam_learning_rate, adam_b1, adam_b2, eps, adam_eps_root,
                      adam_weight_decay, adam_weight_decay_mask, mu_dtype, nesterov),
      keep=MuonState)


def check_alias_arguments(*, learning_rate: Any, adam_learning_rate: Any, adam_b1: Any,
                          adam_b2: Any, weight_decay: Any, adam_weight_decay: Any,
                          scale: str | None, consistent_rms: Any) -> None:
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
    raise ValueError("consistent_rms replaces the shape scale; pass it or "
                     "scale='spectral', not both.")


@dataclasses.dataclass(frozen=True)
class AdamBranch:
  """The AdamW (NAdamW) optimizer of the leaves that are not matrices.

  Attributes:
    learning_rate: its learning rate; None takes the matrices'.
    b1, b2, eps_root: its moments' decays and the root's epsilon.
    eps: its epsilon; None is ``ADAM_EPS``.
    weight_decay, weight_decay_mask: its decoupled weight decay and which leaves it decays.
    mu_dtype: its first moment's dtype, or None.
    nesterov: NAdamW rather than AdamW.
  """

  learning_rate: Any = None
  b1: Any = 0.9
  b2: Any = 0.999
  eps: float | None = None
  eps_root: Any = 0.0
  weight_decay: Any = 0.0
  weight_decay_mask: Any = None
  mu_dtype: Any = None
  nesterov: bool = True


def matrices_and_adam(direction: optax.GradientTransformation, options: MuonOptions, *,
                      learning_rate: optax.ScalarOrSchedule, consistent_rms: Any,
                      weight_decay: Any, weight_decay_mask: Any, adam: AdamBranch,
                      keep: type) -> optax.GradientTransformationExtraArgs:
  """The full optimizer around a matrix direction: routed by ``options``, the direction
  then the shape factor, the weight decay and the learning rate on the matrices, ``adam``
  on the rest, QK-clip last.

  Args:
    direction: the matrices' direction (``muon_direction`` or Dion's).
    options: the static options (routing, shapes, shardings, scale, decay kind, QK-clip).
    learning_rate: the matrices' learning rate.
    consistent_rms: the RMS-matching factor, or None (may be an injected array).
    weight_decay, weight_decay_mask: the matrices' decoupled weight decay.
    adam: the other leaves' optimizer.
    keep: the direction's state type (placed by the direction itself).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.
  """
  # The decay stage is always there (even for λ = 0) so that the state's structure does
  # not depend on whether λ is a Python number or traced (optax.inject_hyperparams).
  decay = (add_cautious_decayed_weights if options.cautious_weight_decay
           else optax.add_decayed_weights)
  muon_chain = optax.chain(
      followed_by_stateless(direction, shape_scaling(branch_options(options), consistent_rms,
                                                     options.scale)),
      decay(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate))
  # optax.adamw's own chain, with the decay stage chosen above.
  adam_chain = with_float32_moments(optax.chain(
      optax.scale_by_adam(b1=adam.b1, b2=adam.b2, eps=ADAM_EPS if adam.eps is None else adam.eps,
                          eps_root=adam.eps_root, mu_dtype=adam.mu_dtype,
                          nesterov=adam.nesterov),
      decay(adam.weight_decay, adam.weight_decay_mask),
      optax.scale_by_learning_rate(
          learning_rate if adam.learning_rate is None else adam.learning_rate)))
  tx = optax.partition({MUON: muon_chain, ADAM: adam_chain},
                       lambda params: tree_spec(params, options).labels(params))
  if options.qk_clip is not None:
    tx = followed_by_stateless(tx, options.qk_clip.transformation())
  return _checked_and_placed(tx, options, keep)


def _checked_and_placed(tx: optax.GradientTransformation, options: MuonOptions, keep: type
                        ) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``init`` warns (once) about what the routing did that the user may not
  expect and puts AdamW's moments where their params live, and whose ``update`` names the
  leaf whose gradient does not fit its param.

  The direction's state (of type ``keep``) is made in place; AdamW's would be replicated
  by ``jax.jit(tx.init)`` on an Auto mesh.
  """
  tx = optax.with_extra_args_support(tx)
  warnings = OncePerTransformation()

  def init_fn(params):
    spec = tree_spec(params, options)
    warnings.warn(spec.notices)
    state = tx.init(params)
    if options.param_shardings is None or inside_shard_map():
      return state
    return place_like_params(state, params, [None if leaf is None else leaf.sharding
                                             for leaf in spec.leaves], keep=keep)

  def update_fn(updates, state, params=None, **extra_args):
    if params is not None:
      check_same_shapes(updates, params, "the param")
    return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
