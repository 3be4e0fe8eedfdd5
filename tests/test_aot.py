"""The update compiled by the real TPU and GPU compilers (ahead of time, on this
CPU host): each device's NS FLOPs are the plan's, every float32 NS product is at
full precision, the plan uses the target's own cost profile, and teams compile
with their collectives inside the NS loop. Each platform compiles in a process
of its own (``aot_worker.py``); a platform whose compile-only package is not
installed is skipped with the command that installs it (``.ci/run`` makes such
an environment).
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {
    "tpu": ("libtpu", 'pip install "jax[tpu]"'),
    "cuda": (
        "jax_cuda12_plugin",
        "pip install jax-cuda12-plugin nvidia-cuda-nvcc-cu12",
    ),
}
EXPECTED = {
    "tpu": ("TPU v5 lite", "TPU v5e"),
    "cuda": ("NVIDIA H100 80GB HBM3", "H100 SXM"),
}


def _compile(platform: str, *args: str) -> dict:
  module, install = PACKAGES[platform]
  if importlib.util.find_spec(module) is None:
    missing = (
        f"no {platform} compiler here ({install}, of the installed JAX's"
        " version)"
    )
    if os.environ.get(
        "OPTAX_MUON_REQUIRE_AOT"
    ):  # set by .ci/run's compiler environment
      pytest.fail(missing)
    pytest.skip(missing)
  # The accelerators' compilers at their own optimization levels (conftest.py
  # turns LLVM's down for the CPU programs of the rest of the suite).
  env = {
      k: v
      for k, v in os.environ.items()
      if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"
  }
  run = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "aot_worker.py"), platform, *args],
      capture_output=True,
      text=True,
      timeout=600,
      cwd=ROOT,
      env=env,
  )
  lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
  assert run.returncode == 0 and lines, run.stderr[-3000:]
  return json.loads(lines[-1].removeprefix("RESULT "))


# One compiler at a time: libtpu allows one process per host.
@pytest.mark.xdist_group("accelerator compilers")
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_accelerator_compilers_run_the_plan_at_full_precision(platform):
  out = _compile(platform)
  kind, profile = EXPECTED[platform]
  assert out["device_kind"] == kind
  for name in ("default", "float32", "teams"):
    got = out[name]
    assert (
        got["device_flops"] == got["plan_flops"]
    ), name  # per device, from the HLO
    assert got["products"] > 0, name
  # Asked for float32: every product's operands are float32 at HIGHEST (none
  # quietly converted to bfloat16). By default on an accelerator: bf16 operands.
  for name in ("float32", "teams"):
    assert out[name]["f32_highest"] == out[name]["products"], out[name]
    assert any("float32 at full precision" in n for n in out[name]["notes"])
  assert out["default"]["bf16_operands"] == out["default"]["products"], out[
      "default"
  ]
  assert any(
      "bfloat16 operands accumulated in float32" in n
      for n in out["default"]["notes"]
  )
  assert (
      out["default"]["profile"] == profile
  )  # planned from this CPU host for the target
  assert max(out["teams"]["teams"]) > 1
  # Each distinct team run loops over its NS steps with the collectives the plan
  # counts: the Gram matrix's reduce-scatter (the TPU compiler emits it as an
  # all-reduce of the small m × m matrix) and the all-gathers of its rows and of
  # the polynomial's.
  loop = out["teams"]["loop_collectives"]
  assert loop and set(loop) <= {
      "all-reduce",
      "reduce-scatter",
      "all-gather",
  }, loop
  assert len(loop) == out["teams"]["plan_loop_collectives"], loop
  assert loop.count("all-gather") == 2 * (
      len(loop) - loop.count("all-gather")
  ), loop
  # Across hosts, the exchange in stages: each stage's NS (in lax.switch
  # branches) runs while the all-to-all of the next stage out and the previous
  # one back moves.
  # Two TPU slices plan at the data-center network's bandwidth (25 Gb/s per
  # v5e chip), not the chips' interconnect.
  if platform == "tpu":
    assert out["two_slices"] == {
        "name": "TPU v5e, 2 slices",
        "bytes_per_second": 25e9 / 8,
    }, out["two_slices"]
  if platform == "cuda":
    two = out["two_hosts"]
    assert two["stages"] >= 2 and two["conditionals"], two
    assert two["overlapped"] >= 0.5, two
  # Dion (rank 1/4 of 256: r = 64): nothing larger gathered than the factors
  # (Q or R of q and up, and down's P, whose 256 rows are whole: (256 + 1024 +
  # 256) × 64, which the GPU compiler gathers in one), all-to-alls only for P. The GPU compiler receives exactly what
  # summarize models (its ring model) and puts no collective in a loop. The TPU
  # compiler gathers Q and R again for their differently laid out consumers,
  # some inside the Cholesky-QR loop (counted per trip), up to 3× the modelled
  # bytes.
  dion = out["dion"]
  assert set(dion["kinds"]) <= {
      "all-gather",
      "all-reduce",
      "all-to-all",
      "reduce-scatter",
  }, dion
  assert dion["largest_gather"] <= (256 + 1024 + 256) * 64 * 4, dion
  if platform == "cuda":
    assert dion["loop_collectives"] == 0, dion
    assert dion["received_bytes"] == pytest.approx(
        dion["modelled_bytes"], rel=1e-6
    ), dion
  else:
    assert (
        dion["modelled_bytes"]
        <= dion["received_bytes"]
        <= 3 * dion["modelled_bytes"]
    ), dion


@pytest.mark.xdist_group("accelerator compilers")
def test_a_pods_team_plan_overlaps_its_exchange():
  """The 7B-like tree on a TPU v5p-256 with asynchronous all-to-alls: a team
  share of a 4096×11008 or a 4096×4096 on each chip, and maybe a 1024×4096;
  each kind in a stage, in line: half of the all-to-all bytes move beside NS,
  shorter than one stage by the model; each chip's NS FLOPs and all-to-all
  bytes the plan's."""
  pod = _compile("tpu", "pod")
  assert pod["teams"] == [2] and pod["stages"] == [[2, True]], pod
  assert pod["overlapped"] >= 0.5, pod
  assert pod["seconds"] < pod["one_stage_seconds"], pod
  assert pod["flops_match"], pod
  assert pod["exchanged"] == pod["plan_exchanged"], pod
