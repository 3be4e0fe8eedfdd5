"""An orbax checkpoint of an optax.contrib.muon run restores into
``optax_muon.muon``'s state, and the restored run continues as contrib's own.

Where the configurations coincide the two states have one layout: the same
tree (dict keys, tuple lengths, NamedTuple names and fields, ``MaskedNode`` and
``EmptyState`` where contrib has them) and the same leaf shapes and dtypes.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import optax_muon as om
from helpers import rel_err, requires_contrib_api

pytestmark = requires_contrib_api

VOCAB, WIDTH, HEADS, LENGTH, BATCH = 32, 16, 2, 8, 4
SAVED_AT, MORE = 3, 3  # steps before the checkpoint, and after it

# Our arguments that make the configurations coincide, beyond the routing:
# optax's NS epsilon (the presets' is 1e-7), and optax's iteration on X·Xᵀ (in
# float32 ours would take the Gram form for 64 × 16 kernels: the same function,
# rounded differently, about 1e-5 of the update apart).
_SAME_NS = {"eps": 1e-8, "ns_options": om.NSOptions(method="standard")}


class _Block(nn.Module):
  """A pre-norm transformer block, as a small GPT has."""

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    # No attention biases: the key's gets no gradient (softmax ignores it), and
    # AdamW turns rounding noise into full-size steps there.
    x = x + nn.MultiHeadDotProductAttention(HEADS, use_bias=False)(
        h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2]))
    )
    h = nn.LayerNorm()(x)
    return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(4 * WIDTH)(h)))


class _GPT(nn.Module):

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH)(tokens)
    x = _Block()(x)
    return nn.Dense(VOCAB, name="head")(nn.LayerNorm()(x))


class _MLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs)
    self.out = nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def _gpt_dims(params):
  """optax.contrib's dimension numbers for the GPT: attention's (d, heads,
  head_dim) and (heads, head_dim, d) kernels and the MLP's kernels on Muon;
  the embedding, the head, norms and biases on AdamW (``None``)."""
  cdn = optax.contrib.MuonDimensionNumbers

  def dims(path, x):
    names = [getattr(k, "key", None) for k in path]
    if names[-1] != "kernel" or "head" in names:
      return None
    if x.ndim == 2:
      return cdn()
    return cdn(0, (1, 2)) if "out" not in names else cdn((0, 1), 2)

  return jax.tree_util.tree_map_with_path(dims, params)


def _gpt():
  """A linen GPT's params, ``muon_weight_dimension_numbers`` for both
  optimizers, and a next-token loss."""
  model = _GPT()
  tokens = np.random.default_rng(1).integers(
      0, VOCAB, (SAVED_AT + MORE, BATCH, LENGTH)
  )
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[0])

  def loss(p, batch):
    logits = model.apply(p, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]
    ).mean()

  dims = {"muon_weight_dimension_numbers": _gpt_dims}
  table = {"ns_coeffs": "dion", "ns_steps": 5}  # ns_coeffs: f32[5, 3]
  return params, loss, tokens, dims | table, dims | table | _SAME_NS


def _nnx_mlp():
  """An NNX MLP's params (a pure dict), optax.contrib's every-2-D routing on
  both sides, and a regression loss."""
  model = _MLP(nnx.Rngs(0))
  graphdef, state = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(state)  # {"hidden": {"kernel", "bias"}, "out": …}
  # 4·WIDTH rows, so that the kernels' gradients have full rank (Newton–Schulz
  # lifts the rounding noise in a rank-deficient gradient's zero singular
  # values).
  xs = np.random.default_rng(1).standard_normal(
      (SAVED_AT + MORE, 4 * WIDTH, WIDTH), np.float32
  )

  def loss(p, x):
    return jnp.mean((nnx.merge(graphdef, p)(x) - jnp.sin(x)) ** 2)

  every_2d = om.Routing(
      adam_pattern=None, biases=False, layouts=(), layer_stacks=()
  )
  return params, loss, xs, {}, {"routing": every_2d, **_SAME_NS}


def _trainer(tx, loss):
  """``run(params, state, batches)``: ``tx`` on ``batches`` (one compiled
  step), returning the params, the state and each step's updates."""

  @jax.jit
  def step(p, s, batch):
    grads = jax.grad(loss)(p, batch)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, updates

  def run(params, state, batches):
    history = []
    for batch in batches:
      params, state, updates = step(params, state, batch)
      history.append(updates)
    return params, state, history

  return run


def _layout(tree):
  """The tree's structure (NamedTuple names and fields, keys, empty nodes) and
  each leaf's shape and dtype."""
  return str(jax.tree.structure(tree)), [
      (x.shape, x.dtype) for x in jax.tree.leaves(tree)
  ]


@pytest.mark.parametrize(
    "model", [pytest.param(_gpt, marks=pytest.mark.slow), _nnx_mlp]
)
def test_contrib_checkpoint_restores_into_muon_and_continues(tmp_path, model):
  params, loss, batches, contrib_args, our_args = model()
  common = {
      "learning_rate": optax.linear_schedule(0.02, 0.005, SAVED_AT + MORE),
      "weight_decay": 0.01,
      "adam_weight_decay": 0.01,
  }
  contrib = optax.contrib.muon(**common, **contrib_args)
  ours = om.muon(**common, **our_args)

  # One layout (the routing included: MaskedNode marks the other branch's
  # leaves), and the same values: zeros, and the NS coefficients.
  fresh = ours.init(params)
  assert _layout(fresh) == _layout(contrib.init(params))
  for a, b in zip(
      jax.tree.leaves(fresh), jax.tree.leaves(contrib.init(params))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # contrib for SAVED_AT steps, saved with orbax; then contrib on.
  run_contrib, run_ours = _trainer(contrib, loss), _trainer(ours, loss)
  p, s, _ = run_contrib(params, contrib.init(params), batches[:SAVED_AT])
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "contrib", {"params": p, "opt_state": s})
  checkpointer.wait_until_finished()
  want_params, _, want_updates = run_contrib(p, s, batches[SAVED_AT:])

  # Restored into our state (our init is the target), then ours on.
  restored = checkpointer.restore(
      tmp_path / "contrib", {"params": params, "opt_state": fresh}
  )
  assert _layout(restored["opt_state"]) == _layout(fresh)
  for a, b in zip(
      jax.tree.leaves(restored), jax.tree.leaves({"params": p, "opt_state": s})
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  got_params, _, got_updates = run_ours(
      restored["params"], restored["opt_state"], batches[SAVED_AT:]
  )

  for t, (got, want) in enumerate(zip(got_updates, want_updates)):
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)
    ):
      assert a.dtype == b.dtype == jnp.float32
      assert rel_err(a, b) < 1e-5, (t, jax.tree_util.keystr(path))
  for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(want_params)):
    assert rel_err(a, b) < 1e-5
