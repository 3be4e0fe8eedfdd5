"""The momentum stage: the new momentum, and the input Newton–Schulz
orthogonalizes.

Per leaf, with g the gradient and β the decay (t counts steps from 1)::

  ema:  m ← β·m + (1−β)·g;  n = (1−β)·g + β·m   (Nesterov; n = m without),
        both divided by their bias corrections (1 − βᵗ) and (1 − βᵗ⁺¹), as
        ``optax.contrib`` does
  ema_uncorrected: the same without the bias corrections (KellerJordan/Muon's
        reference)
  sum:  m ← β·m + g;        n = g + β·m         (Nesterov; n = m without)

NS does not see the scale of n (it is scale-invariant), so n is returned as n =
s·n' with n' a convex combination of m and g: n' is finite whenever they are
(the bias-corrected gradient g/(1−βᵗ) alone is 20·g at the first step with β =
0.95, past float32's range for |g| ≳ 1.7e37). ``adaptive`` scaling needs s.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import optax


def momentum_step(
    grads: list[jax.Array],
    mu: list[jax.Array],
    count: jax.Array,
    beta: jax.typing.ArrayLike,
    kind: str,
    nesterov: bool,
) -> tuple[list[jax.Array], list[jax.Array], jax.Array | float]:
  """One step of Muon's momentum.

  Args:
    grads: the gradients of the Muon leaves.
    mu: their momenta.
    count: the step number t after this step (≥ 1).
    beta: β, in [0, 1); may be traced.
    kind: ``"ema"``, ``"ema_uncorrected"`` or ``"sum"``.
    nesterov: use the Nesterov look-ahead.

  Returns:
    (new momenta in the dtypes of ``mu``, n' in the dtypes of ``grads``, s) with
    the NS input n = s·n'.
  """
  t = count.astype(jnp.float32)
  if kind == "sum":
    new_mu = optax.tree.add_scale(grads, beta, mu)
    w_mu, w_g = beta, 1.0
  else:
    new_mu = optax.tree.update_moment(grads, mu, beta, 1)
    corrected = kind == "ema"
    w_mu = beta / (1 - beta ** (t + 1)) if corrected else beta
    w_g = (1 - beta) / (1 - beta**t) if corrected else 1 - beta
  if nesterov:
    total = w_mu + w_g
    inputs = [
        (w_mu / total) * m + (w_g / total) * g for m, g in zip(new_mu, grads)
    ]
  else:
    inputs, total = new_mu, 1 / (1 - beta**t) if kind == "ema" else 1.0
  return (
      [m.astype(old.dtype) for m, old in zip(new_mu, mu)],
      [n.astype(g.dtype) for n, g in zip(inputs, grads)],
      total,
  )
