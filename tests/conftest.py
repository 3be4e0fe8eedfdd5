"""Test setup: 8 virtual CPU devices (before JAX starts) and the examples on
sys.path."""

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
)

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

# Scripts run in subprocesses by test_multihost.py and test_aot.py (each sets up
# its own
# devices from its command line): never imported here, where --doctest-modules
# would otherwise import them.
collect_ignore = ["multihost_worker.py", "aot_worker.py"]


@pytest.fixture
def key():
  return jax.random.PRNGKey(0)
