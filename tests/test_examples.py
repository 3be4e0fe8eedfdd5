"""The training example runs end to end and writes its curves and plot."""

import json

import numpy as np
import pytest

import train_lm

pytestmark = (
    pytest.mark.slow
)  # compiles or trains real models: the full suite only


def test_train_lm_quick(tmp_path):
  results = train_lm.main(["--quick", "--steps", "12", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "train_lm.json").read_text())
  assert set(saved["results"]) == {"muon", "adamw"}
  for curves in results.values():
    assert len(curves["train_loss"]) == 12
    assert np.mean(curves["train_loss"][-3:]) < curves["train_loss"][0] - 0.5
    assert np.isfinite(curves["val_loss"]).all()


def test_loss_plot_pairs_colours_and_zooms_on_the_differences(tmp_path):
  """Train and validation of one run share a colour, the smoothing is named, and
  the y-axis starts after the initial drop (the first tenth of training)."""
  steps = list(range(1, 101))
  results = {
      name: {
          "step": steps,
          "train_loss": [5.0 / s**0.3 + shift for s in steps],
          "val_step": steps[::10],
          "val_loss": [5.0 / s**0.3 + shift + 0.02 for s in steps[::10]],
      }
      for name, shift in (("muon", 0.0), ("adamw", 0.2))
  }
  fig = train_lm.plot(results, tmp_path / "plot.png")
  (ax,) = fig.axes
  colours = {}
  for line in ax.get_lines():
    run = line.get_label().split(" ")[0]
    colours.setdefault(run, set()).add(line.get_color())
  assert (
      all(len(c) == 1 for c in colours.values())
      and len(set.union(*colours.values())) == 2
  )
  assert {line.get_label() for line in ax.get_lines()} >= {
      "muon train (10-step moving average)",
      "adamw validation",
  }
  low, high = ax.get_ylim()
  assert (
      high < 0.75 * results["adamw"]["train_loss"][0]
  )  # the first steps' 5.2 is cut off
  assert low < min(results["muon"]["train_loss"])
  assert (tmp_path / "plot.png").exists()


def test_train_lm_qk_clip(tmp_path):
  """--qk-clip adds a clipped Muon run and records every run's largest logit per
  step."""
  tau = 3.0
  train_lm.main(
      [
          "--quick",
          "--steps",
          "12",
          "--qk-clip",
          str(tau),
          "--out",
          str(tmp_path),
      ]
  )
  results = json.loads((tmp_path / "train_lm.json").read_text())["results"]
  assert set(results) == {"muon", "muon+qk-clip", "adamw"}
  assert all(len(c["max_logit"]) == 12 for c in results.values())
  assert (tmp_path / "train_lm_max_logit.png").exists()
  plain, clipped = (
      results["muon"]["max_logit"],
      results["muon+qk-clip"]["max_logit"],
  )
  assert max(plain) > 1.3 * tau
  # The largest logit after each step, from a forward pass with the rescaled
  # params. The clip's S_h is measured before the step's update, which then
  # grows the logits a little (4% at most here) on top of τ.
  assert max(clipped) <= 1.1 * tau
  assert clipped[0] == pytest.approx(
      tau, rel=1e-5
  )  # step 1 (learning rate 0): the rescale alone
