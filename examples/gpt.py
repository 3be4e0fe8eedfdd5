"""A small byte-level GPT in Flax NNX and the built-in corpus it trains on.

The corpus is the Python standard library's own source files: real text that
ships with every Python install, so the examples, benchmarks and tests need no
download.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model size.

  Attributes:
    vocab: vocabulary size (256 for bytes).
    seq_len: context length.
    d_model: width.
    n_layers: transformer blocks.
    n_heads: attention heads.
    mlp_ratio: MLP hidden width ÷ d_model.
  """

  vocab: int = 256
  seq_len: int = 128
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  mlp_ratio: int = 4


class Block(nnx.Module):
  """Pre-norm transformer block: causal self-attention and a GELU MLP."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    d = cfg.d_model
    self.n_heads = cfg.n_heads
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.q = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.k = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.v = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, cfg.mlp_ratio * d, rngs=rngs)
    self.mlp_out = nnx.Linear(cfg.mlp_ratio * d, d, rngs=rngs)

  def __call__(self, x: jax.Array, *, with_logit_max: bool = False):
    """The block's output; with ``with_logit_max``, also ``head_logit_max`` of
    its attention."""
    b, t, d = x.shape
    h = self.ln1(x)
    split = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)
    q, k = split(self.q(h)), split(self.k(h))
    attn = jax.nn.dot_product_attention(q, k, split(self.v(h)), is_causal=True)
    x = x + self.o(attn.reshape(b, t, d))
    x = x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))
    return (x, head_logit_max(q, k)) if with_logit_max else x


def head_logit_max(q: jax.Array, k: jax.Array) -> jax.Array:
  """Per head, the largest causal pre-softmax logit q_i·k_j/√head_dim over the
  batch.

  Args:
    q, k: (batch, seq, heads, head_dim) queries and keys.

  Returns:
    A (heads,) float32 array, without gradient (QK-clip's S_h).
  """
  t = q.shape[1]
  logits = jnp.einsum(
      "bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32
  )
  logits = jnp.where(
      jnp.tril(jnp.ones((t, t), bool)), logits / np.sqrt(q.shape[-1]), -jnp.inf
  )
  return jax.lax.stop_gradient(jnp.max(logits, axis=(0, 2, 3)))


def embedding_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """table[tokens], with the output sharded like the tokens under an Explicit
  mesh."""
  spec = jax.typeof(tokens).sharding.spec
  if not any(spec):
    return jnp.take(table, tokens, axis=0)
  return table.at[tokens].get(out_sharding=P(*spec, None))


class GPT(nnx.Module):
  """Token and position embeddings, blocks, final norm and an untied output
  head."""

  def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
    self.pos_embed = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (cfg.seq_len, cfg.d_model))
    )
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
    self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
    self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens: jax.Array, *, with_logit_max: bool = False):
    """Next-token logits; with ``with_logit_max``, also ``{"blocks": [S_0, S_1,
    ...]}``, each block's per-head largest attention logit (``head_logit_max``): the shape QK-clip's
    ``attn_logit_max`` takes, matched to ``blocks/i/q`` and ``blocks/i/k`` by
    path."""
    x = (
        embedding_lookup(self.embed.embedding[...], tokens)
        + self.pos_embed[: tokens.shape[1]]
    )
    maxima = []
    for block in self.blocks:
      if with_logit_max:
        x, m = block(x, with_logit_max=True)
        maxima.append(m)
      else:
        x = block(x)
    logits = self.lm_head(self.ln_f(x))
    return (logits, {"blocks": maxima}) if with_logit_max else logits


def loss_fn(model: GPT, batch: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of a (batch, seq_len + 1) token
  array."""
  return cross_entropy(model(batch[:, :-1]), batch)


def cross_entropy(logits: jax.Array, batch: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of ``logits`` for a (batch, seq_len +
  1) array."""
  return jnp.mean(
      -jnp.take_along_axis(
          jax.nn.log_softmax(logits.astype(jnp.float32)),
          batch[:, 1:, None],
          axis=-1,
      )
  )


def loss_and_logit_max(model: GPT, batch: jax.Array) -> tuple[jax.Array, dict]:
  """``loss_fn`` and the model's per-head attention logit maxima (for
  ``has_aux``)."""
  logits, maxima = model(batch[:, :-1], with_logit_max=True)
  return cross_entropy(logits, batch), maxima


@nnx.jit
def train_step(
    model: GPT, optimizer: nnx.Optimizer, batch: jax.Array
) -> jax.Array:
  """One ``nnx.Optimizer`` step on a batch; returns the loss before the step."""
  loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
  optimizer.update(model, grads)
  return loss


def stdlib_corpus(
    max_bytes: int = 4_000_000, val_fraction: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
  """The standard library's top-level ``.py`` files as bytes, split into
  train/validation.

  Files are read in sorted order and the split is the corpus's last
  ``val_fraction``, so the same Python version always gives the same data.

  Args:
    max_bytes: cap on the corpus size.
    val_fraction: share held out for validation.

  Returns:
    (train, validation) uint8 arrays.
  """
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  corpus = np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)
  split = int(len(corpus) * (1 - val_fraction))
  return corpus[:split], corpus[split:]


def batches(data: np.ndarray, batch_size: int, seq_len: int, seed: int):
  """Endless random windows of ``seq_len + 1`` bytes, as int32 arrays."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
    yield np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_windows(data: np.ndarray, count: int, seq_len: int) -> np.ndarray:
  """``count`` evenly spaced validation windows (deterministic)."""
  starts = np.linspace(0, len(data) - seq_len - 2, count).astype(np.int64)
  return np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)
