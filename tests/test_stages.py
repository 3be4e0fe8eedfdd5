"""Exchanges in stages (``ShardingOptions.exchange_stages``): the update equals
the single-device one, each stage is one all-to-all each way with the plan's
FLOPs per device, and the cost model splits only where overlap shortens its
modelled time."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import aot
import hlo_cost
import optax_muon as om
from optax_muon._src.core.profiles import PROFILES
from hlo_cost import compiled_device_flops
from optax_muon._src.muon import costs
from optax_muon._src.muon.plan.model import PAD, in_line, stage_chunks
from sharded_cases import (
    CASES,
    STANDARD,
    case_grads,
    case_tree,
    compare,
    fsdp_specs,
    sharded_steps,
)
from trees import gpt_tree

FREE = om.CostModel(1e12, math.inf, 0.0)
PROHIBITIVE = om.CostModel(1e12, 1.0, 1.0)


def _stage_counts(plan):
  return [len(s) for g in plan.groups for s in g.stages()]


def test_pipelined_seconds():
  # One stage: out, NS, back in turn.
  assert costs.pipelined_seconds([5.0], [1.0], [2.0]) == 8.0
  # NS longer than what moves beside it: only the first out and the last back
  # show.
  assert costs.pipelined_seconds([3.0] * 3, [1.0] * 3, [1.0] * 3) == 1 + 9 + 1
  # Communication longer: NS hides behind it, and the loop's iterations each
  # move a stage both ways (the first's way back and the last's way out carry
  # nothing the step needs, but take their time).
  assert (
      costs.pipelined_seconds([1.0, 1.0], [3.0, 3.0], [3.0, 3.0])
      == 3 + (3 + 3) + (3 + 3) + 3
  )
  # In line, nothing moves that the step does not need.
  assert (
      costs.pipelined_seconds([1.0, 1.0], [3.0, 3.0], [3.0, 3.0], looped=False)
      == 3 + 3 + 3 + 3
  )
  assert (
      costs.pipelined_seconds(
          [0.5, 9.0, 0.5], [1.0, 4.0, 1.0], [1.0, 4.0, 1.0], looped=False
      )
      == 1 + 4 + max(9.0, 1 + 1) + 4 + 1
  )
  # Each worker runs its own stages between the all-to-alls they all join:
  # worker 1, with nothing in stage 0, orthogonalizes its stage 1 while worker 0
  # is still in stage 0 (8, where the busiest worker of each stage in turn
  # would take 1 + 5 + 5 + 1).
  assert (
      costs.pipelined_seconds(
          [np.array([5.0, 0.0]), np.array([0.0, 5.0])],
          [1.0, 1.0],
          [1.0, 1.0],
          looped=False,
      )
      == 1 + 5 + 1 + 1
  )
  # Leading axes: pipelines side by side (the workers on the last axis).
  np.testing.assert_allclose(
      costs.pipelined_seconds(
          [np.array([[1.0], [5.0]])] * 2,
          [np.array([3.0, 1.0])] * 2,
          [np.array([3.0, 1.0])] * 2,
          looped=False,
      ),
      [12.0, 12.0],
  )


@pytest.mark.parametrize(
    "case, stages, looped",
    [
        pytest.param("fsdp8-3-layers", 2, False, marks=pytest.mark.slow),
        ("fsdp8-3-layers", 3, True),
        ("dp2xfsdp4-split", 2, False),
        pytest.param("fsdp4xtp2-3-layers", 2, False, marks=pytest.mark.slow),
    ],
)
def test_staged_exchange_equals_single_device(
    case, stages, looped, case_reference
):
  """Stages by kind run in line (``looped`` False), the others as a loop."""
  shape, names, kind, specs_fn, policy = CASES[case]
  params, dims = case_tree(kind)
  grads = case_grads(params)
  reference, _ = case_reference(kind)
  mesh = jax.make_mesh(
      shape, names, axis_types=(AxisType.Explicit,) * len(shape)
  )
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs_fn(params))
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  tx = om.muon(
      0.1,
      muon_weight_dimension_numbers=dims,
      ns_options=STANDARD,
      sharding=om.ShardingOptions(
          replica_policy=policy, exchange_stages=stages
      ),
  )
  one = om.muon(
      0.1,
      muon_weight_dimension_numbers=dims,
      ns_options=STANDARD,
      sharding=om.ShardingOptions(replica_policy=policy, exchange_stages=1),
  )
  sharded = put(params)
  updates, _, compiled = sharded_steps(
      tx, mesh, sharded, [put(g) for g in grads]
  )
  compare(updates, reference)

  plan, whole = om.summarize(sharded, tx).plan, om.summarize(sharded, one).plan
  assert max(_stage_counts(plan)) == stages and max(_stage_counts(whole)) == 1
  assert [in_line(s) for g in plan.groups for s in g.stages()] == [not looped]
  _assert_staged(plan, whole, compiled)


def _padded_flops(plan):
  """NS FLOPs of the staged programs' empty slots, summed over the devices."""
  total = 0
  for group in plan.groups:
    devices = plan.device_count // group.workers
    for ex in group.exchanges:
      for owned in ex.owned:
        total += devices * sum(
            mine.count(PAD) * b.flops for mine, b in zip(owned, ex.buckets)
        )
      for runs in ex.teams:
        total += (
            devices
            * ex.team_size
            * sum(r.matrices.count(PAD) * r.cost.flops for r in runs)
        )
  return total


def _assert_staged(plan, whole, compiled):
  """The NS FLOPs over all devices those of one stage plus the empty slots',
  each device's all in the HLO (its branch of each stage); a loop's stages with
  one all-to-all out before the loop, one both ways in it, one back after it;
  stages in line with one out first, one per stage (the next stage out, the
  previous back) and the last one back; the received bytes the plan's (a
  loop: S + 1 stages of the longest chunk; in line: each stage's own)."""
  assert plan.device_ns_flops().sum() == whole.device_ns_flops().sum() + (
      _padded_flops(plan)
  )
  cost = hlo_cost.analyze(compiled, 8)
  np.testing.assert_array_equal(
      compiled_device_flops(cost, plan), plan.device_ns_flops()
  )
  expected = sum(
      len(stages) + 2 if in_line(stages) else 2 + (len(stages) > 1)
      for g in plan.groups
      for stages in g.stages()
  )
  assert len(re.findall(r" all-to-all\(", compiled.as_text())) == expected
  # The exchange's bytes (the teams' own collectives run inside NS).
  teams = any(ex.teams for g in plan.groups for ex in g.exchanges)
  exchanged = sum(
      c.received_bytes
      for c in cost.collectives
      if c.kind == "all-to-all" or not teams
  )
  assert exchanged == plan.device_received_bytes().max()


def _seven_b(model, stages=None, devices=8):
  """A Llama-7B-like tree of abstract leaves, FSDP over ``devices`` (8 CPU
  devices, or an abstract mesh of more), and its plan."""
  mesh = (
      jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
      if devices == 8
      else jax.sharding.AbstractMesh(
          (devices,), ("fsdp",), axis_types=(AxisType.Auto,)
      )
  )
  params, dims, _, shardings = aot.llama_tree(mesh, **aot.TREES["7b"])
  tx = om.muon(
      0.02,
      muon_weight_dimension_numbers=dims,
      param_shardings=shardings,
      ns_options=om.NSOptions(
          compute_dtype=jnp.bfloat16
      ),  # as on an accelerator
      sharding=om.ShardingOptions(cost_model=model, exchange_stages=stages),
  )
  return om.summarize(params, tx).plan


def test_the_cost_model_chooses_the_stages():
  # XLA:CPU's profile cannot overlap; free or prohibitive communication gains
  # nothing, and the plan says why it keeps one stage where it could overlap.
  for model in (PROFILES["cpu"], FREE, PROHIBITIVE):
    plan = _seven_b(model)
    assert _stage_counts(plan) == [1], model
    if model.overlap:
      (note,) = plan.stage_notes
      assert "in one stage: the cost model's pipelined time is no shorter" in (
          note
      ), note
      assert re.search(
          r"\(\d stages [\d.e+]+ ms against [\d.e+]+ ms in one", note
      )
    else:
      assert plan.stage_notes == ()
  # An H100's NS in bfloat16 beside NVLink: split, the modelled time shorter
  # than one stage's, the same FLOPs per device.
  h100 = PROFILES["h100"]
  staged, whole = _seven_b(h100), _seven_b(h100, stages=1)
  assert max(_stage_counts(staged)) > 1
  assert staged.stage_notes == whole.stage_notes == ()
  assert staged.critical_seconds() < whole.critical_seconds()
  np.testing.assert_array_equal(
      staged.device_ns_flops(), whole.device_ns_flops()
  )
  model = staged.cost_model
  ((group, stages),) = [(g, s) for g in staged.groups for s in g.stages()]
  ns, out, back = zip(
      *(
          group.stage_seconds(ex, staged.wire_itemsize(ex), model, chunk)
          for ex, chunk in zip(stages, stage_chunks(stages, 8))
      )
  )
  assert staged.critical_seconds() == pytest.approx(
      costs.pipelined_seconds(ns, out, back, looped=not in_line(stages))
  )


def test_a_pods_teams_stage_by_kind():
  """On 256 TPU v5p chips the 7B-like tree's 4096×11008 matrices go to teams of
  2, the others whole to single owners: no worker holds more than two, one of
  them large, so a loop's stages would each move the largest. Cut by kind, the
  team runs and the 4096×4096 matrices are one stage and the 1024×4096 ones the
  other, in line: no program in two stages, each stage moves its own chunk
  (the bytes of one stage, within the chunks' rounding), and the modelled time
  is shorter than one stage's."""
  v5p = PROFILES["tpu_v5p"]
  staged, whole = _seven_b(v5p, devices=256), _seven_b(v5p, 1, devices=256)
  ((group, stages),) = [(g, s) for g in staged.groups for s in g.stages()]
  assert len(stages) == 2 and in_line(stages)
  assert stages[0].team_size == 2
  kinds = [
      {("team", r.bucket) for runs in ex.teams for r in runs}
      | {("whole", b) for o in ex.owned for b, mine in enumerate(o) if mine}
      for ex in stages
  ]
  shapes = lambda kind: stages[0].buckets[kind[1]].shape
  assert sorted((k[0], shapes(k)) for k in kinds[0]) == [
      ("team", (4096, 11008)),
      ("whole", (4096, 4096)),
  ]
  assert [shapes(k) for k in kinds[1]] == [(1024, 4096)]
  assert staged.critical_seconds() < whole.critical_seconds()
  np.testing.assert_array_equal(
      staged.device_ns_flops(), whole.device_ns_flops()
  )
  chunks = [ex.chunk(256) for ex in stages]
  assert staged.device_received_bytes().max() == 2 * 255 * 4 * sum(chunks)
  (one,) = whole.groups[0].exchanges
  assert one.chunk(256) <= sum(chunks) <= 1.05 * one.chunk(256)


@pytest.mark.parametrize("looped", [False, True])
def test_exchanges_with_teams_in_stages_equal_single_device(looped):
  """Free communication makes teams; forced into stages, each kind (a bucket's
  team runs) has its stage (in line), or each team's run of one kind is cut
  like an owner's (3 stages of one program: a loop): the update equals the
  single-device one, the same FLOPs per device as in one stage (all in the
  HLO), the all-to-alls and received bytes the plan's."""
  shapes = (
      {"w": (6, 256, 256)}
      if looped
      else {"w": (4, 256, 256), "v": (4, 256, 512)}
  )
  stages = 3 if looped else 2
  dims = {name: om.MuonDimensionNumbers(1, 2) for name in shapes}
  params = {
      name: jax.random.normal(jax.random.PRNGKey(i), shape)
      for i, (name, shape) in enumerate(shapes.items())
  }
  grads = [jax.tree.map(lambda x, i=i: jnp.cos(x + i), params) for i in (1, 2)]
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  shardings = jax.tree.map(
      lambda _: NamedSharding(mesh, P(None, "fsdp")), params
  )
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  kw = dict(muon_weight_dimension_numbers=dims, ns_options=STANDARD)
  single = om.muon(0.1, **kw)
  state = single.init(params)
  for g in grads:
    reference, state = jax.jit(single.update)(g, state, params)
  tx = om.muon(
      0.1,
      **kw,
      sharding=om.ShardingOptions(cost_model=FREE, exchange_stages=stages),
  )
  one = om.muon(
      0.1, **kw, sharding=om.ShardingOptions(cost_model=FREE, exchange_stages=1)
  )
  sharded = put(params)
  updates, _, compiled = sharded_steps(
      tx, mesh, sharded, [put(g) for g in grads]
  )
  compare(updates, reference)
  plan, whole = om.summarize(sharded, tx).plan, om.summarize(sharded, one).plan
  assert any(ex.teams for g in plan.groups for ex in g.exchanges)
  assert max(_stage_counts(plan)) == stages
  assert max(_stage_counts(whole)) == 1
  assert [in_line(s) for g in plan.groups for s in g.stages()] == [not looped]
  _assert_staged(plan, whole, compiled)
  words = sorted(
      r.placement.rsplit(", ", 1)[1] for r in om.summarize(sharded, tx).rows
  )
  assert words == (
      ["exchanged in 3 stages"]
      if looped
      else ["exchanged in stage 1 of 2", "exchanged in stage 2 of 2"]
  )


@pytest.mark.parametrize("stages", [0, -1, True, 1.5, "2"])
def test_bad_exchange_stages(stages):
  with pytest.raises(
      ValueError, match="exchange_stages must be a positive int or None"
  ):
    om.ShardingOptions(exchange_stages=stages)


def test_summary_counts_every_stage():
  params = gpt_tree(32, 3)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  sharded = jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
      params,
      fsdp_specs(params),
  )
  tx = om.muon(
      0.1,
      ns_options=STANDARD,
      sharding=om.ShardingOptions(exchange_stages=2),
  )
  rows = {r.path: r for r in om.summarize(sharded, tx).rows}
  # The same owners as in one stage (see test_sharded's summary test), each
  # one's matrices cut by load: no slot padded.
  assert rows["blocks/0/q"].placement.endswith(
      "12 matrices, 1–3 whole per worker of 8, exchanged in 2 stages"
  )
  assert (
      "6 matrices, 0–1 whole per worker of 8"
      in rows["blocks/0/mlp_in"].placement
  )
