"""Compiles the sharded update for a TPU or GPU topology on this CPU host and prints what the
compiler decided, as JSON (run by ``test_aot.py`` in a process of its own: a TPU and a GPU
compiler cannot share one).

  python tests/aot_worker.py tpu|cuda
"""

import json
import math
import os
import pathlib
import re
import sys

PLATFORM = sys.argv[1]
if PLATFORM == "tpu":
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-512")  # quiets libtpu's host probing
else:
  os.environ["JAX_PLATFORMS"] = "cpu"  # the CUDA plugin compiles deviceless

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


def _products(text: str) -> list[str]:
  return [l for l in text.splitlines()
          if re.search(r"\s(dot|convolution)\(", l) and "=" in l]


def main() -> None:
  mesh = aot.make_mesh(TARGET)
  n = mesh.devices.size
  # One layer: 3 matrices on 4 or 8 devices, so that free communication makes teams.
  shapes = {"q": (256, 256), "up": (256, 1024), "down": (1024, 256), "norm": (256,)}
  shardings = {k: NamedSharding(mesh, P("fsdp") if len(s) == 2 else P())
               for k, s in shapes.items()}
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=shardings[k])
            for k, s in shapes.items()}
  out = {"device_kind": mesh.devices.flat[0].device_kind, "devices": n}
  for name, model in (("default", None), ("teams", FREE)):
    tx = om.muon(0.02, param_shardings=shardings,
                 sharding=om.ShardingOptions(cost_model=model))
    with jax.set_mesh(mesh):
      state = jax.eval_shape(tx.init, params)
      compiled = jax.jit(tx.update).lower(params, state, params).compile()
      summary = om.summarize(params, tx)
    plan = summary.plan
    cost = hlo_cost.analyze(compiled, n)
    products = _products(compiled.as_text())
    out[name] = {
        "profile": summary.cost_model.name,
        "teams": sorted({ex.team_size for g in plan.groups for ex in g.exchanges}),
        "device_flops": hlo_cost.compiled_device_flops(cost, plan).reshape(-1).tolist(),
        "plan_flops": plan.device_ns_flops().reshape(-1).tolist(),
        "products": len(products),
        "highest": sum("operand_precision={highest,highest}" in l for l in products),
        "bf16_products": sum("bf16[" in l for l in products),
        "loop_collectives": sorted(c.kind for c in cost.collectives if c.in_loop),
        "notes": list(summary.notes),
    }
  print("RESULT " + json.dumps(out))


if __name__ == "__main__":
  main()
