"""``summarize``: a table of where every leaf goes and what its optimizer costs
there.

It reads every optimizer through the ``Report`` its ``init`` hands over
(``core.reporting``): the table is the optimizer's own.
"""

from __future__ import annotations

from typing import Any

import jax

from optax_muon._src.core.reporting import (
    Report,
    RoutingSummary,
    reporting_options,
)


def _described(tx: Any) -> str:
  """``tx`` in words for messages: an optax transformation is named for what it
  is, not for optax's internal class."""
  if (
      hasattr(tx, "init")
      and hasattr(tx, "update")
      and type(tx).__module__.startswith("optax")
  ):
    return "the given optax transformation"
  return type(tx).__name__


def find_reported(tx: Any, params: Any) -> Report:
  """What the matrix optimizer inside ``tx`` (Muon or Dion) reports at ``init``.

  Args:
    tx: an optax transformation that contains one from ``muon``,
      ``scale_by_muon``, ``dion`` or ``scale_by_dion`` (also inside
      ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
      ``optax.apply_if_finite``, ...), or an ``nnx.Optimizer``.
    params: the params (``tx.init`` is traced with ``jax.eval_shape``: nothing
      is computed).

  Returns:
    Its ``Report``: the options the spec is made under, and its own summary.

  Raises:
    ValueError: if ``tx`` holds no Muon or Dion transformation, or several
      different ones.
  """
  tx = getattr(tx, "tx", tx)  # an nnx.Optimizer holds its transformation as .tx
  init = getattr(tx, "init", None)
  if not callable(init):
    raise ValueError(
        "expected an optax transformation or an nnx.Optimizer, got "
        f"{type(tx).__name__}."
    )
  name = _described(tx)
  with reporting_options() as found:
    # A new function each time: eval_shape caches traces by function, and a
    # cached trace would not run init (nor report) again.
    jax.eval_shape(lambda p: init(p), params)  # noqa: PLW0108
  if not found:
    raise ValueError(
        f"no optax_muon transformation found in {name}: pass the "
        "transformation that muon, scale_by_muon, dion or scale_by_dion is "
        "part of."
    )
  if any(options != found[0] for options in found[1:]):
    raise ValueError(
        f"{name} holds {len(found)} different Muon or Dion "
        "transformations; summarize each on its own."
    )
  return found[0]


def summarize(
    params: Any, tx: Any, *, print_table: bool = False
) -> RoutingSummary:
  """Shows, per leaf, which optimizer ``tx`` applies and what NS costs there.

  For Dion (``dion``, ``scale_by_dion``) the rows give each matrix's rank and
  Dion's FLOPs, received bytes and modelled time per device, beside what Muon's
  plan would move and compute for it (``muon`` with the same arguments).

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct`` objects).
    tx: a transformation that contains ``muon``, ``scale_by_muon``, ``dion`` or
      ``scale_by_dion`` (directly or inside
      ``optax.chain``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
      ``optax.apply_if_finite``, ...), or an ``nnx.Optimizer``.
    print_table: also print the table.

  Returns:
    The optimizer's ``RoutingSummary``: Muon's rows carry Newton–Schulz's
    matrix, FLOPs and placement, Dion's its rank, FLOPs and received bytes.

  Raises:
    ValueError: if ``tx`` holds no Muon or Dion transformation, or its routing
      does not fit ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax, optax_muon
    >>> params = {"embed": jnp.zeros((256, 64)), "w": jnp.zeros((64, 256))}
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax_muon.muon(0.02))
    >>> summary = optax_muon.summarize(params, tx)
    >>> row = summary.rows[1]
    >>> print(row.path, row.reason, row.scale)
    w 2-D 2.0
    >>> for line in str(summary).splitlines()[-2:]:
    ...   print(line)
    1 leaf on Muon, 1 on AdamW; NS 0.016 GFLOP per step.
    Newton–Schulz products: float32 at full precision (Precision.HIGHEST).
  """
  summary = find_reported(tx, params).summarize(params)
  if print_table:
    print(summary)
  return summary
