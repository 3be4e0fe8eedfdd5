"""Train a small byte-level GPT on the Python standard library's source: Muon vs AdamW.

Runs on 8 virtual CPU devices under an Explicit mesh. ``--sharding fsdp`` (the default)
shards every matrix over the devices (FSDP): the forward pass all-gathers the weights, the
gradients come back reduce-scattered, and Muon's plan orthogonalizes each whole matrix on
exactly one device. ``--sharding dp`` replicates the params (data parallel; Muon splits the
NS work over the replicas). The batch is always sharded. Writes ``<out>/train_lm.json`` (the
curves) and ``<out>/train_lm.png`` (the plot).

  python examples/train_lm.py                # default run, < 10 minutes on 2 CPU cores
  python examples/train_lm.py --quick        # a smoke run of a few seconds
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
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optax_muon  # noqa: E402
from gpt import GPT, GPTConfig, batches, eval_windows, loss_fn, stdlib_corpus  # noqa: E402
from plotting import save_loss_plot  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=None,
                      help="optimizer steps per run (default 600; 20 with --quick)")
  parser.add_argument("--quick", action="store_true", help="tiny model, 20 steps")
  parser.add_argument("--out", default="runs", help="output folder")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--muon-lr", type=float, default=0.02)
  parser.add_argument("--adam-lr", type=float, default=3e-3,
                      help="AdamW's learning rate, in the baseline and for Muon's AdamW leaves")
  parser.add_argument("--eval-every", type=int, default=50)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--sharding", choices=("fsdp", "dp"), default="fsdp",
                      help="fsdp: params sharded over the devices; dp: params replicated")
  args = parser.parse_args(argv)
  if args.quick:
    args.d_model, args.layers, args.batch_size, args.seq_len, args.eval_every = 32, 2, 16, 64, 10
  if args.steps is None:
    args.steps = 20 if args.quick else 600
  return args


def make_optimizers(args) -> dict[str, optax.GradientTransformation]:
  """Muon (this package's defaults) and AdamW, on the same warmup + cosine schedule."""
  warmup = max(1, args.steps // 20)
  schedule = lambda peak: optax.warmup_cosine_decay_schedule(0.0, peak, warmup, args.steps,
                                                             end_value=0.1 * peak)
  return {
      "muon": optax_muon.muon(schedule(args.muon_lr), adam_learning_rate=schedule(args.adam_lr),
                              adam_b2=0.95),
      "adamw": optax.adamw(schedule(args.adam_lr), b2=0.95),
  }


def param_sharding(x: jax.Array, mesh, mode: str) -> NamedSharding:
  """FSDP: a matrix is split on its first axis over all devices; vectors stay replicated."""
  if mode == "fsdp" and x.ndim == 2 and x.shape[0] % mesh.size == 0:
    return NamedSharding(mesh, P("data", None))
  return NamedSharding(mesh, P())


def train(name: str, tx, cfg: GPTConfig, args, train_data, val_batch, mesh) -> dict:
  """Trains one model; returns its curves and timing."""
  data_sharding = NamedSharding(mesh, P("data"))
  graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(args.seed)), nnx.Param)
  params = jax.tree.map(lambda x: jax.device_put(x, param_sharding(x, mesh, args.sharding)),
                        params)
  if name == "muon":
    optax_muon.summarize(params, tx, print_table=True)
  opt_state = jax.jit(tx.init)(params)

  def loss_of(params, batch):
    # FSDP forward: gather each weight; the gradient flows back reduce-scattered.
    full = jax.tree.map(lambda p: jax.reshard(p, P()), params)
    return loss_fn(nnx.merge(graphdef, full), batch)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_of)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  eval_loss = jax.jit(loss_of)
  val_batch = jax.device_put(val_batch, data_sharding)
  stream = batches(train_data, args.batch_size, cfg.seq_len, seed=args.seed)
  curves = {"step": [], "train_loss": [], "val_step": [], "val_loss": []}
  start, timed_from = None, 1  # the first step compiles; time the rest
  for step in (bar := tqdm(range(1, args.steps + 1), desc=name, dynamic_ncols=True)):
    params, opt_state, loss = train_step(params, opt_state,
                                         jax.device_put(next(stream), data_sharding))
    loss = float(loss)
    if step == timed_from:
      start = time.perf_counter()
    curves["step"].append(step)
    curves["train_loss"].append(loss)
    if step % args.eval_every == 0 or step == args.steps:
      curves["val_step"].append(step)
      curves["val_loss"].append(float(eval_loss(params, val_batch)))
      bar.set_postfix(loss=f"{loss:.3f}", val=f"{curves['val_loss'][-1]:.3f}")
  elapsed = time.perf_counter() - start
  curves["seconds_per_step"] = elapsed / max(1, args.steps - timed_from)
  return curves


def plot(results: dict, path: pathlib.Path) -> None:
  """Smoothed training loss and validation loss of each run."""
  lines = []
  for name, c in results.items():
    smooth = np.convolve(c["train_loss"], np.ones(10) / 10, mode="valid")
    lines.append((c["step"][len(c["step"]) - len(smooth):], smooth, f"{name} train",
                  {"alpha": 0.5}))
    lines.append((c["val_step"], c["val_loss"], f"{name} validation",
                  {"marker": "o", "ms": 3}))
  save_loss_plot(path, lines, "next-byte loss (nats)")


def main(argv=None) -> dict:
  args = parse_args(argv)
  cfg = GPTConfig(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers,
                  n_heads=max(1, args.d_model // 32))
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  if args.batch_size % jax.device_count():
    raise ValueError(f"--batch-size {args.batch_size} must divide over "
                     f"{jax.device_count()} devices.")
  train_data, val_data = stdlib_corpus()
  val_batch = eval_windows(val_data, 64 if not args.quick else 16, cfg.seq_len)
  print(f"corpus: {len(train_data):,} train / {len(val_data):,} validation bytes; "
        f"{jax.device_count()} devices; model {dataclasses.asdict(cfg)}")
  results = {}
  with jax.set_mesh(mesh):
    for name, tx in make_optimizers(args).items():
      results[name] = train(name, tx, cfg, args, train_data, val_batch, mesh)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "train_lm.json").write_text(json.dumps(
      {"args": vars(args), "model": dataclasses.asdict(cfg), "results": results}, indent=1))
  plot(results, out / "train_lm.png")
  for name, c in results.items():
    print(f"{name:6s} final validation loss {c['val_loss'][-1]:.4f}  "
          f"({c['seconds_per_step'] * 1e3:.0f} ms/step)")
  print(f"wrote {out / 'train_lm.json'} and {out / 'train_lm.png'}")
  return results


if __name__ == "__main__":
  main()
