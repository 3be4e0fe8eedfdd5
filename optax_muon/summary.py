"""``summarize``: a table of where every leaf goes and what Newton–Schulz costs there."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from jax.sharding import NamedSharding

from optax_muon import tree_utils
from optax_muon.orthogonalize import canonical_shape
from optax_muon.routing import ADAM, MUON, Route
from optax_muon.plan import Plan
from optax_muon.qk_clip import ROLES, resolve_projections
from optax_muon.sharding import resolve_param_shardings
from optax_muon.transform import MuonConfig, MuonTransformation


def _plan(params: Any, config: MuonConfig, layouts: list) -> tuple[Plan | None, dict]:
  """The plan of the Muon leaves, and position → index into ``plan.leaves``.

  Shardings come from ``param_shardings`` if the transformation has them, else from the
  params themselves (arrays or ``ShapeDtypeStruct``s with a ``NamedSharding``).
  """
  positions, _ = tree_utils.flatten_positions(params)
  given = resolve_param_shardings(config.param_shardings, params)
  muon = [i for i, layout in enumerate(layouts) if layout is not None]
  if given is None:
    given = [getattr(leaf, "sharding", None) for _, leaf in positions]
    given = [s if isinstance(s, NamedSharding) else None for s in given]
  if not muon:
    return None, {}
  plan = config.plan([layouts[i] for i in muon], [None] * len(muon), [given[i] for i in muon])
  return plan, {i: k for k, i in enumerate(muon) if plan.leaves[k].sharding is not None}


@dataclasses.dataclass(frozen=True)
class LeafSummary:
  """One row of the routing summary.

  Attributes:
    path, shape, dtype: the leaf.
    optimizer: ``"muon"`` or ``"adam"``.
    reason: why it was routed there.
    ns_matrix: the (m, n) matrix NS iterates on (m ≤ n), Muon leaves only.
    batch: how many such matrices the leaf holds.
    scale: the update-scale factor.
    ns_flops: NS FLOPs per step for the whole leaf.
    placement: where its matrices are orthogonalized (sharded leaves only).
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
  ns_flops: int | None = None
  placement: str = ""
  qk_clip: str = ""


@dataclasses.dataclass(frozen=True)
class RoutingSummary:
  """The routing summary: ``rows``, and a table via ``str()``.

  Attributes:
    rows: one per leaf.
    plan: the orthogonalization plan of the Muon leaves, if any.
    notes: footer lines naming the options that change the update (NorMuon, cautious
      weight decay, QK-clip) and the leaves they apply to.
  """

  rows: tuple[LeafSummary, ...]
  plan: Plan | None = None
  notes: tuple[str, ...] = ()

  def by_optimizer(self, optimizer: str) -> list[LeafSummary]:
    return [r for r in self.rows if r.optimizer == optimizer]

  @property
  def total_ns_flops(self) -> int:
    return sum(r.ns_flops or 0 for r in self.rows)

  def __str__(self) -> str:
    header = ("path", "shape", "dtype", "optimizer", "reason", "NS matrix", "batch", "scale",
              "NS GFLOP", "NS placement")
    body = [(r.path, "×".join(map(str, r.shape)) or "()", r.dtype,
             "Muon" if r.optimizer == MUON else "AdamW", r.reason,
             f"{r.ns_matrix[0]}×{r.ns_matrix[1]}" if r.ns_matrix else "",
             str(r.batch or ""), f"{r.scale:.3g}" if r.scale is not None else "",
             f"{r.ns_flops / 1e9:.3f}" if r.ns_flops else "", r.placement)
            for r in self.rows]
    n_muon, n_adam = len(self.by_optimizer(MUON)), len(self.by_optimizer(ADAM))
    footer = (f"{n_muon} leaves on Muon, {n_adam} on AdamW; NS "
              f"{self.total_ns_flops / 1e9:.3f} GFLOP per step.")
    sharded = self.plan is not None and self.plan.sharded
    if sharded:
      footer += (f" Sharded leaves on {self.plan.device_count} devices: NS "
                 f"{self.plan.critical_ns_flops() / 1e9:.3f} GFLOP on the busiest device "
                 f"(lower bound {self.plan.ns_flops_bound() / 1e9:.3f}).")
    else:  # no sharded leaves: no placement column
      header, body = header[:-1], [row[:-1] for row in body]
    if any(r.qk_clip for r in self.rows):
      header, body = header + ("QK-clip",), [(*row, r.qk_clip) for row, r in zip(body, self.rows)]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]
    fmt = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(header), rule, *map(fmt, body), rule, footer, *self.notes])


def _notes(config: MuonConfig, rows: list[LeafSummary]) -> tuple[str, ...]:
  notes = []
  if config.normalization == "neuron":
    n_muon = sum(r.optimizer == MUON for r in rows)
    notes.append(f"NorMuon on all Muon leaves ({n_muon}): updates normalized per output "
                 "neuron after NS.")
  if config.cautious_weight_decay:
    notes.append("Cautious weight decay: Muon and AdamW leaves are decayed only where the "
                 "parameter and the update agree in sign.")
  return tuple(notes)


def summarize(params: Any, tx: MuonTransformation, *, print_table: bool = False
              ) -> RoutingSummary:
  """Shows, per leaf, which optimizer ``tx`` applies and what NS costs there.

  Args:
    params: the params (arrays or ``jax.ShapeDtypeStruct``s).
    tx: a transformation from ``muon`` or ``scale_by_muon``.
    print_table: also print the table.

  Returns:
    A ``RoutingSummary``.

  Raises:
    ValueError: if ``tx`` did not come from this package, or its routing does not fit
      ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> params = {"embed": jnp.zeros((256, 64)), "w": jnp.zeros((64, 256))}
    >>> summary = optax_muon.summarize(params, optax_muon.muon(0.02))
    >>> print(summary.rows[1].path, summary.rows[1].reason, summary.rows[1].scale)
    w 2-D 2.0
    >>> print(str(summary).splitlines()[-1])
    1 leaves on Muon, 1 on AdamW; NS 0.016 GFLOP per step.
  """
  config = getattr(tx, "muon_config", None)
  if config is None:
    raise ValueError(f"summarize needs a transformation from optax_muon.muon or "
                     f"scale_by_muon (it carries the routing); got {type(tx).__name__}.")
  positions, _ = tree_utils.flatten_positions(params)
  if tx.muon_router is None:
    routes = [Route(tree_utils.path_str(p), MUON, "scale_by_muon")
              if tree_utils.is_array_leaf(leaf) else None for p, leaf in positions]
  else:
    routes = tx.muon_router(params)
  layouts = config.layouts(params, [r is not None and r.label == MUON for r in routes])
  plan, plan_index = _plan(params, config, layouts)
  clip = getattr(tx, "qk_clip", None)
  projections = ([None] * len(positions) if clip is None
                 else resolve_projections(clip.heads, params))
  rows = []
  for i, ((_, leaf), r, layout, p) in enumerate(zip(positions, routes, layouts, projections)):
    if r is None:
      continue
    row = LeafSummary(r.path, tuple(leaf.shape), str(np.dtype(leaf.dtype)), r.label, r.reason,
                      qk_clip=p.describe() if p is not None else "")
    if layout is not None:
      m, n = canonical_shape(layout)
      row = dataclasses.replace(
          row, ns_matrix=(m, n), batch=layout.batch, scale=float(config.factor(layout)),
          ns_flops=layout.batch * config.ns.flops(m, n, layout.dtype),
          placement=plan.leaf_placement(plan_index[i]) if i in plan_index else "")
    rows.append(row)
  notes = _notes(config, rows)
  if clip is not None:
    roles = [p.role for p in projections if p is not None]
    notes += (f"QK-clip (τ = {clip.threshold:g}, α = {clip.alpha:g}) on "
              + ", ".join(f"{roles.count(role)} {role}" for role in ROLES if role in roles)
              + " projections.",)
  summary = RoutingSummary(tuple(rows), plan, notes)
  if print_table:
    print(summary)
  return summary
