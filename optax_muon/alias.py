"""``muon``: the full optimizer, Muon on matrices and AdamW on everything else."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_muon import tree_utils
from optax_muon.coefficients import CoefficientsLike
from optax_muon.qk_clip import qk_clip, then_clip
from optax_muon.routing import ADAM, DEFAULT_ADAM_PATTERN, MUON, route
from optax_muon.sharding import place_like_params, resolve_param_shardings
from optax_muon.transform import (MuonTransformation, check_number, inside_shard_map,
                                  scale_by_muon, state_dtype, with_config)
from optax_muon.weight_decay import add_cautious_decayed_weights

#: AdamW's epsilon when neither ``adam_eps`` nor ``eps`` is given (optax's default).
ADAM_EPS = 1e-8


def _cast_tree(tree: Any, dtypes: Any) -> Any:
  return jax.tree.map(lambda x, d: x.astype(d), tree, dtypes)


def with_float32_moments(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Runs ``inner`` on float32 copies of 16-bit leaves, so that its state is float32.

  AdamW in float16 divides by √ν + ε with ε = 1e-8 below float16's smallest value (zero
  gradients give 0/0) and squares gradients above 256 past its largest; in float32 neither
  happens. Updates come back in each leaf's own dtype; other leaves pass through as they
  are.
  """
  widen = lambda tree: jax.tree.map(lambda x: x.astype(state_dtype(x.dtype)), tree)

  def init_fn(params):
    return inner.init(widen(params))

  def update_fn(updates, state, params=None, **extra_args):
    dtypes = jax.tree.map(lambda x: x.dtype, updates)
    wide_params = None if params is None else widen(params)
    out, state = inner.update(widen(updates), state, wide_params, **extra_args)
    return _cast_tree(out, dtypes), state

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
    bias_correction: bool = True,
    compute_dtype: jax.typing.DTypeLike | None = None,
    method: str = "auto",
    gram_restart: int | None = None,
    scale: str | None = "jordan",
    labels: Any = None,
    adam_pattern: str | None = DEFAULT_ADAM_PATTERN,
    adam_eps: jax.typing.ArrayLike | None = None,
    adam_weight_decay_mask: Any = None,
    adam_nesterov: bool = False,
    bucket: bool = True,
    param_shardings: Any = None,
    replica_policy: str = "split",
    wire_dtype: jax.typing.DTypeLike | None = None,
    exchange: str = "group",
    normalization: str | None = None,
    normalization_beta: jax.typing.ArrayLike = 0.95,
    cautious_weight_decay: bool = False,
    qk_clip_threshold: jax.typing.ArrayLike | None = None,
    qk_clip_alpha: jax.typing.ArrayLike = 0.5,
    qk_clip_heads: Any = None,
) -> MuonTransformation:
  """Muon for the network's matrices, AdamW for the rest.

  Accepts every argument of ``optax.contrib.muon``, in its order and with its meaning;
  the options after ``consistent_rms`` are this package's. Where the two differ by
  design (which leaves go to AdamW, AdamW rather than NAdamW there, the coefficient-table
  slicing), the README's "Coming from optax.contrib.muon" says so.

  Muon leaves: W ← W − η·(factor·NS(momentum) + λ·W) (decoupled weight decay λ).
  AdamW leaves: ``optax.adamw`` (``adam_nesterov=True`` gives optax.contrib's NAdamW),
  with float32 moments for 16-bit leaves.
  Routing (see ``routing.route`` and ``summarize``): ``labels`` if given, else
  ``muon_weight_dimension_numbers`` if given (``None`` entries → AdamW, as in
  ``optax.contrib.muon``), else 2-D leaves whose path does not match ``adam_pattern``.

  Args:
    learning_rate: Muon's learning rate η, a scalar or an ``optax.Schedule``.
    ns_coeffs, ns_steps: Newton–Schulz coefficients and steps (see ``scale_by_muon``).
    beta: Muon's momentum decay, in [0, 1).
    eps: the NS normalization epsilon (``None``: the preset's), and AdamW's epsilon when
      ``adam_eps`` is not given (``None``: 1e-8), as ``optax.contrib.muon``'s ``eps``.
    weight_decay: λ for Muon leaves (multiplied by the learning rate, as in AdamW).
    weight_decay_mask: tree, prefix tree or callable of bools selecting decayed Muon leaves.
    mu_dtype: dtype of Muon's momentum and AdamW's first moment; ``None`` keeps the
      params' dtype, except float32 for 16-bit params.
    nesterov: Nesterov momentum for Muon (AdamW's is ``adam_nesterov``).
    adaptive, preconditioning, consistent_rms: see ``scale_by_muon``.
    adam_b1, adam_b2, adam_eps_root: AdamW's moments.
    adam_weight_decay, adam_weight_decay_mask: AdamW's decoupled weight decay.
    adam_learning_rate: AdamW's learning rate; ``None`` uses ``learning_rate``.
    muon_weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf (tree, prefix tree or
      callable); describes ≥3-D leaves (stacked layers, conv kernels, experts, heads).
    momentum, bias_correction: Muon's momentum form, see ``scale_by_muon``.
    compute_dtype, method, gram_restart, bucket: Newton–Schulz options, see
      ``newton_schulz``.
    scale: the shape factor, ``"jordan"`` (default), ``"spectral"`` or ``None``.
    labels: ``"muon"``/``"adam"`` per leaf (tree, prefix tree or callable); overrides the
      other routing rules.
    adam_pattern: regex; under the default rule, 2-D leaves whose path matches go to AdamW.
    adam_eps: AdamW's epsilon (overrides ``eps`` for AdamW).
    adam_nesterov: use NAdamW (optax.contrib.muon's choice) instead of AdamW.
    param_shardings, replica_policy, wire_dtype, exchange: sharding options, see
      ``scale_by_muon``.
    normalization, normalization_beta: ``"neuron"`` for NorMuon on the Muon leaves, see
      ``scale_by_muon``.
    cautious_weight_decay: apply both weight decays (``weight_decay``,
      ``adam_weight_decay``) only where the parameter and the update (before the learning
      rate) agree in sign: W ← W − η·λ·W·[W ⊙ U ≥ 0] − η·U (see
      ``weight_decay.add_cautious_decayed_weights``).
    qk_clip_threshold: τ for QK-clip (MuonClip, see ``qk_clip``), applied last, to the new
      parameters; ``None``: off. ``update`` then takes ``attn_logit_max=``.
    qk_clip_alpha: QK-clip's α, the query's share of the rescale.
    qk_clip_heads: ``QKClipHeads`` per leaf (tree, prefix tree or callable): the query and
      key projections and their head axes; required with ``qk_clip_threshold``.

  Returns:
    A ``MuonTransformation``; ``summarize(params, tx)`` shows where every leaf goes.

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
  check_number("adam_b1", adam_b1, 0.0, 1.0)
  check_number("adam_b2", adam_b2, 0.0, 1.0)
  check_number("adam_eps", adam_eps, 0.0)
  check_number("weight_decay", weight_decay, 0.0)
  check_number("adam_weight_decay", adam_weight_decay, 0.0)
  if (qk_clip_threshold is None) != (qk_clip_heads is None):
    raise ValueError("qk_clip_threshold and qk_clip_heads go together: QK-clip needs both "
                     f"(got qk_clip_threshold={qk_clip_threshold!r} and qk_clip_heads "
                     f"{'given' if qk_clip_heads is not None else 'None'}).")
  muon_tx = scale_by_muon(
      ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
      preconditioning=preconditioning,
      weight_dimension_numbers=muon_weight_dimension_numbers,
      consistent_rms=consistent_rms, momentum=momentum, bias_correction=bias_correction,
      compute_dtype=compute_dtype, method=method, gram_restart=gram_restart, scale=scale,
      bucket=bucket, param_shardings=param_shardings, replica_policy=replica_policy,
      wire_dtype=wire_dtype, exchange=exchange, normalization=normalization,
      normalization_beta=normalization_beta)

  def router(params):
    return route(params, labels=labels, weight_dimension_numbers=muon_weight_dimension_numbers,
                 adam_pattern=adam_pattern)

  def param_labels(params):
    _, treedef = tree_utils.flatten_positions(params)
    return jax.tree_util.tree_unflatten(
        treedef, [r.label if r is not None else ADAM for r in router(params)])

  # The decay stage is always there (even for λ = 0) so that the state's structure does
  # not depend on whether λ is a Python number or traced (optax.inject_hyperparams).
  decay = add_cautious_decayed_weights if cautious_weight_decay else optax.add_decayed_weights
  muon_chain = optax.chain(muon_tx, decay(weight_decay, weight_decay_mask),
                           optax.scale_by_learning_rate(learning_rate))
  if adam_eps is None:
    adam_eps = ADAM_EPS if eps is None else eps
  # optax.adamw's own chain, with the decay stage chosen above.
  adam_tx = with_float32_moments(optax.chain(
      optax.scale_by_adam(b1=adam_b1, b2=adam_b2, eps=adam_eps, eps_root=adam_eps_root,
                          mu_dtype=None if mu_dtype is None else jnp.dtype(mu_dtype),
                          nesterov=adam_nesterov),
      decay(adam_weight_decay, adam_weight_decay_mask),
      optax.scale_by_learning_rate(
          learning_rate if adam_learning_rate is None else adam_learning_rate)))
  tx = optax.partition({MUON: muon_chain, ADAM: adam_tx}, param_labels)
  clip = None
  if qk_clip_threshold is not None:
    clip = qk_clip(qk_clip_threshold, qk_clip_alpha, heads=qk_clip_heads)
    tx = then_clip(tx, clip)
  tx = _state_placed_like_params(tx, param_shardings)
  return with_config(tx, dataclasses.replace(
      muon_tx.muon_config, cautious_weight_decay=cautious_weight_decay), router, clip)


def _state_placed_like_params(tx: optax.GradientTransformation, param_shardings: Any
                              ) -> optax.GradientTransformationExtraArgs:
  """``tx`` whose ``init`` puts every param-shaped state array where its param lives
  (``sharding.place_like_params``): on an Auto mesh, ``jax.jit(tx.init)`` would otherwise
  give replicated momenta."""

  def init_fn(params):
    state = tx.init(params)
    if param_shardings is None or inside_shard_map():
      return state
    return place_like_params(state, params, resolve_param_shardings(param_shardings, params))

  return optax.GradientTransformationExtraArgs(init_fn, tx.update)
