"""Where Dion pays: its modelled step beside Muon's and AdamW's, with the
data-parallel gradient sync counted, by the cost model.

For the Llama-7B-like tree on FSDP meshes of 8 to 256 devices, FSDP 32 × TP 8
and replica 8 × FSDP 32, and the 405B-like tree on replica 64 × FSDP 256 and
replica 64 × FSDP 32 × TP 8 (``sharding.LARGE_TREES``, with their embedding
and output head; abstract shapes, nothing is compiled), per device and step:

- the gradient sync: every gradient's block (FSDP × TP) all-reduced over the
  replica axis (none without one), as AdamW, Muon and Dion on averaged
  gradients need it;
- AdamW: the sync alone;
- Muon: the sync, then the plan with teams (``optax_muon._src.muon.plan``
  under the profile; Newton–Schulz at bfloat16), its busiest device's
  exchange and NS;
- Dion on averaged gradients at rank fractions 1, 1/4, 1/16, 1/64: the sync,
  then ``optax_muon._src.dion.costs`` per leaf (products at float32,
  ``product_dtype=None``, and at the bfloat16 rate, ``dion``'s default on TPUs
  and GPUs), each kind of collective combined over the leaves
  (``step_seconds``);
- Dion with a compressed sync (``replica_axes``): no gradient sync for the
  matrices whose rank-r factors are smaller, only those factors' sums; the
  embedding and head's gradients averaged.

Columns: modelled ms (float32 products · bfloat16), MB received per device
(all collectives), MB of it across the replica axis.

  python benchmarks/dion_vs_muon.py                  # H100 and TPU v5p profiles
  python benchmarks/dion_vs_muon.py --profiles tpu_v5e
"""

from __future__ import annotations

import argparse
import math
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
#: The embedding's and head's vocabulary of each tree (Llama 2's, Llama 3's).
VOCAB = {SEVEN_B: 32000, FOUR_OH_FIVE_B: 128256}
# (tree, mesh shape, axis names): a leaf's n_in is split over "fsdp", its n_out
# over "tp"; "replica" holds data-parallel replicas.
CASES = [(SEVEN_B, (n,), ("fsdp",)) for n in (8, 64, 256)] + [
    (SEVEN_B, (32, 8), ("fsdp", "tp")),
    (SEVEN_B, (8, 32), ("replica", "fsdp")),
    (FOUR_OH_FIVE_B, *LARGE_TREES[FOUR_OH_FIVE_B][1:]),
    (FOUR_OH_FIVE_B, (64, 32, 8), ("replica", "fsdp", "tp")),
]


def gradient_sync(leaves, specs, mesh_shape, names, itemsize=4) -> float:
  """Bytes one device receives all-reducing its gradient blocks over the
  replica axis (ring model), 0 without one."""
  sizes = dict(zip(names, mesh_shape))
  replicas = sizes.get("replica", 1)
  if replicas == 1:
    return 0.0
  total = 0.0
  for name, leaf in leaves.items():
    entries = tuple(specs[name]) + (None,) * leaf.ndim
    shards = math.prod(
        sizes[a]
        for e in entries
        if e is not None
        for a in ((e,) if isinstance(e, str) else e)
    )
    total += 2 * math.prod(leaf.shape) / shards * itemsize * (replicas - 1)
  return total / replicas


def dion_step(
    leaves: dict,
    specs: dict,
    dims: dict,
    mesh_shape: tuple,
    names: tuple,
    fraction: float,
    model: optax_muon.CostModel,
    compressed: bool,
) -> tuple[float, float, float]:
  """(modelled seconds, received bytes, bytes across the replica axis) of one
  Dion step of the matrices on one device; ``compressed``: the replicas sync
  rank-r factors (else the gradients come averaged)."""
  mesh = jax.sharding.AbstractMesh(mesh_shape, names)
  replica_axes = ("replica",) if compressed and "replica" in names else ()
  matrices = []
  for name, leaf in leaves.items():
    layout = make_layout(name, leaf, dims[name])
    sharding = LeafSharding(mesh, dim_axes_of(specs[name], len(leaf.shape)))
    matrices.append(
        DionMatrix.of(
            layout,
            sharding,
            rank_of(fraction, layout),
            replica_axes=replica_axes,
        )
    )
  costs = step_costs(matrices)
  return (
      step_seconds(costs, model),
      sum(c.received_bytes for c in costs),
      sum(c.replica_bytes for c in costs),
  )


def _sync_seconds(nbytes: float, model) -> float:
  return model.collective_seconds(nbytes) if nbytes else 0.0


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
    shapes = LARGE_TREES[tree][0]
    leaves = llama_shapes(**shapes)
    specs = {
        k: P(None, "fsdp", "tp" if "tp" in names else None) for k in leaves
    }
    dims = {k: optax_muon.MuonDimensionNumbers(1, 2) for k in leaves}
    head = {
        "embed": jax.ShapeDtypeStruct((VOCAB[tree], shapes["d"]), np.float32),
        "lm_head": jax.ShapeDtypeStruct((shapes["d"], VOCAB[tree]), np.float32),
    }
    head_specs = {"embed": P("fsdp", None), "lm_head": P(None, "fsdp")}
    sync = gradient_sync(
        {**leaves, **head}, {**specs, **head_specs}, mesh_shape, names
    )
    head_sync = gradient_sync(head, head_specs, mesh_shape, names)
    mesh = " × ".join(f"{a} {n}" for a, n in zip(names, mesh_shape))
    for profile in args.profiles.split(","):
      model = PROFILES[profile]
      base = dict(tree=tree.split(" (")[0], mesh=mesh, profile=profile)
      rows.append(
          dict(
              base,
              optimizer="AdamW",
              ms=_sync_seconds(sync, model) * 1e3,
              **{"bf16 ms": _sync_seconds(sync, model) * 1e3},
              MB=sync / 1e6,
              **{"replica MB": sync / 1e6},
          )
      )
      ns = optax_muon.NSOptions(method="standard", compute_dtype="bfloat16")
      ns_model = model.for_dtype(jnp.bfloat16)
      _, plan, _, _ = abstract_plans(
          leaves, specs, dims, mesh_shape, names, ns, ns_model
      )
      muon_ms = (
          _sync_seconds(sync, model) + plan.critical_seconds(ns_model)
      ) * 1e3
      exchange = float(plan.device_received_bytes().max())
      rows.append(
          dict(
              base,
              optimizer="Muon (bf16 NS)",
              ms=muon_ms,
              **{"bf16 ms": muon_ms},
              MB=(sync + exchange) / 1e6,
              # the exchange crosses the replica axis too (replicas are
              # workers), counted as the sync alone here
              **{"replica MB": sync / 1e6},
          )
      )
      for compressed in (False, True):
        if compressed and "replica" not in names:
          continue
        for fraction in RANKS:
          figures = [
              dion_step(
                  leaves,
                  specs,
                  dims,
                  mesh_shape,
                  names,
                  fraction,
                  model.for_dtype(dtype),
                  compressed,
              )
              for dtype in (np.float32, jnp.bfloat16)
          ]
          pre = head_sync if compressed else sync
          rows.append(
              dict(
                  base,
                  optimizer=(
                      f"Dion r={fraction:g}, "
                      + ("compressed" if compressed else "averaged")
                  ),
                  ms=(_sync_seconds(pre, model) + figures[0][0]) * 1e3,
                  **{
                      "bf16 ms": (_sync_seconds(pre, model) + figures[1][0])
                      * 1e3
                  },
                  MB=(pre + figures[0][1]) / 1e6,
                  **{"replica MB": (pre + figures[0][2]) / 1e6},
              )
          )
      print(f"{tree} on {mesh} ({profile}) done", file=sys.stderr, flush=True)
  columns = list(rows[0])
  formats = {k: "{:.3g}" for k in ("ms", "bf16 ms", "MB", "replica MB")}
  print(table(rows, columns, formats))
  return rows


if __name__ == "__main__":
  main()
