"""Dion's routing summary: per matrix leaf its rank, FLOPs, received bytes and
modelled time per device (``dion.costs``), beside the bytes a whole-matrix
exchange would move for it; the ``Report`` that ``scale_by_dion`` and ``dion``
hand to the tools."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from optax_muon._src.core import profiles
from optax_muon._src.core.dtypes import moment_dtype
from optax_muon._src.core.reporting import (
    SHARED_HEADER,
    LeafSummary,
    RoutingSummary,
    format_table,
    leaf_rows,
    option_notes,
    plural,
    shared_cells,
)
from optax_muon._src.core.routing import ADAM, MUON
from optax_muon._src.core.spec import tree_spec
from optax_muon._src.dion.costs import step_costs, step_seconds
from optax_muon._src.dion.settings import DionSettings


@dataclasses.dataclass(frozen=True, kw_only=True)
class DionLeafSummary(LeafSummary):
  """One row of Dion's summary: the shared fields and Dion's own (matrix leaves
  only).

  Attributes:
    rank: Dion's rank r.
    flops_per_device: Dion's FLOPs per step on one device.
    received_bytes: the bytes one device receives per step for this leaf (Dion's
      collectives, ring model).
    replica_bytes: of those, the bytes that cross the replica axes (with
      ``replica_axes``: P's and R's sums, or the averaged gradient).
    seconds: Dion's modelled time for this leaf on one device (cost model of
      ``DionSummary.cost_model``).
    exchange_bytes: the bytes a whole-matrix exchange of the leaf's momentum
      (Muon's: each matrix to the device that orthogonalizes it and back) moves
      per step, all devices together; 0 for an unsharded leaf.
  """

  rank: int | None = None
  flops_per_device: float | None = None
  received_bytes: float | None = None
  replica_bytes: float | None = None
  seconds: float | None = None
  exchange_bytes: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DionSummary(RoutingSummary):
  """Dion's routing summary.

  Attributes:
    cost_model: the model the times come from (its ``name`` says which profile).
    step_seconds: Dion's modelled step time on one device
      (``dion.costs.step_seconds``: each kind of collective combined over the
      leaves).

  and every attribute of ``RoutingSummary``.
  """

  cost_model: profiles.CostModel | None = None
  step_seconds: float | None = None

  def table(self) -> str:
    sharded = any(r.exchange_bytes for r in self.by_optimizer(MUON))
    replicas = any(r.replica_bytes is not None for r in self.rows)
    header = SHARED_HEADER + (
        "r",
        "GFLOP/device",
        "MB/device",
        "replica MB",
        "ms (model)",
        "exchange MB",
    )
    mb = lambda x: f"{x / 1e6:.3g}" if x is not None else ""
    body = [
        shared_cells(r, "Dion")
        + (
            str(r.rank or ""),
            f"{r.flops_per_device / 1e9:.3g}"
            if r.flops_per_device is not None
            else "",
            mb(r.received_bytes),
            mb(r.replica_bytes),
            f"{r.seconds * 1e3:.3g}" if r.seconds is not None else "",
            mb(r.exchange_bytes),
        )
        for r in self.rows
    ]
    if not replicas:
      header = header[:-3] + header[-2:]
      body = [row[:-3] + row[-2:] for row in body]
    dion = self.by_optimizer(MUON)
    footer = (
        f"{plural(len(dion), 'leaf', 'leaves')} on Dion,"
        f" {len(self.by_optimizer(ADAM))} on AdamW. Dion per step on each"
        f" device: {sum(r.flops_per_device for r in dion) / 1e9:.3g} GFLOP,"
        f" receives {sum(r.received_bytes for r in dion) / 1e6:.3g} MB,"
        f" modelled {self.step_seconds * 1e3:.3g} ms (each kind of collective"
        " combined over the leaves; cost profile:"
        f" {self.cost_model.name or 'given'}).\nMB/device: what one device"
        " receives for the leaf (ring model)"
    )
    if replicas:
      footer += (
          "; replica MB: what it receives across the replica axes (P's and R's"
          " sums, or the averaged gradient; AdamW leaves: their averaged"
          " gradient)"
      )
    if sharded:
      footer += (
          "; exchange MB: what a whole-matrix exchange (Muon's) moves for it,"
          " all devices together (summarize muon with the same arguments for"
          " its plan)"
      )
    else:
      header, body = header[:-1], [row[:-1] for row in body]
    return format_table(header, body, footer + ".", self.notes)


@dataclasses.dataclass(frozen=True)
class DionReport:
  """What ``scale_by_dion``'s ``init`` reports (a ``reporting.Report``).

  Attributes:
    settings: the transformation's static options.
  """

  settings: DionSettings

  @property
  def options(self):
    """The options shared with Muon (routing, dimension numbers, shardings)."""
    return self.settings.options

  def summarize(self, params: Any) -> DionSummary:
    """Dion's summary of ``params``."""
    settings = self.settings
    spec = tree_spec(params, settings.options)
    matrices = settings.matrices(spec, params)
    itemsizes = [
        np.dtype(moment_dtype(spec.leaves[i].dtype)).itemsize
        for i in spec.muon_positions
    ]
    costs = dict(zip(spec.muon_positions, step_costs(matrices, itemsizes)))
    matrices = dict(zip(spec.muon_positions, matrices))
    base = settings.options.sharding.cost_model or profiles.default_cost_model(
        profiles.mesh_devices(spec.mesh)
    )
    products = [mx.product_dtype for mx in matrices.values()]
    model = base.for_dtype(
        next((d for d in products if d is not None), np.float32)
    )
    rows, leaf_costs = [], []
    for i, leaf, row in leaf_rows(params, spec):
      fields = {}
      if i in matrices:
        itemsize = np.dtype(moment_dtype(leaf.dtype)).itemsize
        cost = costs[i]
        leaf_costs.append(cost)
        shards = (
            math.prod(leaf.sharding.shards(d) for d in range(len(leaf.shape)))
            if leaf.sharding is not None
            else 1
        )
        fields = dict(
            rank=matrices[i].rank,
            flops_per_device=cost.flops,
            received_bytes=cost.received_bytes,
            replica_bytes=cost.replica_bytes if settings.replica_axes else None,
            seconds=cost.seconds(model),
            exchange_bytes=2
            * math.prod(leaf.shape)
            * itemsize
            * (shards - 1)
            / shards,
        )
      elif settings.replica_axes and spec.mesh is not None:
        fields = dict(replica_bytes=_averaged_gradient_bytes(leaf, settings))
      rows.append(DionLeafSummary(**vars(row), **fields))
    return DionSummary(
        rows=tuple(rows),
        notes=option_notes(settings.options, params) + spec.notices,
        cost_model=model,
        step_seconds=step_seconds(leaf_costs, model),
    )


def _averaged_gradient_bytes(leaf: Any, settings: DionSettings) -> float:
  """What one device receives across the replica axes to average an AdamW
  leaf's gradient (an all-reduce of its block, ring model)."""
  mesh = leaf.sharding.mesh
  replicas = math.prod(mesh.shape[a] for a in settings.replica_axes)
  block = math.prod(leaf.sharding.local_shape(leaf.shape))
  return 2 * block * np.dtype(leaf.dtype).itemsize * (replicas - 1) / replicas
