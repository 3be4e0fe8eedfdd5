"""Test setup: 8 virtual CPU devices (before JAX starts), a compilation cache
for the session, unoptimized machine code, and the examples on sys.path."""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
# LLVM at -O0, without its expensive passes: half the compile time, and compiles
# are most of this suite's time. XLA's HLO passes run as before, so the programs
# the tests read (fusions, collectives, FLOPs, buffer sizes) are the same. Set
# in the environment too, for the scripts the tests run in subprocesses (the
# multi-process, 64-device and planner workers); test_aot takes it out, to
# compile for the accelerators as a user would, and test_notebook, whose kernel
# trains long enough to gain from optimized code.
os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[1] / "examples")
)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(
    0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
)

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)  # if JAX came first

# A persistent compilation cache for this session only. Tests build fresh
# transformations (fresh closures, so jit's in-memory cache misses), but many
# compile the same program (a case's sharded step under the same options, a
# benchmark's tree); keyed by the program's text, each compiles once. A
# directory of its own under the system's temporary directory, removed at exit:
# nothing in the user's cache or in the repo, nothing kept between sessions. The
# scripts run in subprocesses do not inherit it (a config update, not an
# environment variable).
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="optax_muon_tests_jax_cache_")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# Scripts run in subprocesses by test_multihost.py and test_aot.py (each sets up
# its own devices from its command line): never imported here, where
# --doctest-modules would otherwise import them.
collect_ignore = ["multihost_worker.py", "aot_worker.py"]


@pytest.fixture
def key():
  return jax.random.PRNGKey(0)


@pytest.fixture(scope="session")
def case_reference():
  """``case_reference(kind, variants=False)``: (updates, state) of a sharded
  case's tree kind on one device (``sharded_cases.single_device_steps``: two
  standard-NS steps of ``case_grads``; with ``variants``, NorMuon and the decays
  of ``sharded_cases.VARIANTS``), computed once per kind for the session and
  shared by every test that compares against it."""
  import sharded_cases  # noqa: PLC0415  (imports the benchmarks' trees)

  references = {}

  def reference(kind, variants=False):
    key = (repr(kind), variants)  # repr: the stacked tree True is not 1 layer
    if key not in references:
      params, dims = sharded_cases.case_tree(kind)
      options = sharded_cases.VARIANTS if variants else {}
      references[key] = sharded_cases.single_device_steps(
          params, sharded_cases.case_grads(params), dims, **options
      )
    return references[key]

  return reference
