"""Where Dion pays: its modelled step time and traffic beside Muon's plan, by
the cost model.

For the Llama-7B-like tree on FSDP meshes of 8 to 256 devices and FSDP 32 × TP
8, and the 405B-like tree on replica 64 × FSDP 256 and replica 64 × FSDP 32 × TP
8 (``sharding.LARGE_TREES``; abstract shapes, nothing is compiled):

- Muon: the plan with teams (``optax_muon._src.muon.plan.build_plan`` under the
  profile), Newton– Schulz at bfloat16 or float32 (exchanged at that dtype), its
  busiest device's modelled time (exchanges and NS) and received bytes.
- Dion at rank fractions 1, 1/4, 1/16, 1/64: ``optax_muon._src.dion.costs`` per
  leaf (products on local blocks at float32, as ``dion`` computes them by
  default, and at the bfloat16 rate of ``product_dtype="bfloat16"``; the partial
  sums all-reduced), each kind of collective combined over the leaves
  (``step_seconds``).

  python benchmarks/dion_vs_muon.py                  # H100 and TPU v5p profiles
  python benchmarks/dion_vs_muon.py --profiles tpu_v5e
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import optax_muon
from optax_muon._src.core.profiles import PROFILES
from optax_muon._src.dion.costs import step_costs, step_seconds
from optax_muon._src.dion.matrix import DionMatrix, rank_of
from optax_muon._src.core.matrices import make_layout
from optax_muon._src.core.sharding import LeafSharding, dim_axes_of
from sharding import LARGE_TREES, abstract_plans, llama_shapes
from single_device import table

RANKS = (1.0, 0.25, 1 / 16, 1 / 64)
SEVEN_B = next(k for k in LARGE_TREES if k.startswith("Llama-7B"))
FOUR_OH_FIVE_B = next(k for k in LARGE_TREES if k.startswith("405B"))
# (tree, mesh shape, axis names): a leaf's n_in is split over "fsdp", its n_out
# over "tp".
CASES = [(SEVEN_B, (n,), ("fsdp",)) for n in (8, 64, 256)] + [
    (SEVEN_B, (32, 8), ("fsdp", "tp")),
    (FOUR_OH_FIVE_B, *LARGE_TREES[FOUR_OH_FIVE_B][1:]),
    (FOUR_OH_FIVE_B, (64, 32, 8), ("replica", "fsdp", "tp")),
]


def dion_step(
    leaves: dict,
    specs: dict,
    dims: dict,
    mesh_shape: tuple,
    names: tuple,
    fraction: float,
    model: optax_muon.CostModel,
) -> tuple[float, float]:
  """(modelled seconds, received bytes) of one Dion step on one device."""
  mesh = jax.sharding.AbstractMesh(mesh_shape, names)
  matrices = []
  for name, leaf in leaves.items():
    layout = make_layout(name, leaf, dims[name])
    sharding = LeafSharding(mesh, dim_axes_of(specs[name], len(leaf.shape)))
    matrices.append(DionMatrix.of(layout, sharding, rank_of(fraction, layout)))
  costs = step_costs(matrices)
  return step_seconds(costs, model), sum(c.received_bytes for c in costs)


def main(argv: list[str] | None = None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--profiles",
      default="h100,tpu_v5p",
      help="comma-separated cost profiles (PROFILES; default: h100,tpu_v5p)",
  )
  args = parser.parse_args(argv)
  rows = []
  for tree, mesh_shape, names in CASES:
    leaves = llama_shapes(**LARGE_TREES[tree][0])
    specs = {
        k: P(None, "fsdp", "tp" if "tp" in names else None) for k in leaves
    }
    dims = {k: optax_muon.MuonDimensionNumbers(1, 2) for k in leaves}
    for profile in args.profiles.split(","):
      model = PROFILES[profile]
      row = {
          "tree": tree.split(" (")[0],
          "mesh": " × ".join(f"{a} {n}" for a, n in zip(names, mesh_shape)),
          "profile": profile,
      }
      for dtype in ("bfloat16", None):
        ns = optax_muon.NSOptions(method="standard", compute_dtype=dtype)
        ns_model = model.for_dtype(dtype or np.float32)
        _, plan, _, _ = abstract_plans(
            leaves, specs, dims, mesh_shape, names, ns, ns_model
        )
        label = "bf16" if dtype else "f32"
        row[f"Muon {label} ms"] = plan.critical_seconds(ns_model) * 1e3
        row[f"Muon {label} MB"] = (
            float(plan.device_received_bytes().max()) / 1e6
        )
      for fraction in RANKS:
        seconds, received = dion_step(
            leaves,
            specs,
            dims,
            mesh_shape,
            names,
            fraction,
            model.for_dtype(np.float32),
        )
        low, _ = dion_step(
            leaves,
            specs,
            dims,
            mesh_shape,
            names,
            fraction,
            model.for_dtype(jnp.bfloat16),
        )
        row[f"Dion r={fraction:g} ms"] = seconds * 1e3
        row[f"Dion r={fraction:g} bf16 ms"] = low * 1e3
        row[f"Dion r={fraction:g} MB"] = received / 1e6
      rows.append(row)
      print(
          f"{row['tree']} on {row['mesh']} ({profile}) done",
          file=sys.stderr,
          flush=True,
      )
  formats = {k: "{:.3g}" for k in rows[0] if k.endswith((" ms", " MB"))}
  print(table(rows, list(rows[0]), formats))
  return rows


if __name__ == "__main__":
  main()
