"""The training example runs end to end and writes its curves and plot."""

import json

import numpy as np
import pytest

import train_lm


def test_train_lm_quick(tmp_path):
  results = train_lm.main(["--quick", "--steps", "12", "--out", str(tmp_path)])
  saved = json.loads((tmp_path / "train_lm.json").read_text())
  assert set(saved["results"]) == {"muon", "adamw"}
  assert (tmp_path / "train_lm.png").stat().st_size > 10_000
  for curves in results.values():
    assert len(curves["train_loss"]) == 12
    assert np.mean(curves["train_loss"][-3:]) < curves["train_loss"][0] - 0.5
    assert np.isfinite(curves["val_loss"]).all()


def test_train_lm_qk_clip(tmp_path):
  """--qk-clip adds a clipped Muon run and records every run's largest logit per step."""
  tau = 3.0
  train_lm.main(["--quick", "--steps", "12", "--qk-clip", str(tau), "--out", str(tmp_path)])
  results = json.loads((tmp_path / "train_lm.json").read_text())["results"]
  assert set(results) == {"muon", "muon+qk-clip", "adamw"}
  assert all(len(c["max_logit"]) == 12 for c in results.values())
  assert (tmp_path / "train_lm_max_logit.png").exists()
  plain, clipped = results["muon"]["max_logit"], results["muon+qk-clip"]["max_logit"]
  assert max(plain) > 1.3 * tau
  # The largest logit after each step, from a forward pass with the rescaled params. The
  # clip's S_h is measured before the step's update, which then grows the logits a little
  # (4% at most here) on top of τ.
  assert max(clipped) <= 1.1 * tau
  assert clipped[0] == pytest.approx(tau, rel=1e-5)  # step 1 (learning rate 0): the rescale alone
