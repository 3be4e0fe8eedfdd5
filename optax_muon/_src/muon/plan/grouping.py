"""Grouping: each Muon leaf's axes, the groups of leaves that share them, and
their buckets.

A leaf's mesh axes split into exchange axes X (they split its matrix dimensions)
and replica axes R (the leaf is replicated over them); leaves with the same (X,
R) form a group. Within a group, same-shape matrices (canonical orientation) of
one dtype form a bucket, and the buckets are cut into exchanges: all of them in
one (``"combined"``) or one per bucket (``"per_shape"``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from optax_muon._src.core.matrices import MatrixLayout
from optax_muon._src.core.options import ShardingOptions
from optax_muon._src.muon.plan.model import Bucket, Group, LeafPlacement
from optax_muon._src.core.sharding import LeafSharding

MeshShape = tuple[tuple[str, int], ...]


class ExchangeBuckets(NamedTuple):
  """The buckets of one exchange, before their owners are chosen.

  Attributes:
    group: index into the groups.
    buckets: the buckets that travel in the exchange's all-to-all.
  """

  group: int
  buckets: tuple[Bucket, ...]


def mesh_shape_of(shardings: Sequence[LeafSharding | None]) -> MeshShape:
  """Axis name → size, in mesh order, of the sharded leaves' mesh; empty if none
  is sharded."""
  mesh = next((s.mesh for s in shardings if s is not None), None)
  return tuple(mesh.shape.items()) if mesh is not None else ()


def place_leaves(
    layouts: Sequence[MatrixLayout],
    shardings: Sequence[LeafSharding | None],
    cost: Callable[[int, int, Any], int],
    mesh_shape: MeshShape,
) -> list[LeafPlacement]:
  """Each leaf's exchange and replica axes, and the NS FLOPs of one of its
  matrices.

  Args:
    layouts: the leaves' global layouts.
    shardings: their shardings, ``None`` for a leaf without.
    cost: the NS FLOPs of one (m, n) matrix of a dtype.
    mesh_shape: the mesh.

  Returns:
    One ``LeafPlacement`` per leaf.
  """
  order = [name for name, _ in mesh_shape]
  placements = []
  for layout, sharding in zip(layouts, shardings):
    flops = cost(*layout.ns_shape, layout.dtype)
    if sharding is None:
      placements.append(
          LeafPlacement(
              layout=layout,
              sharding=None,
              exchange_axes=(),
              replica_axes=(),
              flops=flops,
          )
      )
      continue
    matrix_axes = {
        a
        for d in layout.reduction_axes + layout.output_axes
        for a in sharding.dim_axes[d]
    }
    placements.append(
        LeafPlacement(
            layout=layout,
            sharding=sharding,
            exchange_axes=tuple(a for a in order if a in matrix_axes),
            replica_axes=tuple(a for a in order if a not in sharding.used_axes),
            flops=flops,
        )
    )
  return placements


def _buckets(
    placements: list[LeafPlacement], members: list[int], stack: bool
) -> tuple[Bucket, ...]:
  """The buckets of one group's leaves ``members``."""
  by_shape: dict[tuple, list[int]] = {}
  for i in members:
    layout = placements[i].layout
    key = layout.ns_shape + (np.dtype(layout.dtype),)
    by_shape.setdefault(key if stack else key + (i,), []).append(i)
  buckets = []
  for key, idx in by_shape.items():
    # Members sorted by how their pieces fit together, so that a worker's runs
    # of one kind are contiguous in the stack (no reordering on a single
    # device).
    kinds = list(dict.fromkeys(placements[i].signature for i in idx))
    idx = sorted(idx, key=lambda i: kinds.index(placements[i].signature))
    buckets.append(
        Bucket(
            shape=key[:2],
            dtype=key[2],
            members=tuple(idx),
            matrices=sum(placements[i].local_batch for i in idx),
            flops=placements[idx[0]].flops,
        )
    )
  return tuple(buckets)


def group_leaves(
    placements: list[LeafPlacement],
    mesh_shape: MeshShape,
    options: ShardingOptions,
    stack: bool,
) -> tuple[list[Group], list[ExchangeBuckets]]:
  """The groups (without exchanges yet) and the buckets of every exchange.

  Args:
    placements: the leaves.
    mesh_shape: the mesh.
    options: the replica policy and the exchange.
    stack: put same-shape matrices of a group into one bucket; else every leaf
      is a bucket of its own.

  Returns:
    The groups, and the exchanges of all groups in group order.
  """
  size = lambda axes: math.prod(dict(mesh_shape)[a] for a in axes)
  members: dict[tuple, list[int]] = {}
  for i, p in enumerate(placements):
    members.setdefault(
        (p.exchange_axes, p.replica_axes, p.sharding is not None), []
    ).append(i)
  groups, exchanges = [], []
  for (exchange_axes, replica_axes, sharded), idx in members.items():
    buckets = _buckets(placements, idx, stack)
    r = size(replica_axes)
    groups.append(
        Group(
            exchange_axes=exchange_axes,
            replica_axes=replica_axes,
            exchange_size=size(exchange_axes),
            replica_size=r,
            split=options.replica_policy == "split" and r > 1,
            sharded=sharded,
            buckets=buckets,
            exchanges=(),
        )
    )
    parts = (
        [buckets] if options.exchange == "combined" else [(b,) for b in buckets]
    )
    exchanges += [ExchangeBuckets(len(groups) - 1, part) for part in parts]
  return groups, exchanges
