"""Sharded Muon on 8 virtual devices: equal to the single-device update,
shardings kept, every NS FLOP accounted for by the plan."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import hlo_cost
import optax_muon as om
from optax_muon._src.muon.costs import ns_flops
import sharding
from helpers import random_like, rel_err
from optax_muon._src.core.matrices import make_layout
from optax_muon._src.muon.plan import build_plan
from optax_muon._src.core.sharding import LeafSharding, dim_axes_of
from hlo_cost import compiled_device_flops
from sharded_cases import (
    CASES,
    STANDARD,
    VARIANTS,
    case_grads,
    case_tree,
    compare,
    fsdp_specs,
    megatron_specs,
    mesh as make_mesh,
    ns_cost,
    sharded_steps,
    single_device,
    standard_muon,
)
from trees import gpt_tree

# Auto meshes read the shardings from param_shardings instead of the arrays'
# types; after that the plan is the same, so they run on the cases whose meshes
# differ most.
AUTO_CASES = (
    "fsdp4xtp2-3-layers",
    "dp2xfsdp4-split",
    "fsdp8-stacked-layer-axis",
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,axis_type",
    [(c, AxisType.Explicit) for c in CASES]
    + [(c, AxisType.Auto) for c in AUTO_CASES],
)
def test_sharded_equals_single_device(case, axis_type, case_reference):
  shape, names, kind, specs_fn, policy = CASES[case]
  params, dims = case_tree(kind)
  grads = case_grads(params)
  reference, _ = case_reference(kind)

  mesh = make_mesh(shape, names, axis_type)
  specs = specs_fn(params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  explicit = axis_type == AxisType.Explicit
  tx = standard_muon(
      dims, policy, param_shardings=None if explicit else shardings
  )
  sharded_params = put(params)
  updates, state, compiled = sharded_steps(
      tx, mesh, sharded_params, [put(g) for g in grads]
  )
  compare(updates, reference)

  # Updates and momentum keep the params' shardings.
  mu = state.inner_states["muon"].inner_state[0].mu
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    want = jax.tree_util.tree_flatten_with_path(shardings)[0]
    s = dict((jax.tree_util.keystr(p), v) for p, v in want)[
        jax.tree_util.keystr(path)
    ]
    assert u.sharding.is_equivalent_to(s, u.ndim), jax.tree_util.keystr(path)
    if explicit:
      assert dim_axes_of(jax.typeof(u).sharding.spec, u.ndim) == dim_axes_of(
          s.spec, u.ndim
      )
  for m, s in zip(
      jax.tree.leaves(mu),
      jax.tree.leaves(
          jax.tree.map(
              lambda s, x: s if not isinstance(x, optax.MaskedNode) else None,
              shardings,
              mu,
              is_leaf=lambda x: isinstance(x, optax.MaskedNode),
          )
      ),
  ):
    assert m.sharding.is_equivalent_to(s, m.ndim)

  # Every NS FLOP each device runs is one the plan reported: nothing silently
  # redundant.
  plan = om.summarize(sharded_params, tx).plan
  cost = hlo_cost.analyze(compiled, 8)
  np.testing.assert_array_equal(
      compiled_device_flops(cost, plan), plan.device_ns_flops()
  )
  assert cost.received_bytes == plan.device_received_bytes().max()
  assert cost.collectives_in_loops == 0


@pytest.mark.slow
def test_plan_floors_on_fsdp8_gpt():
  """The benchmark's per-layer GPT on FSDP-8 meets the compiled-HLO floors: NS
  FLOPs, received bytes, temp memory and the collective count."""
  params = gpt_tree(64, 4)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), fsdp_specs(params))
  sharded = jax.tree.map(jax.device_put, params, shardings)
  for wire, byte_floor, exchange in (
      (None, 1.05, "per_shape"),
      (jnp.bfloat16, 0.55, "per_shape"),
      (None, 1.05, "combined"),
  ):
    tx = om.muon(
        0.1, sharding=om.ShardingOptions(wire_dtype=wire, exchange=exchange)
    )
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(sharded)
      compiled = jax.jit(tx.update).lower(sharded, state, sharded).compile()
    plan = om.summarize(sharded, tx).plan
    cost = hlo_cost.analyze(compiled, 8)
    muon_bytes = sum(
        4 * p.layout.batch * p.layout.n_in * p.layout.n_out for p in plan.leaves
    )
    lower_bound = 2 * 7 / 64 * muon_bytes
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params)) / 8
    assert cost.dot_flops <= 1.05 * plan.ns_flops_bound()
    assert cost.received_bytes <= byte_floor * lower_bound
    assert cost.temp_bytes <= 3.5 * param_bytes
    assert cost.collectives_in_loops == 0
    buckets = sum(len(g.buckets) for g in plan.groups)  # (d, d) and (d, 4d)
    assert buckets == 2
    assert [c.kind for c in cost.collectives] == ["all-to-all"] * (
        2 * buckets if exchange == "per_shape" else 2
    )


def test_bf16_on_the_wire_is_close(case_reference):
  params, _ = case_tree(False)
  grads = case_grads(params)
  reference, _ = case_reference(False)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), fsdp_specs(params))
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  tx = om.muon(
      0.1,
      ns_options=STANDARD,
      sharding=om.ShardingOptions(wire_dtype=jnp.bfloat16),
  )
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(put(params))
    for t in range(2):
      updates, state = jax.jit(tx.update)(put(grads[t]), state, put(params))
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(reference)):
    assert rel_err(a, b) < 3e-2  # bf16 rounding of the NS input and output


def test_mixed_explicit_auto_mesh_is_an_error():
  mesh = jax.make_mesh(
      (4, 2), ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Auto)
  )
  params = {"w": jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("a")))}
  tx = om.scale_by_muon()
  with (
      jax.set_mesh(mesh),
      pytest.raises(
          ValueError, match="w: the mesh mixes Explicit and Auto axes"
      ),
  ):
    tx.init(params)  # at init, not at the first update


def test_param_shardings_errors():
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  params = {
      "w": jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("fsdp")))
  }
  wrong_tree = {"v": NamedSharding(mesh, P())}
  with pytest.raises(
      ValueError, match="param_shardings does not match the params"
  ):
    tx = om.scale_by_muon(param_shardings=wrong_tree)
    tx.update(params, tx.init(params))
  disagree = {"w": NamedSharding(mesh, P(None, "fsdp"))}
  tx = om.scale_by_muon(param_shardings=disagree)
  with (
      jax.set_mesh(mesh),
      pytest.raises(ValueError, match="w: param_shardings says"),
  ):
    jax.jit(tx.update)(params, tx.init(params))
  uneven = {"w": jnp.ones((12, 8))}
  tx = om.scale_by_muon(param_shardings={"w": NamedSharding(mesh, P("fsdp"))})
  with pytest.raises(
      ValueError, match="w: dimension 0 of size 12 does not divide evenly"
  ):
    jax.jit(tx.update)(uneven, tx.init(uneven))
  with pytest.raises(
      ValueError, match="sharding must be an optax_muon.ShardingOptions"
  ):
    om.muon(0.1, sharding={"exchange": "combined"})


def _shard_map_steps(tx, mesh, specs, shardings, params, grads):
  """``tx.update`` inside the user's own jitted ``shard_map``, one step per
  gradient."""
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  sharded = put(params)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
  state_specs = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, state)

  @jax.jit
  def step(grads, state, params):
    return jax.shard_map(
        tx.update,
        mesh=mesh,
        in_specs=(specs, state_specs, specs),
        out_specs=(specs, state_specs),
    )(grads, state, params)

  with jax.set_mesh(mesh):
    for g in grads:
      updates, state = step(put(g), state, sharded)
  return updates, state


@pytest.mark.parametrize("stages", [1, 3])
def test_shard_map_train_step_matches_pjit(stages, case_reference):
  """The optimizer inside the user's shard_map: local blocks in, collectives by
  axis name; in one stage, and in a loop of stages."""
  params, _ = case_tree(False)
  grads = case_grads(params)
  reference, _ = case_reference(False)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  specs = fsdp_specs(params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  tx = om.muon(
      0.1,
      ns_options=STANDARD,
      param_shardings=shardings,
      sharding=om.ShardingOptions(exchange_stages=stages),
  )
  updates, state = _shard_map_steps(tx, mesh, specs, shardings, params, grads)
  compare(updates, reference)


def test_shard_map_without_param_shardings_is_an_error():
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  params = {
      "w": jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("fsdp")))
  }
  tx = om.scale_by_muon()
  with jax.set_mesh(mesh):
    state = tx.init(params)
    state_specs = om.MuonState(P(), {"w": P("fsdp")}, P())
    run = jax.shard_map(
        lambda g, s: tx.update(g, s),
        mesh=mesh,
        in_specs=({"w": P("fsdp")}, state_specs),
        out_specs=({"w": P("fsdp")}, state_specs),
    )
    with pytest.raises(
        ValueError, match="inside shard_map the leaves are local blocks"
    ):
      jax.jit(run)(params, state)


def test_summary_reports_the_plan():
  params = gpt_tree(32, 3)
  mesh = make_mesh((8,), ("fsdp",), AxisType.Explicit)
  sharded = jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
      params,
      fsdp_specs(params),
  )
  summary = om.summarize(sharded, standard_muon())
  rows = {r.path: r for r in summary.rows}
  assert "all-to-all over fsdp" in rows["blocks/0/q"].placement
  # 3 layers: 12 square matrices (c = 1 unit) and 6 (d, 4d) ones (3 units) over
  # 8 devices, 3.75 units each at best: six devices take one wide and one square
  # matrix, two take 3 square ones (two patterns). The uniform plan ran 2 square
  # + 1 wide slots everywhere (5 units).
  assert (
      "12 matrices, 1–3 whole per worker of 8" in rows["blocks/0/q"].placement
  )
  assert (
      "6 matrices, 0–1 whole per worker of 8"
      in rows["blocks/0/mlp_in"].placement
  )
  unit = ns_flops(32, 32, 5)
  assert (
      sorted(summary.plan.device_ns_flops().tolist())
      == [3 * unit] * 2 + [4 * unit] * 6
  )
  assert (
      summary.plan.critical_ns_flops() / summary.plan.ns_flops_bound()
      == 16 / 15
  )
  assert "GFLOP on the busiest device" in str(summary)


def _layouts_and_shardings(mesh, leaves):
  """(layouts, shardings) of ``leaves``: (shape, PartitionSpec, dimension
  numbers or None)."""
  layouts = [
      make_layout(f"w{i}", jax.ShapeDtypeStruct(shape, jnp.float32), dims)
      for i, (shape, _, dims) in enumerate(leaves)
  ]
  shardings = [
      LeafSharding(mesh, dim_axes_of(spec, len(shape)))
      for shape, spec, _ in leaves
  ]
  return layouts, shardings


def _plan(mesh_shape, names, leaves, **kw):
  mesh = jax.sharding.AbstractMesh(mesh_shape, names)
  layouts, shardings = _layouts_and_shardings(mesh, leaves)
  return build_plan(layouts, shardings, ns_cost, **kw)


def _owned_once(plan):
  for group in plan.groups:
    for ex in group.exchanges:
      for k, b in enumerate(ex.buckets):
        owned = sorted(j for mine in ex.owned for j in mine[k])
        assert owned == list(range(b.matrices))


@pytest.mark.parametrize("devices", [8, 16, 64])
@pytest.mark.parametrize("layers", [1, 3, 5, 16])
def test_assignment_balances_odd_mixes(devices, layers):
  """GQA + SwiGLU shapes (d × d, d × d/4, d × 2.75d) on FSDP: the busiest device
  within 1.1× the lower bound where a whole-matrix placement can reach it (else
  within 1.05× plain LPT), the busiest owner's bytes within 1.45× the byte bound
  where equal chunks can reach it, few distinct programs."""
  d, f = 256, 704
  shapes = [(d, d), (d, d // 4), (d, d // 4), (d, d), (d, f), (d, f), (f, d)]
  leaves = [
      ((layers, *s), P(None, "fsdp", None), om.MuonDimensionNumbers(1, 2))
      for s in shapes
  ]
  plan = _plan((devices,), ("fsdp",), leaves)
  _owned_once(plan)
  lpt = _plan((devices,), ("fsdp",), leaves, weigh_bytes=False)
  bound = plan.ns_flops_bound()
  assert (
      plan.critical_ns_flops() <= 1.1 * bound
      or plan.critical_ns_flops() <= 1.05 * lpt.critical_ns_flops()
  )
  (group,) = plan.groups
  (ex,) = group.exchanges
  sizes = [layers * math.prod(s) for s in shapes]
  total, biggest = sum(sizes), max(math.prod(s) for s in shapes)
  n = devices
  byte_bound = max(
      2 * (n - 1) / n**2 * total, (n - 1) / n * biggest + (n - 1) / n**2 * total
  )
  received = 2 * (n - 1) * ex.chunk(n)  # elements, both ways
  # Equal chunks: no placement does better than the biggest matrix or the fair
  # share in the busiest chunk (1 layer on 16 or 64 devices: the biggest matrix
  # is 2.6× the fair share).
  best_chunks = 2 * (n - 1) / n * max(biggest, total / n)
  assert received <= max(1.45 * byte_bound, 1.05 * best_chunks)
  assert len(ex.programs) <= 8


def test_assignment_three_layers_on_eight_devices():
  """12 square and 6 wide matrices: the uniform plan's 1.33× becomes 16/15."""
  d = 64
  leaves = [((d, d), P("fsdp"), None)] * 12 + [
      ((d, 4 * d), P("fsdp"), None)
  ] * 6
  plan = _plan((8,), ("fsdp",), leaves)
  assert plan.critical_ns_flops() / plan.ns_flops_bound() == 16 / 15
  _owned_once(plan)


def test_assignment_uses_few_programs_where_that_is_free():
  """12 layers of GQA + SwiGLU on 64 devices: 36 (d, f) matrices, 24 d × d and
  24 d × d/4. One wide matrix is the bound, so 36 workers own one each (two
  programs: gate/up and down fit together differently), 12 own two d × d and two
  d × d/4, 16 idle: four programs, at the bound, with the busiest owner's chunk
  one wide matrix."""
  d, f, layers = 256, 704, 12
  shapes = [(d, d), (d, d // 4), (d, d // 4), (d, d), (d, f), (d, f), (f, d)]
  leaves = [
      ((layers, *s), P(None, "fsdp", None), om.MuonDimensionNumbers(1, 2))
      for s in shapes
  ]
  plan = _plan((64,), ("fsdp",), leaves)
  _owned_once(plan)
  (group,) = plan.groups
  (ex,) = group.exchanges
  assert len(ex.programs) == 4
  assert plan.critical_ns_flops() == plan.ns_flops_bound()
  assert ex.chunk(64) == d * f // 64
  counts = sorted(tuple(len(m) for m in mine) for mine in ex.owned)
  by_bucket = {b.shape: k for k, b in enumerate(ex.buckets)}
  wide, square, narrow = (
      by_bucket[(d, f)],
      by_bucket[(d, d)],
      by_bucket[(d // 4, d)],
  )
  assert sum(c[wide] == 1 and sum(c) == 1 for c in counts) == 36
  assert (
      sum(c[square] == 2 and c[narrow] == 2 and sum(c) == 4 for c in counts)
      == 12
  )
  assert sum(sum(c) == 0 for c in counts) == 16


def test_assignment_balances_across_groups():
  """MoE: attention FSDP over expert × fsdp (one group), experts on expert ×
  fsdp (another). A device's load sums over both groups: the attention matrices
  go to the devices whose fsdp coordinate owns fewer experts."""
  d = 128
  attention = [
      (
          (1, d, d),
          P(None, ("expert", "fsdp"), None),
          om.MuonDimensionNumbers(1, 2),
      )
  ] * 2
  kv = [
      (
          (1, d, d // 4),
          P(None, ("expert", "fsdp"), None),
          om.MuonDimensionNumbers(1, 2),
      )
  ] * 2
  # 4 experts, one per expert coordinate; gate, up, down: 3 matrices over 2 fsdp
  # devices.
  expert = [
      (
          (1, 4, d, 2 * d),
          P(None, "expert", "fsdp", None),
          om.MuonDimensionNumbers(2, 3),
      )
  ] * 3
  plan = _plan((4, 2), ("expert", "fsdp"), attention + kv + expert)
  _owned_once(plan)
  assert len(plan.groups) == 2
  loads = plan.device_ns_flops()
  c_expert, c_attention = ns_flops(d, 2 * d, 5), ns_flops(d, d, 5)
  assert loads.max() == 2 * c_expert  # not 2 · c_expert + c_attention
  per_group = sum(
      max(ex.program_flops()) for g in plan.groups for ex in g.exchanges
  )
  assert per_group == 2 * c_expert + c_attention


def test_assignment_bucket_exchange_spreads_each_bucket():
  leaves = [((64, 64), P("fsdp"), None)] * 12 + [
      ((64, 256), P("fsdp"), None)
  ] * 6
  plan = _plan(
      (8,), ("fsdp",), leaves, options=om.ShardingOptions(exchange="per_shape")
  )
  (group,) = plan.groups
  assert len(group.exchanges) == 2
  for ex in group.exchanges:
    (b,) = ex.buckets
    assert max(len(mine[0]) for mine in ex.owned) == -(-b.matrices // 8)


def test_unsharded_leaves_are_the_trivial_plan():
  layouts = [
      make_layout(
          "a",
          jax.ShapeDtypeStruct((3, 16, 32), jnp.float32),
          om.MuonDimensionNumbers(1, 2),
      ),
      make_layout("b", jax.ShapeDtypeStruct((32, 16), jnp.float32), None),
  ]
  plan = build_plan(layouts, [None, None], ns_cost)
  assert plan.mesh_shape == () and not plan.sharded
  (group,) = plan.groups
  assert group.workers == 1 and [b.matrices for b in group.buckets] == [4]
  assert plan.critical_ns_flops() == 4 * ns_flops(16, 32, 5)


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["GQA+SwiGLU", "MoE"])
def test_floors_at_scale_trees_on_eight_devices(tree):
  """The benchmark's GQA + SwiGLU and MoE trees (small) on 8 devices, read off
  the HLO: NS FLOPs, received bytes, temp memory within the floors; each
  device's compiled NS FLOPs are the plan's; the MoE update equals the
  single-device one."""
  name, params, dims, _ = next(
      t for t in sharding.trees(quick=True) if t[0].startswith(tree)
  )
  mesh, specs_fn, _ = sharding.mesh_for(name, 8)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs_fn(params))
  tx = standard_muon(dims, param_shardings=shardings)
  compiled, _, sharded = sharding.compile_update(tx, params, shardings, mesh)
  cost = hlo_cost.analyze(compiled, 8)
  plan = om.summarize(sharded, tx).plan
  per_device = compiled_device_flops(cost, plan)
  np.testing.assert_array_equal(per_device, plan.device_ns_flops())
  bound = sharding.bounds(params, dims, 8)
  lpt = sharding.lpt_plan(plan)
  assert (
      per_device.max() <= 1.1 * bound["flops"]
      or per_device.max() <= 1.05 * lpt.critical_ns_flops()
  )
  assert cost.received_bytes == plan.device_received_bytes().max()
  assert cost.received_bytes <= 1.45 * bound["bytes"]
  assert plan.device_received_bytes(ragged=True).max() <= cost.received_bytes
  param_bytes = sum(
      x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(sharded)
  )
  assert cost.temp_bytes <= 3 * (param_bytes + bound["fair bytes"])
  assert cost.collectives_in_loops == 0
  if tree == "MoE":
    grads = [random_like(params, 10 + t) for t in range(2)]
    reference = single_device(params, grads, dims)
    put = lambda t: jax.tree.map(jax.device_put, t, shardings)
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(sharded)
      for t in range(2):
        updates, state = jax.jit(tx.update)(put(grads[t]), state, sharded)
    compare(updates, reference)


def _moment_spec(param_spec, input_axis, ndim):
  """The params' spec with the input axis replicated: NorMuon's state."""
  axes = dim_axes_of(param_spec, ndim)
  return P(
      *[
          None if d == input_axis or not a else a[0] if len(a) == 1 else a
          for d, a in enumerate(axes)
      ]
  )


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,axis_type",
    [
        ("fsdp8", AxisType.Explicit),
        ("fsdp4xtp2", AxisType.Auto),
        ("fsdp8-stacked-matrix-axis", AxisType.Auto),
    ],
)
def test_normuon_and_cautious_decay_sharded_equal_single_device(
    case, axis_type, case_reference
):
  """Updates and NorMuon's state equal the single-device ones; the state is
  sharded like the params' output axes; NorMuon adds only small all-reduces (no
  gather)."""
  shape, names, kind, specs_fn, policy = CASES[case]
  params, dims = case_tree(kind)
  grads = case_grads(params)
  reference, state1 = case_reference(kind, variants=True)

  mesh = make_mesh(shape, names, axis_type)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs_fn(params))
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  explicit = axis_type == AxisType.Explicit
  sharded_params = put(params)
  compiled = {}
  for name, variants in (("plain", {}), ("variants", VARIANTS)):
    tx = standard_muon(
        dims,
        policy,
        param_shardings=None if explicit else shardings,
        **variants,
    )
    with jax.set_mesh(mesh):
      state = jax.jit(tx.init)(sharded_params)
      update = jax.jit(tx.update)
      for t in range(2):
        updates, state = update(put(grads[t]), state, sharded_params)
      compiled[name] = hlo_cost.analyze(
          update.lower(put(grads[0]), state, sharded_params).compile(), 8
      )
  compare(updates, reference)
  nu, nu1 = (s.inner_states["muon"].inner_state[0].nu for s in (state, state1))
  compare(nu, nu1)

  flat_specs = {
      jax.tree_util.keystr(p, simple=True, separator="/"): s
      for p, s in jax.tree_util.tree_leaves_with_path(specs_fn(params))
  }
  assert len(jax.tree.leaves(nu)) == len(
      om.summarize(params, tx).by_optimizer("muon")
  )
  for path, v in jax.tree_util.tree_leaves_with_path(nu):
    key = jax.tree_util.keystr(path, simple=True, separator="/")
    input_axis = 1 if v.ndim == 3 else 0  # stacked leaves: DN(1, 2)
    assert v.shape[input_axis] == 1
    want = NamedSharding(
        mesh, _moment_spec(flat_specs[key], input_axis, v.ndim)
    )
    assert v.sharding.is_equivalent_to(want, v.ndim), key
  plain, variants = compiled["plain"], compiled["variants"]
  assert (
      variants.dot_flops == plain.dot_flops
      and variants.collectives_in_loops == 0
  )
  moving = lambda cost: sorted(
      (c.kind, c.output_bytes)
      for c in cost.collectives
      if c.kind != "all-reduce"
  )
  assert moving(variants) == moving(plain)  # no gather beyond NS's own exchange


@pytest.mark.slow
def test_normuon_and_cautious_decay_in_shard_map_match_single_device(
    case_reference,
):
  """Inside the user's shard_map (FSDP × TP: input and output axes split): psums
  complete NorMuon's sums; equal to the single-device result."""
  params, _ = case_tree(False)
  grads = case_grads(params)
  reference, state1 = case_reference(False, variants=True)
  mesh = make_mesh((4, 2), ("fsdp", "tp"), AxisType.Explicit)
  specs = megatron_specs(params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  tx = standard_muon(param_shardings=shardings, **VARIANTS)
  updates, state = _shard_map_steps(tx, mesh, specs, shardings, params, grads)
  compare(updates, reference)
  compare(
      state.inner_states["muon"].inner_state[0].nu,
      state1.inner_states["muon"].inner_state[0].nu,
  )


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_normuon_state_sharded_at_init_eager_and_abstract(axis_type):
  """Eager init on sharded arrays, on ShapeDtypeStructs, and eval_shape (for
  checkpoint restore targets) all give NorMuon's state the params' output-axis
  sharding."""
  mesh = make_mesh((4, 2), ("fsdp", "tp"), axis_type)
  sharding = NamedSharding(mesh, P("fsdp", "tp"))
  params = {"w": jax.device_put(jnp.ones((16, 8)), sharding)}
  structs = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=sharding)}
  tx = om.scale_by_muon(normalization=om.NorMuon())
  want = NamedSharding(mesh, P(None, "tp"))
  with warnings.catch_warnings(
      record=True
  ) as caught:  # Auto without param_shardings
    warnings.simplefilter("always")
    states = (tx.init(params), tx.init(structs))
  assert len(caught) == (axis_type == AxisType.Auto), [
      str(w.message) for w in caught
  ]
  for state in states:
    assert state.nu["w"].shape == (1, 8) and state.nu[
        "w"
    ].sharding.is_equivalent_to(want, 2)
  if axis_type == AxisType.Explicit:
    abstract = jax.eval_shape(tx.init, structs).nu["w"]
    assert abstract.shape == (1, 8) and abstract.sharding.spec == P(None, "tp")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_jitted_init_places_the_state_like_the_params(axis_type):
  """A jitted init gives Muon's momentum and AdamW's moments their params'
  shardings (on an Auto mesh the compiler would otherwise replicate the zeros),
  and leaves the rest alone."""
  params = gpt_tree(32, 2)
  mesh = make_mesh((8,), ("fsdp",), axis_type)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), fsdp_specs(params))
  sharded = jax.tree.map(jax.device_put, params, shardings)
  tx = om.muon(0.1, param_shardings=shardings, normalization=om.NorMuon())
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
  flat = dict(jax.tree_util.tree_flatten_with_path(shardings)[0])
  shapes = dict(
      (p, x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
  )
  placed = 0
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    param = next((p for p in flat if path[-len(p) :] == p), None)
    if param is None or x.shape != shapes[param]:
      continue
    assert x.sharding.is_equivalent_to(flat[param], x.ndim), (
        jax.tree_util.keystr(path),
        x.sharding,
    )
    placed += 1
  # One momentum per Muon leaf, mu and nu per AdamW leaf.
  rows = om.summarize(sharded, tx).rows
  muon = sum(r.optimizer == "muon" for r in rows)
  assert muon == 12 and placed == muon + 2 * (len(rows) - muon)
