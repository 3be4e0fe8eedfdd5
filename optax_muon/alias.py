"""``muon``: the full optimizer, Muon on matrices and AdamW on everything else."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optax_muon import tree_utils
from optax_muon.coefficients import CoefficientsLike
from optax_muon.routing import ADAM, DEFAULT_ADAM_PATTERN, MUON, route
from optax_muon.transform import MuonTransformation, scale_by_muon, with_config


def _is_zero(x: Any) -> bool:
  return isinstance(x, (int, float)) and x == 0


def muon(
    learning_rate: optax.ScalarOrSchedule,
    *,
    beta: jax.typing.ArrayLike = 0.95,
    momentum: str = "ema",
    nesterov: bool = True,
    bias_correction: bool = True,
    mu_dtype: jax.typing.DTypeLike | None = None,
    coeffs: CoefficientsLike = "jordan",
    steps: int | None = None,
    compute_dtype: jax.typing.DTypeLike | None = None,
    eps: float | None = None,
    method: str = "auto",
    gram_restart: int | None = None,
    scale: str | None = "jordan",
    rms_scale: jax.typing.ArrayLike = 0.2,
    deepseek_gamma: jax.typing.ArrayLike = 0.2,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_decay_mask: Any = None,
    muon_weight_dimension_numbers: Any = None,
    labels: Any = None,
    adam_pattern: str | None = DEFAULT_ADAM_PATTERN,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    adam_eps: jax.typing.ArrayLike = 1e-8,
    adam_eps_root: jax.typing.ArrayLike = 0.0,
    adam_weight_decay: jax.typing.ArrayLike = 0.0,
    adam_weight_decay_mask: Any = None,
    adam_nesterov: bool = False,
    bucket: bool = True,
    param_shardings: Any = None,
    replica_policy: str = "split",
    wire_dtype: jax.typing.DTypeLike | None = None,
    exchange: str = "group",
) -> MuonTransformation:
  """Muon for the network's matrices, AdamW for the rest.

  Muon leaves: W ← W·(1 − η·λ) − η·factor·NS(momentum) (decoupled weight decay λ).
  AdamW leaves: ``optax.adamw`` (true AdamW; ``adam_nesterov=True`` gives NAdamW).
  Routing (see ``routing.route`` and ``summarize``): ``labels`` if given, else
  ``muon_weight_dimension_numbers`` if given (``None`` entries → AdamW, as in
  ``optax.contrib.muon``), else 2-D leaves whose path does not match ``adam_pattern``.

  Args:
    learning_rate: Muon's learning rate η, a scalar or an ``optax.Schedule``.
    beta, momentum, nesterov, bias_correction, mu_dtype: Muon's momentum, see
      ``scale_by_muon``.
    coeffs, steps, compute_dtype, eps, method, gram_restart: Newton–Schulz options, see
      ``newton_schulz``.
    scale, rms_scale, deepseek_gamma: the update scale, see ``scale_by_muon``.
    weight_decay: λ for Muon leaves (multiplied by the learning rate, as in AdamW).
    weight_decay_mask: tree, prefix tree or callable of bools selecting decayed Muon leaves.
    muon_weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf (tree, prefix tree or
      callable); describes ≥3-D leaves (stacked layers, conv kernels, experts, heads).
    labels: ``"muon"``/``"adam"`` per leaf (tree, prefix tree or callable); overrides the
      other routing rules.
    adam_pattern: regex; under the default rule, 2-D leaves whose path matches go to AdamW.
    adam_learning_rate: AdamW's learning rate; ``None`` uses ``learning_rate``.
    adam_b1, adam_b2, adam_eps, adam_eps_root: AdamW's moments.
    adam_weight_decay, adam_weight_decay_mask: AdamW's decoupled weight decay.
    adam_nesterov: use NAdamW (optax.contrib.muon's choice) instead of AdamW.
    bucket: stack same-shape matrices into one batched NS call.
    param_shardings, replica_policy, wire_dtype, exchange: sharding options, see
      ``scale_by_muon``.

  Returns:
    A ``MuonTransformation``; ``summarize(params, tx)`` shows where every leaf goes.

  Raises:
    ValueError: for invalid options, and at ``init`` for routing trees that don't match the
      params or leaves Muon can't take.
  """
  muon_tx = scale_by_muon(
      beta, momentum=momentum, nesterov=nesterov, bias_correction=bias_correction,
      mu_dtype=mu_dtype, coeffs=coeffs, steps=steps, compute_dtype=compute_dtype, eps=eps,
      method=method, gram_restart=gram_restart,
      scale=scale, rms_scale=rms_scale, deepseek_gamma=deepseek_gamma,
      weight_dimension_numbers=muon_weight_dimension_numbers,
      bucket=bucket, param_shardings=param_shardings, replica_policy=replica_policy,
      wire_dtype=wire_dtype, exchange=exchange)

  def router(params):
    return route(params, labels=labels, weight_dimension_numbers=muon_weight_dimension_numbers,
                 adam_pattern=adam_pattern)

  def param_labels(params):
    positions, treedef = tree_utils.flatten_positions(params)
    return jax.tree_util.tree_unflatten(
        treedef, [r.label if r is not None else ADAM for r in router(params)])

  muon_chain = [muon_tx]
  if not _is_zero(weight_decay):
    muon_chain.append(optax.add_decayed_weights(weight_decay, weight_decay_mask))
  muon_chain.append(optax.scale_by_learning_rate(learning_rate))
  adam_tx = optax.adamw(
      learning_rate if adam_learning_rate is None else adam_learning_rate,
      b1=adam_b1, b2=adam_b2, eps=adam_eps, eps_root=adam_eps_root,
      weight_decay=adam_weight_decay, mask=adam_weight_decay_mask, nesterov=adam_nesterov)
  tx = optax.partition({MUON: optax.chain(*muon_chain), ADAM: adam_tx}, param_labels)
  return with_config(tx, muon_tx.muon_config, router)
