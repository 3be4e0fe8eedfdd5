"""Parameter trees recorded from real libraries (``tests/trees/*.json``), as
trees of ``jax.ShapeDtypeStruct`` (or of zeros, for a numerical check)."""

import json
import pathlib

import jax
import jax.numpy as jnp

TREES = pathlib.Path(__file__).resolve().parent / "trees"


def load(name: str) -> tuple[dict, dict]:
  """The tree recorded in ``tests/trees/<name>.json`` (nested dicts of
  ``jax.ShapeDtypeStruct``), and the record's header (library, version,
  model)."""
  record = json.loads((TREES / f"{name}.json").read_text())
  tree: dict = {}
  for leaf in record.pop("leaves"):
    node = tree
    for key in leaf["path"][:-1]:
      node = node.setdefault(key, {})
    node[leaf["path"][-1]] = jax.ShapeDtypeStruct(
        tuple(leaf["shape"]), jnp.dtype(leaf["dtype"])
    )
  return tree, record


def paths_and_leaves(tree) -> list[tuple[str, jax.ShapeDtypeStruct]]:
  return [
      ("/".join(str(k.key) for k in path), leaf)
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  ]


# Trees built with the libraries themselves (small widths, the libraries' own
# layouts).


def flax_linen_attention():
  """``nn.MultiHeadDotProductAttention``: 4 heads, d_model 16 → 32 features."""
  import flax.linen as nn  # noqa: PLC0415

  x = jnp.ones((1, 5, 16))
  return nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32).init(
      jax.random.PRNGKey(0), x, x
  )["params"]


def flax_nnx_attention():
  """``nnx.MultiHeadAttention`` (the model), 4 heads, d_model 16 → 32
  features."""
  from flax import nnx  # noqa: PLC0415

  return nnx.MultiHeadAttention(
      num_heads=4,
      in_features=16,
      qkv_features=32,
      decode=False,
      rngs=nnx.Rngs(0),
  )


def maxtext_like():
  """MaxText's layout in linen: DenseGeneral kernels with logical names, 3
  layers scanned on axis 1 (``param_scan_axis=1``), a token embedder. Returns
  the boxed params."""
  import flax.linen as nn  # noqa: PLC0415

  init = nn.initializers.lecun_normal()

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x, _):
      q = nn.DenseGeneral(
          (4, 8),
          kernel_init=nn.with_logical_partitioning(
              init, ("embed", "q_heads", "kv")
          ),
          name="query",
      )(x)
      y = nn.DenseGeneral(
          16,
          axis=(-2, -1),
          kernel_init=nn.with_logical_partitioning(
              init, ("heads", "kv", "embed")
          ),
          name="out",
      )(q)
      h = nn.Dense(
          64,
          kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
          name="wi",
      )(y)
      return (
          nn.Dense(
              16,
              kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")),
              name="wo",
          )(h),
          None,
      )

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Embed(
          100,
          16,
          embedding_init=nn.with_logical_partitioning(
              nn.initializers.normal(), ("vocab", "embed")
          ),
          name="token_embedder",
      )(x)
      scanned = nn.scan(
          Block,
          variable_axes={"params": 1},
          split_rngs={"params": True},
          length=3,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      x, _ = scanned(name="layers")(x, None)
      return x

  return Model().init(jax.random.PRNGKey(0), jnp.zeros((1, 5), jnp.int32))[
      "params"
  ]


def equinox_model():
  """An Equinox model of the library's own layers, filtered to its float arrays
  (None where a layer has no bias)."""
  import equinox as eqx  # noqa: PLC0415

  class Model(eqx.Module):
    tokens: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    conv: eqx.nn.Conv2d

  ks = jax.random.split(jax.random.PRNGKey(0), 5)
  model = Model(
      eqx.nn.Embedding(50, 16, key=ks[0]),
      eqx.nn.MultiheadAttention(4, 16, key=ks[1]),
      eqx.nn.Linear(16, 64, key=ks[2]),
      eqx.nn.Linear(64, 16, key=ks[3]),
      eqx.nn.LayerNorm(16),
      eqx.nn.Conv2d(3, 8, 3, key=ks[4]),
  )
  return eqx.filter(model, eqx.is_inexact_array)
