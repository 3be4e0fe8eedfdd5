"""Train a small byte-level GPT on the Python standard library's source: Muon vs
AdamW.

Runs on 8 virtual CPU devices under an Explicit mesh. ``--sharding fsdp`` (the
default) shards every matrix over the devices (FSDP): the forward pass
all-gathers the weights, the gradients come back reduce-scattered, and Muon's
plan orthogonalizes each whole matrix on exactly one device. ``--sharding dp``
replicates the params (data parallel; Muon splits the NS work over the
replicas). The batch is always sharded. Writes ``<out>/train_lm.json`` (the
curves) and ``<out>/train_lm.png`` (the plot).

``--dion RANK`` adds a run of Dion at that rank fraction. ``--replicas R`` lays
the devices out as R data-parallel replicas × FSDP over the rest (params
replicated over "replica", split over "data"); the Dion run then syncs only
rank-r factors across the replicas (``dion(..., replica_axes="replica")``, each
replica's gradient from ``optax_muon.per_replica``), while Muon and AdamW
average their gradients over the replicas as usual.

``--qk-clip TAU`` adds a run of Muon with QK-clip at threshold TAU (``muon(...,
qk_clip=QKClip(TAU, heads))``, fed each step's per-head logit maxima) and
records, for every run, the largest attention logit on each step's batch with
the parameters the step ends with (a second forward pass) in the JSON as
``"max_logit"``, plotted in ``<out>/train_lm_max_logit.png``.

  python examples/train_lm.py                # default run, < 10 minutes on
                                              # 2 CPU cores
  python examples/train_lm.py --quick        # a smoke run of a few seconds
  python examples/train_lm.py --qk-clip 30   # also Muon with QK-clip at τ = 30
  python examples/train_lm.py --dion 0.25 --replicas 2   # also Dion, its 2
                                              # replicas syncing factors
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (XLA_FLAGS must be set first)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optax_muon  # noqa: E402
from gpt import (
    GPT,
    GPTConfig,
    batches,
    eval_windows,
    loss_and_logit_max,
    loss_fn,  # noqa: E402
    stdlib_corpus,
)
from plotting import save_loss_plot  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--steps",
      type=int,
      default=None,
      help="optimizer steps per run (default: 600; 20 with --quick)",
  )
  parser.add_argument(
      "--quick",
      action="store_true",
      help="tiny model, 20 steps: a smoke run (default: off)",
  )
  parser.add_argument(
      "--out", default="runs", help="output folder (default: %(default)s)"
  )
  parser.add_argument(
      "--batch-size",
      type=int,
      default=32,
      help=(
          "sequences per step, split over the devices "
          "(default: %(default)s; --quick sets 16)"
      ),
  )
  parser.add_argument(
      "--seq-len",
      type=int,
      default=128,
      help="context in bytes (default: %(default)s; --quick sets 64)",
  )
  parser.add_argument(
      "--d-model",
      type=int,
      default=128,
      help="model width (default: %(default)s; --quick sets 32)",
  )
  parser.add_argument(
      "--layers",
      type=int,
      default=4,
      help="transformer blocks (default: %(default)s; --quick sets 2)",
  )
  parser.add_argument(
      "--muon-lr",
      type=float,
      default=0.02,
      help="Muon's peak learning rate (default: %(default)s)",
  )
  parser.add_argument(
      "--adam-lr",
      type=float,
      default=3e-3,
      help=(
          "AdamW's learning rate, in the baseline and for Muon's AdamW leaves "
          "(default: %(default)s)"
      ),
  )
  parser.add_argument(
      "--eval-every",
      type=int,
      default=50,
      help=(
          "steps between validation evaluations "
          "(default: %(default)s; --quick sets 10)"
      ),
  )
  parser.add_argument(
      "--seed",
      type=int,
      default=0,
      help="seed of the init and the batch order (default: %(default)s)",
  )
  parser.add_argument(
      "--sharding",
      choices=("fsdp", "dp"),
      default="fsdp",
      help=(
          "fsdp: params sharded over the devices; dp: params replicated "
          "(default: %(default)s)"
      ),
  )
  parser.add_argument(
      "--dion",
      type=float,
      default=None,
      metavar="RANK",
      help="add a Dion run at this rank fraction (default: off)",
  )
  parser.add_argument(
      "--dion-lr",
      type=float,
      default=0.01,
      help="Dion's peak learning rate (default: %(default)s)",
  )
  parser.add_argument(
      "--replicas",
      type=int,
      default=1,
      help=(
          "data-parallel replicas, FSDP over the other devices; Dion's "
          "replicas sync only rank-r factors (default: %(default)s)"
      ),
  )
  parser.add_argument(
      "--qk-clip",
      type=float,
      default=None,
      metavar="TAU",
      help=(
          "add a Muon run with QK-clip at threshold TAU and record every "
          "run's largest attention logit per step (default: off)"
      ),
  )
  args = parser.parse_args(argv)
  if args.quick:
    (
        args.d_model,
        args.layers,
        args.batch_size,
        args.seq_len,
        args.eval_every,
    ) = (32, 2, 16, 64, 10)
  if args.steps is None:
    args.steps = 20 if args.quick else 600
  if args.qk_clip is not None and args.dion is not None and args.replicas > 1:
    parser.error(
        "--qk-clip records every run's logits from one gradient per step;"
        " with --dion and --replicas > 1 the Dion run's gradients are per"
        " replica: leave one of them out."
    )
  return args


def qk_clip_heads(n_heads: int):
  """QK-clip's ``heads`` for the GPT's params: every block's ``q`` and ``k``
  kernels (``blocks/i/q/kernel``), heads on the output axis."""
  roles = {"q": "query", "k": "key"}

  def heads(path, _):
    keys = [getattr(k, "key", None) for k in path]
    if keys[0] == "blocks" and keys[2] in roles and keys[3] == "kernel":
      return optax_muon.QKClipHeads(roles[keys[2]], num_heads=n_heads)
    return None

  return lambda params: jax.tree_util.tree_map_with_path(heads, params)


def make_optimizers(
    args, cfg: GPTConfig
) -> dict[str, optax.GradientTransformation]:
  """Muon (this package's defaults), with ``--qk-clip`` Muon with QK-clip, and
  AdamW, on the same warmup + cosine schedule."""
  warmup = max(1, args.steps // 20)
  schedule = lambda peak: optax.warmup_cosine_decay_schedule(
      0.0, peak, warmup, args.steps, end_value=0.1 * peak
  )
  muon = lambda **kw: optax_muon.muon(
      schedule(args.muon_lr),
      adam_learning_rate=schedule(args.adam_lr),
      adam_b2=0.95,
      **kw,
  )
  optimizers = {"muon": muon()}
  if args.qk_clip is not None:
    optimizers["muon+qk-clip"] = muon(
        qk_clip=optax_muon.QKClip(args.qk_clip, qk_clip_heads(cfg.n_heads))
    )
  if args.dion is not None:
    optimizers[f"dion r={args.dion:g}"] = optax_muon.dion(
        schedule(args.dion_lr),
        rank_fraction=args.dion,
        adam_learning_rate=schedule(args.adam_lr),
        adam_b2=0.95,
        replica_axes="replica" if args.replicas > 1 else None,
    )
  optimizers["adamw"] = optax.adamw(schedule(args.adam_lr), b2=0.95)
  return optimizers


def param_sharding(x: jax.Array, mesh, mode: str) -> NamedSharding:
  """FSDP: a matrix is split on its first axis over the "data" devices;
  vectors stay replicated (and everything over the replicas)."""
  if mode == "fsdp" and x.ndim == 2 and x.shape[0] % mesh.shape["data"] == 0:
    return NamedSharding(mesh, P("data", None))
  return NamedSharding(mesh, P())


def batch_axes(mesh) -> tuple[str, ...]:
  """The mesh axes a batch is split over: all of them."""
  return tuple(mesh.axis_names)


def train(
    name: str, tx, cfg: GPTConfig, args, train_data, val_batch, mesh
) -> dict:
  """Trains one model; returns its curves and timing."""
  data_sharding = NamedSharding(mesh, P(batch_axes(mesh)))
  graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(args.seed)), nnx.Param)
  params = jax.tree.map(
      lambda x: jax.device_put(x, param_sharding(x, mesh, args.sharding)),
      params,
  )
  if name.startswith(("muon", "dion")):
    optax_muon.summarize(params, tx, print_table=True)
  opt_state = jax.jit(tx.init)(params)

  def model_of(params):
    # FSDP forward: gather each weight; the gradient flows back
    # reduce-scattered.
    return nnx.merge(
        graphdef, jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)
    )

  def loss_of(params, batch):
    return loss_fn(model_of(params), batch)

  def largest_logit(params, batch):
    return jnp.max(
        jnp.stack(
            jax.tree.leaves(loss_and_logit_max(model_of(params), batch)[1])
        )
    )

  gradient = jax.value_and_grad(loss_of)
  if name.startswith("dion") and args.replicas > 1:
    # Each replica's own loss and gradient, (replicas, …): Dion syncs only
    # its rank-r factors across them.
    gradient = optax_muon.per_replica(gradient, "replica")

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = gradient(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jnp.mean(loss)

  @jax.jit
  def train_step_with_logit_max(params, opt_state, batch):
    """The step, fed the forward pass's per-head logit maxima (QK-clip uses
    them, the others ignore them); also the largest logit on the step's batch
    with the params the step ends with (after QK-clip's rescale): a second
    forward pass, not the clip's own arithmetic."""
    (loss, maxima), grads = jax.value_and_grad(
        lambda p: loss_and_logit_max(model_of(p), batch), has_aux=True
    )(params)
    updates, opt_state = tx.update(
        grads, opt_state, params, attn_logit_max=maxima
    )
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, largest_logit(params, batch)

  eval_loss = jax.jit(loss_of)
  val_batch = jax.device_put(val_batch, data_sharding)
  stream = batches(train_data, args.batch_size, cfg.seq_len, seed=args.seed)
  curves = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
  if args.qk_clip is not None:
    curves["max_logit"] = []
  start, timed_from = None, 1  # the first step compiles; time the rest
  for step in (
      bar := tqdm(range(1, args.steps + 1), desc=name, dynamic_ncols=True)
  ):
    batch = jax.device_put(next(stream), data_sharding)
    if args.qk_clip is None:
      params, opt_state, loss = train_step(params, opt_state, batch)
    else:
      params, opt_state, loss, max_logit = train_step_with_logit_max(
          params, opt_state, batch
      )
      curves["max_logit"].append(float(max_logit))
    loss = float(loss)
    if step == timed_from:
      start = time.perf_counter()
    curves["step"].append(step)
    curves["train_loss"].append(loss)
    if step % args.eval_every == 0 or step == args.steps:
      curves["val_step"].append(step)
      curves["val_loss"].append(float(eval_loss(params, val_batch)))
      bar.set_postfix(
          loss=f"{loss:.3f}",
          val=f"{curves['val_loss'][-1]:.3f}",
          **(
              {"max_logit": f"{curves['max_logit'][-1]:.1f}"}
              if "max_logit" in curves
              else {}
          ),
      )
  elapsed = time.perf_counter() - start
  curves["seconds_per_step"] = elapsed / max(1, args.steps - timed_from)
  return curves


def plot(results: dict, path: pathlib.Path):
  """Each run's training loss (10-step moving average) and validation loss, in
  one colour per run; the y-axis spans the losses after the first tenth of
  training, where the runs differ. Returns the figure."""
  lines, tail = [], []
  for k, (name, c) in enumerate(results.items()):
    color, window = f"C{k}", min(10, len(c["train_loss"]))
    smooth = np.convolve(
        c["train_loss"], np.ones(window) / window, mode="valid"
    )
    steps = c["step"][len(c["step"]) - len(smooth) :]
    lines.append(
        (
            steps,
            smooth,
            f"{name} train ({window}-step moving average)",
            {"alpha": 0.5, "color": color},
        )
    )
    lines.append(
        (
            c["val_step"],
            c["val_loss"],
            f"{name} validation",
            {"marker": "o", "ms": 3, "color": color},
        )
    )
    start = c["step"][-1] / 10
    tail += [y for x, y in zip(steps, smooth) if x >= start]
    tail += [y for x, y in zip(c["val_step"], c["val_loss"]) if x >= start]
  margin = 0.05 * (max(tail) - min(tail)) or 0.05
  return save_loss_plot(
      path,
      lines,
      "next-byte loss (nats)",
      ylim=(min(tail) - margin, max(tail) + margin),
  )


def plot_max_logit(results: dict, threshold: float, path: pathlib.Path) -> None:
  """Each run's largest attention logit per step, and the QK-clip threshold."""
  lines = [
      (c["step"], c["max_logit"], name, {"alpha": 0.8})
      for name, c in results.items()
  ]
  steps = next(iter(results.values()))["step"]
  lines.append(
      (
          [steps[0], steps[-1]],
          [threshold] * 2,
          f"τ = {threshold:g}",
          {"color": "black", "linestyle": "--"},
      )
  )
  save_loss_plot(path, lines, "largest attention logit after the step")


def main(argv=None) -> dict:
  args = parse_args(argv)
  cfg = GPTConfig(
      seq_len=args.seq_len,
      d_model=args.d_model,
      n_layers=args.layers,
      n_heads=max(1, args.d_model // 32),
  )
  if jax.device_count() % args.replicas:
    raise ValueError(
        f"--replicas {args.replicas} must divide the {jax.device_count()}"
        " devices."
    )
  if args.replicas > 1:
    mesh = jax.make_mesh(
        (args.replicas, jax.device_count() // args.replicas),
        ("replica", "data"),
        axis_types=(AxisType.Explicit,) * 2,
    )
  else:
    mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(AxisType.Explicit,)
    )
  if args.batch_size % jax.device_count():
    raise ValueError(
        f"--batch-size {args.batch_size} must divide over "
        f"{jax.device_count()} devices."
    )
  train_data, val_data = stdlib_corpus()
  val_batch = eval_windows(val_data, 64 if not args.quick else 16, cfg.seq_len)
  print(
      f"corpus: {len(train_data):,} train / {len(val_data):,} validation bytes;"
      f" {jax.device_count()} devices; model {dataclasses.asdict(cfg)}"
  )
  results = {}
  with jax.set_mesh(mesh):
    for name, tx in make_optimizers(args, cfg).items():
      results[name] = train(name, tx, cfg, args, train_data, val_batch, mesh)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "train_lm.json").write_text(
      json.dumps(
          {
              "args": vars(args),
              "model": dataclasses.asdict(cfg),
              "results": results,
          },
          indent=1,
      )
  )
  plot(results, out / "train_lm.png")
  if args.qk_clip is not None:
    plot_max_logit(results, args.qk_clip, out / "train_lm_max_logit.png")
  for name, c in results.items():
    peak = (
        f"; largest logit {max(c['max_logit']):.2f}" if "max_logit" in c else ""
    )
    print(
        f"{name:6s} final validation loss {c['val_loss'][-1]:.4f}  "
        f"({c['seconds_per_step'] * 1e3:.0f} ms/step{peak})"
    )
  print(f"wrote {out / 'train_lm.json'} and {out / 'train_lm.png'}")
  return results


if __name__ == "__main__":
  main()
