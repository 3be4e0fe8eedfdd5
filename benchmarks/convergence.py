"""Muon vs optax.contrib.muon vs AdamW on real text, each at its best swept
learning rate.

The model and data are the training example's (``examples/gpt.py``): a
byte-level GPT on the Python standard library's source with a fixed
train/validation split. Every run has the same budget, warmup + cosine schedule,
batch stream and init for a given seed.

1. AdamW: its learning rate A*; optax_muon.muon (package defaults) and
   optax.contrib.muon (its defaults, which also put the embedding and head on
   Muon): their Muon learning rates, AdamW parts at A*. By default these are
   ``BEST_LRS``, the winners of the full sweep; ``--sweep`` redoes it (every
   sweep is extended, ×2 or ÷2 at most twice, while its best value sits at an
   end).
2. An ablation with this package's routing, at its learning rate: Polar Express
   coefficients.
3. NorMuon (``normalization=NorMuon()``), its Muon learning rate swept.
4. Decoupled weight decay ``WEIGHT_DECAY`` on both branches, plain and cautious,
   and NorMuon with cautious decay (at NorMuon's learning rate).
5. Single-seed variants: sum momentum, and rms scaling at AdamW's learning rate
   A* (the claim that rms lets Muon reuse AdamW's learning rate).
6. Dion (``optax_muon.dion``, the same routing) at rank fractions
   ``DION_RANKS``, each with its learning rate swept over ``DION_LRS``.

Every row but 5 has two seeds (``--quick``: one). Reported: final validation
loss (mean over seeds), the steps each needs to reach AdamW's final validation
loss as a fraction of AdamW's steps, and the time per step. Each finished run is
saved to ``OUT/convergence_runs.json`` at once; ``--resume`` reuses the runs
found there.

  python benchmarks/convergence.py            # the full run (about two hours on
  2 cores; Dion's sweeps are half) python benchmarks/convergence.py --quick    #
  CI: tiny model, a few steps python benchmarks/convergence.py --rows
                                              "optax_muon lr=,optax_muon weight
                                              decay" # AdamW, the defaults and
                                              the recommended
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import optax_muon  # noqa: E402
from gpt import (
    GPT,
    GPTConfig,
    batches,
    eval_windows,
    loss_fn,
    stdlib_corpus,  # noqa: E402
    train_step,
)
from plotting import save_loss_plot  # noqa: E402
from single_device import table  # noqa: E402
from trees import require_optax_contrib_muon  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Budget:
  """Every run's budget: the example's model, batch 16 (about 0.2 s a step on 2
  cores)."""

  steps: int = 500
  batch_size: int = 16
  eval_every: int = 25
  eval_windows: int = 64
  cfg: GPTConfig = GPTConfig()


QUICK = Budget(
    steps=16,
    batch_size=8,
    eval_every=4,
    eval_windows=8,
    cfg=GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32),
)


#: The winners of the full sweep (adamw 0.001–0.008; optax_muon and contrib
#: 0.01–0.04):
#: AdamW's learning rate, and the Muon learning rates (AdamW parts at AdamW's).
BEST_LRS = {"adamw": 4e-3, "optax_muon": 0.02, "contrib": 0.02}
#: NorMuon's Muon learning rates to sweep (the first runs first).
NORMUON_LRS = (0.02, 0.01, 0.04)
#: λ of the weight-decay rows, for both branches (multiplied by each branch's
#: lr).
WEIGHT_DECAY = 0.1
#: Dion's rank fractions, and the learning rates swept for each (the first runs
#: first).
DION_RANKS = (1.0, 0.25, 0.0625)
DION_LRS = (0.02, 0.01, 0.03, 0.04)


def schedule(peak: float, steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      0.0, peak, max(1, steps // 20), steps, end_value=0.1 * peak
  )


def make_optimizer(kind: str, lr: float, adam_lr: float, steps: int, **variant):
  """The optimizer of one run. ``kind``: adamw, optax_muon, dion or contrib."""
  if kind == "adamw":
    return optax.adamw(schedule(lr, steps), b2=0.95)
  if kind == "optax_muon":
    return optax_muon.muon(
        schedule(lr, steps),
        adam_learning_rate=schedule(adam_lr, steps),
        adam_b2=0.95,
        **variant,
    )
  if kind == "dion":
    return optax_muon.dion(
        schedule(lr, steps),
        adam_learning_rate=schedule(adam_lr, steps),
        adam_b2=0.95,
        **variant,
    )
  if kind == "contrib":
    return optax.contrib.muon(
        schedule(lr, steps),
        adam_learning_rate=schedule(adam_lr, steps),
        adam_b2=0.95,
    )
  raise ValueError(kind)


def run(tx, budget: Budget, seed: int, data) -> dict:
  """Trains one model; returns its validation curve and seconds per step."""
  train, val = data
  model = GPT(budget.cfg, nnx.Rngs(seed))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  evaluate = nnx.jit(loss_fn)
  val_batch = eval_windows(val, budget.eval_windows, budget.cfg.seq_len)
  stream = batches(train, budget.batch_size, budget.cfg.seq_len, seed=seed)
  curve, start = [], None
  for t in range(1, budget.steps + 1):
    jax.block_until_ready(train_step(model, optimizer, next(stream)))
    if t == 1:
      start = time.perf_counter()
    if t % budget.eval_every == 0:
      curve.append((t, float(evaluate(model, val_batch))))
  return {
      "curve": curve,
      "seconds_per_step": (
          (time.perf_counter() - start) / max(1, budget.steps - 1)
      ),
  }


def steps_to_reach(curve: list, target: float) -> int | None:
  return next((t for t, loss in curve if loss <= target), None)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--quick",
      action="store_true",
      help="tiny model, a few steps, one seed: a smoke run (default: off)",
  )
  parser.add_argument(
      "--out", default="runs", help="output folder (default: %(default)s)"
  )
  parser.add_argument(
      "--sweep",
      action="store_true",
      help=(
          "sweep the baselines' learning rates instead of using BEST_LRS "
          "(default: off)"
      ),
  )
  parser.add_argument(
      "--resume",
      action="store_true",
      help="reuse the runs saved in OUT/convergence_runs.json (default: off)",
  )
  parser.add_argument(
      "--rows",
      default="",
      help=(
          "comma-separated name prefixes of the runs to train (e.g. 'optax_muon"
          " lr=,optax_muon weight decay'); AdamW, the target, always runs;"
          " other rows are left out of the table (default: every row)"
      ),
  )
  parser.add_argument(
      "--report",
      action="store_true",
      help=(
          "train nothing: the table of the saved runs, rows without runs "
          "left out (default: off)"
      ),
  )
  args = parser.parse_args(argv)
  require_optax_contrib_muon()
  budget = QUICK if args.quick else Budget()
  data = stdlib_corpus(max_bytes=300_000 if args.quick else 4_000_000)
  seeds = (0,) if args.quick else (0, 1)  # --quick: every row once
  dion_lrs = DION_LRS
  if args.quick:
    adam_lrs, normuon_lrs, dion_lrs = (3e-3,), (0.02,), (0.02,)
    muon_lrs = {"optax_muon": (0.02,), "contrib": (0.02,)}
  elif args.sweep:
    adam_lrs, muon_lrs = (1e-3, 2e-3, 4e-3), {
        "optax_muon": (0.01, 0.02, 0.04),
        "contrib": (0.01, 0.02, 0.04),
    }
    normuon_lrs = NORMUON_LRS
  else:
    adam_lrs = (BEST_LRS["adamw"],)
    muon_lrs = {kind: (BEST_LRS[kind],) for kind in ("optax_muon", "contrib")}
    normuon_lrs = NORMUON_LRS
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  saved_path = out / "convergence_runs.json"
  budget_key = {
      "steps": budget.steps,
      "batch_size": budget.batch_size,
      "model": dataclasses.asdict(budget.cfg),
  }
  saved = {}
  if (args.resume or args.report) and saved_path.exists():
    previous = json.loads(saved_path.read_text())
    saved = previous["runs"] if previous["budget"] == budget_key else {}
  results: dict[str, dict] = {}

  only = tuple(prefix for prefix in args.rows.split(",") if prefix)

  def go(name, kind, lr, adam_lr, seed=0, **variant):
    if only and kind != "adamw" and not name.startswith(only):
      return None
    key, described = f"{name} seed={seed}", dict(
        kind=kind, lr=lr, adam_lr=adam_lr, seed=seed, variant=str(variant or "")
    )
    if key in results:
      return results[key]
    if key in saved and all(saved[key][k] == v for k, v in described.items()):
      results[key] = r = saved[key]
    elif args.report:
      return None
    else:
      tx = make_optimizer(kind, lr, adam_lr, budget.steps, **variant)
      r = run(tx, budget, seed, data)
      r.update(described)
      results[key] = r
      saved_path.write_text(
          json.dumps({"budget": budget_key, "runs": {**saved, **results}})
      )
    print(
        f"{name:38s} seed={seed} final val {r['curve'][-1][1]:.4f} "
        f"({r['seconds_per_step'] * 1e3:.0f} ms/step)",
        flush=True,
    )
    return r

  final = lambda r: r["curve"][-1][1]

  def sweep(name, kind, lrs, adam_lr=None, **variant):
    """Runs ``lrs``; while the best is at an end of the sweep (of several),
    extends it by ×2 or ÷2 (≤ 2 more)."""
    runs = {
        lr: go(f"{name} lr={lr:g}", kind, lr, adam_lr or lr, **variant)
        for lr in lrs
    }
    runs = {
        lr: r for lr, r in runs.items() if r is not None
    }  # --report: saved runs only
    if not runs:
      return lrs[0], []
    for _ in range(0 if len(lrs) == 1 else 2):
      best_lr, ordered = min(runs, key=lambda lr: final(runs[lr])), sorted(runs)
      lr = best_lr * 2 if best_lr == ordered[-1] else best_lr / 2
      if best_lr not in (ordered[0], ordered[-1]) or not (
          r := go(f"{name} lr={lr:g}", kind, lr, adam_lr or lr, **variant)
      ):
        break
      runs[lr] = r
    return min(runs, key=lambda lr: final(runs[lr])), sorted(runs)

  # Seed 0 of every row first, then the second seeds: a cut-short run still
  # compares them.
  best_adam, swept = sweep("adamw", "adamw", adam_lrs)
  best, sweeps = {"adamw": best_adam}, {"adamw": swept}
  best["optax_muon"], sweeps["optax_muon"] = sweep(
      "optax_muon", "optax_muon", muon_lrs["optax_muon"], best_adam
  )
  lr = best["optax_muon"]
  normuon = dict(normalization=optax_muon.NorMuon())
  go(
      f"optax_muon NorMuon lr={normuon_lrs[0]:g}",
      "optax_muon",
      normuon_lrs[0],
      best_adam,
      **normuon,
  )
  decay = dict(weight_decay=WEIGHT_DECAY, adam_weight_decay=WEIGHT_DECAY)
  ablations = {  # at optax_muon's learning rate
      f"optax_muon cautious weight decay {WEIGHT_DECAY:g}": dict(
          cautious_weight_decay=True, **decay
      ),
      f"optax_muon weight decay {WEIGHT_DECAY:g}": decay,
      "optax_muon polar_express": dict(ns_coeffs="polar_express"),
  }
  for name, variant in ablations.items():
    go(name, "optax_muon", lr, best_adam, **variant)
  best["contrib"], sweeps["contrib"] = sweep(
      "contrib", "contrib", muon_lrs["contrib"], best_adam
  )
  best["normuon"], sweeps["normuon"] = sweep(
      "optax_muon NorMuon", "optax_muon", normuon_lrs, best_adam, **normuon
  )
  both = f"optax_muon NorMuon + cautious weight decay {WEIGHT_DECAY:g}"
  go(
      both,
      "optax_muon",
      best["normuon"],
      best_adam,
      cautious_weight_decay=True,
      **normuon,
      **decay,
  )
  for seed in seeds[1:]:
    for kind in ("adamw", "optax_muon", "contrib"):
      go(f"{kind} lr={best[kind]:g}", kind, best[kind], best_adam, seed=seed)
    go(
        f"optax_muon NorMuon lr={best['normuon']:g}",
        "optax_muon",
        best["normuon"],
        best_adam,
        seed=seed,
        **normuon,
    )
    for name, variant in ablations.items():
      go(name, "optax_muon", lr, best_adam, seed=seed, **variant)
    go(
        both,
        "optax_muon",
        best["normuon"],
        best_adam,
        seed=seed,
        cautious_weight_decay=True,
        **normuon,
        **decay,
    )
  dion_names = {
      rank: f"dion rank {rank:g}"
      for rank in (DION_RANKS[1:2] if args.quick else DION_RANKS)
  }
  for rank, name in dion_names.items():
    best[name], sweeps[name] = sweep(
        name, "dion", dion_lrs, best_adam, rank_fraction=rank
    )
  for seed in seeds[1:]:
    for rank, name in dion_names.items():
      go(
          f"{name} lr={best[name]:g}",
          "dion",
          best[name],
          best_adam,
          seed=seed,
          rank_fraction=rank,
      )
  singles = {
      "optax_muon sum momentum": (lr, dict(momentum="sum")),
      "optax_muon rms scale @ AdamW lr": (best_adam, dict(consistent_rms=0.2)),
  }
  for name, (single_lr, variant) in singles.items():
    go(name, "optax_muon", single_lr, best_adam, **variant)

  # Summary: seeds averaged; the target is AdamW's final validation loss.
  def runs_of(prefix):
    return [r for k, r in results.items() if k.startswith(prefix + " seed=")]

  rows = []
  winners = {
      "AdamW": f"adamw lr={best_adam:g}",
      "optax_muon.muon": f"optax_muon lr={best['optax_muon']:g}",
      "optax.contrib.muon": f"contrib lr={best['contrib']:g}",
      "optax_muon NorMuon": f"optax_muon NorMuon lr={best['normuon']:g}",
      **{k: k for k in (*ablations, both, *singles)},
      **{
          f"optax_muon.dion, rank fraction {rank:g}": (
              f"{name} lr={best[name]:g}"
          )
          for rank, name in dion_names.items()
      },
  }
  mean_curve = lambda rs: [
      (t, float(np.mean([r["curve"][k][1] for r in rs])))
      for k, (t, _) in enumerate(rs[0]["curve"])
  ]
  target = mean_curve(runs_of(winners["AdamW"]))[-1][1]
  for label, prefix in winners.items():
    rs = runs_of(prefix)
    if not rs:  # --report of a partial run
      continue
    reach = steps_to_reach(mean_curve(rs), target)
    rows.append(
        {
            "optimizer": label,
            "lr": f"{rs[0]['lr']:g}",
            "seeds": len(rs),
            "final val loss": mean_curve(rs)[-1][1],
            "steps to AdamW's final": (
                reach / budget.steps if reach else float("nan")
            ),
            "ms/step": float(np.mean([r["seconds_per_step"] for r in rs]))
            * 1e3,
        }
    )
  print(
      f"\nlearning rates run: {sweeps} (AdamW parts of the Muon runs at"
      f" {best_adam:g}); {budget.steps} steps; target = AdamW's final"
      f" validation loss {target:.4f}"
  )
  print(
      table(
          rows,
          list(rows[0]),
          {
              "final val loss": "{:.4f}",
              "steps to AdamW's final": "{:.2f}×",
              "ms/step": "{:.0f}",
          },
      )
  )
  summary = {
      "budget": budget_key,
      "best_lr": best,
      "swept": sweeps,
      "target": target,
      "table": rows,
      "runs": results,
  }
  (out / "convergence.json").write_text(json.dumps(summary, indent=1))
  _plot(results, winners, out / "convergence.png")
  return summary


def _plot(results: dict, winners: dict, path: pathlib.Path) -> None:
  """Validation curves of the winners (seed 0)."""
  lines = [
      (*zip(*results[f"{prefix} seed=0"]["curve"]), label, {})
      for label, prefix in winners.items()
      if f"{prefix} seed=0" in results
  ]
  save_loss_plot(path, lines, "validation loss (nats/byte)")


if __name__ == "__main__":
  main()
