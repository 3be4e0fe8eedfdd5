"""Run by ``test_group_plan.py`` with 64 virtual devices: the GPT tree (d=256, 3
layers, FSDP) with free communication. Prints the busiest device's compiled NS
FLOPs ÷ Σc/N with teams and with whole matrices only, then the largest relative
error against the single-device update."""

import math

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

import hlo_cost
import optax_muon as om
from helpers import rel_err
from hlo_cost import compiled_device_flops
from sharding import fsdp_specs
from trees import gpt_tree, muon_dims


def main():
  n = jax.device_count()
  params = gpt_tree(256, 3)
  dims = muon_dims(params, adam=("embed", "lm_head"))
  mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Explicit,))
  shardings = jax.tree.map(
      lambda s: NamedSharding(mesh, s), fsdp_specs(params, "fsdp")
  )
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  ns = om.NSOptions(method="standard")
  tx = om.muon(
      0.02,
      muon_weight_dimension_numbers=dims,
      ns_options=ns,
      sharding=om.ShardingOptions(cost_model=om.CostModel(1e12, math.inf, 0.0)),
  )
  grads = jax.tree.map(
      lambda x: jax.random.normal(jax.random.PRNGKey(1), x.shape), params
  )
  sharded = put(params)
  plan = om.summarize(sharded, tx).plan
  average = sum(p.layout.batch * p.flops for p in plan.leaves) / n
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    compiled = jax.jit(tx.update).lower(put(grads), state, sharded).compile()
    got, _ = compiled(put(grads), state, sharded)
  flops = compiled_device_flops(hlo_cost.analyze(compiled, n), plan)
  assert (flops == plan.device_ns_flops()).all()
  whole = max(p.flops for p in plan.leaves)  # the whole-matrix plan's floor
  single = om.muon(0.02, muon_weight_dimension_numbers=dims, ns_options=ns)
  expected, _ = jax.jit(single.update)(grads, single.init(params), params)
  err = max(
      rel_err(a, b)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected))
  )
  print(float(flops.max()) / average, whole / average, float(np.asarray(err)))


if __name__ == "__main__":
  main()
