"""Muon's view of a tree's spec: the shared ``TreeSpec`` with Newton–Schulz's
options settled for the devices, the cost model, and the orthogonalization
plan."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from optax_muon._src.core import profiles
from optax_muon._src.core.spec import TreeSpec, tree_spec
from optax_muon._src.muon import costs
from optax_muon._src.muon.options import MuonOptions, NSOptions
from optax_muon._src.muon.plan.build import build_plan
from optax_muon._src.muon.plan.model import Plan


@dataclasses.dataclass(frozen=True, kw_only=True)
class MuonTreeSpec(TreeSpec):
  """A ``TreeSpec`` made under ``MuonOptions``, with what Muon derives from it.

  ``plan`` is the orthogonalization plan of the Muon leaves with at least one
  element (None when there are none); for each of ``plan.leaves``, ``planned``
  gives its index among the Muon leaves (``muon_positions``).
  """

  options: MuonOptions

  @functools.cached_property
  def plan(self) -> Plan | None:
    """Built on first use (``scale_by_shape`` and the placement of state never
    need it)."""
    if not self.planned:
      return None
    muon = [self.leaves[self.muon_positions[k]] for k in self.planned]
    cost = functools.partial(
        costs.matrix_flops, self.ns, steps=self.options.ns_steps
    )
    team_cost = functools.partial(
        costs.team_cost, self.ns, steps=self.options.ns_steps
    )
    sharding = dataclasses.replace(
        self.options.sharding, cost_model=self.cost_model
    )
    return build_plan(
        [l.layout for l in muon],
        [l.sharding for l in muon],
        cost,
        sharding,
        stack=self.options.ns.stack_same_shape,
        team_cost=team_cost,
    )

  @functools.cached_property
  def ns(self) -> NSOptions:
    """``options.ns`` settled for the devices the NS runs on: those of the mesh
    (concrete or a topology's), else the default backend's."""
    devices = profiles.mesh_devices(self.mesh)
    return self.options.ns.resolved(
        devices[0].platform if devices else jax.default_backend()
    )

  @functools.cached_property
  def cost_model(self) -> profiles.CostModel:
    """The plan's cost model: ``ShardingOptions.cost_model``, else the profile
    of the devices of the Muon leaves' mesh (``profiles.profile_of``; of
    ``jax.devices()`` for an abstract mesh, which has none), at the NS compute
    dtype's throughput."""
    model = self.options.sharding.cost_model or profiles.default_cost_model(
        profiles.mesh_devices(self.mesh)
    )
    dtypes = [l.dtype for l in self.muon_leaves]
    compute = self.ns.compute_dtype or (
        max(dtypes, key=lambda d: d.itemsize) if dtypes else np.float32
    )
    return model.for_dtype(compute)


def muon_tree_spec(tree: Any, options: MuonOptions) -> MuonTreeSpec:
  """``tree_spec(tree, options)`` as a ``MuonTreeSpec``.

  Raises:
    ValueError: as ``tree_spec``, and inside a ``shard_map`` that leaves some
      of a Muon leaf's mesh axes automatic (Muon's plan runs on local blocks).
  """
  spec = tree_spec(tree, options)
  if spec.manual:
    automatic = lambda l: sorted(l.sharding.used_axes - spec.manual_axes)
    partial = [
        f"{l.path} ({', '.join(automatic(l))})"
        for l in spec.muon_leaves
        if l.sharding is not None and automatic(l)
    ]
    if partial:
      raise ValueError(
          "optax_muon: inside shard_map Muon takes local blocks: every mesh"
          " axis a Muon leaf is split over must be manual; these are not:"
          f" {', '.join(partial)}. Call the update outside the shard_map, or"
          " make those axes manual."
      )
  return MuonTreeSpec(
      **{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
  )
