"""Orthogonality per preset and step count: worst singular-value error against
msign.

For each coefficient table: the exact-arithmetic worst |p(σ) − 1| on [1e-3, 1]
(composing the scalar polynomials in float64), and the measured worst
|σ_i(NS(X)) − σ_i(msign(X))| on Gaussian matrices, power-law spectra (σ_i ∝ 1/i, like real gradients) and rank-deficient
matrices (a quarter of σ = 0, which must map to 0), with the NS products in
float32 and bf16.

  python benchmarks/orthogonality.py           # 256 × 1024 matrices
  python benchmarks/orthogonality.py --quick   # CI: 32 × 64
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optax_muon  # noqa: E402
from single_device import table  # noqa: E402

TABLES = [
    ("jordan", 5),
    ("jordan", 8),
    ("dion", 5),
    ("modded_nanogpt", 5),
    ("polar_express", 5),
    ("polar_express", 6),
    ("polar_express", 8),
    ("deepseek_v4", 10),
]


def test_matrices(
    m: int, n: int, batch: int, seed: int = 0
) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)

  def with_spectrum(sv):
    out = []
    for _ in range(batch):
      u, _ = np.linalg.qr(rng.standard_normal((m, m)))
      v, _ = np.linalg.qr(rng.standard_normal((n, m)))
      out.append((u * sv) @ v.T)
    return np.stack(out).astype(np.float32)

  power_law = 1.0 / np.arange(1, m + 1)
  rank_deficient = np.where(
      np.arange(m) < 3 * m // 4, np.geomspace(1.0, 1e-2, m), 0.0
  )
  return {
      "gaussian": rng.standard_normal((batch, m, n)).astype(np.float32),
      "power law": with_spectrum(power_law),
      "rank-deficient": with_spectrum(rank_deficient),
  }


def worst_error(out: np.ndarray, reference: np.ndarray) -> float:
  s_out = np.linalg.svd(np.asarray(out, np.float64), compute_uv=False)
  s_ref = np.linalg.svd(np.asarray(reference, np.float64), compute_uv=False)
  return float(np.max(np.abs(s_out - s_ref)))


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--quick",
      action="store_true",
      help="small matrices: a smoke run (default: off)",
  )
  args = parser.parse_args(argv)
  m, n, batch = (32, 64, 2) if args.quick else (256, 1024, 4)
  matrices = test_matrices(m, n, batch)
  references = {k: np.asarray(optax_muon.msign(x)) for k, x in matrices.items()}
  rows = []
  for name, steps in TABLES:
    lo, hi = optax_muon.singular_value_range(name, 1e-3, ns_steps=steps)
    row = {
        "coefficients": name,
        "steps": steps,
        "exact [1e-3, 1]": max(1 - lo, hi - 1),
    }
    for dtype in (jnp.float32, jnp.bfloat16):
      for kind, x in matrices.items():
        out = optax_muon.newton_schulz(
            jnp.asarray(x),
            name,
            ns_steps=steps,
            compute_dtype=dtype,
            method="standard",
        )
        row[f"{kind} {jnp.dtype(dtype).name}"] = worst_error(
            out, references[kind]
        )
    rows.append(row)
  columns = list(rows[0])
  print(f"worst |σ − σ(msign)| on {batch} matrices of {m} × {n}")
  print(table(rows, columns, {c: "{:.4f}" for c in columns[2:]}))
  return rows


if __name__ == "__main__":
  main()
