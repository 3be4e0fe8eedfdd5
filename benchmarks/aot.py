"""The update compiled for TPU pods and NVIDIA GPU clusters, on this CPU host,
beside optax.contrib.muon: what each real compiler decides (memory, NS FLOPs,
collectives, overlap, precision, compile time).

Nothing runs on an accelerator: JAX builds a topology of devices that are not
here and the TPU compiler (libtpu) or the GPU compiler (the CUDA plugin,
deviceless) compiles for it (``shared/aot/README.md`` of the workspace describes
both). Each platform needs its own environment (they cannot share a process)::

  python -m venv /tmp/aot-tpu && /tmp/aot-tpu/bin/pip install "jax[tpu]==0.10.2" optax
  python -m venv /tmp/aot-gpu && /tmp/aot-gpu/bin/pip install jax==0.10.2 \\
      jax-cuda12-plugin==0.10.2 nvidia-cuda-nvcc-cu12 optax
  /tmp/aot-tpu/bin/pip install --no-deps -e .   # and the same for /tmp/aot-gpu
  /tmp/aot-tpu/bin/python benchmarks/aot.py --targets tpu-v5e-16,tpu-v5p-256
  /tmp/aot-gpu/bin/python benchmarks/aot.py --targets gpu-h100-8,gpu-h200-4x8,gpu-h100-2x8

With ``--dion 0.25,0.0625``, rows of ``optax_muon.dion`` at those rank fractions
too (products at bfloat16 and at float32), their modelled time and received
bytes from ``summarize`` (``optax_muon._src.dion.costs``) beside the HLO's.

Per target and tree, one row per optimizer: optax_muon as it plans by default
(the cost profile of the target's devices, found from their ``device_kind``),
with teams forced off (prohibitive communication) and forced on (free
communication), with its exchange in one stage (no overlap with NS), and
optax.contrib.muon. Compiled with asynchronous collectives (``TPU_FLAGS``,
``GPU_FLAGS``). Columns: temp and argument memory per device
(``memory_analysis``); the busiest device's NS FLOPs counted from that
compiler's HLO (``hlo_cost``: dots, and the convolutions a TPU writes them as,
times loop trip counts) beside the plan's; collectives by kind with the bytes a
device receives (ring model); the share of all-to-all bytes whose start/done
pair has matrix products scheduled between them (the exchange's stages: see
``ShardingOptions.exchange_stages``); compile CPU seconds (``time.process_time``
of lower + compile, optimizers alternating); the plan's modelled NS and exchange
time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

# GPU target configs (GpuTargetConfigProto as text): the published
# characteristics of each part, for the CUDA plugin's deviceless compilation.
GPU_TARGETS = pathlib.Path(__file__).resolve().parent / "gpu_targets"


@dataclasses.dataclass(frozen=True)
class Target:
  """A machine to compile for.

  Attributes:
    platform: ``"tpu"`` or ``"cuda"``.
    topology: libtpu's topology name, or the GPU's ``partitions x hosts x
      devices``.
    gpu_config: the GPU target config file (``*.txtpb``), GPU only.
    slices: TPU slices joined over the data-center network (libtpu's
      ``num_slices``), TPU only.
  """

  platform: str
  topology: str
  gpu_config: str = ""
  slices: int = 1


TARGETS = {
    "tpu-v5e-4": Target("tpu", "v5e:2x2"),
    "tpu-v5e-16": Target("tpu", "v5e:4x4"),
    "tpu-v5p-256": Target("tpu", "v5p:8x8x4"),
    "tpu-v5p-2x64": Target("tpu", "v5p:4x4x4", slices=2),
    "gpu-h100-8": Target("cuda", "1x1x8", "h100_sxm.txtpb"),
    "gpu-h100-2x8": Target("cuda", "1x2x8", "h100_sxm.txtpb"),
    "gpu-h200-4x8": Target("cuda", "1x4x8", "h200.txtpb"),
}

# Trees: name → Llama-like shapes (d, layers, heads, kv heads, ffn, vocab).
TREES = {
    "small": dict(d=256, layers=4, heads=4, kv_heads=2, ffn=704, vocab=1024),
    "1b": dict(d=2048, layers=24, heads=16, kv_heads=4, ffn=5632, vocab=32000),
    "7b": dict(d=4096, layers=32, heads=32, kv_heads=8, ffn=11008, vocab=32000),
}


# Asynchronous collectives, as production runs set them: without them a TPU's
# all-to-all is a synchronous op and nothing overlaps it (MaxText's TPU recipes
# set the same flag); on GPUs the latency-hiding scheduler places the start/done
# pairs around independent compute.
TPU_FLAGS = "--xla_tpu_enable_async_all_to_all=true"
GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true "
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2"
)


def _set_platform_env(platform: str) -> None:
  """Before JAX starts: libtpu's host probing quieted, or the CUDA plugin kept
  deviceless; the flags for asynchronous collectives."""
  if platform == "tpu":
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-512")
    os.environ["LIBTPU_INIT_ARGS"] = (
        f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {TPU_FLAGS}"
    )
  else:
    os.environ["JAX_PLATFORMS"] = (
        "cpu"  # else the plugin calls cuInit, fails, unregisters
    )
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {GPU_FLAGS}"


def make_mesh(target: Target, config_dir: pathlib.Path = GPU_TARGETS):
  """A one-axis ("fsdp") mesh over every device of ``target``'s topology (Auto
  axes; several TPU slices one after another)."""
  import numpy as np  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415
  from jax.sharding import AxisType, Mesh  # noqa: PLC0415

  if target.platform == "tpu":
    topo = topologies.get_topology_desc(
        platform="tpu",
        topology_name=target.topology,
        **({"num_slices": target.slices} if target.slices > 1 else {}),
    )
    if target.slices > 1:  # slice after slice: FSDP over the network too
      devices = sorted(topo.devices, key=lambda d: (d.slice_index, d.id))
      return Mesh(np.array(devices), ("fsdp",), axis_types=(AxisType.Auto,))
  else:
    topo = topologies.get_topology_desc(
        platform="cuda",
        target_config=(config_dir / target.gpu_config).read_text(),
        topology=target.topology,
    )
  devices = topo.devices
  return topologies.make_mesh(topo, (len(devices),), ("fsdp",))


def llama_tree(
    mesh, d: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int
):
  """(params, dimension numbers, optax.contrib's dimension numbers, shardings):
  a stacked Llama-like tree of ``jax.ShapeDtypeStruct`` (float32), FSDP on each
  matrix's first axis."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  import optax_muon  # noqa: PLC0415

  kv = kv_heads * d // heads
  blocks = {
      "q": (d, d),
      "k": (d, kv),
      "v": (d, kv),
      "o": (d, d),
      "gate": (d, ffn),
      "up": (d, ffn),
      "down": (ffn, d),
  }
  shapes = {
      "embed": (vocab, d),
      "lm_head": (d, vocab),
      "final_norm": (d,),
      "blocks": {
          **{k: (layers, *s) for k, s in blocks.items()},
          "attn_norm": (layers, d),
          "mlp_norm": (layers, d),
      },
  }
  is_shape = lambda x: isinstance(x, tuple)
  spec = lambda s: (
      P(None, "fsdp", None)
      if len(s) == 3
      else P("fsdp", None)
      if len(s) == 2 and s[0] > layers
      else P()
  )
  shardings = jax.tree.map(
      lambda s: NamedSharding(mesh, spec(s)), shapes, is_leaf=is_shape
  )
  params = jax.tree.map(
      lambda s, sh: jax.ShapeDtypeStruct(s, jnp.float32, sharding=sh),
      shapes,
      shardings,
      is_leaf=is_shape,
  )

  def dims(cls):
    return jax.tree.map(
        lambda s: cls(1, 2) if len(s) == 3 else None, shapes, is_leaf=is_shape
    )

  contrib_cls = getattr(optax.contrib, "MuonDimensionNumbers", None)
  return (
      params,
      dims(optax_muon.MuonDimensionNumbers),
      (dims(contrib_cls) if contrib_cls else None),
      shardings,
  )


def target_profile(mesh):
  """The cost profile of the mesh's devices at the default NS compute dtype
  (bfloat16 on TPUs and GPUs), as the plan finds it."""
  import jax.numpy as jnp  # noqa: PLC0415

  import optax_muon  # noqa: PLC0415
  from optax_muon._src.core import profiles  # noqa: PLC0415

  devices = profiles.mesh_devices(mesh)
  compute = optax_muon.NSOptions().resolved(devices[0].platform).compute_dtype
  return profiles.profile_of(devices).for_dtype(compute or jnp.float32)


def optimizers(
    mesh,
    dims,
    contrib_dims,
    shardings,
    dion_ranks=(),
    muon: bool = True,
    stages=(),
) -> dict:
  """The compared optimizers: name → (transformation, the cost model it is given
  or None); ``dion_ranks``: also ``optax_muon.dion`` at these rank fractions
  (products at bfloat16 and at float32); ``muon``: this package's Muon rows;
  ``stages``: also this package's Muon with its exchanges forced into each of
  these stage counts."""
  import math  # noqa: PLC0415

  import optax  # noqa: PLC0415

  import optax_muon  # noqa: PLC0415

  profile = target_profile(mesh)
  models = {
      "optax_muon": (
          None
      ),  # the profile of the mesh's devices, found by the plan
      "optax_muon, whole matrices": optax_muon.CostModel(
          profile.flops_per_second, 1.0, 1.0
      ),
      "optax_muon, teams": optax_muon.CostModel(
          profile.flops_per_second, math.inf, 0.0
      ),
  }
  options = {
      name: optax_muon.ShardingOptions(cost_model=model)
      for name, model in models.items()
  }
  options["optax_muon, one stage"] = optax_muon.ShardingOptions(
      exchange_stages=1
  )
  for count in stages:
    options[f"optax_muon, {count} stages"] = optax_muon.ShardingOptions(
        exchange_stages=count
    )
  out = (
      {
          name: (
              optax_muon.muon(
                  0.02,
                  muon_weight_dimension_numbers=dims,
                  param_shardings=shardings,
                  sharding=o,
              ),
              o.cost_model,
          )
          for name, o in options.items()
      }
      if muon
      else {}
  )
  for fraction in dion_ranks:
    for dtype in ("bfloat16", None):
      out[f"dion r={fraction:g}, {dtype or 'float32'} products"] = (
          optax_muon.dion(
              0.02,
              rank_fraction=fraction,
              muon_weight_dimension_numbers=dims,
              param_shardings=shardings,
              product_dtype=dtype,
          ),
          None,
      )
  if contrib_dims is not None:
    out["optax.contrib.muon"] = (
        optax.contrib.muon(0.02, muon_weight_dimension_numbers=contrib_dims),
        None,
    )
  return out


def compile_update(tx, params, mesh):
  """(compiled update, CPU seconds of lower + compile)."""
  import jax  # noqa: PLC0415

  with jax.set_mesh(mesh):
    state = jax.eval_shape(tx.init, params)
    jax.clear_caches()
    start = time.process_time()
    compiled = jax.jit(tx.update).lower(params, state, params).compile()
  return compiled, time.process_time() - start


def row(
    name: str, tx, model, compiled, seconds: float, params, mesh, target: Target
) -> dict:
  """The figures of one compiled update (its plan's modelled time under the
  target's own profile, whatever model chose the plan)."""
  import jax  # noqa: PLC0415

  import hlo_cost  # noqa: PLC0415
  import optax_muon  # noqa: PLC0415

  n = mesh.devices.size
  profile = target_profile(mesh)
  cost = hlo_cost.analyze(compiled, n)
  memory = compiled.memory_analysis()
  by_kind: dict[str, list[float]] = {}
  for c in cost.collectives:
    entry = by_kind.setdefault(c.kind, [0, 0.0])
    entry[0] += c.multiplicity
    entry[1] += c.received_bytes
  overlapped, exchanged = hlo_cost.overlapped_bytes(compiled, "all-to-all")
  out = {
      "target": target.topology,
      "devices": n,
      "optimizer": name,
      "temp GB": memory.temp_size_in_bytes / 1e9,
      "argument GB": memory.argument_size_in_bytes / 1e9,
      # Without a plan: every device runs the same program (no lax.switch).
      "NS GFLOP (HLO)": cost.dot_flops / 1e9,
      "collectives": {
          k: {"count": v[0], "received MB": v[1] / 1e6}
          for k, v in sorted(by_kind.items())
      },
      "all-to-all bytes overlapped": (
          overlapped / exchanged if exchanged else None
      ),
      "compile CPU s": seconds,
  }
  if name.startswith("optax_muon"):
    with jax.set_mesh(mesh):
      summary = optax_muon.summarize(params, tx)
    plan = summary.plan
    out["profile"] = summary.cost_model.name or "given"
    out["NS GFLOP (HLO)"] = (
        hlo_cost.compiled_device_flops(cost, plan).max() / 1e9
    )
    out["NS GFLOP (plan)"] = plan.critical_ns_flops() / 1e9
    out["modelled ms"] = plan.critical_seconds(profile) * 1e3
    out["teams"] = sorted(
        {ex.team_size for g in plan.groups for ex in g.exchanges if ex.teams}
    ) or [1]
    out["stages"] = max(len(s) for g in plan.groups for s in g.stages())
  if name.startswith("dion"):
    with jax.set_mesh(mesh):
      summary = optax_muon.summarize(params, tx)
    out["profile"] = summary.cost_model.name or "given"
    out["modelled ms"] = summary.step_seconds * 1e3
    out["modelled received MB"] = (
        sum(r.received_bytes for r in summary.by_optimizer("muon")) / 1e6
    )
  return out


def measure(
    target_name: str,
    tree: str,
    repeats: int,
    contrib: bool = True,
    dion_ranks=(),
    muon: bool = True,
    stages=(),
) -> list[dict]:
  """Every optimizer's row for ``target_name`` and ``tree``, compiles
  alternating."""
  target = TARGETS[target_name]
  mesh = make_mesh(target)
  params, dims, contrib_dims, shardings = llama_tree(mesh, **TREES[tree])
  txs = optimizers(
      mesh,
      dims,
      contrib_dims if contrib else None,
      shardings,
      dion_ranks,
      muon,
      stages,
  )
  compiled, seconds, failed = {}, {name: [] for name in txs}, {}
  for _ in range(repeats):
    for name, (tx, _) in txs.items():
      if name in failed:
        continue
      try:
        compiled[name], s = compile_update(tx, params, mesh)
      except Exception as e:  # noqa: BLE001  (the compiler's verdict is a result here)
        if "RESOURCE_EXHAUSTED" not in str(e):
          raise
        failed[name] = str(e).split("RESOURCE_EXHAUSTED: ")[-1].splitlines()[0]
        continue
      seconds[name].append(s)
  return [
      dict(
          row(
              name,
              tx,
              model,
              compiled[name],
              min(seconds[name]),
              params,
              mesh,
              target,
          )
          if name not in failed
          else {
              "optimizer": name,
              "does not fit": failed[name],
              "devices": mesh.devices.size,
          },
          tree=tree,
          target_name=target_name,
      )
      for name, (tx, model) in txs.items()
  ]


def table(rows: list[dict]) -> str:
  """A markdown table of ``rows`` (one target and tree)."""
  head = (
      "optimizer",
      "profile",
      "temp GB",
      "arg GB",
      "NS GFLOP busiest (HLO)",
      "(plan)",
      "teams k",
      "stages",
      "collectives: count, received MB",
      "a2a overlapped",
      "compile CPU s",
      "modelled ms",
      "modelled received MB",
  )
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    if "does not fit" in r:
      lines.append(
          f"| {r['optimizer']} | does not fit: {r['does not fit']} |"
          + " |" * (len(head) - 2)
      )
      continue
    collectives = "; ".join(
        f"{k} {v['count']}, {v['received MB']:.0f}"
        for k, v in r["collectives"].items()
    )
    share = r["all-to-all bytes overlapped"]
    lines.append(
        "| "
        + " | ".join(
            [
                r["optimizer"],
                r.get("profile", "—"),
                f"{r['temp GB']:.3f}",
                f"{r['argument GB']:.3f}",
                f"{r['NS GFLOP (HLO)']:.1f}",
                f"{r['NS GFLOP (plan)']:.1f}"
                if "NS GFLOP (plan)" in r
                else "—",
                ",".join(map(str, r.get("teams", []))) or "—",
                str(r.get("stages", "—")),
                collectives or "—",
                "—" if share is None else f"{share:.0%}",
                f"{r['compile CPU s']:.2f}",
                f"{r['modelled ms']:.2f}" if "modelled ms" in r else "—",
                f"{r['modelled received MB']:.0f}"
                if "modelled received MB" in r
                else "—",
            ]
        )
        + " |"
    )
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--targets",
      default="tpu-v5e-16,tpu-v5p-256",
      help=(
          f"comma-separated, of one platform: {', '.join(TARGETS)} "
          "(default: %(default)s)"
      ),
  )
  parser.add_argument(
      "--trees",
      default="7b",
      help=f"comma-separated: {', '.join(TREES)} (default: %(default)s)",
  )
  parser.add_argument(
      "--repeats",
      type=int,
      default=1,
      help=(
          "compiles of each optimizer, alternating; the fastest counts "
          "(default: %(default)s)"
      ),
  )
  parser.add_argument(
      "--no-contrib",
      action="store_true",
      help="leave optax.contrib.muon out (default: off)",
  )
  parser.add_argument(
      "--dion",
      default="",
      help=(
          "comma-separated rank fractions: also optax_muon.dion at each, "
          "products at bfloat16 and float32 (default: none)"
      ),
  )
  parser.add_argument(
      "--stages",
      default="",
      help=(
          "comma-separated stage counts: also this package's Muon with its "
          "exchanges forced into each (default: none)"
      ),
  )
  parser.add_argument(
      "--no-muon",
      action="store_true",
      help="leave this package's Muon rows out (default: off)",
  )
  parser.add_argument(
      "--out",
      default="runs/aot.json",
      help="where the rows go, as JSON (default: %(default)s)",
  )
  args = parser.parse_args(argv)
  names = args.targets.split(",")
  platforms = {TARGETS[n].platform for n in names}
  if len(platforms) != 1:
    raise SystemExit(
        "--targets: one platform per run (TPU and GPU compilers need their own "
        "environments)."
    )
  _set_platform_env(platforms.pop())
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
  rows = []
  for name in names:
    for tree in args.trees.split(","):
      got = measure(
          name,
          tree,
          args.repeats,
          not args.no_contrib,
          tuple(float(f) for f in args.dion.split(",") if f),
          not args.no_muon,
          tuple(int(c) for c in args.stages.split(",") if c),
      )
      print(
          f"\n{name} ({TARGETS[name].topology}), {tree} tree\n\n{table(got)}",
          flush=True,
      )
      rows += got
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
