"""``dion``: the full optimizer, Dion on the matrices and AdamW (NAdamW) on the
rest, routed, shape-scaled and decayed exactly as ``muon``
(``core.assembly.matrices_and_adam``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import optax

from optax_muon._src.core import tree_utils
from optax_muon._src.core.assembly import (
    adamw,
    check_alias_arguments,
    decayed_weights,
    matrices_and_adam,
)
from optax_muon._src.core.matrices import is_dimension_numbers
from optax_muon._src.core.options import Routing, check_number, check_option
from optax_muon._src.core.qk_clipping import QKClip
from optax_muon._src.core.scaling import shape_scaling
from optax_muon._src.core.spec import (
    TreeOptions,
    branch_options,
    static_or_injected,
)
from optax_muon._src.dion.settings import make_settings
from optax_muon._src.dion.transform import (
    DionReplicaState,
    DionState,
    dion_direction,
)


def dion(
    learning_rate: optax.ScalarOrSchedule,
    rank_fraction: Any = 1.0,
    beta: jax.typing.ArrayLike = 0.95,
    eps: float | None = None,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    adam_eps_root: jax.typing.ArrayLike = 0.0,
    adam_weight_decay: jax.typing.ArrayLike = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: jax.typing.ArrayLike | None = None,
    scale: str | None = "jordan",
    routing: Routing | None = None,
    param_shardings: Any = None,
    adam_weight_decay_mask: Any = None,
    cautious_weight_decay: bool = False,
    qk_clip: QKClip | None = None,
    seed: int = 0,
    product_dtype: jax.typing.DTypeLike | str | None = "auto",
    power_iterations: int = 1,
    replica_axes: str | Sequence[str] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Dion for the network's matrices, AdamW (NAdamW with ``nesterov``) for the
  rest.

  Routed, shape-scaled and decayed as ``muon`` is, from the same stages:
  ``optax.partition`` of ``optax.chain(scale_by_dion(...), scale_by_shape(...),
  add_decayed_weights(...), scale_by_learning_rate(...))`` and AdamW. Matrix
  leaves move by W ← W − η·(scale(n_in, n_out)·P·Qᵀ + λ·W). The arguments the
  two share mean what they mean for ``muon``, except three that have no Dion
  counterpart and apply to the AdamW leaves alone: ``eps`` (Dion normalizes
  nothing), ``mu_dtype`` (Dion's state is float32, float64 for float64 params)
  and ``nesterov`` (Dion's momentum has no look-ahead).

  Args:
    learning_rate: the matrices' learning rate η, a scalar or an
      ``optax.Schedule``.
    rank_fraction: see ``scale_by_dion``.
    beta: μ, Dion's momentum decay, in [0, 1).
    eps: AdamW's epsilon (``None``: 1e-8).
    weight_decay, weight_decay_mask: λ for the matrices, and which are decayed.
    mu_dtype: AdamW's first moment's dtype (Dion's state is float32, float64 for
      float64 params).
    nesterov: NAdamW rather than AdamW on the other leaves (Dion's momentum has
      no look-ahead).
    adam_b1, adam_b2, adam_eps_root, adam_weight_decay: AdamW's, as in ``muon``.
    adam_learning_rate, adam_weight_decay_mask: as in ``muon``.
    muon_weight_dimension_numbers, consistent_rms, scale, routing: as in
      ``muon``.
    param_shardings, cautious_weight_decay, qk_clip: as in ``muon``.
    seed, product_dtype, power_iterations: see ``scale_by_dion``.
    replica_axes: the data-parallel mesh axis name(s) whose replicas sync only
      rank-r factors (see ``scale_by_dion``); the AdamW leaves' gradients are
      averaged over them. Every gradient leaf then comes per replica: under
      ``jax.jit`` ``(replicas, *param_shape)`` (``optax_muon.per_replica``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose matrix branch's state is
    a ``DionState`` (a ``DionReplicaState`` with ``replica_axes``).

  Raises:
    ValueError: for invalid options (naming the argument), and at ``init`` for
      routing trees that don't match the params, complex matrices or rank
      fractions out of range (naming the leaf).

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> params = {"embed": jnp.zeros((100, 16)), "w": jnp.zeros((16, 16)),
    ...           "b": jnp.zeros(16)}
    >>> tx = optax_muon.dion(0.02, rank_fraction=0.25, adam_learning_rate=3e-3)
    >>> state = tx.init(params)
    >>> # Q: 16 × r, r = 4
    >>> state.inner_states["muon"].inner_state[0].q["w"].shape
    (16, 4)

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates
    <https://arxiv.org/abs/2504.05295>`_, 2025.
  """
  check_number("beta", beta, 0.0, 1.0)
  check_alias_arguments(
      learning_rate=learning_rate,
      adam_learning_rate=adam_learning_rate,
      adam_b1=adam_b1,
      adam_b2=adam_b2,
      weight_decay=weight_decay,
      adam_weight_decay=adam_weight_decay,
      scale=scale,
      consistent_rms=consistent_rms,
  )
  options = TreeOptions(
      weight_dimension_numbers=tree_utils.freeze_prefix(
          muon_weight_dimension_numbers,
          is_value=is_dimension_numbers,
          what="muon_weight_dimension_numbers",
      ),
      param_shardings=param_shardings,
      routing=check_option("routing", routing, Routing, Routing()),
      scale=scale,
      consistent_rms=static_or_injected(consistent_rms),
      cautious_weight_decay=cautious_weight_decay,
      qk_clip=check_option("qk_clip", qk_clip, QKClip),
  )
  settings = make_settings(
      options,
      rank_fraction,
      product_dtype,
      power_iterations,
      replica_axes,
  )
  # muon's partition with Dion's direction in place of scale_by_muon.
  return matrices_and_adam(
      optax.chain(
          dion_direction(settings, beta, seed),
          shape_scaling(branch_options(options), consistent_rms, scale),
          decayed_weights(
              weight_decay, weight_decay_mask, cautious=cautious_weight_decay
          ),
          optax.scale_by_learning_rate(learning_rate),
      ),
      adamw(
          learning_rate if adam_learning_rate is None else adam_learning_rate,
          b1=adam_b1,
          b2=adam_b2,
          eps=eps,
          eps_root=adam_eps_root,
          weight_decay=adam_weight_decay,
          weight_decay_mask=adam_weight_decay_mask,
          mu_dtype=mu_dtype,
          nesterov=nesterov,
          cautious=cautious_weight_decay,
      ),
      options,
      keep=(DionState, DionReplicaState),
      replica_axes=settings.replica_axes,
  )
