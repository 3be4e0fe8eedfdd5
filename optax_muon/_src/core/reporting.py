"""What a transformation tells the tools, and the summary table both optimizers
fill.

A matrix optimizer's ``init`` hands a ``Report`` to ``report``; ``summarize``
and ``diagnostics`` collect it with ``reporting_options`` and read every
optimizer through that one interface: the shared ``options`` (routing, dimension
numbers, shardings) and ``summarize(params)``, which returns the optimizer's own
``RoutingSummary``. A new optimizer adds its own report and table; the tools do
not change.

The rows and the table's shared columns (path, shape, dtype, optimizer, reason,
matrix, batch, shape factor, QK-clip role) are made here, by ``leaf_rows``; each
optimizer's report adds its own figures to them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from optax_muon._src.core import tree_utils
from optax_muon._src.core.qk_clipping import ROLES, resolve_projections
from optax_muon._src.core.routing import MUON
from optax_muon._src.core.scaling import scale_factor
from optax_muon._src.core.spec import LeafSpec, TreeOptions, TreeSpec


class Report(Protocol):
  """What a matrix optimizer's ``init`` reports to the tools.

  Attributes:
    options: the static options the spec is made under (its routing, dimension
      numbers, shardings).
  """

  options: TreeOptions

  def summarize(self, params: Any) -> RoutingSummary:
    """The routing summary of ``params`` under this optimizer."""


_REPORTED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "optax_muon_reported_options", default=None
)


@contextlib.contextmanager
def reporting_options() -> Iterator[list[Report]]:
  """Collects the ``Report`` every matrix optimizer's ``init`` makes inside the
  block.

  ``summarize(params, tx)`` traces ``tx.init`` (``jax.eval_shape``) inside this
  block, so it finds the optimizer wherever ``tx`` holds it: ``optax.chain``,
  ``optax.partition``, ``optax.inject_hyperparams``, ``optax.MultiSteps``,
  ``optax.apply_if_finite``, an ``nnx.Optimizer``. Nothing simpler reaches it:
  the caller holds only ``tx``, whose options live in closures; attributes set
  on a transformation vanish inside those wrappers; and the state could carry
  them only as a static pytree node, which changes the state's structure and
  which ``flax.serialization`` (linen ``TrainState`` checkpoints) cannot
  serialize. Outside the block ``init`` reports to no one: the context variable
  is set only while a tool asks.

  Yields:
    The list the reports are appended to.
  """
  found: list[Report] = []
  token = _REPORTED.set(found)
  try:
    yield found
  finally:
    _REPORTED.reset(token)


def report(found: Report) -> None:
  """Called by ``init``: hands ``found`` to an active ``reporting_options``."""
  reported = _REPORTED.get()
  if reported is not None:
    reported.append(found)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafSummary:
  """One row of a routing summary: what every optimizer's table shows of a leaf.

  Attributes:
    path: the leaf's path.
    shape: its shape.
    dtype: its dtype, by name.
    optimizer: ``"muon"`` (the matrix optimizer: Muon or Dion) or ``"adam"``.
    reason: why it was routed there, in words.
    ns_matrix: the (m, n) matrix the orthogonalization works on (m ≤ n), matrix
      leaves only.
    batch: how many such matrices the leaf holds.
    scale: the shape factor (None when it is a hyperparameter set at run time).
    qk_clip: its QK-clip role and heads (query and key projections only).
  """

  path: str
  shape: tuple[int, ...]
  dtype: str
  optimizer: str
  reason: str
  ns_matrix: tuple[int, int] | None = None
  batch: int | None = None
  scale: float | None = None
  qk_clip: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingSummary:
  """A routing summary: ``rows``, and the table via ``str()``.

  Attributes:
    rows: one per leaf.
    notes: footer lines: the options that change the update and the leaves they
      apply to, and the warnings ``init`` gives for this tree (routing
      surprises, degenerate matrices).
  """

  rows: tuple[LeafSummary, ...]
  notes: tuple[str, ...] = ()

  def by_optimizer(self, optimizer: str) -> list[LeafSummary]:
    """The rows of ``optimizer`` (``"muon"`` or ``"adam"``)."""
    return [r for r in self.rows if r.optimizer == optimizer]

  def table(self) -> str:
    """The table, footer and notes (what ``str()`` gives)."""
    raise NotImplementedError

  def __str__(self) -> str:
    return self.table()


def plural(count: int, one: str, many: str) -> str:
  return f"{count} {one if count == 1 else many}"


def shared_cells(row: LeafSummary, matrix_name: str) -> tuple[str, ...]:
  """The table cells of the shared columns (``SHARED_HEADER``); ``matrix_name``
  is the optimizer's name for matrix leaves."""
  return (
      row.path,
      "×".join(map(str, row.shape)) or "()",
      row.dtype,
      matrix_name if row.optimizer == MUON else "AdamW",
      row.reason,
      f"{row.ns_matrix[0]}×{row.ns_matrix[1]}" if row.ns_matrix else "",
      str(row.batch or ""),
      f"{row.scale:.3g}" if row.scale is not None else "",
  )


#: The shared columns' headers, for ``shared_cells``.
SHARED_HEADER = (
    "path",
    "shape",
    "dtype",
    "optimizer",
    "reason",
    "NS matrix",
    "batch",
    "scale",
)


def format_table(
    header: tuple[str, ...],
    body: list[tuple[str, ...]],
    footer: str,
    notes: tuple[str, ...],
) -> str:
  """Left-aligned columns under a rule, then the footer and the notes."""
  widths = [
      max(len(row[i]) for row in (header, *body)) for i in range(len(header))
  ]
  fmt = lambda row: "  ".join(
      cell.ljust(w) for cell, w in zip(row, widths)
  ).rstrip()
  rule = "  ".join("-" * w for w in widths)
  return "\n".join([fmt(header), rule, *map(fmt, body), rule, footer, *notes])


def leaf_rows(
    params: Any, spec: TreeSpec
) -> list[tuple[int, LeafSpec, LeafSummary]]:
  """Each leaf's position in ``spec.leaves``, its spec and its row's shared
  fields, in that order (placeholders have no row)."""
  options = spec.options
  positions, _ = tree_utils.flatten_positions(params)
  projections = (
      [None] * len(positions)
      if options.qk_clip is None
      else resolve_projections(options.qk_clip.heads, params)
  )
  injected = options.consistent_rms == "injected"
  rows = []
  for i, ((_, leaf), leaf_spec, p) in enumerate(
      zip(positions, spec.leaves, projections)
  ):
    if leaf_spec is None:
      continue
    r, layout = leaf_spec.route, leaf_spec.layout
    fields = {}
    if layout is not None:
      fields = dict(
          ns_matrix=layout.ns_shape,
          batch=layout.batch,
          scale=None
          if injected
          else float(
              scale_factor(
                  layout.n_in,
                  layout.n_out,
                  options.scale,
                  consistent_rms=options.consistent_rms,
              )
          ),
      )
    rows.append(
        (
            i,
            leaf_spec,
            LeafSummary(
                path=r.path,
                shape=tuple(leaf.shape),
                dtype=str(np.dtype(leaf.dtype)),
                optimizer=r.optimizer,
                reason=r.describe(),
                qk_clip=p.describe() if p is not None else "",
                **fields,
            ),
        )
    )
  return rows


def option_notes(options: TreeOptions, params: Any) -> tuple[str, ...]:
  """Footer lines for the shared options that change the update: the injected
  RMS factor, cautious weight decay and QK-clip (with the projections it applies
  to)."""
  notes = []
  if options.consistent_rms == "injected":
    notes.append(
        "Scale: consistent_rms·√max(n_in, n_out), consistent_rms set at run"
        " time."
    )
  if options.cautious_weight_decay:
    notes.append(
        "Cautious weight decay: matrix and AdamW leaves are decayed only where "
        "the parameter and the update agree in sign."
    )
  if options.qk_clip is not None:
    roles = [
        p.role
        for p in resolve_projections(options.qk_clip.heads, params)
        if p is not None
    ]
    notes.append(
        f"QK-clip (τ = {options.qk_clip.threshold:g}, α ="
        f" {options.qk_clip.alpha:g}) on "
        + ", ".join(
            f"{roles.count(role)} {role}" for role in ROLES if role in roles
        )
        + " projections."
    )
  return tuple(notes)
