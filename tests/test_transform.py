"""scale_by_muon: against optax.contrib, against a NumPy reference, and its
contracts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_muon as om
from optax_muon._src.muon.coefficients import resolve_coefficients
from helpers import (
    normal,
    numpy_newton_schulz,
    random_grads,
    rel_err,
    requires_contrib_api,
    singular_values,
)

DN = om.MuonDimensionNumbers


def _tree(seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  return {
      "attn": {
          "q": normal(ks[0], (32, 32), dtype),
          "o": normal(ks[1], (32, 32), dtype),
      },
      "mlp": {
          "up": normal(ks[2], (32, 128), dtype),
          "down": normal(ks[3], (128, 32), dtype),
      },
      "stack": normal(ks[4], (3, 16, 48), dtype),
  }


DIMS = {
    "attn": {"q": DN(), "o": DN()},
    "mlp": {"up": DN(), "down": DN()},
    "stack": DN(1, 2),
}


def _run(tx, params, steps=4):
  state = tx.init(params)
  update = jax.jit(tx.update)
  out = []
  for t in range(steps):
    u, state = update(random_grads(params, t), state, params)
    out.append(u)
  return out, state


@requires_contrib_api
def test_matches_optax_contrib_scale_by_muon():
  """ema + Nesterov + Jordan coefficients in f32: optax.contrib's
  configuration."""
  params = _tree()
  contrib_dims = jax.tree.map(
      lambda d: optax.contrib.MuonDimensionNumbers(*d),
      DIMS,
      is_leaf=lambda x: isinstance(x, DN),
  )
  ours, _ = _run(om.scale_by_muon(weight_dimension_numbers=DIMS), params)
  theirs, _ = _run(
      optax.contrib.scale_by_muon(weight_dimension_numbers=contrib_dims), params
  )
  for u_ours, u_theirs in zip(ours, theirs):
    for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs)):
      assert rel_err(a, b) < 1e-5


@requires_contrib_api
def test_contrib_dimension_numbers_are_accepted():
  params = _tree()
  contrib_dims = jax.tree.map(
      lambda d: optax.contrib.MuonDimensionNumbers(*d),
      DIMS,
      is_leaf=lambda x: isinstance(x, DN),
  )
  a, _ = _run(
      om.scale_by_muon(weight_dimension_numbers=contrib_dims), params, 2
  )
  b, _ = _run(om.scale_by_muon(weight_dimension_numbers=DIMS), params, 2)
  chex_equal = [
      np.array_equal(x, y)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  ]
  assert all(chex_equal)


@pytest.mark.parametrize("nesterov", [True, False])
def test_sum_momentum_matches_numpy_reference(nesterov):
  """M ← μM + G; N = μM + G (Nesterov) or M; O = NS(N); update = sqrt(max(1,
  out/in))·O."""
  params = {"w": jnp.zeros((24, 40)), "v": jnp.zeros((40, 24))}
  beta = 0.9
  table = resolve_coefficients("polar_express", 6)
  tx = optax.chain(
      om.scale_by_muon(
          beta=beta,
          momentum="sum",
          nesterov=nesterov,
          ns_coeffs="polar_express",
          ns_steps=6,
      ),
      om.scale_by_shape(),
  )
  ours, _ = _run(tx, params, steps=4)
  mom = {k: np.zeros(v.shape) for k, v in params.items()}
  for t in range(4):
    g = {
        k: np.asarray(v, np.float64) for k, v in random_grads(params, t).items()
    }
    for k in params:
      mom[k] = beta * mom[k] + g[k]
      n = beta * mom[k] + g[k] if nesterov else mom[k]
      n_in, n_out = params[k].shape
      expected = np.sqrt(max(1, n_out / n_in)) * numpy_newton_schulz(n, table)
      assert rel_err(ours[t][k], expected) < 1e-4, (t, k)


def test_ema_without_bias_correction_is_keller_jordan():
  """KellerJordan/Muon: m.lerp_(g, 1-β); update = g.lerp(m, β), no bias
  correction."""
  params = {"w": jnp.zeros((16, 16))}
  beta = 0.95
  tx = om.scale_by_muon(
      beta=beta,
      momentum="ema_uncorrected",
      ns_coeffs="polar_express",
      ns_steps=8,
  )
  ours, _ = _run(tx, params, steps=3)
  table = resolve_coefficients("polar_express", 8)
  m = np.zeros((16, 16))
  for t in range(3):
    g = np.asarray(random_grads(params, t)["w"], np.float64)
    m = m + (1 - beta) * (g - m)
    n = g + beta * (m - g)
    assert rel_err(ours[t]["w"], numpy_newton_schulz(n, table)) < 1e-4


def test_bias_corrected_ema_differs_from_the_uncorrected_one_only_in_the_mix():
  """With Nesterov, optax.contrib's bias correction weighs g more at early
  steps: n ∝ β/(1−β^(t+1))·m + (1−β)/(1−β^t)·g; without Nesterov n = m in
  both."""
  params = {"w": jnp.zeros((16, 24))}
  table = resolve_coefficients("polar_express", 8)
  beta = 0.9
  ours, _ = _run(
      om.scale_by_muon(beta=beta, ns_coeffs="polar_express", ns_steps=8),
      params,
      2,
  )
  m = np.zeros((16, 24))
  for t in range(1, 3):
    g = np.asarray(random_grads(params, t - 1)["w"], np.float64)
    m = beta * m + (1 - beta) * g
    n = beta / (1 - beta ** (t + 1)) * m + (1 - beta) / (1 - beta**t) * g
    assert rel_err(ours[t - 1]["w"], numpy_newton_schulz(n, table)) < 1e-4


@pytest.mark.parametrize(
    "kind,consistent_rms,expected",
    [
        ("jordan", None, lambda i, o: np.sqrt(max(1, o / i))),
        ("spectral", None, lambda i, o: np.sqrt(o / i)),
        (None, 0.3, lambda i, o: 0.3 * np.sqrt(max(i, o))),
        ("jordan", 0.3, lambda i, o: 0.3 * np.sqrt(max(i, o))),
        (None, None, lambda i, o: 1.0),
    ],
)
@pytest.mark.slow
def test_update_scale(kind, consistent_rms, expected):
  params = {"wide": jnp.zeros((16, 64)), "tall": jnp.zeros((64, 16))}
  tx = optax.chain(
      om.scale_by_muon(ns_coeffs="polar_express", ns_steps=8),
      om.scale_by_shape(consistent_rms=consistent_rms, scale=kind),
  )
  (u,), _ = _run(tx, params, steps=1)
  for k, (i, o) in {"wide": (16, 64), "tall": (64, 16)}.items():
    sv = singular_values(u[k])
    assert np.allclose(sv, expected(i, o), rtol=2e-3), (k, sv[:3])
  if consistent_rms:  # RMS of the update is consistent_rms, whatever the shape.
    assert np.allclose(
        [float(jnp.sqrt(jnp.mean(v**2))) for v in u.values()], 0.3, rtol=2e-3
    )


def test_stacking_same_shapes_does_not_change_results():
  params = _tree()
  stacked, single = om.NSOptions(stack_same_shape=True), om.NSOptions(
      stack_same_shape=False
  )
  a, _ = _run(
      om.scale_by_muon(weight_dimension_numbers=DIMS, ns_options=stacked),
      params,
      2,
  )
  b, _ = _run(
      om.scale_by_muon(weight_dimension_numbers=DIMS, ns_options=single),
      params,
      2,
  )
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert rel_err(x, y) < 1e-5  # f32 reassociation in batched matmuls


def test_conv_and_per_head_dimension_numbers():
  """Conv kernel (kh, kw, c_in, c_out) as one matrix; (d, heads, hd) per
  head."""
  rng = np.random.default_rng(0)
  conv = rng.standard_normal((3, 3, 8, 16)).astype(np.float32)
  heads = rng.standard_normal((32, 4, 8)).astype(np.float32)
  dims = {"conv": DN((0, 1, 2), 3), "heads": DN(0, 2)}
  tx = om.scale_by_muon(
      ns_coeffs="polar_express", ns_steps=8, weight_dimension_numbers=dims
  )
  state = tx.init({"conv": conv, "heads": heads})
  u, _ = jax.jit(tx.update)({"conv": conv, "heads": heads}, state)
  conv_matrix = np.asarray(u["conv"]).reshape(72, 16)
  assert np.allclose(singular_values(conv_matrix), 1, atol=2e-3)
  for h in range(4):  # every head is its own orthogonal matrix
    assert np.allclose(
        singular_values(np.asarray(u["heads"])[:, h, :]), 1, atol=2e-3
    )
  assert (
      rel_err(u["conv"], om.msign(conv.reshape(72, 16)).reshape(conv.shape))
      < 5e-3
  )


def test_state_dtype_and_structure():
  params = _tree()
  tx = om.scale_by_muon(mu_dtype=jnp.bfloat16, weight_dimension_numbers=DIMS)
  _, state = _run(tx, params, 2)
  assert isinstance(state, om.MuonState)
  assert state.count.dtype == jnp.int32 and int(state.count) == 2
  assert all(m.dtype == jnp.bfloat16 for m in jax.tree.leaves(state.mu))
  assert jax.tree.structure(state.mu) == jax.tree.structure(params)
  u, _ = _run(tx, params, 1)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(u))


def test_init_on_shape_dtype_structs():
  params = _tree()
  sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  tx = om.scale_by_muon(weight_dimension_numbers=DIMS)
  abstract = jax.eval_shape(tx.init, sds)
  concrete = tx.init(sds)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(
      lambda a: (a.shape, a.dtype), tx.init(params)
  )
  assert all(float(jnp.abs(m).max()) == 0 for m in jax.tree.leaves(concrete.mu))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_zero_gradients_are_finite(dtype):
  params = {"w": jnp.zeros((8, 16), dtype)}
  tx = om.scale_by_muon()
  state = tx.init(params)
  u, state = tx.update({"w": jnp.zeros((8, 16), dtype)}, state)
  assert u["w"].dtype == dtype and np.all(np.asarray(u["w"], np.float32) == 0)


@pytest.mark.parametrize(
    "params,dims,match",
    [
        ({"b": jnp.zeros(8)}, None, r"b: Muon needs a matrix; got a 1-D leaf"),
        ({"s": jnp.zeros(())}, None, r"s: Muon needs a matrix; got a 0-D leaf"),
        (
            {"s": jnp.zeros(())},
            {"s": DN()},
            r"s: Muon needs at least 2 dimensions",
        ),
        (
            {"i": jnp.zeros((4, 4), jnp.int32)},
            None,
            r"i: Muon needs a floating-point or complex leaf",
        ),
        (
            {"w": jnp.zeros((2, 4, 4))},
            {"w": DN(1, 1)},
            r"w: reduction axes \(1,\) and output " r"axes \(1,\) overlap",
        ),
        (
            {"w": jnp.zeros((2, 4, 4))},
            {"w": DN(0, 3)},
            r"w: output_axis 3 is out of range",
        ),
        (
            {"w": jnp.zeros((2, 4, 4))},
            {"w": DN((), 1)},
            r"w: reduction_axis must name",
        ),
        ({"w": jnp.zeros((4, 4))}, {"v": DN()}, r"no entry for leaf 'w'"),
        (
            {"w": jnp.zeros((4, 4))},
            {"w": DN(), "v": DN()},
            r"entries \['v'\] name no leaf",
        ),
        (
            {"w": jnp.zeros((4, 4))},
            {"w": (0, 1)},
            r"at leaf 'w' it has a container \(entries such as 'w/0'\)",
        ),
    ],
)
def test_bad_leaves(params, dims, match):
  tx = om.scale_by_muon(weight_dimension_numbers=dims)
  with pytest.raises(ValueError, match=match):
    tx.init(params)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: om.scale_by_muon(momentum="adam"), "momentum must be one of"),
        (lambda: om.scale_by_shape(scale="shape"), "scale must be one of"),
        (lambda: om.muon(0.1, scale="shape"), "scale must be one of"),
        (
            lambda: om.scale_by_muon(ns_coeffs="jordan5"),
            "Unknown Newton–Schulz preset",
        ),
        (
            lambda: om.scale_by_muon(preconditioning="qr"),
            "preconditioning must be one of",
        ),
        (
            lambda: om.scale_by_muon(ns_options={"method": "gram"}),
            r"ns_options must be an optax_muon.NSOptions or None, got dict",
        ),
        (
            lambda: om.scale_by_muon(normalization="neuron"),
            r"normalization must be an optax_muon.NorMuon or None, got str",
        ),
        (lambda: om.NSOptions(method="qr"), r"NSOptions.method must be one of"),
        (
            lambda: om.NSOptions(gram_restart=0),
            r"NSOptions.gram_restart must be a positive",
        ),
        (
            lambda: om.ShardingOptions(exchange="bucket"),
            r"ShardingOptions.exchange must be one",
        ),
        (
            lambda: om.ShardingOptions(replica_policy="all"),
            r"ShardingOptions.replica_policy must be one",
        ),
        (
            lambda: om.NorMuon(beta=1.0),
            r"NorMuon.beta must lie in \[0.0, 1.0\)",
        ),
        (lambda: om.Routing(adam_pattern=3), r"Routing.adam_pattern must be"),
    ],
)
def test_bad_options(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def _numpy_normuon(o, v, beta):
  """NorMuon on one (n_in, n_out) matrix, written out: returns (Ô, v)."""
  v = beta * v + (1 - beta) * np.mean(o**2, axis=0)
  o_hat = o / (np.sqrt(v) + 1e-8)
  return o_hat * np.linalg.norm(o) / np.linalg.norm(o_hat), v


def test_normuon_matches_numpy_reference():
  """2-D leaves, a stacked 3-D leaf and one with its output axis before its
  input axis."""
  params = {
      "w": jnp.zeros((24, 40)),
      "v": jnp.zeros((40, 24)),
      "stack": jnp.zeros((3, 16, 48)),
      "flipped": jnp.zeros((3, 40, 24)),
  }
  dims = {"w": None, "v": None, "stack": DN(1, 2), "flipped": DN(2, 1)}
  beta, beta2, steps = 0.9, 0.8, 4
  table = resolve_coefficients("polar_express", 6)
  tx = optax.chain(
      om.scale_by_muon(
          beta=beta,
          momentum="sum",
          ns_coeffs="polar_express",
          ns_steps=6,
          weight_dimension_numbers=dims,
          normalization=om.NorMuon(beta2),
      ),
      om.scale_by_shape(dims),
  )
  ours, (state, _) = _run(tx, params, steps=steps)
  # Every leaf as (batch, n_in, n_out) matrices, and back.
  to_mats = {
      "w": lambda x: x[None],
      "v": lambda x: x[None],
      "stack": lambda x: x,
      "flipped": lambda x: np.swapaxes(x, 1, 2),
  }
  mom = {k: np.zeros(v.shape) for k, v in params.items()}
  nu = {
      k: np.zeros(
          (
              to_mats[k](np.zeros(v.shape)).shape[0],
              to_mats[k](np.zeros(v.shape)).shape[2],
          )
      )
      for k, v in params.items()
  }
  for t in range(steps):
    g = {
        k: np.asarray(v, np.float64) for k, v in random_grads(params, t).items()
    }
    for k in params:
      mom[k] = beta * mom[k] + g[k]
      mats = to_mats[k](beta * mom[k] + g[k])
      expected = []
      for b, n in enumerate(mats):
        o_hat, nu[k][b] = _numpy_normuon(
            numpy_newton_schulz(n, table), nu[k][b], beta2
        )
        expected.append(np.sqrt(max(1, n.shape[1] / n.shape[0])) * o_hat)
      got = to_mats[k](np.asarray(ours[t][k]))
      assert rel_err(got, np.stack(expected)) < 1e-4, (t, k)
  # The state: one second moment per output neuron, the input axes kept as size
  # 1.
  assert state.nu["w"].shape == (1, 40) and state.nu["stack"].shape == (
      3,
      1,
      48,
  )
  assert state.nu["flipped"].shape == (3, 40, 1)
  np.testing.assert_allclose(
      np.asarray(state.nu["stack"])[:, 0], nu["stack"], rtol=1e-4
  )
  np.testing.assert_allclose(
      np.asarray(state.nu["flipped"])[..., 0], nu["flipped"], rtol=1e-4
  )


def test_normuon_keeps_the_frobenius_norm_and_equalizes_neurons():
  params = {"w": jnp.zeros((64, 32))}
  plain = om.scale_by_muon(ns_coeffs="polar_express", ns_steps=8)
  normed = om.scale_by_muon(
      ns_coeffs="polar_express", ns_steps=8, normalization=om.NorMuon()
  )
  g = {
      "w": (
          normal(jax.random.PRNGKey(0), (64, 32)) * jnp.linspace(0.1, 10.0, 32)
      )
  }  # neurons of very different scale
  u_plain, _ = jax.jit(plain.update)(g, plain.init(params))
  u, state = jax.jit(normed.update)(g, normed.init(params))
  assert np.isclose(
      jnp.linalg.norm(u["w"]), jnp.linalg.norm(u_plain["w"]), rtol=1e-5
  )
  # One step: v = (1−β₂)·mean_i O_ij², so every neuron (column) ends with the
  # same norm.
  col = np.linalg.norm(np.asarray(u["w"]), axis=0)
  assert np.allclose(col, col.mean(), rtol=1e-4)
  assert state.nu["w"].shape == (1, 32) and state.nu["w"].dtype == jnp.float32


def test_normuon_state_is_none_when_off_and_float32_for_16_bit_leaves():
  params = {"w": jnp.zeros((8, 16), jnp.bfloat16)}
  plain = om.scale_by_muon().init(params)
  assert type(plain) is om.MuonState and not hasattr(plain, "nu")
  state = om.scale_by_muon(normalization=om.NorMuon()).init(params)
  assert type(state).__name__ == "NorMuonState"
  assert state.nu["w"].dtype == jnp.float32
  u, state = om.scale_by_muon(normalization=om.NorMuon()).update(
      {"w": jnp.zeros((8, 16), jnp.bfloat16)}, state
  )
  assert u["w"].dtype == jnp.bfloat16 and np.all(
      np.asarray(u["w"], np.float32) == 0
  )
