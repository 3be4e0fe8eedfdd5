"""The training example runs end to end and writes its curves and plot."""

import json

import numpy as np

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
