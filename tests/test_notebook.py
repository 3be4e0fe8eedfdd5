"""The quickstart notebook runs top to bottom and prints what its prose
describes. (The docs build runs it too, to render its outputs; this test checks
the values.)"""

import ast
import os
import pathlib

import nbclient
import nbformat
import pytest

pytestmark = (
    pytest.mark.slow
)  # compiles or trains real models: the full suite only

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes():
  notebook = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
  client = nbclient.NotebookClient(
      notebook,
      timeout=600,
      kernel_name="python3",
      resources={"metadata": {"path": str(ROOT)}},
  )
  # The kernel compiles with LLVM's optimizations (conftest.py turns them off
  # for the rest of the suite): the notebook trains long enough that its
  # unoptimized programs would cost more time than their compiles save.
  env = {
      k: v
      for k, v in os.environ.items()
      if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"
  }
  client.execute(env=env)
  outputs = "".join(
      str(o.get("text", ""))
      for cell in notebook.cells
      if cell.cell_type == "code"
      for o in cell.get("outputs", [])
  )
  assert "leaves on Muon" in outputs
  assert "validation loss" in outputs
  assert "NS, polar_express ×6" in outputs
  metrics = ast.literal_eval(
      notebook.cells[-1].outputs[-1]["data"]["text/plain"]
  )
  assert (
      metrics["update_rms/muon"] > 0 and metrics["update_rms/adam"] > 0
  ), metrics
  assert (
      metrics["orthogonality_error"] < 0.9
  ), metrics  # 1 for a zero or rank-deficient update
