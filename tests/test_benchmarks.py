"""The benchmarks run in their --quick modes (they print tables; no timing is
asserted)."""

import json
import pathlib
import sys

import pytest

sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
)

import orthogonality  # noqa: E402
import single_device  # noqa: E402
from helpers import requires_contrib_api  # noqa: E402

pytestmark = (
    pytest.mark.slow
)  # compiles or trains real models: the full suite only


@requires_contrib_api
def test_single_device_quick(capsys):
  update_rows, ns_rows = single_device.main(["--quick"])
  names = {r["optimizer"] for r in update_rows}
  assert {
      "optax.contrib.muon",
      "optax.adamw",
      "optax_muon (method=auto)",
      "optax_muon (method=standard)",
  } <= names
  for (
      r
  ) in (
      update_rows
  ):  # each update's time over optax.contrib.muon's, timed alongside
    if r["optimizer"] == "optax_muon (method=standard)":
      continue  # timed in a second round, against that round's optax.contrib.muon
    base = next(
        b["ms"]
        for b in update_rows
        if b["tree"] == r["tree"] and b["optimizer"] == "optax.contrib.muon"
    )
    assert r["vs_contrib"] == pytest.approx(r["ms"] / base)
  # NS throughput of the d=64, 2-layer stacked tree: one row per canonical shape
  # and method (q, k, v, o: 4·2 of 64×64; mlp in and out: 2·2 of 64×256, the
  # same shape once turned).
  assert sorted((r["shape"], r["method"]) for r in ns_rows) == sorted(
      (shape, method)
      for shape in ("8 × 64×64", "4 × 64×256")
      for method in ("standard", "auto")
  )
  assert "vs_contrib" in capsys.readouterr().out


def test_orthogonality_quick():
  rows = orthogonality.main(["--quick"])
  by_name = {(r["coefficients"], r["steps"]): r for r in rows}
  # The exact bounds order the presets as documented.
  assert by_name[("polar_express", 8)]["exact [1e-3, 1]"] < 1e-6
  assert by_name[("deepseek_v4", 10)]["exact [1e-3, 1]"] < 1e-3
  assert by_name[("jordan", 5)]["exact [1e-3, 1]"] > 0.5
  # Measured in f32: Polar Express ×8 is orthogonal on the power-law spectrum.
  assert by_name[("polar_express", 8)]["power law float32"] < 1e-2


@requires_contrib_api
def test_sharding_quick():
  import sharding

  rows = sharding.main(["--quick"])
  assert {r["tree"].split(" ")[0] for r in rows} == {"GPT", "GQA+SwiGLU", "MoE"}
  for r in rows:
    assert r["flops"] <= max(1.1, 1.05 * r["lpt"]) and r["in_loops"] == 0
    assert r["bytes"] <= max(1.45, 1.05 * r["chunks"]) and r["temp"] <= 3


@requires_contrib_api
def test_convergence_quick(tmp_path):
  import convergence

  summary = convergence.main(["--quick", "--out", str(tmp_path)])
  labels = [r["optimizer"] for r in summary["table"]]
  assert labels[:3] == ["AdamW", "optax_muon.muon", "optax.contrib.muon"]
  assert (
      summary["table"][0]["steps to AdamW's final"] == 1.0
  )  # AdamW reaches its own final
  assert {
      "optax_muon NorMuon",
      "optax_muon cautious weight decay 0.1",
      "optax_muon weight decay 0.1",
      "optax_muon NorMuon + cautious weight decay 0.1",
      "optax_muon polar_express",
      "optax_muon.dion, rank fraction 0.25",
  } <= set(labels)
  runs = summary["runs"]
  assert (
      "'cautious_weight_decay': True"
      in runs["optax_muon cautious weight decay 0.1 seed=0"]["variant"]
  )
  assert (
      "NorMuon(beta=0.95)"
      in runs["optax_muon NorMuon lr=0.02 seed=0"]["variant"]
  )
  # Each finished run is saved at once; --resume reuses them instead of training
  # again.
  again = convergence.main(["--quick", "--out", str(tmp_path), "--resume"])
  assert json.dumps(again["table"]) == json.dumps(summary["table"])  # NaN-safe
  report = convergence.main(
      ["--quick", "--out", str(tmp_path), "--report"]
  )  # trains nothing
  assert json.dumps(report["table"]) == json.dumps(summary["table"])
  assert (tmp_path / "convergence.png").exists() and (
      tmp_path / "convergence.json"
  ).exists()


def test_dion_vs_muon():
  """Dion's modelled step beside Muon's and AdamW's on the large abstract
  trees, the gradient sync counted: a row per tree, mesh and optimizer; Dion's
  bytes fall with the rank; on FSDP 32 × TP 8 at rank 1/64 it moves fewer
  bytes than Muon's exchange (both sides split), on FSDP 256 more (one side);
  on the replica meshes the compressed sync moves less across the replicas
  than the averaged gradients, on the 7B-like replica 8 × FSDP 32 at rank 1/16
  at most a fifth of AdamW's."""
  import dion_vs_muon  # noqa: PLC0415

  rows = dion_vs_muon.main(["--profiles", "h100"])
  by = {(r["tree"], r["mesh"], r["optimizer"]): r for r in rows}
  meshes = {(r["tree"], r["mesh"]) for r in rows}
  assert len(meshes) == len(dion_vs_muon.CASES)
  ranks = ("1", "0.25", "0.0625", "0.015625")
  for tree, mesh in meshes:
    averaged = [by[tree, mesh, f"Dion r={r}, averaged"] for r in ranks]
    assert all(a["MB"] > b["MB"] for a, b in zip(averaged, averaged[1:]))
    assert averaged[1]["bf16 ms"] < averaged[1]["ms"]
    if "replica" in mesh:
      for r in ranks[1:]:
        compressed = by[tree, mesh, f"Dion r={r}, compressed"]
        average = by[tree, mesh, f"Dion r={r}, averaged"]
        assert compressed["replica MB"] < average["replica MB"]
  tp = ("Llama-7B-like", "fsdp 32 × tp 8")
  fsdp = ("Llama-7B-like", "fsdp 256")
  muon = lambda m: by[(*m, "Muon (bf16 NS)")]["MB"]
  assert by[(*tp, "Dion r=0.015625, averaged")]["MB"] < muon(tp)
  assert by[(*fsdp, "Dion r=0.015625, averaged")]["MB"] > muon(fsdp)
  dp = ("Llama-7B-like", "replica 8 × fsdp 32")
  assert (
      by[(*dp, "Dion r=0.0625, compressed")]["replica MB"]
      <= 0.2 * by[(*dp, "AdamW")]["replica MB"]
  )
