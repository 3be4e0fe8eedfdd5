"""Sharded Muon at scale, read off the compiled update: this checkout vs an
earlier one (``--baseline``), next to optax.contrib.muon's compile time.

Trees (``trees.py``; embedding and head on AdamW, every block matrix on Muon;
Jordan, 5 NS steps, standard iteration, f32):

* GPT, 3 layers, per-layer leaves, d=256 (q, k, v, o: d × d; mlp: d × 4d, 4d ×
  d), FSDP;
* Llama-like, 12 layers stacked, d=256: grouped-query attention (8 query heads,
  2 key/value heads: k, v are d × d/4) and SwiGLU (ffn 704), FSDP;
* MoE, 8 layers stacked, d=256: the same attention and a router (d × 8) FSDP
  over every device, 8 SwiGLU experts per layer (ffn 256) on an expert axis ×
  FSDP.

Device counts 8, 16 and 64, one process per count (the script re-launches itself
with ``--devices N``); FSDP over all N devices; the MoE mesh is expert × fsdp =
4 × 2, 8 × 2, 8 × 8. Auto mesh with ``param_shardings`` (where
optax.contrib.muon compiles; an Explicit mesh gives the same program for
optax_muon). Per device, per step, from the compiled HLO:

* NS FLOPs: the busiest device's dot FLOPs (a device running a ``lax.switch``
  branch costs that branch; the branch each device takes comes from the plan,
  and the branch FLOPs from the HLO) ÷ LB = max(Σ_j c_j / N, max_j c_j), c_j the
  NS FLOPs of matrix j on one device; "LPT" is the same figure for a FLOPs-only
  longest-processing-time placement;
* bytes: received bytes ÷ max(2(N−1)/N²·Σ_j b_j, (N−1)/N·max_j b_j +
  (N−1)/N²·Σ_j b_j), b_j the matrix bytes; "chunks" is the least that
  equal-chunk all-to-alls of whole matrices can reach, 2(N−1)/N·max(Σ_j b_j / N,
  max_j b_j), on the same scale, and "ragged" what ``jax.lax.ragged_all_to_all``
  would receive with the same owners (from the plan; XLA:CPU does not implement
  it);
* temp: XLA's temp memory ÷ (per-device param bytes + max(Σ_j b_j / N, max_j
  b_j));
* compile: seconds to lower and compile the update, and optax.contrib.muon's on
  the same tree and mesh (caches cleared; the faster of two compiles each,
  alternating);
* avg: the busiest device's NS FLOPs ÷ Σ_j c_j / N (the plan with the default
  cost model); teams avg: the same with communication made free
  (``CostModel(1e12, inf, 0)``), where the plan splits matrices over teams of
  devices; teams compile: that update's compile time.

The "old" columns are measured from earlier code: ``--baseline REV`` (default:
the last commit before teams and the cost model) is extracted with ``git
archive`` and put first on the path of a second child process.

``--plan-only`` compiles nothing: it plans from abstract shapes and prints the
modelled NS + all-to-all time of the busiest device per step, whole matrices vs
teams, under the GPU and TPU profiles, for the trees above and for a
Llama-7B-like tree on 256 devices and a 405B-like tree on 16384
(``LARGE_TREES``).

  python benchmarks/sharding.py              # 8, 16, 64 devices, this code and
  the baseline's python benchmarks/sharding.py --quick      # CI: 8 devices,
  small trees, new plan only python benchmarks/sharding.py --plan-only  #
  modelled times, up to 16384 devices
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASELINE = (  # the last commit before group NS (teams) and the cost model
    "804d755"
)
COUNTS = (8, 16, 64)


def _device_count(argv: list[str]) -> int:
  if "--devices" in argv:
    return int(argv[argv.index("--devices") + 1])
  return 8


# This process's device count, set before JAX starts (imported by the tests, JAX
# already runs with theirs).
if __name__ == "__main__" or "jax" not in sys.modules:
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={_device_count(sys.argv)}"
  ).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optax_muon  # noqa: E402
from optax_muon._src.core.profiles import PROFILES
from optax_muon._src.muon.costs import ns_flops
from single_device import table  # noqa: E402
from trees import (
    gpt_tree,
    llama_tree,
    moe_tree,
    muon_dims,  # noqa: E402
    require_optax_contrib_muon,
    stacked_dims,
)

import hlo_cost  # noqa: E402  (this checkout's HLO reader, also when optax_muon is the baseline's)
from hlo_cost import compiled_device_flops  # noqa: E402

ADAM = ("embed", "lm_head")


def fsdp_specs(params, axes):
  """Every matrix split on its first matrix axis over ``axes`` (norm scales
  replicated)."""

  def spec(path, x):
    if x.ndim == 1 or "norm" in path[-1].key:
      return P()
    return P(*(None,) * (x.ndim - 2), axes, None)

  return jax.tree_util.tree_map_with_path(spec, params)


def moe_specs(params, expert: str, fsdp: str):
  """Experts (L, E, n_in, n_out) over expert × fsdp; everything else FSDP over
  both."""

  def spec(path, x):
    if x.ndim == 4:
      return P(None, expert, fsdp, None)
    if x.ndim == 1 or "norm" in path[-1].key:
      return P()
    return P(*(None,) * (x.ndim - 2), (expert, fsdp), None)

  return jax.tree_util.tree_map_with_path(spec, params)


def trees(quick: bool) -> list[tuple]:
  """(name, params, dims, contrib dims) of each benchmark tree."""
  d = 64 if quick else 256
  gpt = gpt_tree(d, 3)
  llama = llama_tree(
      d, 4 if quick else 12, heads=8, kv_heads=2, ffn=704 * d // 256
  )
  moe = moe_tree(
      d, 2 if quick else 8, heads=8, kv_heads=2, experts=8, expert_ffn=d
  )
  return [
      (
          f"GPT d={d}, 3 layers",
          gpt,
          muon_dims(gpt, adam=ADAM),
          muon_dims(gpt, adam=ADAM, contrib=True),
      ),
      (
          f"GQA+SwiGLU d={d}, {4 if quick else 12} layers",
          llama,
          stacked_dims(llama, adam=ADAM),
          stacked_dims(llama, adam=ADAM, contrib=True),
      ),
      (
          f"MoE d={d}, {2 if quick else 8} layers, 8 experts",
          moe,
          stacked_dims(moe, adam=ADAM),
          stacked_dims(moe, adam=ADAM, contrib=True),
      ),
  ]


def mesh_layout(name: str, n: int):
  """The tree's mesh shape and axis names on ``n`` devices, and its specs
  function."""
  if name.startswith("MoE"):
    expert = min(8, n // 2)
    return (
        (expert, n // expert),
        ("expert", "fsdp"),
        lambda p: moe_specs(p, "expert", "fsdp"),
    )
  return (n,), ("fsdp",), lambda p: fsdp_specs(p, "fsdp")


def mesh_for(name: str, n: int):
  """The tree's mesh (Auto axes), its specs function and the mesh in words."""
  shape, names, specs_fn = mesh_layout(name, n)
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  return (
      mesh,
      specs_fn,
      " × ".join(f"{a} {size}" for a, size in zip(names, shape)),
  )


def bounds(params, dims, n: int) -> dict:
  """The metrics' denominators for ``params`` on ``n`` devices (Jordan, 5 steps,
  f32)."""
  flops, sizes = [], []
  for x, d in zip(
      jax.tree.leaves(params),
      jax.tree.leaves(
          dims,
          is_leaf=lambda v: v is None
          or isinstance(v, optax_muon.MuonDimensionNumbers),
      ),
  ):
    if d is not None:
      layout = optax_muon._src.core.matrices.make_layout("", x, d)
      m, k = sorted((layout.n_in, layout.n_out))
      flops += [ns_flops(m, k, 5)] * layout.batch
      sizes += [4 * m * k] * layout.batch
  total_b = sum(sizes)
  return {
      "flops": max(sum(flops) / n, max(flops)),
      "average": sum(flops) / n,
      "bytes": max(
          2 * (n - 1) / n**2 * total_b,
          (n - 1) / n * max(sizes) + (n - 1) / n**2 * total_b,
      ),
      "fair bytes": max(total_b / n, max(sizes)),
      "chunk min": 2 * (n - 1) / n * max(total_b / n, max(sizes)),
  }


def _benchmarked_muon(dims, shardings, cost_model=None):
  """The measured optimizer: standard NS iteration, plan from ``shardings`` (and
  ``cost_model``); also with the flat keywords of the code before the option
  objects (a ``--baseline`` checkout)."""
  if hasattr(optax_muon, "CostModel"):
    return optax_muon.muon(
        0.02,
        muon_weight_dimension_numbers=dims,
        param_shardings=shardings,
        ns_options=optax_muon.NSOptions(method="standard"),
        sharding=optax_muon.ShardingOptions(cost_model=cost_model),
    )
  if hasattr(optax_muon, "NSOptions"):
    return optax_muon.muon(
        0.02,
        muon_weight_dimension_numbers=dims,
        param_shardings=shardings,
        ns_options=optax_muon.NSOptions(method="standard"),
    )
  return optax_muon.muon(
      0.02,
      muon_weight_dimension_numbers=dims,
      method="standard",
      param_shardings=shardings,
  )


def lpt_plan(plan):
  """The same matrices placed by FLOPs alone (plain longest processing time
  first)."""
  layouts, shardings = [p.layout for p in plan.leaves], [
      p.sharding for p in plan.leaves
  ]
  if hasattr(
      plan, "ns"
  ):  # a --baseline checkout from before the option objects
    return optax_muon._src.muon.plan.build_plan(
        layouts, shardings, plan.ns, exchange=plan.exchange, weigh_bytes=False
    )
  costs = {(p.layout.ns_shape, p.layout.dtype): p.flops for p in plan.leaves}
  return optax_muon._src.muon.plan.build_plan(
      layouts,
      shardings,
      lambda m, n, dtype: costs[(m, n), dtype],
      optax_muon.ShardingOptions(
          exchange=plan.exchange, wire_dtype=plan.wire_dtype
      ),
      weigh_bytes=False,
  )


def compile_update(tx, params, shardings, mesh):
  """(compiled update, seconds to lower and compile it, the sharded params)."""
  sharded = jax.tree.map(jax.device_put, params, shardings)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.jit(tx.update).lower(sharded, state, sharded).compile()
  return compiled, time.perf_counter() - start, sharded


def compile_seconds(txs: dict, params, shardings, mesh, repeats: int) -> dict:
  """Fastest of ``repeats`` compiles of each update, alternating between
  them."""
  seconds = {name: [] for name in txs}
  for _ in range(repeats):
    for name, tx in txs.items():
      seconds[name].append(compile_update(tx, params, shardings, mesh)[1])
  return {name: min(s) for name, s in seconds.items()}


def measure(n: int, quick: bool, contrib: bool) -> list[dict]:
  """The rows of this process's device count (optax_muon as importable here)."""
  assert jax.device_count() == n, (jax.device_count(), n)
  rows = []
  for name, params, dims, contrib_dims in trees(quick):
    mesh, specs_fn, mesh_name = mesh_for(name, n)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs_fn(params))  # noqa: B023 (called in this iteration)
    tx = _benchmarked_muon(dims, shardings)
    compiled, _, sharded = compile_update(tx, params, shardings, mesh)
    cost = hlo_cost.analyze(compiled, n)
    plan = optax_muon.summarize(sharded, tx).plan
    row = {"tree": name, "mesh": mesh_name, "N": n}
    if hasattr(
        plan, "switches"
    ):  # the balanced plan: devices may run different branches
      row["flops"] = float(compiled_device_flops(cost, plan).max())
      row["lpt"] = float(lpt_plan(plan).critical_ns_flops())
      row["ragged"] = float(plan.device_received_bytes(ragged=True).max())
      row["branches"] = sum(
          len(ex.programs) for g in plan.groups for ex in g.exchanges
      )
    else:  # the uniform plan: every device runs the same program
      row["flops"] = float(cost.dot_flops)
    bound = bounds(params, dims, n)
    param_bytes = sum(
        x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(sharded)
    )
    row.update(
        flops=row["flops"] / bound["flops"],
        bytes=cost.received_bytes / bound["bytes"],
        temp=cost.temp_bytes / (param_bytes + bound["fair bytes"]),
        collectives=len(cost.collectives),
        in_loops=cost.collectives_in_loops,
        chunks=bound["chunk min"] / bound["bytes"],
    )
    if "lpt" in row:
      row["lpt"] /= bound["flops"]
      row["ragged"] /= bound["bytes"]
    if (
        hasattr(optax_muon, "CostModel") and not quick
    ):  # teams, with free communication
      free = _benchmarked_muon(
          dims, shardings, optax_muon.CostModel(1e12, float("inf"), 0.0)
      )
      compiled_free, seconds, sharded = compile_update(
          free, params, shardings, mesh
      )
      plan_free = optax_muon.summarize(sharded, free).plan
      row["avg"] = (
          row["flops"] * bound["flops"] / bound["average"]
      )  # the same, ÷ Σc/N
      row["teams avg"] = (
          float(
              compiled_device_flops(
                  hlo_cost.analyze(compiled_free, n), plan_free
              ).max()
          )
          / bound["average"]
      )
      row["teams compile"] = seconds
    txs = {"compile": tx}
    if contrib:
      txs["contrib compile"] = optax.contrib.muon(
          0.02, muon_weight_dimension_numbers=contrib_dims
      )
    row.update(compile_seconds(txs, params, shardings, mesh, 1 if quick else 2))
    rows.append(row)
  return rows


# Trees too large to compile here, planned from abstract shapes: (llama_tree's
# arguments, mesh shape, mesh axis names, the FSDP axis; other axes hold
# replicas that split the work).
LARGE_TREES = {
    "Llama-7B-like (d 4096, GQA 32/8, SwiGLU 11008, 32 layers)": (
        dict(d=4096, layers=32, heads=32, kv_heads=8, ffn=11008),
        (256,),
        ("fsdp",),
    ),
    "405B-like (d 16384, GQA 128/8, SwiGLU 53248, 126 layers)": (
        dict(d=16384, layers=126, heads=128, kv_heads=8, ffn=53248),
        (64, 256),
        ("replica", "fsdp"),
    ),
}


def llama_shapes(
    d: int, layers: int, heads: int, kv_heads: int, ffn: int
) -> dict:
  """The Muon matrices of ``llama_tree`` as abstract stacked leaves (L, n_in,
  n_out)."""
  kv = kv_heads * d // heads
  shapes = {
      "q": (d, d),
      "k": (d, kv),
      "v": (d, kv),
      "o": (d, d),
      "gate": (d, ffn),
      "up": (d, ffn),
      "down": (ffn, d),
  }
  return {
      name: jax.ShapeDtypeStruct((layers, *s), np.float32)
      for name, s in shapes.items()
  }


def abstract_plans(
    leaves: dict,
    specs: dict,
    dims: dict,
    mesh_shape: tuple,
    names: tuple,
    ns,
    model,
) -> tuple:
  """(whole-matrix plan, plan with teams under ``model``, seconds to build each)
  for abstract ``leaves`` with PartitionSpecs ``specs`` on an abstract mesh."""
  mesh = jax.sharding.AbstractMesh(mesh_shape, names)
  layouts = [
      optax_muon._src.core.matrices.make_layout(k, x, dims[k])
      for k, x in leaves.items()
  ]
  shardings = [
      optax_muon._src.core.sharding.LeafSharding(
          mesh,
          optax_muon._src.core.sharding.dim_axes_of(specs[k], len(x.shape)),
      )
      for k, x in leaves.items()
  ]
  cost = lambda m, n, dtype: optax_muon._src.muon.costs.matrix_flops(
      ns, m, n, dtype, 5
  )
  team_cost = lambda m, n, dtype, k: optax_muon._src.muon.costs.team_cost(
      ns, m, n, dtype, k, 5
  )
  start = time.perf_counter()
  whole = optax_muon._src.muon.plan.build_plan(layouts, shardings, cost)
  middle = time.perf_counter()
  groups = optax_muon._src.muon.plan.build_plan(
      layouts,
      shardings,
      cost,
      optax_muon.ShardingOptions(cost_model=model),
      team_cost=team_cost,
  )
  return whole, groups, middle - start, time.perf_counter() - middle


def _teams(plan) -> str:
  """The kinds teams orthogonalize, as "k=2: down, gate"."""
  found = {}
  for g in plan.groups:
    for ex in g.exchanges:
      for runs in ex.teams:
        for r in runs:
          found.setdefault(ex.team_size, set()).add(
              plan.leaves[r.leaf].layout.path
          )
  return (
      "; ".join(
          f"k={k}: {', '.join(sorted(p))}" for k, p in sorted(found.items())
      )
      or "—"
  )


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}/"))
    else:
      out[prefix + k] = v
  return out


def plan_only_rows(counts: tuple[int, ...], large: bool) -> list[dict]:
  """Modelled NS time per step of the whole-matrix plan and of the plan with
  teams, under the GPU and TPU profiles, NS in float32 and in bfloat16 (standard
  iteration, 5 steps)."""
  cases = []
  for name, params, dims, _ in trees(False):
    leaves, flat_dims = _flat(params), _flat(dims)
    muon = {
        k: jax.ShapeDtypeStruct(x.shape, x.dtype)
        for k, x in leaves.items()
        if flat_dims[k] is not None
    }
    for n in counts:
      shape, names, specs_fn = mesh_layout(name, n)
      specs = _flat(specs_fn(params))
      cases.append(
          (
              name,
              muon,
              {k: specs[k] for k in muon},
              {k: flat_dims[k] for k in muon},
              shape,
              names,
          )
      )
  if large:
    for name, (args, mesh_shape, names) in LARGE_TREES.items():
      muon = llama_shapes(**args)
      cases.append(
          (
              name,
              muon,
              {k: P(None, "fsdp", None) for k in muon},
              {k: optax_muon.MuonDimensionNumbers(1, 2) for k in muon},
              mesh_shape,
              names,
          )
      )
  rows = []
  for name, muon, specs, dims, mesh_shape, names in cases:
    for dtype in (None, "bfloat16"):
      ns = optax_muon.NSOptions(method="standard", compute_dtype=dtype)
      for profile in ("gpu", "tpu"):
        model = PROFILES[profile]
        whole, groups, _, seconds = abstract_plans(
            muon, specs, dims, mesh_shape, names, ns, model
        )
        average = (
            sum(p.layout.batch * p.flops for p in whole.leaves)
            / whole.device_count
        )
        rows.append(
            {
                "tree": name,
                "N": whole.device_count,
                "mesh": " × ".join(f"{a} {n}" for a, n in whole.mesh_shape),
                "NS dtype": dtype or "float32",
                "profile": profile,
                "whole ms": whole.critical_seconds(model) * 1e3,
                "teams ms": groups.critical_seconds(model) * 1e3,
                "ratio": (
                    groups.critical_seconds(model)
                    / whole.critical_seconds(model)
                ),
                "whole FLOPs/avg": whole.critical_ns_flops() / average,
                "teams FLOPs/avg": groups.critical_ns_flops() / average,
                "teams": _teams(groups),
                "plan s": seconds,
            }
        )
  return rows


def replica_policy_timing(d: int, layers: int, repeats: int) -> list[dict]:
  """Step time of the two replica policies on replicated params (pure data
  parallel)."""
  from single_device import alternate  # noqa: PLC0415  (only this table needs timing)

  n = jax.device_count()
  params = gpt_tree(d, layers)
  mesh = jax.make_mesh((n,), ("dp",), axis_types=(AxisType.Explicit,))
  replicated = jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, P())), params
  )
  fns, args = {}, {}
  with jax.set_mesh(mesh):
    for policy in ("split", "redundant"):
      tx = optax_muon.muon(
          0.02, sharding=optax_muon.ShardingOptions(replica_policy=policy)
      )
      fns[policy] = jax.jit(tx.update)
      args[policy] = (replicated, jax.jit(tx.init)(replicated), replicated)
    times = alternate(fns, args, repeats)
    costs = {
        p: hlo_cost.analyze(fns[p].lower(*args[p]).compile(), n) for p in fns
    }
  return [
      {
          "policy": p,
          "ms": times[p] * 1e3,
          "NS GFLOP/device": costs[p].dot_flops / 1e9,
          "received MB/device": costs[p].received_bytes / 2**20,
      }
      for p in fns
  ]


def _child(n: int, quick: bool, contrib: bool, pythonpath: str) -> list[dict]:
  """``measure`` in a fresh process with ``n`` devices and ``pythonpath``
  first."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = os.pathsep.join(
      [pythonpath, env.get("PYTHONPATH", "")]
  ).rstrip(os.pathsep)
  cmd = (
      [sys.executable, __file__, "--devices", str(n)]
      + ["--quick"] * quick
      + ([] if contrib else ["--no-contrib"])
  )
  out = subprocess.run(
      cmd, env=env, check=True, capture_output=True, text=True
  ).stdout
  return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> list[dict]:
  parser = (
      argparse.ArgumentParser(  # the docstring's first sentence, without markup
          description=" ".join(__doc__.split("\n\n")[0].split()).replace(
              "``", ""
          )
      )
  )
  parser.add_argument(
      "--quick",
      action="store_true",
      help="8 devices, small trees, this code only: a smoke run (default: off)",
  )
  # Child mode, internal: _child re-launches this script with --devices N.
  parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)
  parser.add_argument(
      "--no-contrib",
      action="store_true",
      help="skip optax.contrib.muon's compile times (default: off)",
  )
  parser.add_argument(
      "--baseline",
      default=BASELINE,
      metavar="REV",
      help=(
          "git revision of the code the 'old' columns measure; 'none' to skip"
          " (default: the last commit before teams and the cost model,"
          f" {BASELINE})"
      ),
  )
  parser.add_argument(
      "--counts",
      default=",".join(map(str, COUNTS)),
      help="comma-separated device counts (default: %(default)s)",
  )
  parser.add_argument(
      "--plan-only",
      action="store_true",
      help=(
          "no compiling: model the whole-matrix plan and the plan with teams "
          "under the GPU and TPU profiles, on the benchmark trees at --counts "
          "and on a 7B-like tree at 256 and a 405B-like tree at 16384 devices "
          "(default: off)"
      ),
  )
  parser.add_argument(
      "--no-large",
      action="store_true",
      help="with --plan-only: skip the two large trees (default: off)",
  )
  args = parser.parse_args(argv)
  if args.plan_only:
    rows = plan_only_rows(
        tuple(int(c) for c in args.counts.split(",")), not args.no_large
    )
    print(
        "modelled NS + exchange time per step of the busiest device: whole"
        " matrices vs teams (standard NS, 5 steps); busiest NS FLOPs ÷ Σc/N;"
        " planning time"
    )
    print(
        table(
            rows,
            list(rows[0]),
            {
                "whole ms": "{:.3g}",
                "teams ms": "{:.3g}",
                "ratio": "{:.2f}×",
                "whole FLOPs/avg": "{:.2f}×",
                "teams FLOPs/avg": "{:.2f}×",
                "plan s": "{:.1f}",
            },
        )
    )
    return rows
  require_optax_contrib_muon()
  if args.devices is not None:
    rows = measure(args.devices, args.quick, not args.no_contrib)
    print(json.dumps(rows))
    return rows
  if args.quick:
    rows = measure(8, True, True)
    baseline = {}
  else:
    counts = [int(c) for c in args.counts.split(",")]
    rows = [r for n in counts for r in _child(n, False, True, str(ROOT))]
    baseline = {}
    if args.baseline != "none":
      with tempfile.TemporaryDirectory() as old:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "optax_muon"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", old], input=archive, check=True)
        baseline = {
            (r["tree"], r["N"]): r
            for n in counts
            for r in _child(n, False, False, old)
        }
  for r in rows:
    old = baseline.get((r["tree"], r["N"]))
    r["old flops"] = old["flops"] if old else float("nan")
    r["old bytes"] = old["bytes"] if old else float("nan")
    r["old temp"] = old["temp"] if old else float("nan")
    r["old compile"] = old["compile"] if old else float("nan")
    for column in (
        "avg",
        "teams avg",
        "teams compile",
    ):  # not measured with --quick
      r.setdefault(column, float("nan"))
  columns = [
      "tree",
      "mesh",
      "N",
      "old flops",
      "flops",
      "lpt",
      "old bytes",
      "bytes",
      "chunks",
      "ragged",
      "old temp",
      "temp",
      "branches",
      "old compile",
      "compile",
      "contrib compile",
      "avg",
      "teams avg",
      "teams compile",
  ]
  formats = {
      c: "{:.2f}×"
      for c in (
          "old flops",
          "flops",
          "lpt",
          "old bytes",
          "bytes",
          "chunks",
          "ragged",
          "old temp",
          "temp",
          "avg",
          "teams avg",
      )
  }
  formats["branches"] = "{}"
  formats.update(
      {
          c: "{:.1f} s"
          for c in (
              "old compile",
              "compile",
              "contrib compile",
              "teams compile",
          )
      }
  )
  print(
      "per device, per step: critical NS FLOPs ÷ LB (baseline, this code,"
      " FLOPs-only LPT), critical received bytes ÷ LB, temp ÷ (param shard +"
      " fair share), compile time of the update vs optax.contrib.muon's"
  )
  print(table(rows, columns, formats))
  d = 64 if args.quick else 256
  policy_rows = replica_policy_timing(d, 4, 3 if args.quick else 7)
  print(
      f"\nreplicated params (data parallel over {jax.device_count()} devices),"
      f" d={d}, 4 layers: median step"
  )
  print(
      table(
          policy_rows,
          list(policy_rows[0]),
          {
              "ms": "{:.1f}",
              "NS GFLOP/device": "{:.3f}",
              "received MB/device": "{:.2f}",
          },
      )
  )
  return rows


if __name__ == "__main__":
  main()
