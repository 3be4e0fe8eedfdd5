"""Matrices split over teams of devices, chosen by the cost model: equal to the
single-device update, and each device's compiled NS FLOPs and NS-loop
collectives are the plan's."""

import math
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import hlo_cost
import optax_muon as om
from optax_muon._src.core.profiles import PROFILES, default_cost_model
import planner
import sharding
from helpers import normal, random_like, rel_err
from optax_muon._src.muon.plan import build_plan
from hlo_cost import compiled_device_flops
from sharded_cases import (
    CASES,
    STANDARD,
    case_grads,
    case_tree,
    compare,
    fsdp_specs,
    mesh as make_mesh,
    ns_cost,
    single_device,
)
from trees import moe_tree, stacked_dims

FREE = om.CostModel(1e12, math.inf, 0.0)  # communication costs nothing
PROHIBITIVE = om.CostModel(
    1e12, 1.0, 1.0
)  # one byte per second, a second per collective


def _muon(model, dims=None, policy="split", stages=None, **kw):
  return om.muon(
      0.1,
      muon_weight_dimension_numbers=dims,
      ns_options=STANDARD,
      sharding=om.ShardingOptions(
          replica_policy=policy, cost_model=model, exchange_stages=stages
      ),
      **kw,
  )


def _rounds(plan):
  """Every team run of the plan."""
  return [
      r
      for g in plan.groups
      for ex in g.exchanges
      for runs in ex.teams
      for r in runs
  ]


def _check_compiled_is_the_plan(compiled, plan):
  """Per device NS FLOPs, and the collectives inside NS loops, as the plan
  predicts: each distinct team run (a run of each team program) loops over its
  steps with a reduce-scatter and two all-gathers."""
  cost = hlo_cost.analyze(compiled, plan.device_count)
  assert (compiled_device_flops(cost, plan) == plan.device_ns_flops()).all()
  in_loop = [c for c in cost.collectives if c.in_loop]
  runs = [
      (key, ex)
      for g in plan.groups
      for ex in g.exchanges
      for p in ex.team_programs
      for key in p
  ]
  expected = sum(
      ex.teams[ex.team_program_of.index(i)][0].cost.loop_collectives
      for g in plan.groups
      for ex in g.exchanges
      for i, p in enumerate(ex.team_programs)
      for _ in p
  )
  assert runs and len(in_loop) == expected == 3 * len(runs)
  assert sorted(c.kind for c in in_loop) == sorted(
      ["reduce-scatter", "all-gather", "all-gather"] * len(runs)
  )
  assert all(c.multiplicity == 5 for c in in_loop)  # one per NS step


# One layer (4 d × d and 2 d × 4d matrices on 8 workers): whole matrices leave
# the busiest device at the largest matrix, so splitting pays when communication
# is free.
GROUP_CASES = ["fsdp8", "fsdp4xtp2", "dp2xfsdp4-split"]


@pytest.mark.parametrize(
    "case, axis_type",
    [
        (GROUP_CASES[0], AxisType.Explicit),
        pytest.param(GROUP_CASES[0], AxisType.Auto, marks=pytest.mark.slow),
        *(
            pytest.param(c, AxisType.Explicit, marks=pytest.mark.slow)
            for c in GROUP_CASES[1:]
        ),
    ],
)
def test_groups_equal_single_device(case, axis_type, case_reference):
  shape, names, _, specs_fn, policy = CASES[case]
  params, dims = case_tree(1)
  grads = case_grads(params)
  reference, _ = case_reference(1)
  mesh = make_mesh(shape, names, axis_type)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs_fn(params))
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  explicit = axis_type == AxisType.Explicit
  tx = _muon(
      FREE, dims, policy, param_shardings=None if explicit else shardings
  )
  sharded = put(params)
  plan = om.summarize(sharded, tx).plan
  assert _rounds(plan), "free communication should split some matrices"
  assert (
      plan.critical_ns_flops()
      < build_plan(
          [p.layout for p in plan.leaves],
          [p.sharding for p in plan.leaves],
          ns_cost,
          om.ShardingOptions(replica_policy=policy),
      ).critical_ns_flops()
  )
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    update = jax.jit(tx.update).lower(put(grads[0]), state, sharded).compile()
    _check_compiled_is_the_plan(update, plan)
    for t in range(2):
      updates, state = update(put(grads[t]), state, sharded)
  compare(updates, reference)
  for u, s in zip(jax.tree.leaves(updates), jax.tree.leaves(shardings)):
    assert u.sharding.is_equivalent_to(s, u.ndim)


@pytest.mark.slow
@pytest.mark.parametrize("stages", [None, 2])
def test_groups_in_a_shard_map_train_step(stages):
  """Inside the user's shard_map (which checks replication): the same update as
  pjit; also with the exchange in a loop of stages."""
  params, _ = case_tree(3)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  specs = fsdp_specs(params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  grads, sharded = put(random_like(params, 3)), put(params)
  tx = _muon(FREE, param_shardings=specs, stages=stages)
  with jax.set_mesh(mesh):
    assert _rounds(om.summarize(sharded, tx).plan)
    state = jax.jit(tx.init)(sharded)
    expected, _ = jax.jit(tx.update)(grads, state, sharded)
    state_specs = jax.tree.map(lambda x: x.sharding.spec, state)
    step = jax.jit(
        jax.shard_map(
            tx.update,
            in_specs=(specs, state_specs, specs),
            out_specs=(specs, state_specs),
        )
    )
    got, _ = step(grads, state, sharded)
  compare(got, expected)


def test_prohibitive_communication_keeps_the_whole_matrix_plan():
  params, _ = case_tree(3)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  sharded = jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
      params,
      fsdp_specs(params),
  )
  plan = om.summarize(sharded, _muon(PROHIBITIVE)).plan
  whole = build_plan(
      [p.layout for p in plan.leaves],
      [p.sharding for p in plan.leaves],
      ns_cost,
  )
  assert plan.groups == whole.groups and not _rounds(plan)
  assert (plan.device_received_bytes() == whole.device_received_bytes()).all()


@pytest.mark.slow
def test_bf16_groups_err_like_single_device():
  """bf16 leaves (NS products in bf16): split and whole round differently; both
  stay as close to the float32 update as bf16 allows."""
  params32 = case_tree(1)[0]
  grads32 = [random_like(params32, 5)]
  exact = single_device(params32, grads32, None, steps=1)
  params, grads = jax.tree.map(
      lambda x: x.astype(jnp.bfloat16), (params32, grads32)
  )
  whole = single_device(params, grads, None, steps=1)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), fsdp_specs(params))
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  tx = _muon(FREE)
  sharded = put(params)
  assert _rounds(om.summarize(sharded, tx).plan)
  with jax.set_mesh(mesh):
    updates, _ = jax.jit(tx.update)(
        put(grads[0]), jax.jit(tx.init)(sharded), sharded
    )
  for a, b, c in zip(
      jax.tree.leaves(updates), jax.tree.leaves(whole), jax.tree.leaves(exact)
  ):
    assert a.dtype == jnp.bfloat16
    assert rel_err(a, c) < 1.5 * max(rel_err(b, c), 1e-2)


def test_summary_shows_team_sizes_and_modelled_time():
  params, _ = case_tree(3)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  sharded = jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
      params,
      fsdp_specs(params),
  )
  summary = om.summarize(sharded, _muon(FREE))
  rows = [r for r in summary.rows if r.optimizer == "muon"]
  split = [r for r in rows if r.team > 1]
  assert split and all(f"teams of {r.team}" in r.placement for r in split)
  assert all(
      "standard iteration, every product split" in r.placement for r in split
  )
  for r in rows:  # free communication: a matrix's time is its FLOPs per member
    flops = STANDARD.flops(*r.ns_matrix, jnp.float32, 5, team=r.team)
    assert r.ns_seconds == pytest.approx(flops / FREE.flops_per_second)
  assert summary.plan.critical_seconds() == pytest.approx(
      summary.plan.critical_ns_flops() / FREE.flops_per_second
  )
  assert "modelled NS and exchange time" in str(summary)


def test_cost_model_validation_and_default():
  with pytest.raises(ValueError, match="CostModel.bytes_per_second"):
    om.CostModel(1e12, 0.0, 0.0)
  with pytest.raises(ValueError, match="CostModel.collective_latency"):
    om.CostModel(1e12, 1e9, -1.0)
  with pytest.raises(ValueError, match="ShardingOptions.cost_model"):
    om.ShardingOptions(cost_model="gpu")
  assert (
      default_cost_model() is PROFILES["cpu"]
  )  # these tests run on CPU devices
  assert om.CostModel(1e12, math.inf, 0.0).collective_seconds(1e9) == 0.0


@pytest.mark.slow
def test_gpt_on_64_devices_reaches_the_average_with_free_communication():
  """The README's GPT (d=256, 3 layers) on 64 devices: whole matrices leave the
  busiest device at 6.4× Σc/N; with teams it is within 1.3×, compiled as
  planned, and the update equals the single-device one."""
  root = pathlib.Path(__file__).resolve().parents[1]
  env = dict(
      os.environ,
      XLA_FLAGS="--xla_force_host_platform_device_count=64",
      PYTHONPATH=os.pathsep.join(
          [str(root), str(root / "benchmarks"), str(root / "tests")]
      ),
  )
  out = subprocess.run(
      [sys.executable, str(root / "tests" / "group_plan_worker.py")],
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  ratio, whole_ratio, err = map(float, out.stdout.split()[-3:])
  assert whole_ratio > 6 and ratio <= 1.3 and err < 1e-5


@pytest.mark.parametrize(
    "dtype, method",
    [
        (jnp.float32, "standard"),
        pytest.param(jnp.complex64, "gram", marks=pytest.mark.slow),
    ],
)
def test_split_pads_blocks_that_k_does_not_divide(dtype, method):
  """(40, 8) leaves FSDP-split on the long side (5 rows per device) and (8, 40)
  ones split on the short side: teams of 2 get 3 of the 5 local rows (one
  zero-padded), and the update still equals the single-device one, for both NS
  methods and complex leaves."""
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  key = jax.random.PRNGKey(0)
  shapes = {"a": (40, 8), "b": (40, 8), "c": (40, 8), "d": (8, 40)}
  params = {
      name: normal(jax.random.fold_in(key, i), s, dtype)
      for i, (name, s) in enumerate(shapes.items())
  }
  grads = {
      name: normal(jax.random.fold_in(key, 10 + i), x.shape, dtype)
      for i, (name, x) in enumerate(params.items())
  }
  specs = {"a": P("fsdp"), "b": P("fsdp"), "c": P("fsdp"), "d": P("fsdp")}
  shardings = {k: NamedSharding(mesh, s) for k, s in specs.items()}
  ns = om.NSOptions(method=method)
  make = lambda model: om.scale_by_muon(
      ns_options=ns, sharding=om.ShardingOptions(cost_model=model)
  )
  single = make(None)
  expected, _ = jax.jit(single.update)(grads, single.init(params), params)
  tx = make(FREE)
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  sharded = put(params)
  plan = om.summarize(sharded, tx).plan
  split = {plan.leaves[r.leaf].layout.path: r for r in _rounds(plan)}
  assert "a" in split and plan.leaves[split["a"].leaf].local_shape[0] % 2 == 1
  with jax.set_mesh(mesh):
    got, _ = jax.jit(tx.update)(put(grads), jax.jit(tx.init)(sharded), sharded)
  compare(got, expected)


@pytest.mark.parametrize("method", ["auto", "standard"])
@pytest.mark.parametrize("case", ["gpt", "llama"])
def test_free_communication_reaches_the_average_on_64_devices(case, method):
  """GPT-like (3 layers, d=256) and Llama-like (GQA 4:1, SwiGLU; 2 layers,
  d=256) on 64 devices with free communication, either NS method: the busiest
  device within 1.3× Σc/N (whole matrices: 5.3–8.1×). Plans;
  ``test_planner_property`` compiles such trees."""
  whole, plan, _, _ = sharding.abstract_plans(
      *getattr(planner, f"{case}_case")(), om.NSOptions(method=method), FREE
  )
  assert whole.critical_ns_flops() > 5 * planner.average(plan)
  assert plan.critical_ns_flops() <= 1.3 * planner.average(plan)


@pytest.mark.parametrize("method", ["auto", "standard"])
def test_prohibitive_communication_on_64_devices_is_the_whole_matrix_plan(
    method,
):
  """The GPT-like tree on 64 devices at one byte per second and a second per
  collective: the whole-matrix plan, two all-to-alls."""
  whole, plan, _, _ = sharding.abstract_plans(
      *planner.gpt_case(), om.NSOptions(method=method), PROHIBITIVE
  )
  assert plan.groups == whole.groups and planner.collectives(plan) == 2


@pytest.mark.parametrize("method", ["auto", "standard"])
def test_moe_plan_bytes_near_the_bound(method):
  """MoE, 4 layers, 8 experts on expert 4 × fsdp 8 (32 devices), d = 256,
  planned from abstract shapes under the CPU profile, either NS method: FLOPs at
  plain LPT's level and the busiest device's received bytes within 1.45× the
  byte bound (1.12×)."""
  params = moe_tree(256, 4, heads=8, kv_heads=2, experts=8, expert_ffn=256)
  dims = stacked_dims(params, adam=sharding.ADAM)
  leaves, flat_dims = sharding._flat(params), sharding._flat(dims)
  muon = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype)
      for k, x in leaves.items()
      if flat_dims[k] is not None
  }
  specs = sharding._flat(sharding.moe_specs(params, "expert", "fsdp"))
  plan, _, _, _ = sharding.abstract_plans(
      muon,
      {k: specs[k] for k in muon},
      {k: flat_dims[k] for k in muon},
      (4, 8),
      ("expert", "fsdp"),
      om.NSOptions(method=method),
      PROFILES["cpu"],
  )
  bound = sharding.bounds(params, dims, 32)
  assert plan.critical_ns_flops() == sharding.lpt_plan(plan).critical_ns_flops()
  assert plan.device_received_bytes().max() <= 1.45 * bound["bytes"]


def _element_index(ex, plan, g):
  """Step 2's buffer, element by element, written out: the reference for the
  executor's unit index (a row: the member's blocks of its team's runs, its
  whole matrices' pieces, padding one past the end)."""
  from optax_muon._src.muon.executor import _member_slice  # noqa: PLC0415

  starts = np.cumsum([0] + [b.matrices * b.piece_size(g) for b in ex.buckets])
  index = np.full((len(ex.owned), ex.chunk(g)), starts[-1], np.int64)
  for w, owned in enumerate(ex.owned):
    parts = []
    for run in ex.teams[w // ex.team_size] if ex.teams else ():
      size = ex.buckets[run.bucket].piece_size(g)
      block = _member_slice(
          plan.leaves[run.leaf], run.split_dim, ex.team_size, w % ex.team_size
      )
      parts += [
          np.where(block < 0, starts[-1], starts[run.bucket] + j * size + block)
          for j in run.matrices
      ]
    parts += [
        start
        + (
            np.asarray(mine)[:, None] * b.piece_size(g)
            + np.arange(b.piece_size(g))
        ).reshape(-1)
        for mine, b, start in zip(owned, ex.buckets, starts)
    ]
    row = np.concatenate(parts)
    index[w, : row.size] = row
  return index


@pytest.mark.parametrize("model", [FREE, None], ids=["teams", "whole"])
def test_the_exchange_index_is_per_unit_and_means_the_same_elements(model):
  """The compiled program holds one index entry per run of elements that always
  move together, not one per element (a constant the size of the params
  otherwise), and it addresses exactly the elements the element-wise description
  does — padded team blocks included."""
  from optax_muon._src.muon.executor import buffer_units  # noqa: PLC0415

  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  shapes = {
      "a": (40, 8),
      "b": (40, 8),
      "c": (40, 8),
      "d": (8, 40),
      "w": (64, 256),
      "v": (256, 64),
  }
  params = {
      k: jax.ShapeDtypeStruct(
          s, jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))
      )
      for k, s in shapes.items()
  }
  tx = om.scale_by_muon(sharding=om.ShardingOptions(cost_model=model))
  plan = om.summarize(params, tx).plan
  exchanges = [(g, ex) for g in plan.groups for ex in g.exchanges]
  assert any(ex.teams for _, ex in exchanges) == (model is FREE)
  for group, ex in exchanges:
    units, unit = buffer_units(ex, plan, group.exchange_size)
    reference = _element_index(ex, plan, group.exchange_size)
    padding = reference.max()  # one past the stacks
    expanded = (
        units[..., None].astype(np.int64) * unit + np.arange(unit)
    ).reshape(reference.shape)
    np.testing.assert_array_equal(np.minimum(expanded, padding), reference)
    assert unit > 1 and units.size * unit == reference.size


def test_device_profiles_by_generation_and_dtype():
  """Generation profiles carry the vendors' bf16 and full-float32 rates; the
  plan takes the rate of the NS compute dtype, and summarize names the
  profile."""
  h100 = PROFILES["h100"]
  assert h100.for_dtype(jnp.float32).flops_per_second == 67e12
  assert h100.for_dtype(jnp.bfloat16).flops_per_second == 989e12
  assert (
      PROFILES["tpu_v5p"].for_dtype(jnp.float32).flops_per_second == 459e12 / 6
  )
  assert PROFILES["gpu"].for_dtype(jnp.float32) is PROFILES["gpu"]  # one rate
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  params = {
      "w": jax.ShapeDtypeStruct(
          (64, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp"))
      )
  }
  for model, name in ((None, "cpu"), (h100, "H100 SXM")):
    summary = om.summarize(
        params, om.scale_by_muon(sharding=om.ShardingOptions(cost_model=model))
    )
    assert summary.cost_model.name == name and f"(cost profile: {name})" in str(
        summary
    )
  assert (
      om.summarize(
          params, om.scale_by_muon(sharding=om.ShardingOptions(cost_model=h100))
      ).cost_model.flops_per_second
      == 67e12
  )  # float32 NS
