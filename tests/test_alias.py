"""muon: routing, the AdamW branch, weight decay, and parity with
optax.contrib.muon."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_muon as om
from gpt import GPT, GPTConfig
from helpers import normal, random_grads, rel_err, requires_contrib_api

DN = om.MuonDimensionNumbers


def _params():
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  return {
      "embed": {"embedding": normal(ks[0], (64, 16))},
      "layer": {
          "kernel": normal(ks[1], (16, 32)),
          "bias": jnp.zeros(32),
      },
      "norm": {"scale": jnp.ones(32)},
      "lm_head": {"kernel": normal(ks[2], (32, 64))},
  }


_grads = random_grads


def _labels(tx, params):
  return {r.path: r.optimizer for r in om.summarize(params, tx).rows}


def test_default_routing_of_nnx_gpt():
  """Every leaf of the example GPT lands where the README says."""
  model = GPT(
      GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16), nnx.Rngs(0)
  )
  params = nnx.state(model, nnx.Param)
  tx = om.muon(0.02)
  summary = om.summarize(params, tx)
  routes = {row.path: row for row in summary.rows}
  for path, row in routes.items():
    name = path  # Flax's Variable ".value" steps are not part of the path
    if name in ("embed/embedding", "pos_embed", "lm_head/kernel"):
      assert row.optimizer == "adam" and "pattern" in row.reason, path
    elif name.endswith("kernel"):
      assert row.optimizer == "muon" and row.reason == "2-D", path
      assert row.ns_matrix in ((32, 32), (32, 128)) and row.batch == 1
    else:
      assert row.optimizer == "adam" and row.reason == "1-D", path
  assert len(summary.by_optimizer("muon")) == 2 * 6
  text = str(summary)
  assert "blocks/0/mlp_in/kernel " in text and "/value" not in text
  assert "12 leaves on Muon" in text


def test_summary_costs():
  params = {"w": jnp.zeros((64, 256)), "stack": jnp.zeros((3, 256, 64))}
  dims = {"w": None, "stack": DN(1, 2)}
  tx = om.muon(
      0.1,
      ns_coeffs="polar_express",
      ns_steps=6,
      ns_options=om.NSOptions(method="standard"),
      muon_weight_dimension_numbers={"w": DN(), "stack": DN(1, 2)},
  )
  rows = {r.path: r for r in om.summarize(params, tx).rows}
  assert rows["w"].ns_flops == 6 * (4 * 64 * 64 * 256 + 2 * 64**3)
  # Gram: 2 chunks of 3 steps, each 4·m²·n + 10·m³ + 8·m³.
  gram = om.scale_by_muon(
      ns_coeffs="polar_express", ns_steps=6, weight_dimension_numbers=dims
  )
  gram_rows = {r.path: r for r in om.summarize(params, gram).rows}
  assert gram_rows["w"].ns_flops == 2 * (4 * 64 * 64 * 256 + 18 * 64**3)
  assert gram_rows["w"].scale == 1.0  # scale_by_muon applies no shape factor
  assert rows["stack"].ns_flops == 3 * rows["w"].ns_flops
  assert rows["stack"].ns_matrix == (64, 256) and rows["stack"].scale == 1.0
  assert rows["w"].scale == 2.0


def test_three_d_leaves_without_dimension_numbers_warn_once_at_the_users_line():
  params = {"stack": jnp.zeros((2, 8, 8)), "w": jnp.zeros((8, 8))}
  tx = om.muon(0.1)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx.init(params)
    jax.jit(tx.init)(params)
    summary = om.summarize(params, tx)
  assert len(caught) == 1, [str(w.message) for w in caught]
  assert (
      caught[0].filename == __file__
  )  # the user's line, not optax_muon's or optax's
  message = str(caught[0].message)
  assert "rank ≥ 3 go to AdamW" in message and "'stack (2×8×8)'" in message
  assert (
      "MuonDimensionNumbers(1, 2)" in message and "attention heads" in message
  )
  assert {r.path: r.optimizer for r in summary.rows} == {
      "stack": "adam",
      "w": "muon",
  }
  assert message in summary.notes and message in str(summary)


def test_dimension_numbers_route_like_optax_contrib():
  params = {
      "stack": jnp.zeros((2, 8, 8)),
      "w": jnp.zeros((8, 8)),
      "b": jnp.zeros(8),
  }
  dims = {"stack": DN(1, 2), "w": None, "b": None}
  tx = om.muon(0.1, "polar_express", 8, muon_weight_dimension_numbers=dims)
  # A 2-D leaf with None goes to AdamW, as in optax.contrib, and a warning says
  # so.
  with pytest.warns(
      UserWarning,
      match=r"None for leaves that the default routing puts on "
      r"Muon.*\['w \(8×8\)'\]",
  ):
    assert _labels(tx, params) == {"stack": "muon", "w": "adam", "b": "adam"}
  grads = _grads(params, 0)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  # The stacked leaf is two orthogonalized 8 × 8 matrices (all σ = lr); w and b
  # get NAdamW.
  np.testing.assert_allclose(
      np.linalg.svd(np.asarray(updates["stack"]), compute_uv=False),
      0.1,
      rtol=2e-3,
  )
  nadamw = optax.adamw(0.1, nesterov=True, weight_decay=0.0)
  adam_params = {k: params[k] for k in ("w", "b")}
  expected, _ = jax.jit(nadamw.update)(
      {k: grads[k] for k in ("w", "b")}, nadamw.init(adam_params), adam_params
  )
  for k in ("w", "b"):
    assert rel_err(updates[k], expected[k]) < 1e-6, k


@pytest.mark.parametrize(
    "labels",
    [
        {
            "embed": "muon",
            "layer": {"kernel": "adam", "bias": "adam"},
            "norm": "adam",
            "lm_head": "muon",
        },
        lambda p: {
            "embed": "muon",
            "layer": {"kernel": "adam", "bias": "adam"},
            "norm": "adam",
            "lm_head": "muon",
        },
    ],
)
@pytest.mark.slow
def test_user_labels_tree_prefix_and_callable(labels):
  params = _params()
  tx = om.muon(0.1, routing=om.Routing(labels=labels))
  assert _labels(tx, params) == {
      "embed/embedding": "muon",
      "layer/kernel": "adam",
      "layer/bias": "adam",
      "norm/scale": "adam",
      "lm_head/kernel": "muon",
  }
  state = tx.init(params)
  u, _ = tx.update(_grads(params, 0), state, params)
  # Muon on the embedding: its update is orthogonal (all singular values equal).
  sv = np.linalg.svd(np.asarray(u["embed"]["embedding"]), compute_uv=False)
  assert sv.max() / sv.min() < 1.7  # Jordan's σ spread, not AdamW's.


@pytest.mark.parametrize(
    "labels,match",
    [
        (
            {"embed": "muon"},
            r"labels does not match the params: no entry for leaf 'layer/bias'",
        ),
        (
            {
                "embed": "sgd",
                "layer": "adam",
                "norm": "adam",
                "lm_head": "adam",
            },
            r"leaf 'embed/embedding' has label 'sgd'",
        ),
        (
            {
                "embed": "adam",
                "layer": "muon",
                "norm": "adam",
                "lm_head": "adam",
            },
            r"layer/bias: Muon needs a matrix; got a 1-D leaf",
        ),
        (
            {
                "embed": "adam",
                "layer": "adam",
                "norm": "adam",
                "lm_head": "adam",
                "extra": "adam",
            },
            r"entries \['extra'\] name no leaf",
        ),
    ],
)
def test_bad_labels(labels, match):
  with pytest.raises(ValueError, match=match):
    om.muon(0.1, routing=om.Routing(labels=labels)).init(_params())


@pytest.mark.parametrize("nesterov", [True, False])
def test_adam_branch_is_optax_adamw_and_muon_decay_is_decoupled(nesterov):
  """As optax.contrib.muon: ``nesterov`` is Muon's look-ahead and NAdamW on the
  rest."""
  params = _params()
  lr, wd, adam_lr, adam_wd = 0.05, 0.1, 0.003, 0.01
  tx = om.muon(
      lr,
      weight_decay=wd,
      adam_learning_rate=adam_lr,
      adam_weight_decay=adam_wd,
      adam_b2=0.98,
      ns_coeffs="polar_express",
      ns_steps=8,
      nesterov=nesterov,
  )
  adamw = optax.adamw(adam_lr, b2=0.98, weight_decay=adam_wd, nesterov=nesterov)
  muon_only = optax.chain(
      om.scale_by_muon(
          ns_coeffs="polar_express", ns_steps=8, nesterov=nesterov
      ),
      om.scale_by_shape(),
  )
  adam_keys = ("embed", "norm", "lm_head")
  s, s_adam = tx.init(params), adamw.init(params)
  s_muon = muon_only.init({"w": params["layer"]["kernel"]})
  update, adamw_update, muon_update = (
      jax.jit(t.update) for t in (tx, adamw, muon_only)
  )
  for t in range(3):
    g = _grads(params, t)
    u, s = update(g, s, params)
    u_adam, s_adam = adamw_update(g, s_adam, params)
    u_muon, s_muon = muon_update({"w": g["layer"]["kernel"]}, s_muon)
    for k in adam_keys:
      for a, b in zip(jax.tree.leaves(u[k]), jax.tree.leaves(u_adam[k])):
        assert rel_err(a, b) < 1e-6
    expected = -lr * (u_muon["w"] + wd * params["layer"]["kernel"])
    assert rel_err(u["layer"]["kernel"], expected) < 1e-6
    params = optax.apply_updates(params, u)


@requires_contrib_api
def test_matches_optax_contrib_muon():
  """Same configuration (all 2-D on Muon, NAdamW elsewhere): same updates."""
  params = _params()
  ours = om.muon(0.02, eps=1e-8, routing=om.Routing(adam_pattern=None))
  theirs = optax.contrib.muon(0.02)
  s1, s2 = ours.init(params), theirs.init(params)
  for t in range(3):
    g = _grads(params, t)
    u1, s1 = jax.jit(ours.update)(g, s1, params)
    u2, s2 = jax.jit(theirs.update)(g, s2, params)
    for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
      assert rel_err(a, b) < 1e-5
    params = optax.apply_updates(params, u1)


def test_learning_rate_schedule_is_applied():
  params = {"w": jnp.ones((8, 8)) + jnp.eye(8)}
  schedule = optax.linear_schedule(0.1, 0.0, 4)
  tx = om.muon(schedule, ns_coeffs="polar_express", ns_steps=8)
  state = tx.init(params)
  norms = []
  update = jax.jit(tx.update)
  for t in range(5):
    u, state = update(_grads(params, t), state, params)
    norms.append(float(jnp.linalg.norm(u["w"], 2)))  # spectral norm = lr·scale
  np.testing.assert_allclose(norms, [0.1, 0.075, 0.05, 0.025, 0.0], atol=1e-3)


def _mlp(key=jax.random.PRNGKey(0), sizes=(16, 64, 64, 4)):
  """A plain MLP (no embedding or head names): every kernel is a Muon leaf in
  both."""
  keys = jax.random.split(key, len(sizes) - 1)
  return {
      f"dense_{i}": {
          "kernel": normal(k, (a, b)) / np.sqrt(a),
          "bias": jnp.zeros(b),
      }
      for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
  }


@requires_contrib_api
@pytest.mark.slow
def test_defaults_follow_optax_contrib_loss_curve():
  """Default arguments of both on a plain MLP: the same loss curve over 20 steps
  (the differences left: the NS ε of the preset and the float32
  normalization)."""
  x = normal(jax.random.PRNGKey(1), (256, 16))
  y = jnp.sin(x[:, :4] * 2.0) + x[:, 4:8] ** 2

  def loss(params):
    h = x
    for i in range(3):
      layer = params[f"dense_{i}"]
      h = h @ layer["kernel"] + layer["bias"]
      h = jax.nn.gelu(h) if i < 2 else h
    return jnp.mean((h - y) ** 2)

  def curve(tx):
    params, state = _mlp(), tx.init(_mlp())

    @jax.jit
    def step(params, state):
      value, grads = jax.value_and_grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state, value

    out = []
    for _ in range(20):
      params, state, value = step(params, state)
      out.append(float(value))
    return np.array(out)

  ours, theirs = curve(om.muon(0.02)), curve(optax.contrib.muon(0.02))
  assert ours[-1] < 0.5 * ours[0]  # it trains
  assert np.max(np.abs(ours - theirs) / theirs) < 1e-3, (ours, theirs)


def _wrapped(kind, tx):
  if kind == "chain":
    return optax.chain(optax.clip_by_global_norm(1.0), tx)
  if kind == "multi_steps":
    return optax.MultiSteps(tx, 2)
  if kind == "apply_if_finite":
    return optax.apply_if_finite(tx, 3)
  return tx


@pytest.mark.parametrize(
    "kind",
    [
        "muon",
        "chain",
        "inject_hyperparams",
        "multi_steps",
        "apply_if_finite",
        "nnx_optimizer",
    ],
)
def test_summarize_and_diagnostics_find_muon_inside_wrappers(kind):
  """Plain optax transformations: the tools find Muon's options by tracing
  ``init``."""
  params = _params()
  options = dict(
      ns_coeffs="polar_express",
      ns_steps=8,
      adam_learning_rate=1e-3,
      routing=om.Routing(adam_pattern="lm_head"),
      normalization=om.NorMuon(0.9),
  )
  if kind == "inject_hyperparams":
    tx = optax.inject_hyperparams(om.muon, static_args=("ns_steps",))(
        0.05, **options
    )
  else:
    tx = _wrapped(kind, om.muon(0.05, **options))
  expected = om.summarize(params, om.muon(0.05, **options))
  # The embedding goes to Muon: only lm_head matches this routing's pattern.
  assert {r.path: r.optimizer for r in expected.rows}[
      "embed/embedding"
  ] == "muon"
  if kind == "nnx_optimizer":
    model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    expected = om.summarize(params, om.muon(0.05, **options))
    holder = nnx.Optimizer(model, tx, wrt=nnx.Param)
  else:
    holder = tx
  summary = om.summarize(params, holder)
  assert summary.rows == expected.rows and summary.notes == expected.notes
  assert summary.notes[0].startswith("NorMuon (β₂ = 0.9)")
  plain = om.muon(0.05, **options)
  updates = jax.jit(plain.update)(
      random_grads(params, 0), plain.init(params), params
  )[0]
  metrics = om.diagnostics(updates, holder, params)
  assert metrics == om.diagnostics(updates, plain, params)
  assert set(metrics) == {
      "update_rms/muon",
      "update_rms/adam",
      "orthogonality_error",
  }


def test_summarize_rejects_foreign_transformations():
  with pytest.raises(ValueError, match="no optax_muon transformation found in"):
    om.summarize(_params(), optax.adam(1e-3))


def test_diagnostics():
  params = _params()
  tx = om.muon(
      0.05, ns_coeffs="polar_express", ns_steps=8, adam_learning_rate=1e-3
  )
  state = tx.init(params)
  updates, state = tx.update(_grads(params, 0), state, params)
  metrics = jax.jit(lambda u: om.diagnostics(u, tx, params))(updates)
  muon_u = updates["layer"]["kernel"]
  assert np.isclose(
      metrics["update_rms/muon"], jnp.sqrt(jnp.mean(muon_u**2)), rtol=1e-5
  )
  adam_leaves = [updates[k] for k in ("embed", "norm", "lm_head")]
  adam_rms = np.sqrt(
      sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(adam_leaves))
      / sum(x.size for x in jax.tree.leaves(adam_leaves))
  )
  assert np.isclose(metrics["update_rms/adam"], adam_rms, rtol=1e-5)
  assert metrics["orthogonality_error"] < 1e-3  # Polar Express ×8: orthogonal
  jordan = om.muon(0.05, adam_learning_rate=1e-3)
  u, _ = jordan.update(_grads(params, 0), jordan.init(params), params)
  assert om.diagnostics(u, jordan, params)["orthogonality_error"] > 0.05
  with pytest.raises(ValueError, match="'embed/embedding' is not a Muon leaf"):
    om.diagnostics(updates, tx, params, sample="embed/embedding")


def test_cautious_weight_decay_matches_numpy_reference():
  """W ← W − η·λ·W·[W ⊙ U ≥ 0] − η·U on both branches, U the direction before
  η."""
  params = _params()
  lr, wd, adam_lr, adam_wd = 0.05, 0.3, 0.003, 0.2
  tx = om.muon(
      lr,
      weight_decay=wd,
      adam_learning_rate=adam_lr,
      adam_weight_decay=adam_wd,
      ns_coeffs="polar_express",
      ns_steps=8,
      cautious_weight_decay=True,
  )
  adam_dir = optax.scale_by_adam(nesterov=True)
  muon_dir = optax.chain(
      om.scale_by_muon(ns_coeffs="polar_express", ns_steps=8),
      om.scale_by_shape(),
  )
  adam_keys = ("embed", "norm", "lm_head")
  s = tx.init(params)
  s_adam = adam_dir.init({k: params[k] for k in adam_keys})
  s_muon = muon_dir.init({"w": params["layer"]["kernel"]})
  masks = []
  update, adam_update, muon_update = (
      jax.jit(t.update) for t in (tx, adam_dir, muon_dir)
  )
  for t in range(3):
    g = _grads(params, t)
    u, s = update(g, s, params)
    u_adam, s_adam = adam_update({k: g[k] for k in adam_keys}, s_adam)
    u_muon, s_muon = muon_update({"w": g["layer"]["kernel"]}, s_muon)
    for k in adam_keys:
      for a, d, w in zip(
          jax.tree.leaves(u[k]),
          jax.tree.leaves(u_adam[k]),
          jax.tree.leaves(params[k]),
      ):
        d, w = np.asarray(d, np.float64), np.asarray(w, np.float64)
        assert rel_err(a, -adam_lr * (d + adam_wd * w * (w * d >= 0))) < 1e-6, k
    d, w = np.asarray(u_muon["w"], np.float64), np.asarray(
        params["layer"]["kernel"], np.float64
    )
    masks.append(w * d >= 0)
    assert rel_err(u["layer"]["kernel"], -lr * (d + wd * w * masks[-1])) < 1e-6
    params = optax.apply_updates(params, u)
  assert (
      0.2 < np.mean(masks) < 0.8
  )  # the mask really selects: neither all nor none


def test_cautious_weight_decay_keeps_the_state_structure():
  params = _params()
  plain = om.muon(0.02, weight_decay=0.1)
  cautious = om.muon(0.02, weight_decay=0.1, cautious_weight_decay=True)
  injected = optax.inject_hyperparams(om.muon)(
      learning_rate=0.02, weight_decay=0.1, cautious_weight_decay=True
  )
  assert jax.tree.structure(plain.init(params)) == jax.tree.structure(
      cautious.init(params)
  )
  assert jax.tree.structure(
      injected.init(params).inner_state
  ) == jax.tree.structure(cautious.init(params))
  u1, _ = cautious.update(_grads(params, 0), cautious.init(params), params)
  u2, _ = injected.update(_grads(params, 0), injected.init(params), params)
  for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2)):
    assert (
        rel_err(a, b) < 1e-4
    )  # injected b2 = 0.999 in float32: 1 − b2ᵗ is off by ~7e-6
  with pytest.raises(
      ValueError, match="weight_decay: cautious weight decay takes a number"
  ):
    om.muon(
        0.02,
        weight_decay=optax.constant_schedule(0.1),
        cautious_weight_decay=True,
    )


def test_summary_names_normuon_cautious_decay_and_the_ns_precision():
  params = _params()
  text = str(
      om.summarize(
          params,
          om.muon(0.02, normalization=om.NorMuon(), cautious_weight_decay=True),
      )
  )
  assert text.splitlines()[-3] == (
      "NorMuon (β₂ = 0.95) on 1 Muon leaf: updates normalized "
      "per output neuron after NS."
  )
  assert text.splitlines()[-2].startswith(
      "Cautious weight decay: matrix and AdamW leaves"
  )
  assert text.splitlines()[-1] == (
      "Newton–Schulz products: float32 at full precision (Precision.HIGHEST)."
  )
  assert "1 leaf on Muon, 4 on AdamW" in text
  plain = om.summarize(params, om.muon(0.02))
  assert len(plain.notes) == 1 and "NorMuon" not in str(plain)
  stack = om.summarize(
      {"w": jnp.zeros((2, 8, 8)), "v": jnp.zeros((8, 8))},
      om.scale_by_muon(
          normalization=om.NorMuon(0.9),
          weight_dimension_numbers={"w": DN(1, 2), "v": DN()},
          ns_options=om.NSOptions(compute_dtype=jnp.bfloat16),
      ),
  )
  assert stack.notes == (
      (
          "NorMuon (β₂ = 0.9) on 2 Muon leaves: updates normalized per "
          "output neuron after NS."
      ),
      "Newton–Schulz products: bfloat16 operands accumulated in float32.",
  )
