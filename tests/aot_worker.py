"""Compiles the sharded update for a TPU or GPU topology on this CPU host and
prints what the compiler decided, as JSON (run by ``test_aot.py`` in a process
of its own: a TPU and a GPU compiler cannot share one).

  python tests/aot_worker.py tpu|cuda
  python tests/aot_worker.py tpu pod   # the v5p-256 team plan, async all-to-alls
"""

import json
import math
import os
import pathlib
import re
import sys

PLATFORM = sys.argv[1]
POD = sys.argv[2:] == ["pod"]
if PLATFORM == "tpu":
  os.environ.setdefault(
      "TPU_ACCELERATOR_TYPE", "v5p-512"
  )  # quiets libtpu's host probing
if POD:  # asynchronous all-to-alls, as the docs' TPU flags set them
  os.environ["LIBTPU_INIT_ARGS"] = (
      f"{os.environ.get('LIBTPU_INIT_ARGS', '')} "
      "--xla_tpu_enable_async_all_to_all=true"
  )
else:
  os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin compiles deviceless
  # The latency-hiding scheduler, as the docs' GPU flags set it.
  os.environ["XLA_FLAGS"] = (
      f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_enable_latency_hiding_"
      "scheduler=true --xla_gpu_experimental_parallel_collective_overlap_"
      "limit=2"
  )

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import aot  # noqa: E402
import hlo_cost  # noqa: E402
import optax_muon as om  # noqa: E402

TARGET = aot.TARGETS["tpu-v5e-4" if PLATFORM == "tpu" else "gpu-h100-8"]
FREE = om.CostModel(1e12, math.inf, 0.0)  # teams wherever they shorten NS


def _products(text: str) -> list[tuple[str, tuple[str, ...]]]:
  """Every dot and convolution: (its line, its operands' element types)."""
  types, out = {}, []
  for line in text.splitlines():
    inst = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[", line)
    if not inst:
      continue
    types[inst.group(1)] = inst.group(2)
    call = re.search(r"\s(?:dot|convolution)\(([^)]*)\)", line)
    if call:
      names = [a.split()[-1].lstrip("%") for a in call.group(1).split(",")]
      out.append((line, tuple(types.get(n, "?") for n in names)))
  return out


def main() -> None:
  mesh = aot.make_mesh(TARGET)
  n = mesh.devices.size
  # One layer: 3 matrices on 4 or 8 devices, so that free communication makes
  # teams.
  shapes = {
      "q": (256, 256),
      "up": (256, 1024),
      "down": (1024, 256),
      "norm": (256,),
  }
  shardings = {
      k: NamedSharding(mesh, P("fsdp") if len(s) == 2 else P())
      for k, s in shapes.items()
  }
  params = {
      k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=shardings[k])
      for k, s in shapes.items()
  }
  out = {"device_kind": mesh.devices.flat[0].device_kind, "devices": n}
  for name, model, compute in (
      ("default", None, "auto"),
      ("float32", None, jnp.float32),
      ("teams", FREE, jnp.float32),
  ):
    tx = om.muon(
        0.02,
        param_shardings=shardings,
        ns_options=om.NSOptions(compute_dtype=compute),
        sharding=om.ShardingOptions(cost_model=model),
    )
    with jax.set_mesh(mesh):
      state = jax.eval_shape(tx.init, params)
      compiled = jax.jit(tx.update).lower(params, state, params).compile()
      summary = om.summarize(params, tx)
    plan = summary.plan
    cost = hlo_cost.analyze(compiled, n)
    products = _products(compiled.as_text())
    out[name] = {
        "profile": summary.cost_model.name,
        "teams": sorted(
            {ex.team_size for g in plan.groups for ex in g.exchanges}
        ),
        "device_flops": (
            hlo_cost.compiled_device_flops(cost, plan).reshape(-1).tolist()
        ),
        "plan_flops": plan.device_ns_flops().reshape(-1).tolist(),
        "products": len(products),
        "f32_highest": sum(
            t == ("f32", "f32") and "operand_precision={highest,highest}" in l
            for l, t in products
        ),
        "bf16_operands": sum(t == ("bf16", "bf16") for _, t in products),
        "loop_collectives": sorted(
            c.kind for c in cost.collectives if c.in_loop
        ),
        # Per distinct team program, its runs' collectives in each NS loop step.
        "plan_loop_collectives": sum(
            r.cost.loop_collectives
            for g in plan.groups
            for ex in g.exchanges
            for i in range(len(ex.team_programs))
            for r in ex.teams[list(ex.team_program_of).index(i)]
        ),
        "notes": list(summary.notes),
    }
  # Dion at rank 1/4: what the compiler keeps of "no matrix gathered, small sums
  # only" (float32 products: with bfloat16 ones the compiler gathers R at
  # bfloat16, fewer bytes than the model's).
  tx = om.dion(
      0.02, rank_fraction=0.25, param_shardings=shardings, product_dtype=None
  )
  with jax.set_mesh(mesh):
    state = jax.eval_shape(tx.init, params)
    compiled = jax.jit(tx.update).lower(params, state, params).compile()
    summary = om.summarize(params, tx)
  cost = hlo_cost.analyze(compiled, n)
  out["dion"] = {
      "kinds": sorted({c.kind for c in cost.collectives}),
      "largest_gather": max(
          (c.output_bytes for c in cost.collectives if c.kind == "all-gather"),
          default=0,
      ),
      "received_bytes": cost.received_bytes,
      "modelled_bytes": sum(
          r.received_bytes for r in summary.by_optimizer("muon")
      ),
      "loop_collectives": sum(c.in_loop for c in cost.collectives),
  }
  if PLATFORM == "cuda":
    out["two_hosts"] = _staged_across_hosts()
  else:
    out["two_slices"] = _two_slices_profile()
  print("RESULT " + json.dumps(out))


def _pod_team_stages() -> dict:
  """The 7B-like tree on a TPU v5p-256 (FSDP 256): its plan (teams, stages,
  in line or a loop, modelled time beside one stage's), and what the compiler
  made of it (the share of all-to-all bytes with matrix products scheduled
  between start and done, the all-to-all bytes, each chip's NS FLOPs)."""
  from optax_muon._src.muon.plan.model import in_line  # noqa: PLC0415

  mesh = aot.make_mesh(aot.TARGETS["tpu-v5p-256"])
  params, dims, _, shardings = aot.llama_tree(mesh, **aot.TREES["7b"])
  txs, plans = {}, {}
  for stages in (None, 1):
    txs[stages] = om.muon(
        0.02,
        muon_weight_dimension_numbers=dims,
        param_shardings=shardings,
        sharding=om.ShardingOptions(exchange_stages=stages),
    )
    with jax.set_mesh(mesh):
      plans[stages] = om.summarize(params, txs[stages]).plan
  compiled, _ = aot.compile_update(txs[None], params, mesh)
  plan = plans[None]
  cost = hlo_cost.analyze(compiled, mesh.devices.size)
  overlapped, exchanged = hlo_cost.overlapped_bytes(compiled, "all-to-all")
  return {
      "teams": sorted(
          {ex.team_size for g in plan.groups for ex in g.exchanges}
      ),
      "stages": [(len(s), in_line(s)) for g in plan.groups for s in g.stages()],
      "seconds": plan.critical_seconds(),
      "one_stage_seconds": plans[1].critical_seconds(),
      "overlapped": overlapped / exchanged,
      "exchanged": sum(
          c.received_bytes for c in cost.collectives if c.kind == "all-to-all"
      ),
      "plan_exchanged": float(plan.device_received_bytes().max()),
      "flops_match": bool(
          (
              hlo_cost.compiled_device_flops(cost, plan)
              == plan.device_ns_flops()
          ).all()
      ),
  }


def _two_slices_profile() -> dict:
  """The cost profile the plan finds for two v5e slices joined over the
  data-center network."""
  from jax.experimental import topologies  # noqa: PLC0415

  from optax_muon._src.core import profiles  # noqa: PLC0415

  topo = topologies.get_topology_desc(
      platform="tpu", topology_name="v5e:2x2", num_slices=2
  )
  profile = profiles.profile_of(topo.devices)
  return {"name": profile.name, "bytes_per_second": profile.bytes_per_second}


def _staged_across_hosts() -> dict:
  """A 24-layer d = 2048 Llama-like tree on 2 hosts × 8 H100s (FSDP 16): the
  plan's stages, and the share of all-to-all bytes with matrix products
  scheduled between start and done (its NS runs in ``lax.switch`` branches:
  the workers' programs differ)."""
  target = aot.TARGETS["gpu-h100-2x8"]
  mesh = aot.make_mesh(target)
  params, dims, _, shardings = aot.llama_tree(mesh, **aot.TREES["1b"])
  tx = om.muon(
      0.02, muon_weight_dimension_numbers=dims, param_shardings=shardings
  )
  compiled, _ = aot.compile_update(tx, params, mesh)
  overlapped, exchanged = hlo_cost.overlapped_bytes(compiled, "all-to-all")
  with jax.set_mesh(mesh):
    plan = om.summarize(params, tx).plan
  return {
      "stages": max(len(s) for g in plan.groups for s in g.stages()),
      "overlapped": overlapped / exchanged,
      "conditionals": " conditional(" in compiled.as_text(),
  }


if __name__ == "__main__":
  if POD:
    print("RESULT " + json.dumps(_pod_team_stages()))
  else:
    main()
