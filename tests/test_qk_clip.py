"""QK-clip: a NumPy reference per head layout, the logit cap it promises, muon's
option, errors naming the leaf, and sharded == single device with no
collective."""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import optax_muon as om
from helpers import normal, rel_err
import hlo_cost

H = om.QKClipHeads
D, DH = 16, 4


def _normal(seed, shape):
  return normal(jax.random.PRNGKey(seed), shape)


def _reference(new, role, maxima, tau, alpha, heads, kv_heads=None):
  """NumPy QK-clip of one (d, blocks·head_dim) leaf, head by head."""
  new, maxima = np.array(new, np.float64), np.asarray(maxima, np.float64)
  gamma = np.where(maxima > tau, tau / maxima, 1.0)
  kv_heads = kv_heads or heads
  group = len(gamma) // kv_heads
  blocks = heads + 2 * kv_heads if role == "qkv" else heads
  width = new.shape[-1] // blocks
  for b in range(blocks):
    cols = slice(b * width, (b + 1) * width)
    if role == "query" or (role == "qkv" and b < heads):
      new[:, cols] *= gamma[b] ** alpha
    elif role == "key" or (role == "qkv" and b < heads + kv_heads):
      j = b if role == "key" else b - heads
      new[:, cols] *= gamma[j * group : (j + 1) * group].min() ** (1 - alpha)
  return new


CASES = {
    # name: (params shapes, heads declaration, maxima shape)
    "mha": (
        {"q": (D, 4 * DH), "k": (D, 4 * DH)},
        {"q": H("query", num_heads=4), "k": H("key", num_heads=4)},
        (4,),
    ),
    "gqa": (
        {"q": (D, 4 * DH), "k": (D, 2 * DH)},
        {"q": H("query", num_heads=4), "k": H("key", num_heads=2)},
        (4,),
    ),
    "fused-gqa": (
        {"qkv": (D, (4 + 2 * 2) * DH)},
        {"qkv": H("qkv", num_heads=4, num_kv_heads=2)},
        (4,),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_numpy_reference(case):
  shapes, heads, maxima_shape = CASES[case]
  params = {name: _normal(i, s) for i, (name, s) in enumerate(shapes.items())}
  grads = {
      name: _normal(10 + i, s) for i, (name, s) in enumerate(shapes.items())
  }
  maxima = jnp.array([40.0, 5.0, 8.0, 9.0])[
      : maxima_shape[0]
  ]  # head 0 over τ = 10
  tau, alpha, lr = 10.0, 0.3, 0.1
  tx = optax.chain(optax.sgd(lr), om.qk_clip(tau, alpha, heads=heads))
  updates, _ = jax.jit(tx.update)(
      grads, tx.init(params), params, attn_logit_max=maxima
  )
  for name, spec in heads.items():
    new = params[name] - lr * grads[name]
    want = _reference(
        new, spec.role, maxima, tau, alpha, spec.num_heads, spec.num_kv_heads
    )
    assert rel_err(params[name] + updates[name], want) < 1e-6, name
    untouched = np.isclose(want, np.asarray(new, np.float64), rtol=0, atol=0)
    assert untouched.any() and (~untouched).any()
    # Heads below τ keep the plain update bit for bit.
    assert np.array_equal(
        np.asarray(updates[name])[untouched],
        np.asarray(-lr * grads[name])[untouched],
    )


@pytest.mark.slow
def test_stacked_layers_with_head_axis():
  """(layers, d, heads, head_dim) kernels: maxima (layers, heads), each layer
  its own γ."""
  q, k = _normal(0, (3, D, 4, DH)), _normal(1, (3, D, 2, DH))
  params = {"q": q, "k": k}
  heads = {
      "q": H("query", axis=2, layer_axes=(0,)),
      "k": H("key", axis=2, layer_axes=(0,)),
  }
  maxima = jnp.array([[20.0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 40.0]])
  tx = om.qk_clip(10.0, heads=heads)
  zero = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero, tx.init(params), params, attn_logit_max=maxima)
  new = optax.apply_updates(params, updates)
  for layer in range(3):
    flat = lambda x: np.asarray(x[layer]).reshape(D, -1)  # noqa: B023 (called in this iteration)
    assert (
        rel_err(
            flat(new["q"]),
            _reference(flat(q), "query", maxima[layer], 10.0, 0.5, 4),
        )
        < 1e-6
    )
    assert (
        rel_err(
            flat(new["k"]),
            _reference(flat(k), "key", maxima[layer], 10.0, 0.5, 2),
        )
        < 1e-6
    )
  assert np.array_equal(new["q"][1], q[1])


def _head_max_logits(x, wq, wk, heads, kv_heads):
  """Per query head, the largest causal logit of one attention layer (GQA by
  repeat)."""
  b, t, _ = x.shape
  q = (x @ wq).reshape(b, t, heads, DH)
  k = jnp.repeat(
      (x @ wk).reshape(b, t, kv_heads, DH), heads // kv_heads, axis=2
  )
  logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(DH)
  return jnp.max(
      jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf),
      axis=(0, 2, 3),
  )


@pytest.mark.slow
def test_post_clip_logits_are_capped_at_tau():
  """With S measured on the parameters it rescales, every head's logits end ≤ τ,
  and the head that set its group's γ lands on τ."""
  x = 3 * _normal(0, (2, 8, D))
  params = {"q": _normal(1, (D, 4 * DH)), "k": _normal(2, (D, 2 * DH))}
  heads = {"q": H("query", num_heads=4), "k": H("key", num_heads=2)}
  grads = {"q": _normal(3, (D, 4 * DH)), "k": _normal(4, (D, 2 * DH))}
  new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  before = _head_max_logits(x, new["q"], new["k"], 4, 2)
  tau = float(jnp.sort(before)[1])  # two heads over τ
  tx = optax.chain(optax.sgd(0.1), om.qk_clip(tau, heads=heads))
  updates, _ = tx.update(grads, tx.init(params), params, attn_logit_max=before)
  clipped = optax.apply_updates(params, updates)
  after = _head_max_logits(x, clipped["q"], clipped["k"], 4, 2)
  assert int(jnp.sum(before > tau)) == 2 and float(jnp.max(before)) > 1.2 * tau
  np.testing.assert_array_less(after, tau * (1 + 1e-5))
  assert float(jnp.max(after)) == pytest.approx(
      tau, rel=1e-5
  )  # the largest lands on τ
  np.testing.assert_array_less(
      after, before * (1 + 1e-5)
  )  # GQA: siblings only shrink


def _gpt_like():
  params = {
      "blocks": [
          {
              "q": _normal(i, (D, 4 * DH)),
              "k": _normal(10 + i, (D, 2 * DH)),
              "mlp": _normal(20 + i, (D, 2 * D)),
              "ln": jnp.ones(D),
          }
          for i in range(2)
      ],
      "embed": _normal(30, (32, D)),
  }
  heads = lambda p: {
      "blocks": [
          {
              "q": H("query", num_heads=4),
              "k": H("key", num_heads=2),
              "mlp": None,
              "ln": None,
          }
          for _ in p["blocks"]
      ],
      "embed": None,
  }
  maxima = {
      "blocks": [
          jnp.array([30.0, 1.0, 2.0, 15.0]),
          jnp.array([1.0, 2.0, 3.0, 4.0]),
      ]
  }
  return params, heads, maxima


@pytest.mark.slow
def test_muon_option_is_muon_then_qk_clip():
  params, heads, maxima = _gpt_like()
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  plain = om.muon(0.05)
  clipped = om.muon(0.05, qk_clip=om.QKClip(10.0, heads))
  s_plain, s_clip = plain.init(params), clipped.init(params)
  assert jax.tree.structure(s_plain) == jax.tree.structure(s_clip)
  clip = om.qk_clip(10.0, heads=heads)
  for _ in range(2):
    u_plain, s_plain = jax.jit(plain.update)(grads, s_plain, params)
    u_clip, s_clip = jax.jit(clipped.update)(
        grads, s_clip, params, attn_logit_max=maxima
    )
    want, _ = clip.update(
        u_plain, clip.init(params), params, attn_logit_max=maxima
    )
    for a, b in zip(jax.tree.leaves(u_clip), jax.tree.leaves(want)):
      assert rel_err(a, b) < 1e-6
    params = optax.apply_updates(params, u_clip)
  assert not np.allclose(u_clip["blocks"][0]["q"], u_plain["blocks"][0]["q"])
  np.testing.assert_array_equal(
      u_clip["blocks"][1]["q"], u_plain["blocks"][1]["q"]
  )
  summary = om.summarize(params, clipped)
  rows = {r.path: r.qk_clip for r in summary.rows}
  assert (
      rows["blocks/0/q"] == "query, 4 heads"
      and rows["blocks/1/k"] == "key, 2 heads"
  )
  assert rows["blocks/0/mlp"] == ""
  assert "QK-clip (τ = 10, α = 0.5) on 2 query, 2 key projections." in str(
      summary
  )


@pytest.mark.parametrize(
    "maxima,match",
    [
        (None, r"update needs attn_logit_max= .* 'blocks/0/k'"),
        (
            {"blocks": [jnp.ones(4)]},
            r"no attn_logit_max entry for 'blocks/1/k'",
        ),
        (
            {"blocks": [jnp.ones(4), jnp.ones(4)], "head": jnp.ones(4)},
            r"entries \['head'\] serve no query or key projection",
        ),
        (
            {"blocks": [jnp.ones(4), jnp.ones(3)]},
            r"'blocks/1/k' \(key, 2 heads\) needs maxima of shape \('H',\) with"
            r" H = a multiple of "
            r"its 2 key heads; attn_logit_max entry 'blocks/1' has shape"
            r" \(3,\)",
        ),
        (
            {"blocks": [jnp.ones(4), jnp.ones((2, 4))]},
            r"'blocks/1/k' .* has shape \(2, 4\)",
        ),
    ],
)
def test_bad_maxima_name_the_leaf(maxima, match):
  params, heads, _ = _gpt_like()
  tx = om.muon(0.05, qk_clip=om.QKClip(10.0, heads))
  with pytest.raises(ValueError, match=match):
    # Traced, not run: the error is raised at trace time, before any compile.
    jax.eval_shape(
        lambda p: tx.update(p, tx.init(p), p, attn_logit_max=maxima), params
    )


@pytest.mark.parametrize(
    "heads,match",
    [
        (
            {"q": H("query", num_heads=3), "k": None},
            r"q: 3 heads do not split axis 1 of size 16",
        ),
        (
            {"q": H("query", axis=2), "k": None},
            r"q: QKClipHeads.axis 2 is out of range",
        ),
        ({"q": H("value"), "k": None}, r"q: QKClipHeads.role must be one of"),
        (
            {"q": H("qkv"), "k": None},
            r"q: a fused qkv projection needs QKClipHeads.num_heads",
        ),
        (
            {"q": H("query", layer_axes=(1,)), "k": None},
            r"q: QKClipHeads axis -1 and layer_axes",
        ),
        (
            {"q": H("query")},
            r"heads does not match the params: no entry for leaf 'k'",
        ),
        ({"q": None, "k": None}, r"heads declares no query or key projection"),
    ],
)
def test_bad_heads_name_the_leaf(heads, match):
  params = {"q": jnp.ones((8, 16)), "k": jnp.ones((8, 16))}
  with pytest.raises(ValueError, match=match):
    om.qk_clip(heads=heads).init(params)


def test_bad_options():
  with pytest.raises(ValueError, match="threshold must lie in"):
    om.qk_clip(0.0, heads=H("query"))
  with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
    om.qk_clip(alpha=1.5, heads=H("query"))
  with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
    om.QKClip(100.0, H("query"), alpha=-0.5)
  with pytest.raises(ValueError, match="QKClip.heads is required"):
    om.QKClip(100.0, None)
  with pytest.raises(
      ValueError, match="qk_clip must be an optax_muon.QKClip or None"
  ):
    om.muon(0.02, qk_clip=100.0)
  tx = om.qk_clip(heads=H("query"))
  with pytest.raises(ValueError, match="pass params to update"):
    tx.update(
        {"q": jnp.ones((4, 4))}, optax.EmptyState(), attn_logit_max=jnp.ones(4)
    )


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_sharded_equals_single_device_without_collectives(axis_type):
  """q sharded on its input axis (FSDP), k on its head axis (tensor
  parallel)."""
  params, heads, maxima = _gpt_like()
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  standard = om.NSOptions(method="standard")
  tx = om.muon(0.05, qk_clip=om.QKClip(10.0, heads), ns_options=standard)
  reference, _ = jax.jit(tx.update)(
      grads, tx.init(params), params, attn_logit_max=maxima
  )

  mesh = jax.make_mesh((8,), ("x",), axis_types=(axis_type,))

  def spec(path, leaf):
    name = path[-1].key
    return (
        P(None, "x")
        if name == "k"
        else P("x")
        if leaf.shape[0] % 8 == 0
        else P()
    )

  shardings = jax.tree.map(
      lambda s: NamedSharding(mesh, s),
      jax.tree_util.tree_map_with_path(spec, params),
  )
  put = lambda tree: jax.tree.map(jax.device_put, tree, shardings)
  explicit = axis_type == AxisType.Explicit
  sharded_tx = om.muon(
      0.05,
      qk_clip=om.QKClip(10.0, heads),
      ns_options=standard,
      param_shardings=None if explicit else shardings,
  )
  clip = om.qk_clip(10.0, heads=heads)
  with jax.set_mesh(mesh):
    state = jax.jit(sharded_tx.init)(put(params))
    updates, _ = jax.jit(sharded_tx.update)(
        put(grads), state, put(params), attn_logit_max=maxima
    )
    compiled = (
        jax.jit(clip.update, out_shardings=(shardings, None))
        .lower(
            put(grads), optax.EmptyState(), put(params), attn_logit_max=maxima
        )
        .compile()
    )
  for (path, a), b, s in zip(
      jax.tree_util.tree_leaves_with_path(updates),
      jax.tree.leaves(reference),
      jax.tree.leaves(shardings),
  ):
    assert rel_err(a, b) < 1e-5, jax.tree_util.keystr(path)
    assert a.sharding.is_equivalent_to(s, a.ndim), jax.tree_util.keystr(path)
  # Elementwise per head: no matrix moves. (Under Auto axes XLA may all-gather a
  # factor vector it chose to compute sharded: 16 floats, against 256 for the
  # smallest matrix.)
  collectives = hlo_cost.analyze(compiled, 8).collectives
  assert all(c.output_bytes <= 4 * 4 * DH for c in collectives), collectives
  assert explicit <= (collectives == [])


def test_docstring_examples():
  module = importlib.import_module("optax_muon._src.core.qk_clipping")
  assert doctest.testmod(module).failed == 0


def test_inside_shard_map_with_local_heads():
  """In a shard_map train step each device declares and reports the heads it
  holds."""
  params = {"q": _normal(0, (D, 8 * DH)), "k": _normal(1, (D, 8 * DH))}
  updates = jax.tree.map(lambda x: 0.1 * jnp.sin(x), params)
  maxima = jnp.arange(8.0) * 4  # heads 3..7 over τ = 10
  full = om.qk_clip(
      10.0, heads={"q": H("query", num_heads=8), "k": H("key", num_heads=8)}
  )
  want, _ = full.update(
      updates, optax.EmptyState(), params, attn_logit_max=maxima
  )
  local = om.qk_clip(
      10.0, heads={"q": H("query", num_heads=1), "k": H("key", num_heads=1)}
  )
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,))
  specs = {"q": P(None, "x"), "k": P(None, "x")}
  step = jax.shard_map(
      lambda u, p, m: local.update(u, optax.EmptyState(), p, attn_logit_max=m)[
          0
      ],
      mesh=mesh,
      in_specs=(specs, specs, P("x")),
      out_specs=specs,
  )
  put = lambda tree: jax.tree.map(
      lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  with jax.set_mesh(mesh):
    got = jax.jit(step)(
        put(updates),
        put(params),
        jax.device_put(maxima, NamedSharding(mesh, P("x"))),
    )
  for name in params:
    assert rel_err(got[name], want[name]) < 1e-6, name
