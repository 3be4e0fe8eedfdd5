"""The whole train step (loss, gradient and update) on a replica × FSDP mesh,
compiled for TPU pods and NVIDIA GPU clusters on this CPU host: what Dion's
compressed data-parallel sync saves over the replica axes.

Optimizers: AdamW (``optax.adamw``), Muon (``optax_muon.muon``), Dion on
averaged gradients (``optax_muon.dion``; the compiler all-reduces the gradients
over the replicas, as for the others) and Dion with a compressed sync
(``replica_axes="replica"``: ``optax_muon.per_replica`` gives each replica's
gradient and only rank-r factors cross the replica axis), each Dion at the
given rank fractions. The model is a Llama-like decoder (``aot.TREES``: RMSNorm,
grouped-query causal attention, SwiGLU MLP, layers scanned and rematerialized)
on a batch of token sequences split over (replica, fsdp); its params lie FSDP
over "fsdp" (the embedding along its width) and are replicated over "replica";
each layer's weights are gathered whole where they are used (explicit FSDP:
left to itself, the partitioner inside ``per_replica`` passes activations
around the FSDP ring instead, 3× the bytes).

Per optimizer: the bytes a device receives per step over the replica axis
(``hlo_cost.crossing_bytes``) and in all (ring model), temp and argument memory
per device (``memory_analysis``), compile CPU seconds (lower + compile). Each
platform needs its own environment (see ``aot.py``)::

  /tmp/aot-tpu/bin/python benchmarks/train_step.py --target tpu-v5p-256 \\
      --mesh 8,32
  /tmp/aot-gpu/bin/python benchmarks/train_step.py --target gpu-h200-4x8 \\
      --mesh 4,8

Without ``--target`` it compiles for this host's CPU devices (give
``XLA_FLAGS=--xla_force_host_platform_device_count=N``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import aot  # noqa: E402

SEQUENCE = 2048


def make_mesh(target: str | None, shape: tuple[int, int]):
  """A ("replica", "fsdp") mesh over the target's devices (this host's CPU
  devices without one), replicas major: across hosts on a GPU cluster."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.experimental import topologies  # noqa: PLC0415

  if target is None:
    return jax.make_mesh(
        shape,
        ("replica", "fsdp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
  spec = aot.TARGETS[target]
  if spec.platform == "tpu" and spec.slices > 1:
    # A replica per slice: the replica axis runs over the data-center network.
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=spec.topology, num_slices=spec.slices
    )
    devices = sorted(topo.devices, key=lambda d: (d.slice_index, d.id))
    if shape[0] % spec.slices:
      raise ValueError(f"--mesh: {shape[0]} replicas over {spec.slices} slices")
    return jax.sharding.Mesh(
        np.array(devices).reshape(shape),
        ("replica", "fsdp"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
  if spec.platform == "tpu":
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=spec.topology
    )
  else:
    topo = topologies.get_topology_desc(
        platform="cuda",
        target_config=(aot.GPU_TARGETS / spec.gpu_config).read_text(),
        topology=spec.topology,
    )
  return topologies.make_mesh(topo, shape, ("replica", "fsdp"))


def loss_fn(heads: int, kv_heads: int, batch_axes=("replica", "fsdp")):
  """The Llama-like model's mean next-token cross entropy, ``(params, tokens)
  -> loss``, its activations split along the batch over ``batch_axes``."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  def rms(x, scale):
    x32 = x.astype(jnp.float32)
    return (
        x32
        * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
        * (1 + scale)
    )

  def gathered(w):
    """FSDP: a layer's weight whole on every device while it is used."""
    return jax.lax.with_sharding_constraint(w, jax.sharding.PartitionSpec())

  def layer(x, p):
    p = jax.tree.map(gathered, p)
    b, t, d = x.shape
    head = d // heads
    h = rms(x, p["attn_norm"])
    q = (h @ p["q"]).reshape(b, t, heads, head)
    k = (h @ p["k"]).reshape(b, t, kv_heads, head)
    v = (h @ p["v"]).reshape(b, t, kv_heads, head)
    k, v = (jnp.repeat(a, heads // kv_heads, axis=2) for a in (k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head)
    causal = jnp.tril(jnp.ones((t, t), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    attention = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    x = x + attention @ p["o"]
    h = rms(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"], None

  def batch_split(x):
    spec = jax.sharding.PartitionSpec(batch_axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)

  def loss(params, tokens):
    x = batch_split(gathered(params["embed"])[batch_split(tokens)[:, :-1]])
    x, _ = jax.lax.scan(
        jax.checkpoint(lambda x, p: layer(batch_split(x), p)),
        x,
        params["blocks"],
    )
    logits = rms(x, params["final_norm"]) @ gathered(params["lm_head"])
    labels = tokens[:, 1:]
    return jnp.mean(
        jax.nn.logsumexp(logits, -1)
        - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    )

  return loss


def optimizers(dims, shardings, ranks) -> dict:
  """name → (transformation, whether it takes per-replica gradients)."""
  import optax  # noqa: PLC0415

  import optax_muon  # noqa: PLC0415

  out = {
      "AdamW": (optax.adamw(3e-4, weight_decay=0.1), False),
      "optax_muon.muon": (
          optax_muon.muon(
              0.02,
              muon_weight_dimension_numbers=dims,
              param_shardings=shardings,
          ),
          False,
      ),
  }
  for fraction in ranks:
    for compressed in (False, True):
      name = (
          f"dion r={fraction:g}, "
          f"{'compressed sync' if compressed else 'averaged gradients'}"
      )
      out[name] = (
          optax_muon.dion(
              0.02,
              rank_fraction=fraction,
              muon_weight_dimension_numbers=dims,
              param_shardings=shardings,
              replica_axes="replica" if compressed else None,
          ),
          compressed,
      )
  return out


def compile_step(tx, per_replica: bool, loss, params, tokens, mesh):
  """(compiled train step, CPU seconds of lower + compile)."""
  import jax  # noqa: PLC0415
  import optax  # noqa: PLC0415

  import optax_muon  # noqa: PLC0415

  gradient = jax.value_and_grad(loss)
  if per_replica:
    gradient = optax_muon.per_replica(gradient, "replica")

  def step(params, state, tokens):
    losses, grads = gradient(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jax.numpy.mean(losses)

  with jax.set_mesh(mesh):
    state = jax.eval_shape(tx.init, params)
    jax.clear_caches()
    start = time.process_time()
    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, state, tokens)
        .compile()
    )
  return compiled, time.process_time() - start


def measure(target, mesh_shape, tree, batch, ranks, names=None) -> list[dict]:
  """Every optimizer's row."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: PLC0415

  import hlo_cost  # noqa: PLC0415

  mesh = make_mesh(target, mesh_shape)
  shapes = aot.TREES[tree]
  params, dims, _, shardings = aot.llama_tree(mesh, **shapes)
  # The embedding split along its width (the rows a batch looks up are on
  # every device; its gradient scatters locally), as MaxText lays it out.
  shardings["embed"] = NamedSharding(mesh, P(None, "fsdp"))
  params["embed"] = jax.ShapeDtypeStruct(
      params["embed"].shape, params["embed"].dtype, sharding=shardings["embed"]
  )
  tokens = jax.ShapeDtypeStruct(
      (batch, SEQUENCE + 1),
      jnp.int32,
      sharding=NamedSharding(mesh, P(("replica", "fsdp"))),
  )
  # Inside ``per_replica`` the replica axis is manual: a replica's activations
  # split over "fsdp" alone.
  losses = {
      per_replica: loss_fn(
          shapes["heads"],
          shapes["kv_heads"],
          ("fsdp",) if per_replica else ("replica", "fsdp"),
      )
      for per_replica in (False, True)
  }
  replica = hlo_cost.mesh_coordinate(mesh.devices.shape, (0,))
  n = mesh.devices.size
  rows = []
  for name, (tx, per_replica) in optimizers(dims, shardings, ranks).items():
    if names and name not in names:
      continue
    compiled, seconds = compile_step(
        tx, per_replica, losses[per_replica], params, tokens, mesh
    )
    cost = hlo_cost.analyze(compiled, n)
    memory = compiled.memory_analysis()
    rows.append(
        {
            "target": target or "cpu",
            "mesh": f"replica {mesh_shape[0]} × fsdp {mesh_shape[1]}",
            "tree": tree,
            "optimizer": name,
            "replica MB": sum(
                hlo_cost.crossing_bytes(c, replica, n) for c in cost.collectives
            )
            / 1e6,
            "received MB": cost.received_bytes / 1e6,
            "temp GB": memory.temp_size_in_bytes / 1e9,
            "argument GB": memory.argument_size_in_bytes / 1e9,
            "compile CPU s": seconds,
        }
    )
    print(json.dumps(rows[-1]), flush=True)
  return rows


def table(rows: list[dict]) -> str:
  """A markdown table of ``rows``, with each row's replica bytes beside
  AdamW's."""
  adamw = next((r for r in rows if r["optimizer"] == "AdamW"), None)
  head = (
      "optimizer",
      "replica MB",
      "÷ AdamW",
      "received MB",
      "temp GB",
      "arg GB",
      "compile CPU s",
  )
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    ratio = (
        f"{r['replica MB'] / adamw['replica MB']:.3f}"
        if adamw and adamw["replica MB"]
        else "—"
    )
    lines.append(
        f"| {r['optimizer']} | {r['replica MB']:.1f} | {ratio} |"
        f" {r['received MB']:.1f} | {r['temp GB']:.2f} |"
        f" {r['argument GB']:.3f} | {r['compile CPU s']:.1f} |"
    )
  return "\n".join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
      "--target",
      default=None,
      help=f"one of {', '.join(aot.TARGETS)} (default: this host's CPUs)",
  )
  parser.add_argument(
      "--mesh", default="8,32", help="replicas,fsdp (default: %(default)s)"
  )
  parser.add_argument(
      "--tree",
      default="7b",
      help=f"one of {', '.join(aot.TREES)} (default: %(default)s)",
  )
  parser.add_argument(
      "--batch",
      type=int,
      default=0,
      help="sequences per step (default: one per device)",
  )
  parser.add_argument(
      "--ranks",
      default="0.25,0.0625",
      help="Dion's rank fractions (default: %(default)s)",
  )
  parser.add_argument(
      "--only",
      default="",
      help="semicolon-separated optimizer names to compile (default: all)",
  )
  parser.add_argument(
      "--out",
      default="runs/train_step.json",
      help="where the rows go, as JSON (default: %(default)s)",
  )
  args = parser.parse_args(argv)
  if args.target:
    aot._set_platform_env(aot.TARGETS[args.target].platform)
  shape = tuple(int(s) for s in args.mesh.split(","))
  rows = measure(
      args.target,
      shape,
      args.tree,
      args.batch or shape[0] * shape[1],
      tuple(float(f) for f in args.ranks.split(",") if f),
      set(filter(None, args.only.split(";"))) or None,
  )
  print(table(rows))
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == "__main__":
  main()
