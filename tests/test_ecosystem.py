"""muon inside the usual Flax and optax machinery: each trains a few steps on
real text."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import optax_muon as om
from gpt import GPT, GPTConfig, batches, loss_fn, stdlib_corpus, train_step

pytestmark = (
    pytest.mark.slow
)  # compiles or trains real models: the full suite only

CFG = GPTConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32)
STEPS = 12


@pytest.fixture(scope="module")
def data():
  train, _ = stdlib_corpus(max_bytes=200_000)
  it = batches(train, 8, CFG.seq_len, seed=0)
  return [jnp.asarray(next(it)) for _ in range(STEPS)]


def _train_nnx(tx, data, steps=STEPS):
  model = GPT(CFG, nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  losses = [
      float(train_step(model, opt, data[i % len(data)])) for i in range(steps)
  ]
  return losses, model, opt


def _went_down(losses):
  return np.mean(losses[-3:]) < losses[0] - 0.3


def test_nnx_optimizer(data):
  losses, _, _ = _train_nnx(om.muon(0.02, adam_learning_rate=3e-3), data)
  assert _went_down(losses), losses


def test_chain_with_global_norm_clipping(data):
  tx = optax.chain(
      optax.clip_by_global_norm(1.0), om.muon(0.02, adam_learning_rate=3e-3)
  )
  losses, _, _ = _train_nnx(tx, data)
  assert _went_down(losses), losses


def test_inject_hyperparams_changes_learning_rate_at_run_time(data):
  tx = optax.inject_hyperparams(om.muon)(
      learning_rate=0.02, adam_learning_rate=3e-3
  )
  losses, model, opt = _train_nnx(tx, data)
  assert _went_down(losses), losses
  opt.opt_state.hyperparams["learning_rate"][...] = jnp.asarray(0.0)
  opt.opt_state.hyperparams["adam_learning_rate"][...] = jnp.asarray(0.0)
  before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  grads = nnx.grad(loss_fn)(model, data[0])
  opt.update(model, grads)
  after = nnx.state(model, nnx.Param)
  assert all(
      np.array_equal(a, b)
      for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
  )


def test_multi_steps_accumulates(data):
  tx = optax.MultiSteps(
      om.muon(0.02, adam_learning_rate=3e-3), every_k_schedule=2
  )
  losses, _, _ = _train_nnx(tx, data, steps=2 * STEPS)
  assert _went_down(losses), losses
  # Odd steps only accumulate: the loss on the first two steps is computed at
  # the same params.
  model = GPT(CFG, nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  p0 = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  opt.update(model, nnx.grad(loss_fn)(model, data[0]))
  assert all(
      np.array_equal(a, b)
      for a, b in zip(
          jax.tree.leaves(p0), jax.tree.leaves(nnx.state(model, nnx.Param))
      )
  )


def test_apply_if_finite_skips_nan_steps(data):
  tx = optax.apply_if_finite(
      om.muon(0.02, adam_learning_rate=3e-3), max_consecutive_errors=3
  )
  model = GPT(CFG, nnx.Rngs(0))
  opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
  p0 = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  grads = nnx.grad(loss_fn)(model, data[0])
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
  nnx.jit(lambda model, opt, grads: opt.update(model, grads))(model, opt, bad)
  assert all(
      np.array_equal(a, b)
      for a, b in zip(
          jax.tree.leaves(p0), jax.tree.leaves(nnx.state(model, nnx.Param))
      )
  )
  assert int(opt.opt_state.notfinite_count[...]) == 1

  @nnx.jit
  def step(model, opt, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    opt.update(model, grads)
    return loss

  losses = [float(step(model, opt, batch)) for batch in data]
  assert _went_down(losses), losses
  assert all(
      np.all(np.isfinite(x))
      for x in jax.tree.leaves(nnx.state(model, nnx.Param))
  )


class LinenLM(nn.Module):
  """A small linen byte model: embedding, a residual MLP, norm and head (no
  attention)."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(256, 32, name="embed")(tokens)
    x = x + nn.Dense(32, name="down")(nn.gelu(nn.Dense(64, name="up")(x)))
    return nn.Dense(256, name="lm_head")(nn.LayerNorm()(x))


def test_linen_train_state(data):
  model = LinenLM()
  params = model.init(jax.random.PRNGKey(0), data[0][:, :-1])["params"]
  tx = om.muon(0.02, adam_learning_rate=3e-3)
  labels = {r.path: r.optimizer for r in om.summarize(params, tx).rows}
  assert labels["up/kernel"] == "muon" and labels["embed/embedding"] == "adam"
  assert labels["lm_head/kernel"] == "adam" and labels["up/bias"] == "adam"
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx
  )

  @jax.jit
  def step(state, batch):
    def loss(p):
      logits = state.apply_fn({"params": p}, batch[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, batch[:, 1:]
      ).mean()

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), value

  losses = []
  for batch in data:
    state, loss = step(state, batch)
    losses.append(float(loss))
  assert _went_down(losses), losses
