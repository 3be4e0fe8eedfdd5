"""One process of the 2-process × 4-device run (see test_multihost.py).

Usage: python multihost_worker.py PORT PROCESS_ID
"""

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
root = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root / "benchmarks"))
sys.path.insert(0, str(root / "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import optax_muon  # noqa: E402
from trees import gpt_tree  # noqa: E402


def sharded_steps(tx, params, grads, mesh, matrix_spec):
  """``tx``'s steps on ``mesh`` (matrices laid out by ``matrix_spec``, the rest
  replicated): (the last updates gathered whole on every process, the sharded
  params)."""
  specs = jax.tree.map(lambda x: matrix_spec if x.ndim == 2 else P(), params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  put = lambda tree: jax.tree.map(  # noqa: E731
      lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]),
      tree,
      shardings,
  )
  sharded_params = put(params)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded_params)
    for g in grads:
      updates, state = jax.jit(tx.update)(put(g), state, sharded_params)
  return multihost_utils.process_allgather(updates, tiled=True), sharded_params


def check(
    params, cost_model, process_id: int, name: str, interleave: bool = False
) -> None:
  """Two steps of Muon on FSDP over both processes' 8 devices == one process's
  update. ``interleave``: mesh devices alternate between the processes (so that
  every team of consecutive devices spans both)."""
  rng = np.random.default_rng(7)
  grads = [
      jax.tree.map(
          lambda x: rng.standard_normal(x.shape).astype(np.float32), params
      )
      for _ in range(2)
  ]
  ns = optax_muon.NSOptions(method="standard")

  # Single-process reference on this process's first device.
  tx_ref = optax_muon.muon(0.1, ns_options=ns)
  state = tx_ref.init(params)
  for g in grads:
    reference, state = jax.jit(tx_ref.update)(g, state, params)

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if interleave:
    devices = [d for pair in zip(devices[:4], devices[4:]) for d in pair]
  mesh = jax.sharding.Mesh(
      np.array(devices), ("fsdp",), axis_types=(AxisType.Explicit,)
  )
  tx = optax_muon.muon(
      0.1,
      ns_options=ns,
      sharding=optax_muon.ShardingOptions(cost_model=cost_model),
  )
  gathered, sharded_params = sharded_steps(tx, params, grads, mesh, P("fsdp"))
  worst = max(
      float(np.max(np.abs(a - np.asarray(b))) / np.max(np.abs(np.asarray(b))))
      for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(reference))
  )
  plan = optax_muon.summarize(sharded_params, tx).plan
  teams = sum(len(ex.teams) for g in plan.groups for ex in g.exchanges)
  sizes = sorted(
      {ex.team_size for g in plan.groups for ex in g.exchanges if ex.teams}
  )
  print(
      f"MULTIHOST {name} process {process_id}: max relative difference"
      f" {worst:.2e}; plan on {plan.device_count} devices, {teams} teams of"
      f" {sizes}",
      flush=True,
  )
  assert worst < 1e-5, worst
  assert (teams > 0) == (name == "teams"), teams
  if interleave:  # each team's devices belong to both processes
    for g in plan.groups:
      for ex in g.exchanges:
        for t in range(len(ex.teams)):
          members = devices[t * ex.team_size : (t + 1) * ex.team_size]
          assert len({d.process_index for d in members}) == 2


def check_dion(params, process_id: int) -> None:
  """Two steps of Dion (rank fractions 1/4 and 1) on FSDP × TP over both
  processes' devices == one process's update."""
  rng = np.random.default_rng(8)
  grads = [
      jax.tree.map(
          lambda x: rng.standard_normal(x.shape).astype(np.float32), params
      )
      for _ in range(2)
  ]
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  # tp pairs a device of each process: every product's partial sums cross
  # processes.
  mesh = jax.sharding.Mesh(
      np.array(
          [d for pair in zip(devices[:4], devices[4:]) for d in pair]
      ).reshape(4, 2),
      ("fsdp", "tp"),
      axis_types=(AxisType.Explicit,) * 2,
  )
  worst = 0.0
  for fraction in (0.25, 1.0):
    tx = optax_muon.dion(0.1, rank_fraction=fraction)
    state = tx.init(params)
    for g in grads:
      reference, state = jax.jit(tx.update)(g, state, params)
    gathered, _ = sharded_steps(tx, params, grads, mesh, P("fsdp", "tp"))
    for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(reference)):
      b = np.asarray(b)
      # Square matrices at full rank: see test_dion._compare_to_single_device.
      tolerance = (
          2e-4
          if fraction == 1 and b.ndim == 2 and b.shape[0] == b.shape[1]
          else 1e-5
      )
      error = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
      worst = max(worst, error / tolerance * 1e-5)
      assert error < tolerance, (fraction, b.shape, error)
  print(
      f"MULTIHOST dion process {process_id}: max relative difference"
      f" {worst:.2e} (scaled to a 1e-5 tolerance)",
      flush=True,
  )


def check_dion_replicas(params, process_id: int) -> None:
  """Five steps of Dion with its replicas syncing rank-r factors, each process
  one replica (FSDP over its 4 devices), every step's two gradients different
  == one process's Dion on their mean; the averaged buffers too."""
  rng = np.random.default_rng(9)
  grads = [
      [
          jax.tree.map(
              lambda x: rng.standard_normal(x.shape).astype(np.float32), params
          )
          for _ in range(2)
      ]
      for _ in range(5)
  ]
  tx_ref = optax_muon.dion(0.1, rank_fraction=0.25)
  state = tx_ref.init(params)
  for pair in grads:
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *pair)
    reference, state = jax.jit(tx_ref.update)(mean, state, params)
  reference_buffers = state.inner_states["muon"].inner_state[0].momentum

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = jax.sharding.Mesh(
      np.array(devices).reshape(2, 4),
      ("replica", "fsdp"),
      axis_types=(AxisType.Explicit,) * 2,
  )
  specs = jax.tree.map(lambda x: P("fsdp") if x.ndim == 2 else P(), params)
  place = lambda x, spec: jax.make_array_from_callback(  # noqa: E731
      x.shape, NamedSharding(mesh, spec), lambda idx: x[idx]
  )
  tx = optax_muon.dion(0.1, rank_fraction=0.25, replica_axes="replica")
  sharded = jax.tree.map(place, params, specs)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    for pair in grads:
      per_replica = jax.tree.map(
          lambda a, b, spec: place(np.stack([a, b]), P("replica", *spec)),
          *pair,
          specs,
      )
      updates, state = jax.jit(tx.update)(per_replica, state, sharded)
    averaged = jax.jit(optax_muon.average_replicas)(state)
  gathered = multihost_utils.process_allgather(
      (updates, averaged.inner_states["muon"].inner_state[0].momentum),
      tiled=True,
  )
  worst = max(
      float(np.max(np.abs(a - np.asarray(b))) / np.max(np.abs(np.asarray(b))))
      for a, b in zip(
          jax.tree.leaves(gathered),
          jax.tree.leaves((reference, reference_buffers)),
      )
  )
  print(
      f"MULTIHOST dion-replicas process {process_id}: max relative difference"
      f" {worst:.2e}",
      flush=True,
  )
  assert worst < 1e-5, worst


def main(port: str, process_id: int) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      f"127.0.0.1:{port}", num_processes=2, process_id=process_id
  )
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  check(jax.tree.map(np.asarray, gpt_tree(32, 4)), None, process_id, "whole")
  # One layer with free communication: teams split the matrices across the
  # processes.
  free = optax_muon.CostModel(1e12, float("inf"), 0.0)
  check(
      jax.tree.map(np.asarray, gpt_tree(32, 1)),
      free,
      process_id,
      "teams",
      interleave=True,
  )
  check_dion(jax.tree.map(np.asarray, gpt_tree(32, 2)), process_id)
  check_dion_replicas(jax.tree.map(np.asarray, gpt_tree(32, 2)), process_id)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
