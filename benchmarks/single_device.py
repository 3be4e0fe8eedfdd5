"""Single-device speed: the Muon update of optax_muon vs optax.contrib.muon vs
optax.adamw.

In one process, the three updates of each tree run alternately (A, B, C, A, B,
C, ...) and the table reports medians; then Newton–Schulz alone is compared with
a plain batched matmul of the same shapes, measured in the same run.

  python benchmarks/single_device.py            # d=256 and d=512, 6 layers, 9
  repeats python benchmarks/single_device.py --quick    # CI: tiny trees, 3
  repeats python benchmarks/single_device.py --baseline REV   # also optax_muon
  as of git REV

``--baseline REV`` extracts the package as it was at REV (``git archive``),
imports it under another name, and times its update in the same alternation
(this checkout's ``--baseline`` rows use the default method).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import pathlib
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optax_muon  # noqa: E402
from optax_muon._src.muon.costs import ns_flops
from trees import gpt_tree, muon_dims, random_like, require_optax_contrib_muon  # noqa: E402


def _timed(fn, *args) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - start


def alternate(fns: dict, args: dict, repeats: int) -> dict[str, float]:
  """Median seconds per call of each compiled fn, calls interleaved across
  fns."""
  for name, fn in fns.items():  # compile and warm up
    jax.block_until_ready(fn(*args[name]))
  times = collections.defaultdict(list)
  for _ in range(repeats):
    for name, fn in fns.items():
      times[name].append(_timed(fn, *args[name]))
  return {name: float(np.median(t)) for name, t in times.items()}


def _muon(package, params, stacked: bool, method: str):
  """``package.muon`` with every matrix (2-D or stacked) on Muon and NAdamW
  elsewhere; also the flat keywords of the code before the option objects (a
  ``--baseline`` checkout)."""
  # optax.contrib's dimension numbers: every version of optax_muon accepts them.
  dims = muon_dims(params, contrib=True) if stacked else None
  if hasattr(package, "NSOptions"):
    # Every matrix on Muon (the embedding and head too, as optax.contrib.muon
    # does with these dimension numbers); the stacked norm scales (ln1, ln2) on
    # AdamW.
    return package.muon(
        0.02,
        routing=package.Routing(adam_pattern=r"(^|/)ln\d$"),
        ns_options=package.NSOptions(method=method),
        muon_weight_dimension_numbers=dims,
    )
  return package.muon(
      0.02,
      adam_pattern=None,
      method=method,
      adam_nesterov=True,
      muon_weight_dimension_numbers=dims,
  )


def import_baseline(rev: str, directory: str):
  """optax_muon as of git revision ``rev``, imported as ``optax_muon_<rev>``."""
  name = f"optax_muon_{rev}"
  root = pathlib.Path(__file__).resolve().parents[1]
  archive = subprocess.run(
      ["git", "-C", str(root), "archive", rev, "optax_muon"],
      check=True,
      capture_output=True,
  ).stdout
  subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
  package = pathlib.Path(directory) / name
  (pathlib.Path(directory) / "optax_muon").rename(package)
  for source in package.rglob(
      "*.py"
  ):  # subpackages (optax_muon._src.muon.plan) too
    source.write_text(source.read_text().replace("optax_muon", name))
  sys.path.insert(0, directory)
  return importlib.import_module(name)


def optimizers(params, stacked: bool, method: str, baseline=None) -> dict:
  """Same routing for both Muon implementations: every matrix (2-D or stacked)
  on Muon."""
  contrib = optax.contrib.muon(
      0.02,
      muon_weight_dimension_numbers=muon_dims(params, contrib=True)
      if stacked
      else None,
  )
  txs = {
      "optax_muon": _muon(optax_muon, params, stacked, method),
      "optax.contrib.muon": contrib,
      "optax.adamw": optax.adamw(1e-3),
  }
  if baseline is not None:
    txs[baseline.__name__] = _muon(baseline, params, stacked, method)
  return txs


def bench_updates(
    d: int, layers: int, stacked: bool, repeats: int, baseline=None
) -> list[dict]:
  params = gpt_tree(d, layers, stacked=stacked)
  grads = random_like(params, 1)
  rows = []
  for method in ("auto", "standard"):
    txs = optimizers(
        params, stacked, method, baseline if method == "auto" else None
    )
    if method == "standard":  # the anchors don't depend on the method
      txs = {
          "optax_muon": txs["optax_muon"],
          "optax.contrib.muon": txs["optax.contrib.muon"],
      }
    fns = {name: jax.jit(tx.update) for name, tx in txs.items()}
    args = {name: (grads, tx.init(params), params) for name, tx in txs.items()}
    times = alternate(fns, args, repeats)
    base = times["optax.contrib.muon"]
    for name, t in times.items():
      if method == "standard" and name != "optax_muon":
        continue
      label = name + (f" (method={method})" if name == "optax_muon" else "")
      rows.append(
          {
              "tree": (
                  f"d={d}, {layers} layers, {'stacked' if stacked else 'per-layer'}"
              ),
              "optimizer": label,
              "ms": t * 1e3,
              "vs_contrib": t / base,
          }
      )
  return rows


def bench_ns_throughput(d: int, layers: int, repeats: int) -> list[dict]:
  """NS (one batched call per canonical shape) vs a plain batched matmul of the
  same shapes."""
  params = gpt_tree(d, layers, stacked=True)
  shapes = collections.Counter()
  for x in jax.tree.leaves(params):
    if x.ndim == 3:
      layout = optax_muon._src.core.matrices.make_layout(
          "", x, optax_muon.MuonDimensionNumbers(1, 2)
      )
      shapes[layout.ns_shape] += layout.batch
  rows = []
  for (m, n), batch in sorted(shapes.items()):
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, m, n))
    a = jax.random.normal(jax.random.PRNGKey(1), (batch, m, m))
    steps = 5
    fns = {
        "standard": jax.jit(
            lambda x: optax_muon.newton_schulz(
                x, ns_steps=steps, method="standard"  # noqa: B023 (called in this iteration)
            )
        ),
        "auto": jax.jit(
            lambda x: optax_muon.newton_schulz(x, ns_steps=steps, method="auto")  # noqa: B023 (called in this iteration)
        ),
        # The NS products: (m, n)·(n, m), (m, m)·(m, m), (m, m)·(m, n); one of
        # each.
        "matmul": jax.jit(
            lambda x, a: (x @ jnp.swapaxes(x, 1, 2), a @ a, a @ x)
        ),
    }
    times = alternate(
        fns, {"standard": (x,), "auto": (x,), "matmul": (x, a)}, repeats
    )
    ns_flop = batch * ns_flops(m, n, steps)
    matmul_rate = batch * (4 * m * m * n + 2 * m**3) / times["matmul"]
    for method in ("standard", "auto"):
      rows.append(
          {
              "shape": f"{batch} × {m}×{n}",
              "method": method,
              "GFLOP/s": ns_flop / times[method] / 1e9,
              "matmul GFLOP/s": matmul_rate / 1e9,
              "fraction": ns_flop / times[method] / matmul_rate,
          }
      )
  return rows


def table(rows: list[dict], columns: list[str], formats: dict) -> str:
  cells = [[formats.get(c, "{}").format(r[c]) for c in columns] for r in rows]
  widths = [
      max(len(c), *(len(row[i]) for row in cells))
      for i, c in enumerate(columns)
  ]
  line = (
      lambda row: "| "
      + " | ".join(v.ljust(w) for v, w in zip(row, widths))
      + " |"
  )
  return "\n".join(
      [
          line(columns),
          "|" + "|".join("-" * (w + 2) for w in widths) + "|",
          *map(line, cells),
      ]
  )


def main(argv=None) -> tuple[list[dict], list[dict]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--quick",
      action="store_true",
      help="tiny trees, 3 repeats: a smoke run (default: off)",
  )
  parser.add_argument(
      "--repeats",
      type=int,
      default=9,
      help=(
          "timed calls of each update, alternating "
          "(default: %(default)s; 3 with --quick)"
      ),
  )
  parser.add_argument(
      "--baseline",
      metavar="REV",
      help="git revision of optax_muon to time alongside (default: none)",
  )
  args = parser.parse_args(argv)
  require_optax_contrib_muon()
  sizes, repeats = (
      ([(64, 2)], 3) if args.quick else ([(256, 6), (512, 6)], args.repeats)
  )
  print(
      f"jax {jax.__version__} on {jax.devices()[0].device_kind}; median of"
      f" {repeats}"
  )
  with tempfile.TemporaryDirectory() as directory:
    baseline = (
        import_baseline(args.baseline, directory) if args.baseline else None
    )
    update_rows = [
        r
        for d, layers in sizes
        for stacked in (False, True)
        for r in bench_updates(d, layers, stacked, repeats, baseline)
    ]
  print(
      table(
          update_rows,
          ["tree", "optimizer", "ms", "vs_contrib"],
          {"ms": "{:.1f}", "vs_contrib": "{:.2f}×"},
      )
  )
  ns_rows = [
      r for d, layers in sizes for r in bench_ns_throughput(d, layers, repeats)
  ]
  print()
  print(
      table(
          ns_rows,
          ["shape", "method", "GFLOP/s", "matmul GFLOP/s", "fraction"],
          {
              "GFLOP/s": "{:.1f}",
              "matmul GFLOP/s": "{:.1f}",
              "fraction": "{:.2f}",
          },
      )
  )
  print(
      "GFLOP/s counts plain-NS FLOPs (4·m²·n + 2·m³ per step) for both methods."
  )
  return update_rows, ns_rows


if __name__ == "__main__":
  main()
