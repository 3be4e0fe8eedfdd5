"""Orbax round trip of the sharded optimizer state: a run restored mid-way
continues bit-identically to an uninterrupted one."""

import jax
import numpy as np
import optax
import pytest
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import optax_muon as om
from helpers import random_like
from trees import gpt_tree

pytestmark = (
    pytest.mark.slow
)  # compiles or trains real models: the full suite only


# Free communication on one layer: matrices split over teams of devices.
TEAMS = om.ShardingOptions(cost_model=om.CostModel(1e12, float("inf"), 0.0))


@pytest.mark.parametrize(
    "variants, layers",
    [
        ({}, 4),
        ({"normalization": om.NorMuon(), "cautious_weight_decay": True}, 4),
        ({"sharding": TEAMS}, 1),
        ({"rank_fraction": 0.25}, 2),
    ],
)
def test_restore_continues_bit_identically(tmp_path, variants, layers):
  """Muon (whole matrices, NorMuon with cautious decay, teams) and Dion
  (rank_fraction)."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  params = gpt_tree(32, layers)
  shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, P("fsdp") if x.ndim == 2 else P()), params
  )
  params = jax.tree.map(jax.device_put, params, shardings)
  grads = [
      jax.tree.map(jax.device_put, random_like(params, 20 + t), shardings)
      for t in range(4)
  ]
  optimizer = om.dion if "rank_fraction" in variants else om.muon
  tx = optimizer(
      optax.linear_schedule(0.05, 0.01, 4),
      weight_decay=0.01,
      mu_dtype="bfloat16",
      **variants,
  )

  if optimizer is om.muon:
    plan = om.summarize(params, tx).plan
    assert any(ex.teams for g in plan.groups for ex in g.exchanges) == (
        "sharding" in variants
    )
  with jax.set_mesh(mesh):
    update = jax.jit(lambda g, s, p: _apply(tx, g, s, p))
    state = jax.jit(tx.init)(params)
    p, s = params, state
    for t in range(4):
      p, s = update(grads[t], s, p)
    uninterrupted = p

    p, s = params, state
    for t in range(2):
      p, s = update(grads[t], s, p)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step2", {"params": p, "opt_state": s})
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        {"params": p, "opt_state": s},
    )
    restored = checkpointer.restore(tmp_path / "step2", abstract)
    for a, b in zip(
        jax.tree.leaves(restored),
        jax.tree.leaves({"params": p, "opt_state": s}),
    ):
      assert (
          a.sharding.is_equivalent_to(b.sharding, a.ndim) and a.dtype == b.dtype
      )
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    p, s = restored["params"], restored["opt_state"]
    for t in range(2, 4):
      p, s = update(grads[t], s, p)
  for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(uninterrupted)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _apply(tx, grads, state, params):
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state
