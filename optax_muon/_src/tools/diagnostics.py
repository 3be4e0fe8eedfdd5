"""Per-step scalars to log: update RMS per optimizer group, orthogonality of a
Muon leaf.

Nothing here runs unless called: the optimizer's own path is untouched.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from optax_muon._src.core import tree_utils
from optax_muon._src.core.routing import ADAM, MUON
from optax_muon._src.core.spec import tree_spec
from optax_muon._src.tools.summary import find_reported


def diagnostics(
    updates: Any, tx: Any, params: Any, sample: str | None = None
) -> dict[str, jax.Array]:
  """Scalars describing one step's updates.

  Args:
    updates: the updates ``tx.update`` returned.
    tx: the transformation that ``muon`` or ``scale_by_muon`` is part of, or an
      ``nnx.Optimizer``, as ``summarize`` takes it.
    params: the params (for routing and layouts).
    sample: path of the Muon leaf whose first matrix is checked for
      orthogonality; None takes the first Muon leaf.

  Returns:
    ``update_rms/muon`` and ``update_rms/adam`` (root mean square over each
    group's elements), and ``orthogonality_error``: max ``|σᵢ / mean(σ) − 1|``
    over the singular values of the sampled update matrix (0 for an exactly
    orthogonal direction; Jordan's coefficients leave about 0.3; weight decay
    adds to it). Call it inside your jitted step.

  Raises:
    ValueError: if ``sample`` names no Muon leaf, or ``tx`` holds no Muon
      transformation.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> params = {"w": jnp.zeros((32, 32)), "b": jnp.zeros(32)}
    >>> tx = optax_muon.muon(0.02, "polar_express", 8)
    >>> grads = {"w": jax.random.normal(jax.random.PRNGKey(0), (32, 32)),
    ...          "b": jnp.ones(32)}
    >>> updates, _ = tx.update(grads, tx.init(params), params)
    >>> metrics = optax_muon.diagnostics(updates, tx, params)
    >>> sorted(metrics), bool(metrics["orthogonality_error"] < 1e-3)
    (['orthogonality_error', 'update_rms/adam', 'update_rms/muon'], True)
  """
  positions, _ = tree_utils.flatten_positions(updates)
  spec = tree_spec(params, find_reported(tx, params).options)
  labels = [
      None if leaf is None else leaf.route.optimizer for leaf in spec.leaves
  ]
  layouts = [None if leaf is None else leaf.layout for leaf in spec.leaves]
  out = {}
  for group in (MUON, ADAM):
    leaves = [
        leaf for (_, leaf), label in zip(positions, labels) if label == group
    ]
    if leaves:
      total = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves)
      out[f"update_rms/{group}"] = jnp.sqrt(total / sum(x.size for x in leaves))
  candidates = [
      (layout.path, leaf, layout)
      for (_, leaf), layout in zip(positions, layouts)
      if layout is not None and (sample is None or layout.path == sample)
  ]
  if sample is not None and not candidates:
    raise ValueError(f"diagnostics: sample {sample!r} is not a Muon leaf.")
  if candidates:
    _, leaf, layout = candidates[0]
    matrix = layout.to_matrices(leaf)[0].astype(jnp.float32)
    sv = jnp.linalg.svd(matrix, compute_uv=False)
    out["orthogonality_error"] = jnp.max(
        jnp.abs(sv / jnp.maximum(jnp.mean(sv), 1e-30) - 1)
    )
  return out
