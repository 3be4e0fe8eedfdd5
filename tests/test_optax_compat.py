"""Drop-in for optax.contrib.muon: same calls, same updates; and the odd inputs
users try."""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_muon as om
from helpers import normal, random_grads, rel_err, requires_contrib_api

# optax.contrib's own type where it has one (optax >= 0.2.6), to show ours
# accepts it.
CDN = getattr(optax.contrib, "MuonDimensionNumbers", om.MuonDimensionNumbers)


def _params(dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  return {
      "layer": {
          "kernel": normal(ks[0], (16, 32), dtype),
          "bias": jnp.zeros(32, dtype),
      },
      "wide": normal(ks[1], (8, 48), dtype),
      "stack": normal(ks[2], (3, 12, 20), dtype),
      "norm": jnp.ones(20, dtype),
  }


_grads = random_grads


@requires_contrib_api
@pytest.mark.parametrize(
    "ours,theirs,most",
    [
        (om.muon, optax.contrib.muon, 28),
        (om.scale_by_muon, optax.contrib.scale_by_muon, 16),
    ],
)
def test_call_surface_starts_with_optax_contribs_arguments(ours, theirs, most):
  """optax.contrib's arguments, in its order and kinds, then this package's few
  options."""
  mine = list(inspect.signature(ours).parameters.values())
  optax_args = list(inspect.signature(theirs).parameters.values())
  assert [(p.name, p.kind) for p in mine[: len(optax_args)]] == [
      (p.name, p.kind) for p in optax_args
  ]
  assert len(mine) <= most
  assert all(p.kind == p.KEYWORD_ONLY for p in mine[len(optax_args) :])


def _dims(params):
  """A callable, as optax users write it: stacked leaf per layer, 2-D as is,
  else AdamW."""
  return {
      "layer": {"kernel": CDN(), "bias": None},
      "wide": CDN(),
      "stack": CDN(1, 2),
      "norm": None,
  }


def _assert_same_updates(ours, theirs, params, steps=3, tol=1e-5):
  s1, s2 = ours.init(params), theirs.init(params)
  for t in range(steps):
    g = _grads(params, t)
    u1, s1 = jax.jit(ours.update)(g, s1, params)
    u2, s2 = jax.jit(theirs.update)(g, s2, params)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(u1), jax.tree.leaves(u2)
    ):
      assert rel_err(a, b) < tol, (t, jax.tree_util.keystr(path), rel_err(a, b))
    params = optax.apply_updates(params, u1)


@requires_contrib_api
@pytest.mark.slow
@pytest.mark.parametrize(
    "preconditioning", ["frobenius", "spectral", "aol", "schatten"]
)
@pytest.mark.parametrize(
    "adaptive,consistent_rms", [(False, None), (True, 0.2)]
)
def test_muon_equals_optax_contrib(preconditioning, adaptive, consistent_rms):
  """Only the import changes; routing (dimension numbers) and NAdamW matched."""
  kwargs = dict(
      ns_coeffs=(3.4445, -4.7750, 2.0315),
      ns_steps=5,
      beta=0.9,
      eps=1e-8,
      weight_decay=0.01,
      nesterov=True,
      adaptive=adaptive,
      preconditioning=preconditioning,
      adam_b1=0.8,
      adam_b2=0.99,
      adam_learning_rate=3e-3,
      muon_weight_dimension_numbers=_dims,
      consistent_rms=consistent_rms,
  )
  ours = om.muon(0.02, **kwargs)
  theirs = optax.contrib.muon(0.02, **kwargs)
  _assert_same_updates(ours, theirs, _params())


@requires_contrib_api
@pytest.mark.parametrize("preset", ["standard", "dion"])
def test_optax_presets_and_positional_order(preset):
  """optax's positional order: learning_rate, ns_coeffs, ns_steps, beta, eps,
  weight_decay."""
  args = (0.02, preset, 5, 0.95, 1e-8, 0.1)
  params = {"w": _params()["wide"], "b": jnp.zeros(48)}
  _assert_same_updates(
      om.muon(*args, routing=om.Routing(adam_pattern=None)),
      optax.contrib.muon(*args),
      params,
  )


@requires_contrib_api
@pytest.mark.parametrize("adaptive", [False, True])
def test_scale_by_muon_equals_optax_contrib(adaptive):
  """optax.contrib.scale_by_muon applies no shape factor: neither does ours by
  default."""
  params = {k: v for k, v in _params().items() if k in ("wide", "stack")}
  dims = {"wide": CDN(), "stack": CDN(1, 2)}
  _assert_same_updates(
      om.scale_by_muon(
          weight_dimension_numbers=dims, adaptive=adaptive, eps=1e-8
      ),
      optax.contrib.scale_by_muon(
          weight_dimension_numbers=dims, adaptive=adaptive
      ),
      params,
  )


@pytest.mark.parametrize("consistent_rms", [None, 0.3])
def test_scale_by_shape(consistent_rms):
  """optax.contrib's scale_by_shape: Jordan's sqrt(max(1, out/in)) or
  k·sqrt(max(in, out))."""
  updates = {"wide": jnp.ones((8, 48)), "stack": jnp.ones((3, 12, 20))}
  tx = om.scale_by_shape(
      {"wide": om.MuonDimensionNumbers(), "stack": CDN(1, 2)}, consistent_rms
  )
  out, _ = tx.update(updates, tx.init(updates))
  for name, (n_in, n_out) in {"wide": (8, 48), "stack": (12, 20)}.items():
    want = (
        np.sqrt(max(1, n_out / n_in))
        if consistent_rms is None
        else consistent_rms * np.sqrt(max(n_in, n_out))
    )
    np.testing.assert_allclose(out[name], want, rtol=1e-6)


def _complex_problem():
  ka, kb = jax.random.split(jax.random.PRNGKey(1))
  a = (normal(ka, (64, 16)) + 1j * normal(kb, (64, 16))).astype(jnp.complex64)
  w_true = (
      jnp.exp(1j * jnp.linspace(0, 3, 16 * 8))
      .reshape(16, 8)
      .astype(jnp.complex64)
  )
  b = a @ w_true + 0.5j
  loss = lambda p: jnp.mean(jnp.abs(a @ p["w"] + p["bias"] - b) ** 2)
  params = {
      "w": jnp.zeros((16, 8), jnp.complex64),
      "bias": jnp.zeros(8, jnp.complex64),
  }
  return loss, params


def test_complex_least_squares():
  """NS with conjugate transposes on the complex matrix, AdamW on the complex
  bias."""
  loss, params = _complex_problem()
  tx = om.muon(
      optax.cosine_decay_schedule(0.2, 300),
      adam_learning_rate=optax.cosine_decay_schedule(0.05, 300),
  )
  assert [r.optimizer for r in om.summarize(params, tx).rows] == [
      "adam",
      "muon",
  ]
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    grads = jax.tree.map(
        jnp.conj, jax.grad(loss)(params)
    )  # descent direction for complex
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  start = float(loss(params))
  for _ in range(300):
    params, state = step(params, state)
  assert float(loss(params)) < 1e-6 * start  # measured 6e-10·start


@requires_contrib_api
@pytest.mark.slow
def test_complex_updates_equal_optax_contrib():
  """Frobenius preconditioning, NAdamW matched, well-conditioned complex
  gradients."""
  _, params = _complex_problem()
  params["v"] = jnp.zeros((24, 10), jnp.complex64)
  complex_grads = lambda p, t: jax.tree.map(
      lambda g: (g + 1j * jnp.roll(g, 1)).astype(jnp.complex64),
      _grads(jax.tree.map(lambda x: x.real, p), t),
  )
  ours, theirs = om.muon(0.05, eps=1e-8), optax.contrib.muon(0.05)
  s1, s2 = ours.init(params), theirs.init(params)
  for t in range(3):
    g = complex_grads(params, t)
    u1, s1 = ours.update(g, s1, params)
    u2, s2 = theirs.update(g, s2, params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      assert a.dtype == jnp.complex64 and rel_err(a, b) < 1e-5


@pytest.mark.slow
def test_complex_newton_schulz_matches_svd():
  key = jax.random.PRNGKey(2)
  x = (normal(key, (2, 12, 20)) + 1j * normal(key, (2, 12, 20))).astype(
      jnp.complex64
  )
  for method in ("standard", "gram"):
    y = om.newton_schulz(x, "polar_express", ns_steps=8, method=method)
    assert y.dtype == jnp.complex64
    assert rel_err(y, om.msign(x)) < 1e-3, method


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("magnitude", [0.0, 6e4])
def test_16_bit_params_give_finite_updates(dtype, magnitude):
  params = _params(dtype)
  tx = om.muon(0.02, muon_weight_dimension_numbers=_dims)
  state = tx.init(params)
  for t in range(3):
    grads = jax.tree.map(
        lambda x: (magnitude * jnp.sign(x + 0.1)).astype(dtype),
        _grads(params, t),
    )
    updates, state = jax.jit(tx.update)(grads, state, params)
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
      assert u.dtype == dtype and bool(
          jnp.all(jnp.isfinite(u))
      ), jax.tree_util.keystr(path)
  # Moments are float32: AdamW's ν of a 6e4 gradient overflows float16.
  for leaf in jax.tree.leaves(state):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  if (
      magnitude == 0.0
  ):  # zero gradients: zero updates (not optax.contrib's NaN in fp16)
    assert all(
        float(jnp.max(jnp.abs(u))) == 0 for u in jax.tree.leaves(updates)
    )


def test_zero_size_matrix_gives_zero_size_update():
  """An empty leaf is passed through; the others get the update they get without
  it."""
  params = {
      "empty": jnp.zeros((0, 5)),
      "w": normal(jax.random.PRNGKey(0), (4, 6)),
  }
  alone = {"w": params["w"]}
  for make in (lambda: om.muon(0.1), om.scale_by_muon):
    tx = make()
    updates, _ = tx.update(params, tx.init(params), params)
    expected, _ = tx.update(alone, tx.init(alone), alone)
    assert updates["empty"].shape == (0, 5)
    np.testing.assert_array_equal(updates["w"], expected["w"])


@pytest.mark.parametrize(
    "momentum,nesterov", [("ema", True), ("ema", False), ("sum", True)]
)
def test_huge_gradients_give_the_scale_invariant_update(momentum, nesterov):
  """NS is scale-invariant: gradients of 1e37 give the update of gradients of
  1."""
  params = {"w": jnp.zeros((8, 16))}
  g = _grads(params, 0)
  tx = om.scale_by_muon(momentum=momentum, nesterov=nesterov)
  state_a, state_b = tx.init(params), tx.init(params)
  for t in range(3):
    g = _grads(params, t)
    ua, state_a = tx.update(g, state_a)
    ub, state_b = tx.update(jax.tree.map(lambda x: x * 1e37, g), state_b)
    assert bool(jnp.all(jnp.isfinite(ub["w"])))
    assert rel_err(ub["w"], ua["w"]) < 1e-5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(beta=1.5), r"beta must lie in \[0.0, 1.0\), got 1.5"),
        (dict(beta=-0.1), r"beta must lie in \[0.0, 1.0\)"),
        (dict(eps=-1e-8), r"eps must lie in \[0.0, inf\)"),
        (dict(consistent_rms=0.0), r"consistent_rms must lie in \(0.0, inf\)"),
        (dict(adam_b2=1.0), r"adam_b2 must lie in \[0.0, 1.0\)"),
        (dict(ns_steps=0), r"ns_steps must be a positive integer"),
        (dict(preconditioning="polar"), r"preconditioning must be one of"),
        (dict(ns_coeffs="muon"), r"Unknown Newton–Schulz preset 'muon'"),
        (
            dict(consistent_rms=0.2, scale="spectral"),
            r"consistent_rms replaces the shape scale",
        ),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
  with pytest.raises(ValueError, match=match):
    om.muon(0.02, **kwargs)


def test_inject_hyperparams_keeps_the_state_structure():
  params = _params()
  plain = om.muon(0.02, muon_weight_dimension_numbers=_dims)
  injected = optax.inject_hyperparams(
      om.muon, static_args=("muon_weight_dimension_numbers",)
  )(learning_rate=0.02, muon_weight_dimension_numbers=_dims)
  inner = injected.init(params).inner_state
  assert jax.tree.structure(inner) == jax.tree.structure(plain.init(params))
  chex.assert_trees_all_equal_shapes_and_dtypes(inner, plain.init(params))
  # And it runs: the injected learning rate reaches the Muon leaves.
  state = injected.init(params)
  state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  updates, _ = jax.jit(injected.update)(_grads(params, 0), state, params)
  assert float(jnp.abs(updates["wide"]).max()) == 0.0
