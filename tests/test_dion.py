"""Dion: converges to Muon's direction at full rank, finite on degenerate
gradients, routed like ``muon``, and on 8 virtual devices equal to the
single-device update with only small collectives in the compiled program."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import hlo_cost
import optax_muon as om
from optax_muon._src.core.scaling import scale_factor
from helpers import (
    matrix_with_spectrum,
    normal,
    random_like,
    rel_err,
    singular_values,
)
from optax_muon._src.core.spec import TreeOptions, tree_spec
from optax_muon._src.dion import orthonormalization
from optax_muon._src.dion import settings as dion_settings
from optax_muon._src.dion.matrix import rank_of
from optax_muon._src.core.matrices import make_layout
from trees import gpt_tree, muon_dims

DN = om.MuonDimensionNumbers
MATRICES = ("q", "k", "v", "o", "mlp_in", "mlp_out")


def _run(tx, params, grads, steps=None):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps or len(grads)):
    updates, state = update(grads[t % len(grads)], state, params)
  return updates, state


def _dion_state(state):
  return state.inner_states["muon"].inner_state[0]


# ----------------------------------------------------------------------------
# the algorithm


def test_full_rank_converges_to_svd_polar_factor():
  """Fed one gradient (distinct singular values 0.8ᵏ) for 50 steps at rank
  fraction 1, the direction is U·Vᵀ of a float64 SVD to 1e-3, its singular
  values within 1e-3 of 1: tall, wide and stacked (3 matrices along a batch
  axis) leaves, float32."""
  rng = np.random.default_rng(0)
  spectrum = lambda k: 0.8 ** np.arange(k)
  params = {
      "tall": np.zeros((24, 16)),
      "wide": np.zeros((16, 40)),
      "stack": np.zeros((3, 12, 20)),
  }
  grads = {
      "tall": matrix_with_spectrum(rng, 24, 16, spectrum(16)),
      "wide": matrix_with_spectrum(rng, 16, 40, spectrum(16)),
      "stack": np.stack(
          [matrix_with_spectrum(rng, 12, 20, spectrum(12)) for _ in range(3)]
      ),
  }
  tx = om.scale_by_dion(
      1.0,
      weight_dimension_numbers={"tall": None, "wide": None, "stack": DN(1, 2)},
  )
  f32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)
  updates, _ = _run(tx, f32(params), [f32(grads)], steps=50)
  for name, g in grads.items():
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    polar = u @ vt
    out = np.asarray(updates[name], np.float64)
    assert np.max(np.abs(out - polar)) < 1e-3, name
    s = singular_values(out)
    assert np.all(np.abs(s - 1) < 1e-3), (name, s.min(), s.max())


@pytest.mark.parametrize(
    "fraction,iterations",
    [
        pytest.param(1.0, 1, marks=pytest.mark.slow),
        (0.5, 1),
        pytest.param(0.125, 1, marks=pytest.mark.slow),
        (0.5, 2),
    ],
)
def test_matches_a_float64_reference_of_the_algorithm(fraction, iterations):
  """20 steps of ``scale_by_dion`` (float32, randomized Cholesky-QR at rank < 1)
  on drifting gradients equal the algorithm written out in float64 NumPy with
  Householder QR, from the same initial Q: both orthonormalizations are P·T with
  T upper triangular, so they agree up to column signs, which the update and the
  buffer do not see. ``iterations``: power iterations per step."""
  rng = np.random.default_rng(0)
  m, n, beta = 32, 64, 0.9
  tx = om.scale_by_dion(fraction, beta=beta, power_iterations=iterations)
  state = tx.init({"w": jnp.zeros((m, n))})
  q = np.asarray(state.q["w"], np.float64)  # n × r: the long side
  buffer, base = np.zeros((m, n)), rng.standard_normal((m, n))
  update = jax.jit(tx.update)
  for _ in range(20):
    g = base + 0.3 * rng.standard_normal((m, n))
    got, state = update({"w": jnp.asarray(g, jnp.float32)}, state)
    momentum, r = buffer + g, q
    for _ in range(iterations):
      p, _ = np.linalg.qr(momentum @ r)
      r = momentum.T @ p
    buffer = momentum - (1 - beta) * p @ r.T
    q = r / np.linalg.norm(r, axis=0, keepdims=True)
    want = p @ q.T
    assert np.max(np.abs(np.asarray(got["w"]) - want)) < 5e-4 * np.max(
        np.abs(want)
    )


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_degenerate_gradients_give_finite_updates(fraction):
  """Gradients of rank below r (all zeros, one nonzero row, rank 2 with r ≥ 8)
  give finite updates and state, Q keeps unit columns, and a zero gradient gives
  a zero update."""
  rng = np.random.default_rng(1)
  m, n = 32, 16
  one_row = np.zeros((m, n))
  one_row[5] = rng.standard_normal(n)
  grads = {
      "zeros": np.zeros((m, n)),
      "one_row": one_row,
      "rank_2": rng.standard_normal((m, 2)) @ rng.standard_normal((2, n)),
  }
  grads = {k: jnp.asarray(g, jnp.float32) for k, g in grads.items()}
  tx = om.scale_by_dion(fraction)
  updates, state = _run(
      tx, jax.tree.map(jnp.zeros_like, grads), [grads], steps=4
  )
  for path, x in _by_path((updates, state)).items():
    assert np.all(np.isfinite(x)), path
  for kind, q in state.q.items():
    np.testing.assert_allclose(
        np.linalg.norm(q, axis=0), 1.0, atol=1e-5, err_msg=kind
    )
  assert not np.any(updates["zeros"])
  assert (
      np.max(np.abs(updates["one_row"])) > 0
      and np.max(np.abs(updates["rank_2"])) > 0
  )


def test_rank_and_state():
  """Ranks: ceil(fraction · min(m, n)); Q is (batch…, n, r) on the long side;
  state in float32 for bfloat16 params; per-leaf fractions as a tree or a
  callable."""
  params = {
      "a": jnp.zeros((64, 16), jnp.bfloat16),
      "b": jnp.zeros((4, 8, 48)),
      "c": jnp.zeros((10, 30)),
  }
  dims = {"a": None, "b": DN(1, 2), "c": None}
  fractions = {"a": 0.25, "b": 1.0, "c": 1 / 3}
  for fraction in (fractions, lambda p: fractions):
    state = om.scale_by_dion(fraction, weight_dimension_numbers=dims).init(
        params
    )
    assert state.q["a"].shape == (64, 4) and state.q["a"].dtype == jnp.float32
    assert state.momentum["a"].dtype == jnp.float32
    assert state.q["b"].shape == (4, 48, 8)
    assert state.q["c"].shape == (30, 4)  # ceil(10 / 3)
  layout = make_layout("w", jax.ShapeDtypeStruct((100, 7), jnp.float32), None)
  assert [rank_of(f, layout) for f in (1e-3, 0.5, 1.0)] == [1, 4, 7]


def test_bad_inputs():
  with pytest.raises(ValueError, match="rank_fraction"):
    om.scale_by_dion(0.0)
  with pytest.raises(ValueError, match="rank_fraction"):
    om.dion(0.1, rank_fraction=1.5)
  with pytest.raises(ValueError, match="beta"):
    om.dion(0.1, beta=1.0)
  params = {"blocks": {"w": jnp.zeros((8, 8)), "v": jnp.zeros((8, 8))}}
  with pytest.raises(ValueError, match="blocks/v: rank_fraction"):
    om.scale_by_dion({"blocks": {"w": 0.5, "v": 2.0}}).init(params)
  complex_params = {
      "blocks": {"w": jnp.zeros((8, 8)), "z": jnp.zeros((8, 8), jnp.complex64)}
  }
  with pytest.raises(ValueError, match="blocks/z: Dion takes real matrices"):
    om.scale_by_dion().init(complex_params)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
  tx = om.scale_by_dion()
  with pytest.raises(
      ValueError, match="inside shard_map the leaves are local blocks"
  ):
    jax.shard_map(
        lambda w: tx.init({"w": w}).q["w"],
        mesh=mesh,
        in_specs=P("fsdp"),
        out_specs=P(),
    )(jax.device_put(jnp.zeros((16, 8)), NamedSharding(mesh, P("fsdp"))))
  with pytest.raises(ValueError, match="blocks/z: Dion takes real matrices"):
    om.dion(
        0.1, routing=om.Routing(labels={"blocks": {"w": "muon", "z": "muon"}})
    ).init(complex_params)


def _by_path(tree):
  return {
      jax.tree_util.keystr(p, simple=True, separator="/"): x
      for p, x in jax.tree_util.tree_leaves_with_path(tree)
  }


def test_dion_is_muon_with_another_direction():
  """``dion`` routes like ``muon``: its matrix updates are −η·(scale(n_in,
  n_out)· ``scale_by_dion``'s direction + λ·W), the embedding, head and vectors
  get NAdamW's."""
  params = gpt_tree(8, 1, vocab=32)
  grads = [random_like(params, s) for s in (1, 2)]
  tx = om.dion(
      0.02,
      rank_fraction=0.5,
      weight_decay=0.1,
      adam_learning_rate=3e-3,
      adam_weight_decay=0.01,
  )
  updates, _ = _run(tx, params, grads)
  block = lambda tree: {k: tree["blocks"]["0"][k] for k in MATRICES}
  expected, _ = _run(
      om.scale_by_dion(0.5), block(params), [block(g) for g in grads]
  )
  adamw = optax.adamw(3e-3, weight_decay=0.01, nesterov=True)
  adam_updates, _ = _run(adamw, params, grads)
  got, adam_got = _by_path(updates), _by_path(adam_updates)
  for path, u in got.items():
    name = path.split("/")[-1]
    if name in MATRICES:
      w = params["blocks"]["0"][name]
      want = -0.02 * (
          scale_factor(*w.shape, "jordan") * expected[name] + 0.1 * w
      )
      assert rel_err(u, want) < 1e-5, path
    else:
      assert rel_err(u, adam_got[path]) < 1e-6, path


@pytest.mark.slow
def test_dion_and_muon_update_the_adamw_leaves_alike():
  params = gpt_tree(16, 1)
  grads = [random_like(params, s) for s in (1, 2)]
  kw = dict(
      weight_decay=0.1,
      adam_learning_rate=3e-3,
      adam_weight_decay=0.01,
      adam_weight_decay_mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p),
  )
  dion_got = _by_path(_run(om.dion(0.02, 0.25, **kw), params, grads)[0])
  muon_got = _by_path(_run(om.muon(0.02, **kw), params, grads)[0])
  adam_leaves = [p for p in dion_got if p.split("/")[-1] not in MATRICES]
  assert len(adam_leaves) == 6
  for path in adam_leaves:
    np.testing.assert_array_equal(dion_got[path], muon_got[path], err_msg=path)


# ------------------------------------------------------------------------------- sharded

D = 32


def _fsdp_specs(params):
  return jax.tree.map(
      lambda x: P("fsdp") if x.shape[0] % 8 == 0 else P(), params
  )


def _megatron_specs(params):
  """FSDP × TP: column-parallel (q, k, v, mlp_in) P(fsdp, tp), row-parallel
  P(tp, fsdp)."""

  def spec(path, x):
    if x.ndim == 1:
      return P()
    return (
        P("tp", "fsdp") if path[-1].key in ("o", "mlp_out") else P("fsdp", "tp")
    )

  return jax.tree_util.tree_map_with_path(spec, params)


def _stacked_specs(params):
  """Stacked layers split over fsdp along the layer axis, the rest
  replicated."""
  return jax.tree.map(lambda x: P("fsdp") if x.ndim == 3 else P(), params)


CASES = {
    # name: (mesh shape, axis names, layers (stacked: True, 8 layers), specs);
    # "fsdp8" keeps one layer's q, mlp_in and mlp_out (square, wide, tall) to
    # compile fast.
    "fsdp8": ((8,), ("fsdp",), 1, _fsdp_specs),
    "fsdp8-2-layers": ((8,), ("fsdp",), 2, _fsdp_specs),
    "fsdp4xtp2": ((4, 2), ("fsdp", "tp"), 2, _megatron_specs),
    "fsdp8-stacked-layer-axis": ((8,), ("fsdp",), True, _stacked_specs),
}


def _sharded_run(case, axis_type, fraction, steps=2, reference=True):
  """(updates, state, compiled update, sharded params, shardings) for ``case``,
  and the single-device updates (None unless ``reference``)."""
  shape, names, layers, specs_fn = CASES[case]
  stacked = layers is True
  params = gpt_tree(D, 8 if stacked else layers, stacked=stacked)
  if case == "fsdp8":
    params["blocks"]["0"] = {
        k: v
        for k, v in params["blocks"]["0"].items()
        if k not in ("k", "v", "o")
    }
  dims = muon_dims(params, adam=("embed", "lm_head")) if stacked else None
  grads = [random_like(params, 10 + t) for t in range(steps)]
  if reference:
    reference, _ = _run(
        om.dion(
            0.1, rank_fraction=fraction, muon_weight_dimension_numbers=dims
        ),
        params,
        grads,
    )
  else:
    reference = None
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs_fn(params))
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  explicit = axis_type == AxisType.Explicit
  tx = om.dion(
      0.1,
      rank_fraction=fraction,
      muon_weight_dimension_numbers=dims,
      param_shardings=None if explicit else shardings,
  )
  sharded_params = put(params)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded_params)
    update = (
        jax.jit(tx.update).lower(put(grads[0]), state, sharded_params).compile()
    )
    for t in range(steps):
      updates, state = update(put(grads[t]), state, sharded_params)
  return updates, state, update, sharded_params, shardings, reference


@pytest.mark.parametrize(
    "case,axis_type",
    [
        ("fsdp8", AxisType.Explicit),
        pytest.param("fsdp4xtp2", AxisType.Explicit, marks=pytest.mark.slow),
        pytest.param("fsdp8-2-layers", AxisType.Auto, marks=pytest.mark.slow),
        pytest.param(
            "fsdp8-stacked-layer-axis",
            AxisType.Explicit,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_sharded_equals_single_device(case, axis_type):
  """``dion`` on a GPT-like tree at rank fraction 1/2: equal to one device
  (1e-5, f32), updates and the buffer B sharded like the params, Q like the
  param's long side (replicated elsewhere); the compiled update's collectives as
  in ``test_compiled_collectives_are_small``."""
  updates, state, compiled, params, shardings, reference = _sharded_run(
      case, axis_type, 0.5
  )
  got, want = _by_path(updates), _by_path(reference)
  for path, u in got.items():
    assert rel_err(u, want[path]) < 1e-5, path
  placed = _by_path(shardings)
  for path, u in got.items():
    assert u.sharding.is_equivalent_to(placed[path], u.ndim), path
  dion_state = _dion_state(state)
  buffers, factors = _by_path(dion_state.momentum), _by_path(dion_state.q)
  shapes = {path: x.shape for path, x in _by_path(params).items()}
  assert set(factors) == {p for p in shapes if p.split("/")[-1] in MATRICES}
  for path, q in factors.items():
    assert buffers[path].sharding.is_equivalent_to(
        placed[path], len(shapes[path])
    ), path
    # Q: (batch…, long side, r): the param's batch axes; on the long side its
    # own axes, then the short side's where they split it evenly; r unsharded.
    shape = shapes[path]
    long_axis = len(shape) - 2 if shape[-2] > shape[-1] else len(shape) - 1
    short_axis = 2 * len(shape) - 3 - long_axis
    entries = tuple(placed[path].spec) + (None,) * len(shape)
    names = lambda e: () if e is None else (e,) if isinstance(e, str) else e
    shards = lambda axes, mesh=placed[path].mesh: math.prod(
        mesh.shape[a] for a in axes
    )
    side, short = names(entries[long_axis]), names(entries[short_axis])
    if short and (shape[long_axis] // shards(side)) % shards(short) == 0:
      side = side + short
    want_q = P(*entries[: len(shape) - 2], side or None, None)
    assert q.sharding.is_equivalent_to(
        NamedSharding(placed[path].mesh, want_q), q.ndim
    ), (path, want_q)
  _check_collectives(
      compiled,
      params,
      0.5,
      muon_dims(params, adam=("embed", "lm_head"))
      if case == "fsdp8-stacked-layer-axis"
      else None,
      shardings,
  )


def _algorithm_bytes(params, fraction, itemsize=4):
  """Σ over the matrices of (m + n)·r·itemsize, and the smallest (m + n)·r."""
  total, smallest = 0, math.inf
  for x in jax.tree.leaves(params):
    if x.ndim != 2 or x.shape in (
        (256, D),
        (D, 256),
    ):  # embedding and head: AdamW
      continue
    layout = make_layout("w", x, None)
    elements = (layout.n_in + layout.n_out) * rank_of(fraction, layout)
    total, smallest = total + elements * itemsize, min(smallest, elements)
  return total, smallest


def _check_collectives(compiled, params, fraction, dims=None, shardings=None):
  """The compiled step's collectives: none inside a loop; the bytes a device
  receives exactly those ``summarize`` models (ring model); at most 1.5 × Σ (m
  + n)·r·4 (Σ over the Muon matrices); and the only all-to-alls carry P's m × r
  values, there and back (Dion never moves a matrix)."""
  cost = hlo_cost.analyze(compiled, 8)
  bound, _ = _algorithm_bytes(params, fraction)
  assert cost.collectives_in_loops == 0
  summary = om.summarize(
      params,
      om.dion(
          0.1,
          rank_fraction=fraction,
          muon_weight_dimension_numbers=dims,
          param_shardings=shardings,
      ),
  )
  modelled = sum(r.received_bytes for r in summary.by_optimizer("muon"))
  assert cost.received_bytes == pytest.approx(modelled, rel=1e-6)
  assert cost.received_bytes <= 1.5 * bound, (cost.received_bytes, bound)
  exchanged = sum(
      c.received_bytes for c in cost.collectives if c.kind == "all-to-all"
  )
  assert exchanged <= 2 * 4 * _factor_elements(params, fraction, "m")


def _factor_elements(params, fraction, side):
  """Σ over the Muon matrices of m·r (``side`` "m") or n·r."""
  total = 0
  for x in jax.tree.leaves(params):
    if x.ndim < 2 or x.shape[-2:] in ((256, D), (D, 256)):
      continue
    layout = make_layout("w", jax.ShapeDtypeStruct(x.shape[-2:], x.dtype), None)
    m, n = layout.ns_shape
    batch = math.prod(x.shape[:-2])
    total += batch * (m if side == "m" else n) * rank_of(fraction, layout)
  return total


@pytest.mark.slow
def test_buckets_deal_many_matrices_round_the_devices():
  """Stacked leaves of three shapes on FSDP 4: P's rows split (a), or whole
  and their sums reduce-scattered over the column axis (b, c); 18 matrices
  dealt round 4 devices, 5 slots each, padded to c's 40 rows, in one
  Cholesky-QR. Equal to one device (1e-5, f32, two steps) and the compiled
  update receives the modelled bytes."""
  mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(AxisType.Explicit,))
  shapes = {"a": (6, 32, 64), "b": (5, 64, 32), "c": (7, 40, 48)}
  fractions = {"a": 0.5, "b": 0.5, "c": 0.4}  # r = 16 for all
  specs = {
      "a": P(None, "fsdp"),
      "b": P(None, "fsdp"),
      "c": P(None, None, "fsdp"),
  }
  dims = {k: om.MuonDimensionNumbers(1, 2) for k in shapes}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  grads = [random_like(params, 20 + t) for t in range(2)]
  kw = dict(rank_fraction=fractions, weight_dimension_numbers=dims)
  want, _ = _run(om.scale_by_dion(**kw), params, grads)
  put = lambda tree: {
      k: jax.device_put(x, NamedSharding(mesh, specs[k]))
      for k, x in tree.items()
  }
  tx = om.scale_by_dion(**kw)
  with jax.set_mesh(mesh):
    options = TreeOptions(weight_dimension_numbers=dims)
    settings = dion_settings.make_settings(options, fractions, "auto", 1)
    matrices = settings.matrices(tree_spec(put(params), options), put(params))
    (bucket,) = orthonormalization.buckets(matrices)
    assert (bucket.slots, bucket.size, len(bucket.classes)) == (5, 4, 3)
    assert [c.scattered for c in bucket.classes].count(True) == 2
    state = tx.init(put(params))
    update = jax.jit(tx.update).lower(put(grads[0]), state).compile()
    for g in grads:
      got, state = update(put(g), state)
    summary = om.summarize(
        put(params),
        om.dion(
            0.1, rank_fraction=fractions, muon_weight_dimension_numbers=dims
        ),
    )
  for k in shapes:
    assert rel_err(got[k], want[k]) < 1e-5, k
  cost = hlo_cost.analyze(update, 4)
  modelled = sum(r.received_bytes for r in summary.by_optimizer("muon"))
  assert cost.received_bytes == pytest.approx(modelled, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("case,fraction", [("fsdp8-2-layers", 1.0)])
def test_compiled_collectives_are_small(case, fraction):
  """The compiled update (Explicit mesh) at full rank: collectives as
  ``_check_collectives`` requires them (r = ceil(fraction · min(m, n)); ring
  model of ``benchmarks/hlo_cost.py``: all-reduce 2·B·(g−1)/g, all-gather and
  all-to-all B·(g−1)/g, reduce-scatter B·(g−1)).
  (``test_summary_models_the_compiled_collectives`` and
  ``test_sharded_equals_single_device`` check the other layouts and ranks.)"""
  _, _, compiled, params, _, _ = _sharded_run(
      case, AxisType.Explicit, fraction, steps=1, reference=False
  )
  _check_collectives(compiled, params, fraction)


@pytest.mark.slow
@pytest.mark.parametrize("case,fraction", [("fsdp8", 0.5), ("fsdp4xtp2", 1.0)])
def test_shard_map_equals_single_device(case, fraction):
  """``dion`` inside the user's jitted ``shard_map`` (local blocks in, ``psum``s
  and, at full rank, P's row gather by axis name): init outside and inside the
  ``shard_map`` agree (Q's column norms summed in another order), two steps
  equal one device (as ``_compare_to_single_device``), and the compiled step's
  collectives are as small as under ``jit`` (``_check_collectives``)."""
  shape, names, layers, specs_fn = CASES[case]
  params = gpt_tree(D, layers)
  grads = [random_like(params, 10 + t) for t in range(2)]
  reference, _ = _run(om.dion(0.1, rank_fraction=fraction), params, grads)
  mesh = jax.make_mesh(
      shape, names, axis_types=(AxisType.Explicit,) * len(shape)
  )
  specs = specs_fn(params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  tx = om.dion(0.1, rank_fraction=fraction, param_shardings=shardings)
  sharded = put(params)
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    state_specs = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, state)
    inside = jax.jit(
        jax.shard_map(
            tx.init, mesh=mesh, in_specs=(specs,), out_specs=state_specs
        )
    )(sharded)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(inside)):
      np.testing.assert_allclose(
          np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
      )
    step = jax.jit(
        jax.shard_map(
            tx.update,
            mesh=mesh,
            in_specs=(specs, state_specs, specs),
            out_specs=(specs, state_specs),
        )
    )
    step = step.lower(put(grads[0]), state, sharded).compile()
    for g in grads:
      updates, state = step(put(g), state, sharded)
  _compare_to_single_device(updates, reference, fraction)
  _check_collectives(step, sharded, fraction)


def _compare_to_single_device(updates, reference, fraction):
  """1e-5 relative, but for square matrices at full rank: there P = M·Q is
  square and its Q factor is as ill-conditioned as P (κ(M)² after a step), so
  summing M·Q's products in another order moves the update by up to about 6e-5
  on random Gaussian gradients; those get 2e-4."""
  got, want = _by_path(updates), _by_path(reference)
  for path, u in got.items():
    square = u.ndim >= 2 and u.shape[-1] == u.shape[-2]
    assert rel_err(u, want[path]) < (
        2e-4 if fraction == 1 and square else 1e-5
    ), path


@pytest.mark.slow
@pytest.mark.parametrize(
    "case,fraction", [("fsdp8-2-layers", 0.25), ("fsdp4xtp2", 1.0)]
)
def test_summary_models_the_compiled_collectives(case, fraction):
  """``summarize`` of ``dion``: each matrix leaf's rank and Dion's figures,
  beside the bytes a whole-matrix exchange would move for it; the modelled bytes
  a device receives equal the compiled program's (ring model), on FSDP and on
  FSDP × TP (``_check_collectives``)."""
  _, _, compiled, params, _, _ = _sharded_run(
      case, AxisType.Explicit, fraction, steps=1, reference=False
  )
  summary = om.summarize(
      params,
      optax.chain(
          optax.clip_by_global_norm(1.0), om.dion(0.1, rank_fraction=fraction)
      ),
  )
  rows = {r.path: r for r in summary.by_optimizer("muon")}
  assert set(rows) == {
      p for p in _by_path(params) if p.split("/")[-1] in MATRICES
  }
  for path, row in rows.items():
    layout = make_layout(path, _by_path(params)[path], None)
    assert row.rank == rank_of(fraction, layout), path
    assert (
        not hasattr(row, "ns_flops")
        and row.flops_per_device > 0
        and row.seconds > 0
    ), path
    assert row.exchange_bytes == pytest.approx(
        2 * 4 * math.prod(row.shape) * 7 / 8
    ), path
  _check_collectives(compiled, params, fraction)
  text = str(summary)
  assert (
      "on Dion" in text and "exchange MB: what a whole-matrix exchange" in text
  )
  assert "replica MB" not in text
  assert summary.step_seconds > 0
  single = om.summarize(gpt_tree(D, 1), om.dion(0.1, rank_fraction=fraction))
  assert all(
      r.received_bytes == 0 and r.exchange_bytes == 0
      for r in single.by_optimizer("muon")
  )
  assert "exchange MB" not in str(single)


def test_bfloat16_products():
  """``product_dtype="bfloat16"``: the four large products take bfloat16
  operands (seen in the jaxpr) and the update stays within bfloat16 rounding of
  the float32 one; the default ``"auto"`` is float32 on the CPU (bfloat16 on
  TPUs and GPUs, with the orthonormalization at ``Precision.HIGH`` on TPUs
  only); other dtypes are refused."""
  params = {"w": jnp.zeros((32, 64))}
  grads = [{"w": normal(jax.random.key(t), (32, 64))} for t in range(3)]
  full, _ = _run(om.scale_by_dion(0.5, product_dtype=None), params, grads)
  auto, _ = _run(om.scale_by_dion(0.5), params, grads)
  np.testing.assert_array_equal(auto["w"], full["w"])
  bf16, highest = jnp.dtype(jnp.bfloat16), jax.lax.Precision.HIGHEST
  assert dion_settings._resolved_dtype("auto", "tpu") == bf16
  assert dion_settings._resolved_dtype("auto", "gpu") == bf16
  assert dion_settings._resolved_dtype("auto", "cpu") is None
  assert dion_settings._resolved_dtype(None, "tpu") is None
  assert dion_settings._orthonormal_precision(bf16, "tpu") == (
      jax.lax.Precision.HIGH
  )
  for dtype, platform in [(bf16, "gpu"), (None, "tpu"), (jnp.float32, "tpu")]:
    assert dion_settings._orthonormal_precision(dtype, platform) == highest
  tx = om.scale_by_dion(0.5, product_dtype="bfloat16")
  low, _ = _run(tx, params, grads)
  assert 1e-4 < rel_err(low["w"], full["w"]) < 3e-2
  state = tx.init(params)
  jaxpr = str(jax.make_jaxpr(tx.update)(grads[0], state))
  assert jaxpr.count("preferred_element_type=float32") >= 4 and "bf16" in jaxpr
  with pytest.raises(
      ValueError, match="product_dtype must be 'auto', a floating-point dtype"
  ):
    om.dion(0.1, product_dtype="int8")
  with pytest.raises(ValueError, match="power_iterations must be an int ≥ 1"):
    om.scale_by_dion(power_iterations=0)


def test_summary_of_dion_on_an_abstract_mesh():
  """``summarize`` of ``dion`` from abstract shapes on FSDP 8: per matrix its
  rank and Dion's ring-model bytes (P = M·Q needs no sum when the rows are
  split; Q is gathered, R = Mᵀ·P reduce-scattered and gathered, the Gram
  matrices all-reduced over the 8 devices), beside a whole-matrix exchange's
  bytes; twice the power iterations, twice the per-iteration bytes."""
  mesh = jax.sharding.AbstractMesh(
      (8,), ("fsdp",), axis_types=(AxisType.Explicit,)
  )
  params = {
      "w": jax.ShapeDtypeStruct(
          (64, 256), jnp.float32, sharding=NamedSharding(mesh, P("fsdp", None))
      ),
      "b": jax.ShapeDtypeStruct(
          (256,), jnp.float32, sharding=NamedSharding(mesh, P())
      ),
  }
  summary = om.summarize(params, om.dion(0.1, rank_fraction=0.25))
  row = {r.path: r for r in summary.rows}["w"]
  r, ring = 16, 7 / 8
  assert (row.rank, row.optimizer) == (r, "muon")
  # One matrix: summing its Gram matrix in each of the 3 Cholesky-QR passes
  # (3·2·r²) moves less than exchanging its P (2·m·r). Q gathered (n·r), R
  # reduce-scattered and gathered back (2·n·r), the column norms all-reduced.
  assert row.received_bytes == pytest.approx(
      4 * ring * (3 * 256 * r + 3 * 2 * r * r + 2 * r)
  )
  assert row.flops_per_device == pytest.approx(
      8 * 8 * 256 * r + 3 * (4 * 8 * r * r + 2 * r**3)
  )
  assert row.exchange_bytes == pytest.approx(2 * 4 * 64 * 256 * 7 / 8)
  assert "exchange MB" in str(summary) and "on Dion" in str(summary)
  twice = om.summarize(
      params, om.dion(0.1, rank_fraction=0.25, power_iterations=2)
  )
  per_iteration = 4 * ring * (2 * 256 * r + 3 * 2 * r * r)
  assert {r.path: r for r in twice.rows}["w"].received_bytes == pytest.approx(
      row.received_bytes + per_iteration
  )
