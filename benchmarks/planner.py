"""The planner on trees of the benchmark families at other sizes: the busiest
device's NS FLOPs, its received bytes and its collectives, from the plans (the
compiled update's NS FLOPs equal the plan's: ``tests/test_group_plan.py``,
``tests/test_planner_property.py``).

Rows (f32, FSDP; Jordan, 5 NS steps):

* GPT-like, 3 layers, d=256, vocab 1024, 64 devices, the default NS method
  ("auto") and the standard one, free communication (``CostModel(1e12, inf,
  0)``): the busiest device's NS FLOPs ÷ Σc/N, c the NS FLOPs of a whole matrix
  (floor 1.3);
* Llama-like (GQA 4:1, SwiGLU ffn 704), 2 layers, d=256, 64 devices, free
  communication: the same (floor 1.3);
* the GPT-like tree with prohibitive communication (1 byte/s, 1 s per
  collective): the busiest device's NS FLOPs ÷ those of the whole-matrix plan
  (min FLOPs, then bytes), its collectives, and whether the plan is that plan
  (floor: 1.00, 2 collectives, yes);
* MoE, 4 layers, 8 SwiGLU experts (ffn = d) per layer, d=256, expert 4 × fsdp 8,
  the default cost model (the CPU profile): the busiest device's received bytes
  ÷ the critical byte bound (``sharding.bounds``), and its NS FLOPs ÷ plain
  LPT's (floor 1.45 and 1.00).

  python benchmarks/planner.py
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402

import optax_muon as om  # noqa: E402
from optax_muon._src.core.profiles import PROFILES
import sharding  # noqa: E402
from single_device import table  # noqa: E402
from trees import gpt_tree, llama_tree, moe_tree, muon_dims, stacked_dims  # noqa: E402

FREE = om.CostModel(1e12, math.inf, 0.0)
PROHIBITIVE = om.CostModel(1e12, 1.0, 1.0)


def abstract_case(params, dims, mesh_shape, names, specs_fn):
  """(leaves, specs, dims) of ``params``' Muon leaves as abstract arrays."""
  leaves, flat_dims = sharding._flat(params), sharding._flat(dims)
  muon = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype)
      for k, x in leaves.items()
      if flat_dims[k] is not None
  }
  specs = sharding._flat(specs_fn(params))
  return (
      muon,
      {k: specs[k] for k in muon},
      {k: flat_dims[k] for k in muon},
      mesh_shape,
      names,
  )


def collectives(plan) -> int:
  """The most collectives any device runs per step: two all-to-alls per exchange
  (and the replicas' all-gather), plus its team's collectives."""
  counts = {}
  for g in plan.groups:
    if g.workers == 1:
      continue
    worker = g.worker_of_devices(plan.mesh_shape).reshape(-1)
    for ex in g.exchanges:
      per = ex.per_worker(lambda r: len(r.cost.collective_bytes))
      for d, w in enumerate(worker):
        counts[d] = (
            counts.get(d, 0) + 2 * (g.exchange_size > 1) + g.split + int(per[w])
        )
  return max(counts.values(), default=0)


def average(plan) -> float:
  """Σc/N: the NS FLOPs of every matrix, whole, over the devices."""
  return sum(p.layout.batch * p.flops for p in plan.leaves) / plan.device_count


def gpt_case():
  """GPT-like, 3 layers, d=256, vocab 1024, FSDP over 64 devices."""
  params = gpt_tree(256, 3, vocab=1024)
  return abstract_case(
      params,
      muon_dims(params, adam=sharding.ADAM),
      (64,),
      ("fsdp",),
      lambda p: sharding.fsdp_specs(p, "fsdp"),
  )


def llama_case():
  """Llama-like (GQA 8/2 heads, SwiGLU ffn 704), 2 layers, d=256, FSDP over 64
  devices."""
  params = llama_tree(256, 2, heads=8, kv_heads=2, ffn=704)
  return abstract_case(
      params,
      stacked_dims(params, adam=sharding.ADAM),
      (64,),
      ("fsdp",),
      lambda p: sharding.fsdp_specs(p, "fsdp"),
  )


def moe_case():
  """MoE, 4 layers, 8 SwiGLU experts (ffn = d), d=256, expert 4 × fsdp 8; and
  its bounds."""
  params = moe_tree(256, 4, heads=8, kv_heads=2, experts=8, expert_ffn=256)
  dims = stacked_dims(params, adam=sharding.ADAM)
  case = abstract_case(
      params,
      dims,
      (4, 8),
      ("expert", "fsdp"),
      lambda p: sharding.moe_specs(p, "expert", "fsdp"),
  )
  return case, sharding.bounds(params, dims, 32)


def rows() -> list[dict]:
  """The table's rows."""
  out = []
  methods = {
      "auto (default)": om.NSOptions(),
      "standard": om.NSOptions(method="standard"),
  }
  for tree, case in (
      ("GPT 3L d256 N64", gpt_case()),
      ("Llama GQA+SwiGLU 2L d256 N64", llama_case()),
  ):
    for method, ns in methods.items():
      start = time.perf_counter()
      whole, plan, _, _ = sharding.abstract_plans(*case, ns, FREE)
      out.append(
          {
              "row": f"{tree}, free",
              "NS": method,
              "figure": "busiest FLOPs / Σc/N",
              "value": plan.critical_ns_flops() / average(plan),
              "floor": 1.3,
              "whole-matrix plan": whole.critical_ns_flops() / average(plan),
              "collectives": collectives(plan),
              "plan s": time.perf_counter() - start,
          }
      )
  for method, ns in methods.items():
    start = time.perf_counter()
    whole, plan, _, _ = sharding.abstract_plans(*gpt_case(), ns, PROHIBITIVE)
    out.append(
        {
            "row": "GPT 3L d256 N64, prohibitive",
            "NS": method,
            "figure": "busiest FLOPs / whole plan's",
            "value": plan.critical_ns_flops() / whole.critical_ns_flops(),
            "floor": 1.0,
            "whole-matrix plan": (
                "same" if plan.groups == whole.groups else "differs"
            ),
            "collectives": collectives(plan),
            "plan s": time.perf_counter() - start,
        }
    )
  case, bound = moe_case()
  for method, ns in methods.items():
    start = time.perf_counter()
    _, plan, _, _ = sharding.abstract_plans(*case, ns, PROFILES["cpu"])
    lpt = sharding.lpt_plan(plan)
    out.append(
        {
            "row": "MoE 4L 8x SwiGLU d256 expert4 x fsdp8, cpu profile",
            "NS": method,
            "figure": "busiest bytes / bound",
            "value": plan.device_received_bytes().max() / bound["bytes"],
            "floor": 1.45,
            "whole-matrix plan": (
                "FLOPs / LPT's "
                f"{plan.critical_ns_flops() / lpt.critical_ns_flops():.3f}"
            ),
            "collectives": collectives(plan),
            "plan s": time.perf_counter() - start,
        }
    )
  return out


COLUMNS = [
    "row",
    "NS",
    "figure",
    "value",
    "floor",
    "whole-matrix plan",
    "collectives",
    "plan s",
]
FORMATS = {"value": "{:.3f}", "plan s": "{:.2f}", "whole-matrix plan": "{}"}


def main(argv=None):
  argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
  found = rows()
  for r in found:
    if isinstance(r["whole-matrix plan"], float):
      r["whole-matrix plan"] = f"{r['whole-matrix plan']:.3f}"
  print(table(found, COLUMNS, FORMATS))


if __name__ == "__main__":
  main()
