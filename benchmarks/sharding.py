"""Sharded Muon, read off the compiled update: optax_muon vs optax.contrib.muon.

The trees are GPT-like: every block matrix on Muon, the embedding and head on AdamW (in
both optimizers), Jordan coefficients, 5 NS steps, f32.

For each model tree and mesh, compiles one optimizer update on 8 virtual CPU devices and
reports, per device and from the compiled HLO (while-loop trip counts included):
NS FLOPs ÷ ideal (Σ NS FLOPs of all matrices ÷ devices), received bytes ÷ the lower bound
2·(N−1)/N²·(Muon matrix bytes, f32), the number of collectives (and how many sit inside
loops), and temp memory ÷ per-device parameter bytes. optax.contrib.muon cannot compile
on an Explicit mesh (ShardingTypeError): those rows say so.

  python benchmarks/sharding.py           # d=256 trees
  python benchmarks/sharding.py --quick   # CI: d=64
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optax_muon  # noqa: E402
from optax_muon import hlo_cost  # noqa: E402
from optax_muon.orthogonalize import canonical_shape  # noqa: E402
from optax_muon.layout import make_layout  # noqa: E402
from single_device import table  # noqa: E402
from trees import gpt_tree, muon_dims  # noqa: E402

N = 8


def fsdp_specs(params, axis="fsdp"):
  """Every leaf split on its first matrix axis over ``axis`` (vectors replicated)."""
  def spec(x):
    if x.ndim == 3:
      return P(None, axis, None)
    if x.ndim == 2:  # a matrix, or stacked per-layer vectors (L, d)
      return P(axis) if x.shape[0] % N == 0 else P(None, axis)
    return P()
  return jax.tree.map(spec, params)


def megatron_specs(params):
  """FSDP × TP: column-parallel P(fsdp, tp), row-parallel (o, mlp_out) P(tp, fsdp)."""
  def spec(path, x):
    name = path[-1].key
    if x.ndim == 1 or (x.ndim == 2 and x.shape[0] == x.shape[-1] and False):
      return P()
    lead = (None,) * (x.ndim - 2)
    if x.ndim < 2:
      return P()
    if name in ("o", "mlp_out", "lm_head"):
      return P(*lead, "tp", "fsdp")
    return P(*lead, "fsdp", "tp")
  return jax.tree_util.tree_map_with_path(spec, params)


MESHES = {"FSDP-8": ((8,), ("fsdp",), fsdp_specs),
          "FSDP-4×TP-2": ((4, 2), ("fsdp", "tp"), megatron_specs)}


ADAM = ("embed", "lm_head")


def muon_matrices(params):
  dims = muon_dims(params, adam=ADAM)
  out = []
  for x, d in zip(jax.tree.leaves(params), jax.tree.leaves(
      dims, is_leaf=lambda v: v is None or isinstance(v, optax_muon.MuonDimensionNumbers))):
    if d is not None:
      layout = make_layout("", x, d)
      out.append((layout.batch, *canonical_shape(layout)))
  return out


def measure(name, tx, params, shardings, mesh) -> dict:
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  sharded = put(params)
  with jax.set_mesh(mesh):
    try:
      state = jax.jit(tx.init)(sharded)
      compiled = jax.jit(tx.update).lower(sharded, state, sharded).compile()
    except Exception as e:  # noqa: BLE001  (a row, not a crash: the anchor may not compile)
      return {"optimizer": name, "error": f"{type(e).__name__}"}
  cost = hlo_cost.analyze(compiled, N)
  matrices = muon_matrices(params)
  ideal = sum(b * optax_muon.ns_flops(m, n, 5) for b, m, n in matrices) / N
  lower_bound = 2 * (N - 1) / N**2 * sum(4 * b * m * n for b, m, n in matrices)
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) / N
  return {"optimizer": name, "flops": cost.dot_flops / ideal,
          "bytes": cost.received_bytes / lower_bound, "collectives": len(cost.collectives),
          "in loops": cost.collectives_in_loops, "temp": cost.temp_bytes / param_bytes}


def replica_policy_timing(d: int, layers: int, repeats: int) -> list[dict]:
  """Step time of the two replica policies on replicated params (pure data parallel)."""
  from single_device import alternate  # noqa: PLC0415  (only this table needs timing)
  params = gpt_tree(d, layers)
  mesh = jax.make_mesh((N,), ("dp",))
  replicated = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
  fns, args = {}, {}
  with jax.set_mesh(mesh):
    for policy in ("split", "redundant"):
      tx = optax_muon.muon(0.02, replica_policy=policy)
      fns[policy] = jax.jit(tx.update)
      args[policy] = (replicated, jax.jit(tx.init)(replicated), replicated)
    times = alternate(fns, args, repeats)
    costs = {p: hlo_cost.analyze(fns[p].lower(*args[p]).compile(), N) for p in fns}
  return [{"policy": p, "ms": times[p] * 1e3, "NS GFLOP/device": costs[p].dot_flops / 1e9,
           "received MB/device": costs[p].received_bytes / 2**20} for p in fns]


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  d = 64 if args.quick else 256
  trees = [("per-layer, 4 layers", 4, False), ("stacked, 4 layers", 4, True),
           ("per-layer, 3 layers", 3, False)]
  if args.quick:
    trees = trees[:1] + trees[2:]
  rows = []
  for tree_name, layers, stacked in trees:
    params = gpt_tree(d, layers, stacked=stacked)
    dims = muon_dims(params, adam=ADAM)
    for mesh_name, (shape, names, specs_fn) in MESHES.items():
      specs = specs_fn(params)
      for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        explicit = axis_type == AxisType.Explicit
        given = None if explicit else shardings
        candidates = {
            "optax_muon": optax_muon.muon(0.02, muon_weight_dimension_numbers=dims,
                                          method="standard", param_shardings=given),
            "optax_muon, bf16 wire": optax_muon.muon(
                0.02, muon_weight_dimension_numbers=dims, method="standard",
                param_shardings=given, wire_dtype=jnp.bfloat16),
            "optax_muon, one exchange": optax_muon.muon(
                0.02, muon_weight_dimension_numbers=dims, method="standard",
                param_shardings=given, exchange="group"),
            "optax.contrib.muon": optax.contrib.muon(
                0.02, muon_weight_dimension_numbers=muon_dims(params, contrib=True,
                                                              adam=ADAM)),
        }
        for name, tx in candidates.items():
          row = measure(name, tx, params, shardings, mesh)
          row.update(tree=f"d={d}, {tree_name}", mesh=mesh_name,
                     axes="Explicit" if explicit else "Auto")
          rows.append(row)
  for r in rows:
    if "error" in r:
      r.update(flops=float("nan"), bytes=float("nan"), collectives=-1, temp=float("nan"))
      r["in loops"] = r["error"]
  columns = ["tree", "mesh", "axes", "optimizer", "flops", "bytes", "collectives", "in loops",
             "temp"]
  print("per device: NS FLOPs ÷ ideal, received bytes ÷ lower bound, collectives (in NS "
        "loops), temp memory ÷ param bytes")
  print(table(rows, columns, {"flops": "{:.2f}×", "bytes": "{:.2f}×", "temp": "{:.2f}×"}))
  policy_rows = replica_policy_timing(d, 4, 3 if args.quick else 7)
  print(f"\nreplicated params (data parallel over {N} devices), d={d}, 4 layers: median step")
  print(table(policy_rows, list(policy_rows[0]), {"ms": "{:.1f}", "NS GFLOP/device": "{:.3f}",
                                                   "received MB/device": "{:.2f}"}))
  return rows


if __name__ == "__main__":
  main()
