"""Cautious weight decay: decoupled decay only where it agrees with the update.

With U the descent direction (the update before the learning rate and the minus
sign) and λ the decay::

  W ← W − η·λ·W·[W ⊙ U ≥ 0] − η·U

elementwise; 0 counts as agreement (for complex leaves, Re(conj(W)·U) ≥ 0).
Coordinates where the update already moves W towards 0 are left to the update
alone.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def _agree(p: jax.Array, u: jax.Array) -> jax.Array:
  if jnp.iscomplexobj(p) or jnp.iscomplexobj(u):
    return jnp.real(jnp.conj(p) * u) >= 0
  return jnp.sign(p) * jnp.sign(u) >= 0  # signs: p·u may underflow to 0


def add_cautious_decayed_weights(
    weight_decay: jax.typing.ArrayLike = 0.0, mask: Any = None
) -> optax.GradientTransformation:
  """``optax.add_decayed_weights``, applied only where parameter and update
  agree in sign.

  Same state (empty, or ``optax.masked``'s with ``mask``) as
  ``optax.add_decayed_weights``; ``weight_decay`` may be traced
  (``optax.inject_hyperparams``).

  Args:
    weight_decay: λ.
    mask: a tree, prefix tree or callable of bools selecting the decayed leaves
      (as ``optax.add_decayed_weights``).

  Returns:
    An ``optax.GradientTransformation`` mapping U to U + λ·W·[W ⊙ U ≥ 0].

  Raises:
    ValueError: for a ``weight_decay`` schedule (a number or array is needed),
      and if ``update`` is called without ``params``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_muon import add_cautious_decayed_weights
    >>> tx = add_cautious_decayed_weights(0.5)
    >>> w, u = jnp.array([1.0, 1.0, -2.0]), jnp.array([0.1, -0.1, -0.1])
    >>> out, _ = tx.update(u, tx.init(w), w)
    >>> [round(float(x), 2) for x in out]  # decayed where the signs agree
    [0.6, -0.1, -1.1]

  References:
    Chen et al., `Cautious Weight Decay <https://arxiv.org/abs/2510.12402>`_,
    2025.
  """
  if callable(weight_decay):
    raise ValueError(
        "weight_decay: cautious weight decay takes a number or array, not a "
        f"schedule; got {weight_decay!r}."
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(
          "add_cautious_decayed_weights needs params: call "
          "update(updates, state, params)."
      )
    decayed = jax.tree.map(
        lambda u, p: (u + weight_decay * p * _agree(p, u)).astype(u.dtype),
        updates,
        params,
    )
    return decayed, state

  tx = optax.GradientTransformation(
      lambda params: optax.EmptyState(), update_fn
  )
  return tx if mask is None else optax.masked(tx, mask)
