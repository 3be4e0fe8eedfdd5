"""Parameter trees for the benchmarks: GPT-like (per-layer or stacked),
Llama-like (grouped- query attention + SwiGLU, stacked) and mixture-of-experts
(stacked, experts per layer)."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_muon


def gpt_tree(
    d: int,
    layers: int,
    *,
    stacked: bool = False,
    vocab: int = 256,
    dtype=jnp.float32,
    seed: int = 0,
) -> dict:
  """Params shaped like a GPT: embed, blocks (q, k, v, o, mlp_in, mlp_out,
  norms), head.

  Args:
    d: width.
    layers: block count.
    stacked: one (layers, ...) leaf per block parameter instead of one leaf per
      layer.
    vocab: vocabulary size.
    dtype: leaf dtype.
    seed: for the random values.

  Returns:
    A nested dict of arrays.
  """
  rng = np.random.default_rng(seed)
  block_shapes = {
      "q": (d, d),
      "k": (d, d),
      "v": (d, d),
      "o": (d, d),
      "mlp_in": (d, 4 * d),
      "mlp_out": (4 * d, d),
      "ln1": (d,),
      "ln2": (d,),
      "mlp_in_bias": (4 * d,),
  }
  make = lambda shape: jnp.asarray(
      rng.standard_normal(shape) / np.sqrt(shape[-1]), dtype
  )
  if stacked:
    blocks = {k: make((layers, *s)) for k, s in block_shapes.items()}
  else:
    blocks = {
        str(i): {k: make(s) for k, s in block_shapes.items()}
        for i in range(layers)
    }
  return {
      "embed": make((vocab, d)),
      "blocks": blocks,
      "ln_f": make((d,)),
      "lm_head": make((d, vocab)),
  }


def llama_tree(
    d: int,
    layers: int,
    *,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int = 256,
    dtype=jnp.float32,
    seed: int = 0,
) -> dict:
  """Stacked Llama-like params: grouped-query attention (q, o: d × d; k, v: d ×
  kv_heads·hd) and a SwiGLU MLP (gate, up: d × ffn; down: ffn × d), RMSNorm
  scales, embedding and head.

  Args:
    d: width.
    layers: block count (the leading axis of every block leaf).
    heads: query heads (head dim d / heads).
    kv_heads: key/value heads.
    ffn: the MLP's hidden width.
    vocab: vocabulary size.
    dtype: leaf dtype.
    seed: for the random values.

  Returns:
    A nested dict of arrays.
  """
  kv = kv_heads * d // heads
  shapes = {
      "q": (d, d),
      "k": (d, kv),
      "v": (d, kv),
      "o": (d, d),
      "gate": (d, ffn),
      "up": (d, ffn),
      "down": (ffn, d),
      "attn_norm": (d,),
      "mlp_norm": (d,),
  }
  return _stacked(shapes, d, layers, vocab, dtype, seed)


def moe_tree(
    d: int,
    layers: int,
    *,
    heads: int,
    kv_heads: int,
    experts: int,
    expert_ffn: int,
    vocab: int = 256,
    dtype=jnp.float32,
    seed: int = 0,
) -> dict:
  """Stacked mixture-of-experts params: the attention of ``llama_tree``, a
  router (d × E) and per layer E SwiGLU experts (gate, up: (L, E, d,
  expert_ffn); down: (L, E, expert_ffn, d)).

  Args:
    d: width.
    layers: block count.
    heads: query heads.
    kv_heads: key/value heads.
    experts: E, experts per layer.
    expert_ffn: each expert's hidden width.
    vocab: vocabulary size.
    dtype: leaf dtype.
    seed: for the random values.

  Returns:
    A nested dict of arrays.
  """
  kv = kv_heads * d // heads
  shapes = {
      "q": (d, d),
      "k": (d, kv),
      "v": (d, kv),
      "o": (d, d),
      "router": (d, experts),
      "gate": (experts, d, expert_ffn),
      "up": (experts, d, expert_ffn),
      "down": (experts, expert_ffn, d),
      "attn_norm": (d,),
      "mlp_norm": (d,),
  }
  return _stacked(shapes, d, layers, vocab, dtype, seed)


def _stacked(
    block_shapes: dict, d: int, layers: int, vocab: int, dtype, seed: int
) -> dict:
  rng = np.random.default_rng(seed)
  make = lambda shape: jnp.asarray(
      rng.standard_normal(shape) / np.sqrt(shape[-1]), dtype
  )
  return {
      "embed": make((vocab, d)),
      "blocks": {k: make((layers, *s)) for k, s in block_shapes.items()},
      "final_norm": make((d,)),
      "lm_head": make((d, vocab)),
  }


def stacked_dims(
    params: dict, *, contrib: bool = False, adam: tuple[str, ...] = ()
):
  """Dimension numbers of a stacked tree: the last two axes of every ≥3-D block
  leaf form the matrix (layer and expert axes are batch axes); block vectors and
  the top-level entries named in ``adam`` get None (AdamW)."""
  # optax.contrib has its own type from optax 0.2.6 on; before, its muon takes
  # no trees.
  cls = (
      getattr(
          optax.contrib, "MuonDimensionNumbers", optax_muon.MuonDimensionNumbers
      )
      if contrib
      else optax_muon.MuonDimensionNumbers
  )
  dims = lambda x: cls(x.ndim - 2, x.ndim - 1) if x.ndim >= 3 else None
  return {
      k: (
          jax.tree.map(lambda _: None, v)
          if k in adam
          else jax.tree.map(dims, v)
          if k == "blocks"
          else jax.tree.map(lambda x: cls(0, 1) if x.ndim == 2 else None, v)
      )
      for k, v in params.items()
  }


def muon_dims(
    params: dict, *, contrib: bool = False, adam: tuple[str, ...] = ()
):
  """Dimension numbers: (L, n_in, n_out) → per-layer matrices, 2-D → itself,
  else None.

  Top-level entries named in ``adam`` (e.g. the embedding and head) get None:
  AdamW.
  """
  # optax.contrib has its own type from optax 0.2.6 on; before, its muon takes
  # no trees.
  cls = (
      getattr(
          optax.contrib, "MuonDimensionNumbers", optax_muon.MuonDimensionNumbers
      )
      if contrib
      else optax_muon.MuonDimensionNumbers
  )

  stacked = any(x.ndim == 3 for x in jax.tree.leaves(params))

  def dims(x):
    if x.ndim == 3:
      return cls(1, 2)
    # In a stacked tree the 2-D block leaves are per-layer vectors (L, d).
    return cls(0, 1) if x.ndim == 2 and not stacked else None

  return {
      k: (
          jax.tree.map(lambda _: None, v)
          if k in adam
          else jax.tree.map(dims, v)
          if k == "blocks"
          else jax.tree.map(lambda x: cls(0, 1) if x.ndim == 2 else None, v)
      )
      for k, v in params.items()
  }


def random_like(params: dict, seed: int) -> dict:
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(
      treedef,
      [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)],
  )


def require_optax_contrib_muon() -> None:
  """The benchmarks compare against optax.contrib.muon as optax 0.2.8 has it
  (dimension numbers, preconditioning, consistent_rms, a separate AdamW learning
  rate).

  Raises:
    SystemExit: with what to install, on an older optax.
  """
  if "preconditioning" not in inspect.signature(optax.contrib.muon).parameters:
    raise SystemExit(
        "This benchmark compares against optax.contrib.muon as optax 0.2.8 has"
        f" it; optax {optax.__version__} is installed. pip install"
        " 'optax>=0.2.8'"
    )
