"""``muon``: the full optimizer, Muon on matrices and AdamW (NAdamW) on
everything else."""

from __future__ import annotations

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
from optax_muon._src.core.options import Routing, ShardingOptions, check_option
from optax_muon._src.core.qk_clipping import QKClip
from optax_muon._src.core.scaling import shape_scaling
from optax_muon._src.core.spec import branch_options, static_or_injected
from optax_muon._src.muon.coefficients import CoefficientsLike
from optax_muon._src.muon.options import MuonOptions, NorMuon, NSOptions
from optax_muon._src.muon.transform import (
    MuonState,
    NorMuonState,
    muon_direction,
    muon_hyperparams,
)


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
  """Muon for the network's matrices, AdamW (NAdamW with ``nesterov``) for the
  rest.

  Takes every argument of ``optax.contrib.muon``, in its order and with its
  meaning; the options after ``consistent_rms`` are this package's. Where the
  two differ by design (which leaves go to AdamW by default, the
  coefficient-table slicing), the README's "Coming from optax.contrib.muon" says
  so.

  Built from its stages as ``optax.contrib.muon`` is, and with its state::

    optax.partition({
        "muon": optax.chain(scale_by_muon(...), scale_by_shape(...),
                            add_decayed_weights(weight_decay, ...),
                            scale_by_learning_rate(learning_rate)),
        "adam": adamw(...),  # optax.adamw's chain
    }, labels)

  so Muon leaves move by W ← W − η·(scale(n_in, n_out)·NS(momentum) + λ·W)
  (decoupled decay λ), and an ``optax.contrib.muon`` checkpoint restores into
  this optimizer's state with the same arguments (``MuonState(count, mu,
  ns_coeffs)``, then three empty states; NorMuon adds its moments to the first,
  a ``NorMuonState``). AdamW leaves: ``optax.adamw`` with optax's ``nesterov``
  (NAdamW by default, as ``optax.contrib.muon``), with float32 moments for
  16-bit leaves. QK-clip, when given, runs after the partition and adds no
  state; cautious weight decay replaces both decay stages.
  Routing (see ``Routing``, ``route`` and ``summarize``): ``routing.labels`` if
  given, else ``muon_weight_dimension_numbers`` if given (``None`` entries →
  AdamW, as in ``optax.contrib.muon``), else 2-D leaves whose path does not
  match ``routing.adam_pattern`` (embeddings and output heads go to AdamW).

  Args:
    learning_rate: Muon's learning rate η, a scalar or an ``optax.Schedule``.
    ns_coeffs, ns_steps: Newton–Schulz coefficients and steps (see
      ``scale_by_muon``).
    beta: Muon's momentum decay, in [0, 1).
    eps: the NS normalization epsilon (``None``: the preset's) and AdamW's
      epsilon (``None``: 1e-8), as ``optax.contrib.muon``'s ``eps`` (an
      ``NSCoefficients`` passed as ``ns_coeffs`` carries an NS epsilon of its
      own).
    weight_decay: λ for Muon leaves (multiplied by the learning rate, as in
      AdamW).
    weight_decay_mask: tree, prefix tree or callable of bools selecting decayed
      Muon leaves.
    mu_dtype: dtype of Muon's momentum and AdamW's first moment; ``None`` keeps
      the params' dtype, except float32 for 16-bit params.
    nesterov: Nesterov momentum for Muon, and NAdamW rather than AdamW on the
      other leaves (optax.contrib's meaning).
    adaptive, preconditioning: see ``scale_by_muon``.
    adam_b1, adam_b2, adam_eps_root: AdamW's moments.
    adam_weight_decay: AdamW's decoupled weight decay.
    adam_learning_rate: AdamW's learning rate; ``None`` uses ``learning_rate``.
    muon_weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf (tree,
      prefix tree or callable); describes ≥3-D leaves (stacked layers, conv
      kernels, experts, heads).
    consistent_rms: k: scale Muon's updates by k·sqrt(max(n_in, n_out)) instead
      of ``scale`` (RMS ≈ k for every shape; 0.2 matches AdamW).
    momentum: Muon's momentum form, see ``scale_by_muon``.
    scale: the shape factor: ``"jordan"`` sqrt(max(1, n_out/n_in)) (optax's),
      ``"spectral"`` sqrt(n_out/n_in), or ``None`` (1).
    ns_options: how NS runs (``NSOptions``).
    normalization: ``NorMuon(beta)`` on the Muon leaves, or None.
    routing: which leaf goes where (``Routing``: labels, adam_pattern
      (embeddings, heads, norms)).
    param_shardings, sharding: for sharded params, see ``scale_by_muon``.
    adam_weight_decay_mask: tree, prefix tree or callable of bools selecting
      decayed AdamW leaves.
    cautious_weight_decay: apply both weight decays only where the parameter and
      the update (before the learning rate) agree in sign: W ← W − η·λ·W·[W ⊙ U
      ≥ 0] − η·U (see ``add_cautious_decayed_weights``).
    qk_clip: ``QKClip(threshold, heads, alpha)`` for QK-clip (MuonClip), applied
      last, to the new parameters; ``update`` then takes ``attn_logit_max=``.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``summarize(params, tx)``
    shows where every leaf goes.

  Raises:
    ValueError: for invalid options (naming the argument), and at ``init`` for
      routing trees that don't match the params or leaves Muon can't take
      (naming the leaf).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> params = {"embed": jnp.zeros((100, 16)), "w": jnp.zeros((16, 16)),
    ...           "b": jnp.zeros(16)}
    >>> tx = optax_muon.muon(0.02, adam_learning_rate=3e-3)
    >>> [(r.path, r.optimizer) for r in optax_muon.summarize(params, tx).rows]
    [('b', 'adam'), ('embed', 'adam'), ('w', 'muon')]
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> muon_state = state.inner_states["muon"].inner_state
    >>> len(muon_state), muon_state[0]._fields, muon_state[0].ns_coeffs.shape
    (4, ('count', 'mu', 'ns_coeffs'), (3,))

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.

    Liu et al., `Muon is Scalable for LLM Training
    <https://arxiv.org/abs/2502.16982>`_, 2025.

    DeepSeek-AI, `DeepSeek-V4 technical report`, 2026 (hybrid Newton–Schulz
    schedule: ``ns_coeffs="deepseek_v4"``).

    Chen et al., `Cautious Weight Decay <https://arxiv.org/abs/2510.12402>`_,
    2025.
  """
  hyper = muon_hyperparams(
      ns_coeffs,
      ns_steps,
      beta,
      eps,
      mu_dtype,
      nesterov=nesterov,
      adaptive=adaptive,
      preconditioning=preconditioning,
      momentum=momentum,
  )
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
  options = MuonOptions(
      ns_steps=hyper.coefficients.steps,
      ns=check_option("ns_options", ns_options, NSOptions, NSOptions()),
      weight_dimension_numbers=tree_utils.freeze_prefix(
          muon_weight_dimension_numbers,
          is_value=is_dimension_numbers,
          what="muon_weight_dimension_numbers",
      ),
      param_shardings=param_shardings,
      sharding=check_option(
          "sharding", sharding, ShardingOptions, ShardingOptions()
      ),
      routing=check_option("routing", routing, Routing, Routing()),
      normalization=check_option("normalization", normalization, NorMuon),
      scale=scale,
      consistent_rms=static_or_injected(consistent_rms),
      cautious_weight_decay=cautious_weight_decay,
      qk_clip=check_option("qk_clip", qk_clip, QKClip),
  )
  # optax.contrib.muon's partition, stage for stage (and so its state): the
  # stages take the options whole, so that they see the routing's dimension
  # numbers and the params' shardings.
  return matrices_and_adam(
      optax.chain(
          muon_direction(options, hyper),  # scale_by_muon
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
      keep=(MuonState, NorMuonState),
  )
