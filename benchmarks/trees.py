"""GPT-like parameter trees for the benchmarks: per-layer or stacked (scanned) layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_muon


def gpt_tree(d: int, layers: int, *, stacked: bool = False, vocab: int = 256,
             dtype=jnp.float32, seed: int = 0) -> dict:
  """Params shaped like a GPT: embed, blocks (q, k, v, o, mlp_in, mlp_out, norms), head.

  Args:
    d: width.
    layers: block count.
    stacked: one (layers, ...) leaf per block parameter instead of one leaf per layer.
    vocab: vocabulary size.
    dtype: leaf dtype.
    seed: for the random values.

  Returns:
    A nested dict of arrays.
  """
  rng = np.random.default_rng(seed)
  block_shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d),
                  "mlp_in": (d, 4 * d), "mlp_out": (4 * d, d), "ln1": (d,), "ln2": (d,),
                  "mlp_in_bias": (4 * d,)}
  make = lambda shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), dtype)
  if stacked:
    blocks = {k: make((layers, *s)) for k, s in block_shapes.items()}
  else:
    blocks = {str(i): {k: make(s) for k, s in block_shapes.items()} for i in range(layers)}
  return {"embed": make((vocab, d)), "blocks": blocks, "ln_f": make((d,)),
          "lm_head": make((d, vocab))}


def muon_dims(params: dict, *, contrib: bool = False, adam: tuple[str, ...] = ()):
  """Dimension numbers: (L, n_in, n_out) → per-layer matrices, 2-D → itself, else None.

  Top-level entries named in ``adam`` (e.g. the embedding and head) get None: AdamW.
  """
  cls = optax.contrib.MuonDimensionNumbers if contrib else optax_muon.MuonDimensionNumbers

  stacked = any(x.ndim == 3 for x in jax.tree.leaves(params))

  def dims(x):
    if x.ndim == 3:
      return cls(1, 2)
    # In a stacked tree the 2-D block leaves are per-layer vectors (L, d).
    return cls(0, 1) if x.ndim == 2 and not stacked else None

  return {k: jax.tree.map(lambda _: None, v) if k in adam
          else jax.tree.map(dims, v) if k == "blocks" else
          jax.tree.map(lambda x: cls(0, 1) if x.ndim == 2 else None, v)
          for k, v in params.items()}


def random_like(params: dict, seed: int) -> dict:
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype)
                                      for k, x in zip(keys, leaves)])

