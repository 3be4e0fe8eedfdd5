"""Real libraries' layouts reach Muon: Gemma's recorded trees, Flax's attention
and logical axis names, Equinox's layers; heads whole or per head, the shape
factor of the matrix that is orthogonalized."""

import json
import math
import re
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hypothesis import given, settings, strategies as st

import optax_muon as om
from helpers import normal, random_grads, rel_err, requires_contrib_api
import real_trees
from real_trees import load, paths_and_leaves

DN = om.MuonDimensionNumbers
# optax.contrib.muon's Newton–Schulz, for updates compared with it.
_CONTRIB_NS = dict(ns_coeffs=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-8)
GEMMA = [
    "gemma_Gemma2_2B",
    "gemma_Gemma3_270M",
    "gemma_Gemma3_1B",
    "gemma_Gemma3_4B",
]
# The hidden matrices of a Gemma text block, and of the SigLIP encoder of Gemma
# 3 4B.
GEMMA_KERNEL = re.compile(
    r"attn/(q|kv|attn_vec)_einsum/w$|mlp/(gating_einsum|linear)$"
    r"|(query|key|value|out)/kernel$|MlpBlock_0/Dense_\d/kernel$"
)


def _rows(params, tx):
  with warnings.catch_warnings():
    warnings.simplefilter(
        "error"
    )  # a real model's tree routes without a warning
    return {r.path: r for r in om.summarize(params, tx).rows}


def _same_dims(a, b) -> bool:
  axes = lambda x: (x,) if isinstance(x, int) else tuple(x)
  return (axes(a.reduction_axis), axes(a.output_axis)) == (
      axes(b.reduction_axis),
      axes(b.output_axis),
  )


@pytest.mark.parametrize("name", GEMMA)
def test_gemma_kernels_go_to_muon_embeddings_norms_and_biases_to_adamw(name):
  params, record = load(name)
  assert record["library"] == "gemma" and record["version"] == "4.0.1"
  rows = _rows(params, om.muon(0.02))
  for path, row in rows.items():
    if GEMMA_KERNEL.search(path):
      assert row.optimizer == "muon", (path, row.reason)
    else:  # embeddings (text, image patches, positions, projector), norms, biases
      assert row.optimizer == "adam", (path, row.reason)
      assert re.search(r"embed|norm|scale$|bias$", path), path
  layers = sum(bool(re.fullmatch(r"layer_\d+/mlp/linear", p)) for p in rows)
  text_kernels = [
      p for p in rows if p.startswith("layer_") and GEMMA_KERNEL.search(p)
  ]
  assert (
      len(text_kernels) == 5 * layers
  )  # q, kv, attention output, gating, linear


@pytest.mark.parametrize(
    "heads,expected",
    [
        # leaf of layer 7: (NS matrix m × n, batch, scale sqrt(max(1, n_out /
        # n_in)))
        (
            "whole",
            {
                "attn/q_einsum/w": ((1024, 1152), 1, 1.0),
                "attn/kv_einsum/w": ((256, 1152), 2, 1.0),
                "attn/attn_vec_einsum/w": (
                    (1024, 1152),
                    1,
                    math.sqrt(1152 / 1024),
                ),
                "mlp/gating_einsum": ((1152, 6912), 2, math.sqrt(6912 / 1152)),
                "mlp/linear": ((1152, 6912), 1, 1.0),
            },
        ),
        (
            "per_head",
            {
                "attn/q_einsum/w": ((256, 1152), 4, 1.0),
                "attn/kv_einsum/w": ((256, 1152), 2, 1.0),
                "attn/attn_vec_einsum/w": (
                    (256, 1152),
                    4,
                    math.sqrt(1152 / 256),
                ),
                "mlp/gating_einsum": ((1152, 6912), 2, math.sqrt(6912 / 1152)),
                "mlp/linear": ((1152, 6912), 1, 1.0),
            },
        ),
    ],
)
def test_gemma3_1b_matrices_and_shape_factors(heads, expected):
  """Whole heads: the d_model × heads·head_dim projection (Moonlight, Kimi K2);
  per head: one head_dim × d_model matrix per head, with its own shape factor
  (2.12 vs 1.06 for the attention output)."""
  params, _ = load("gemma_Gemma3_1B")
  rows = _rows(params, om.muon(0.02, routing=om.Routing(heads=heads)))
  for leaf, (matrix, batch, scale) in expected.items():
    row = rows[f"layer_7/{leaf}"]
    assert (row.ns_matrix, row.batch) == (matrix, batch), leaf
    assert row.scale == pytest.approx(scale), leaf


def test_gemma2_gating_is_read_with_d_model_as_input():
  """Gemma 2 2B stores gate and up as (2, d_model, hidden), Gemma 3 as (2,
  hidden, d_model): both are read as 2 matrices d_model → hidden."""
  for name, shape in (
      ("gemma_Gemma2_2B", (2, 2304, 9216)),
      ("gemma_Gemma3_1B", (2, 6912, 1152)),
  ):
    params, _ = load(name)
    assert params["layer_0"]["mlp"]["gating_einsum"].shape == shape
    dims = om.infer_dimension_numbers(params)["layer_0"]["mlp"]["gating_einsum"]
    d_axis = shape.index(min(shape[1:]), 1)
    assert _same_dims(dims, DN(d_axis, 3 - d_axis)), dims


def test_gemma_dimension_numbers_are_the_ones_the_einsums_contract():
  """The Gemma library's equations: q 'BTD,NDH->BTNH', kv 'BSD,CKDH->CBSKH',
  attention output 'BTNH,NHD->BTD', gating '...F,NHF->...NH', linear
  '...H,HF->...F'."""
  params, _ = load("gemma_Gemma3_1B")
  dims = om.infer_dimension_numbers(params)
  attn, mlp = dims["layer_0"]["attn"], dims["layer_0"]["mlp"]
  assert _same_dims(attn["q_einsum"]["w"], DN(1, (0, 2)))
  assert _same_dims(attn["kv_einsum"]["w"], DN(2, (1, 3)))
  assert _same_dims(attn["attn_vec_einsum"]["w"], DN((0, 1), 2))
  assert _same_dims(mlp["gating_einsum"], DN(2, 1))
  assert _same_dims(mlp["linear"], DN(0, 1))
  assert dims["embedder"]["input_embedding"] is None
  assert dims["layer_0"]["pre_attention_norm"]["scale"] is None


def _gemma3_block(dtype=jnp.float32):
  """Layer 0 of Gemma 3 1B with its real shapes, the final norm, and the
  embedding with its vocabulary cut to 512 rows (the update is compared
  numerically, on the CPU)."""
  full, _ = load("gemma_Gemma3_1B")
  tree = {
      "layer_0": full["layer_0"],
      "final_norm": full["final_norm"],
      "embedder": {"input_embedding": jax.ShapeDtypeStruct((512, 1152), dtype)},
  }
  return jax.tree.map(
      lambda s: normal(jax.random.PRNGKey(s.shape[-1]), s.shape, dtype),
      tree,
  )


@requires_contrib_api
@pytest.mark.slow
def test_gemma3_update_equals_optax_contrib_with_the_same_dimension_numbers():
  params = _gemma3_block()
  dims = om.infer_dimension_numbers(params)
  kwargs = dict(ns_coeffs=(3.4445, -4.7750, 2.0315), ns_steps=2, eps=1e-8)
  ours_default = om.muon(
      0.02, **kwargs
  )  # the layout rules, no dimension numbers given
  ours = om.muon(0.02, **kwargs, muon_weight_dimension_numbers=dims)
  theirs = optax.contrib.muon(
      0.02, **kwargs, muon_weight_dimension_numbers=dims
  )
  grads = random_grads(params, 0)
  results = [
      jax.jit(tx.update)(grads, tx.init(params), params)[0]
      for tx in (ours_default, ours, theirs)
  ]
  flat = [jax.tree.leaves(r) for r in results]
  for (path, _), x, y, z in zip(paths_and_leaves(params), *flat):
    assert rel_err(x, z) < 1e-5 and rel_err(y, z) < 1e-5, path


# Flax
# -------------------------------------------------------------------------------------


def test_flax_linen_attention_kernels_on_muon_biases_on_adamw():
  params = real_trees.flax_linen_attention()
  rows = _rows(params, om.muon(0.02))
  for name in ("query", "key", "value"):
    assert params[name]["kernel"].shape == (16, 4, 8) and params[name][
        "bias"
    ].shape == (4, 8)
    assert rows[f"{name}/kernel"].optimizer == "muon"
    assert (rows[f"{name}/kernel"].ns_matrix, rows[f"{name}/kernel"].batch) == (
        (16, 32),
        1,
    )
    assert (
        rows[f"{name}/bias"].optimizer == "adam"
        and rows[f"{name}/bias"].reason == "bias"
    )
  assert rows["out/kernel"].optimizer == "muon" and rows[
      "out/kernel"
  ].ns_matrix == (16, 32)
  assert rows["out/bias"].optimizer == "adam"
  per_head = _rows(params, om.muon(0.02, routing=om.Routing(heads="per_head")))
  assert (
      per_head["query/kernel"].ns_matrix,
      per_head["query/kernel"].batch,
  ) == ((8, 16), 4)
  assert per_head["out/kernel"].scale == pytest.approx(math.sqrt(16 / 8))


def test_a_bias_is_known_by_the_kernel_beside_it():
  """A (heads, head_dim) leaf beside a (d, heads, head_dim) kernel is that
  layer's bias, whatever its name."""
  params = {
      "proj": {"kernel": jnp.zeros((16, 4, 8)), "offset": jnp.zeros((4, 8))},
      "w": jnp.zeros((8, 8)),
      "u": jnp.zeros((4, 8)),
  }
  routes = {
      r.path: r
      for r in om.route(
          params,
          om.Routing(
              layouts=(om.LayoutRule(r"proj/kernel$", "iOo", "projection"),)
          ),
      )
  }
  assert (
      routes["proj/offset"].optimizer == "adam"
      and routes["proj/offset"].describe() == "bias of kernel"
  )
  assert routes["proj/kernel"].optimizer == "muon"
  assert routes["u"].optimizer == "muon"  # (4, 8) beside no kernel: a matrix


def test_flax_nnx_attention_reaches_muon_inside_nnx_optimizer():
  model = real_trees.flax_nnx_attention()
  tx = om.muon(0.02)
  rows = _rows(nnx.state(model, nnx.Param), tx)
  assert {p for p, r in rows.items() if r.optimizer == "muon"} == {
      "query/kernel",
      "key/kernel",
      "value/kernel",
      "out/kernel",
  }
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = normal(jax.random.PRNGKey(1), (4, 8, 16))  # 32 rows: full-rank gradients
  before = model.query.kernel[...]

  @nnx.jit
  def step(model, optimizer):
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)

  step(model, optimizer)
  delta = np.asarray(model.query.kernel[...] - before).reshape(16, 32)
  # One Muon step from zero momentum: all singular values equal lr · scale
  # (sqrt(32/16)).
  s = np.linalg.svd(delta, compute_uv=False) / (0.02 * math.sqrt(2))
  assert (
      0.6 < s.min() and s.max() < 1.2
  ), s  # Jordan's coefficients: σ ∈ [0.68, 1.13]


def _mesh_of_names(names):
  """Flax 0.12 places variables with sharding names on the current mesh when it
  makes them; the names here are logical, so a one-device mesh with those axis
  names stands in."""
  mesh = jax.make_mesh(
      (1,) * len(names),
      names,
      axis_types=(jax.sharding.AxisType.Auto,) * len(names),
  )
  return jax.set_mesh(mesh)


def test_maxtext_style_logical_names_from_linen_boxes():
  """MaxText's layout: DenseGeneral kernels with logical names, layers scanned
  on axis 1."""
  boxed = real_trees.maxtext_like()
  assert boxed["layers"]["query"]["kernel"].names == (
      "embed",
      "layers",
      "q_heads",
      "kv",
  )
  dims = om.infer_dimension_numbers(boxed)  # the names the boxes carry
  layers = dims["layers"]
  assert _same_dims(layers["query"]["kernel"], DN(0, (2, 3)))
  assert _same_dims(layers["out"]["kernel"], DN((0, 2), 3))
  assert _same_dims(layers["wi"]["kernel"], DN(0, 2)) and _same_dims(
      layers["wo"]["kernel"], DN(0, 2)
  )
  assert dims["token_embedder"]["embedding"] is None
  # The same names given explicitly, for unboxed params; per head.
  params = nn.unbox(boxed)
  names = nn.get_partition_spec(boxed)
  per_head = om.infer_dimension_numbers(
      params, om.Routing(heads="per_head"), logical_names=names
  )
  assert _same_dims(per_head["layers"]["query"]["kernel"], DN(0, 3))
  assert _same_dims(per_head["layers"]["out"]["kernel"], DN(2, 3))
  # They drive muon: 3 layers × (query, out, wi, wo) on Muon, each layer its own
  # matrix.
  rows = _rows(params, om.muon(0.02, muon_weight_dimension_numbers=dims))
  assert rows["layers/query/kernel"].batch == 3 and rows[
      "layers/query/kernel"
  ].ns_matrix == (16, 32)
  assert rows["token_embedder/embedding"].optimizer == "adam"
  assert sum(r.optimizer == "muon" for r in rows.values()) == 4


def test_nnx_einsum_logical_names_from_variable_metadata():
  with _mesh_of_names(("embed", "heads", "kv")):
    init = nnx.initializers.lecun_normal()
    q = nnx.Einsum(
        "btd,dnh->btnh",
        (16, 4, 8),
        (4, 8),
        rngs=nnx.Rngs(0),
        kernel_init=nnx.with_partitioning(init, ("embed", "heads", "kv")),
        bias_init=nnx.with_partitioning(
            nnx.initializers.zeros_init(), ("heads", "kv")
        ),
    )
  state = nnx.state(q, nnx.Param)
  dims = om.infer_dimension_numbers(state)
  assert _same_dims(dims["kernel"], DN(0, (1, 2))) and dims["bias"] is None
  tx = om.muon(0.02, muon_weight_dimension_numbers=dims)
  on_the_host = jax.tree.map(
      lambda x: jnp.asarray(np.asarray(x)), state
  )  # off the mesh
  rows = _rows(on_the_host, tx)
  assert rows["kernel"].optimizer == "muon" and rows["kernel"].ns_matrix == (
      16,
      32,
  )
  assert rows["bias"].optimizer == "adam"


def test_logical_names_without_a_role_are_one_error_that_names_every_leaf():
  params = {"v": jnp.zeros((8, 3)), "w": jnp.zeros((8, 4, 2))}
  names = {"v": ("embed", "wide"), "w": ("embed", "groups", "kv")}
  with pytest.raises(ValueError) as raised:
    om.infer_dimension_numbers(params, logical_names=names)
  message = str(raised.value)
  assert "['groups', 'wide']" in message and "axis_roles" in message
  assert "v (embed, wide)" in message and "w (embed, groups, kv)" in message
  dims = om.infer_dimension_numbers(
      params,
      logical_names=names,
      axis_roles={"groups": "batch", "wide": "hidden"},
  )
  assert _same_dims(dims["w"], DN(0, 2)) and _same_dims(dims["v"], DN(0, 1))


# Equinox
# ----------------------------------------------------------------------------------


def test_equinox_layers_read_in_pytorch_order():
  """Equinox's Linear.weight is (out, in): the shape factor uses the real n_in
  and n_out; Conv weights are one (in·kh·kw) × out matrix; Embedding goes to
  AdamW."""
  params = real_trees.equinox_model()
  rows = _rows(params, om.muon(0.02))
  assert (
      rows["up/weight"].optimizer == "muon" and rows["up/weight"].scale == 2.0
  )  # 16 → 64
  assert rows["down/weight"].scale == 1.0
  assert rows["attn/query_proj/weight"].optimizer == "muon"
  assert rows["conv/weight"].optimizer == "muon" and rows[
      "conv/weight"
  ].ns_matrix == (8, 27)
  assert (
      rows["tokens/weight"].optimizer == "adam"
      and "Embedding" in rows["tokens/weight"].reason
  )
  assert {
      rows[p].optimizer for p in ("up/bias", "norm/weight", "norm/bias")
  } == {"adam"}


@pytest.mark.slow
def test_equinox_update_is_the_transpose_of_the_flax_layout_update():
  params = real_trees.equinox_model()
  tx = om.muon(0.02)
  grads = random_grads(params, 0)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert (
      updates.attn.query_proj.bias is None
  )  # the filtered-out leaves stay None
  flax_layout = {"up": params.up.weight.T, "down": params.down.weight.T}
  flax_grads = {"up": grads.up.weight.T, "down": grads.down.weight.T}
  expected, _ = tx.update(flax_grads, tx.init(flax_layout), flax_layout)
  assert rel_err(updates.up.weight, expected["up"].T) < 1e-5
  assert rel_err(updates.down.weight, expected["down"].T) < 1e-5
  new = eqx.apply_updates(params, updates)
  assert jax.tree.structure(new) == jax.tree.structure(params)


# Routing that does not surprise
# -----------------------------------------------------------


def test_dimension_numbers_for_an_embedding_keep_it_on_adamw_and_say_so():
  params = {
      "embedder": {"input_embedding": jnp.zeros((64, 16))},
      "mlp": {"kernel": jnp.zeros((16, 32)), "bias": jnp.zeros((4, 8))},
  }
  every_matrix = lambda p: jax.tree.map(
      lambda x: DN() if x.ndim >= 2 else None, p
  )
  tx = om.muon(0.02, muon_weight_dimension_numbers=every_matrix)
  with pytest.warns(
      UserWarning,
      match=r"biases or whose path matches adam_pattern "
      r".*embedder/input_embedding \(64×16\)'.*'mlp/bias \(4×8\)'",
  ):
    tx.init(params)
  rows = {r.path: r.optimizer for r in om.summarize(params, tx).rows}
  assert rows == {
      "embedder/input_embedding": "adam",
      "mlp/kernel": "muon",
      "mlp/bias": "adam",
  }
  # Saying so puts them on Muon, without a warning.
  optax_rule = om.Routing(adam_pattern=None, biases=False)
  tx = om.muon(
      0.02, muon_weight_dimension_numbers=every_matrix, routing=optax_rule
  )
  assert set(_rows(params, tx)[p].optimizer for p in rows) == {"muon"}


def test_degenerate_matrices_are_warned_about():
  params = {"w": jnp.zeros((4, 1, 1152)), "v": jnp.zeros((8, 8))}
  tx = om.muon(0.02, muon_weight_dimension_numbers={"w": DN(1, 2), "v": DN()})
  with pytest.warns(
      UserWarning, match=r"side shorter than 2.*'w \(4×1×1152 as 4 × 1×1152\)'"
  ):
    tx.init(params)


def test_errors_name_the_argument_or_leaf():
  params = {"w": jnp.ones((16, 8)), "step": jnp.zeros((), jnp.int32)}
  with pytest.raises(ValueError, match=r"leaf 'step' has dtype int32"):
    om.muon(0.02).init(params)
  with pytest.raises(
      ValueError, match=r"learning_rate must lie in \[0.0, inf\), got -1"
  ):
    om.muon(-1)
  with pytest.raises(ValueError, match=r"adam_learning_rate must lie"):
    om.muon(0.02, adam_learning_rate=-1e-3)
  tx = om.muon(0.02)
  good = {"w": jnp.ones((16, 8))}
  state = tx.init(good)
  with pytest.raises(
      ValueError,
      match=r"update of leaf 'w' has shape \(8, 16\), the param " r"\(16, 8\)",
  ):
    tx.update({"w": jnp.ones((8, 16))}, state, good)
  sbm = om.scale_by_muon()
  with pytest.raises(
      ValueError, match=r"update of leaf 'w' has shape \(8, 16\)"
  ):
    sbm.update({"w": jnp.ones((8, 16))}, sbm.init(good))


def test_inject_hyperparams_names_the_static_arguments():
  params = {"w": jnp.ones((16, 8)), "b": jnp.zeros(8)}
  tx = optax.inject_hyperparams(om.muon)(learning_rate=0.02, ns_steps=5)
  with pytest.raises(
      ValueError, match=r"ns_steps is traced.*static_args=\('ns_steps', 'eps'\)"
  ):
    jax.jit(tx.init)(params)
  tx = optax.inject_hyperparams(om.muon, static_args=("ns_steps", "eps"))(
      learning_rate=0.02, ns_steps=5, eps=1e-7
  )
  updates, _ = jax.jit(tx.update)(params, jax.jit(tx.init)(params), params)
  assert updates["w"].shape == (16, 8)


def test_trees_without_matrices_update():
  """No Muon leaf (vectors only, embeddings only, empty, None leaves): init and
  update."""
  for params in (
      {"b": jnp.ones(3)},
      {"embed": jnp.ones((10, 4)), "b": jnp.ones(4)},
      {},
      {"a": None, "b": jnp.ones(2)},
      {"w": jnp.zeros((0, 4)), "b": jnp.ones(1)},
  ):
    tx = om.muon(0.02)
    updates, _ = jax.jit(tx.update)(params, tx.init(params), params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


# The docs' table
# ----------------------------------------------------------------------------


def _maxtext_shapes(name: str) -> dict:
  """A recorded MaxText tree (``tests/trees/maxtext_*.json``) as shapes."""
  record = json.loads((real_trees.TREES / f"{name}.json").read_text())
  tree: dict = {}
  for leaf in record["leaves"]:
    node = tree
    for key in leaf["path"][:-1]:
      node = node.setdefault(key, {})
    node[leaf["path"][-1]] = jax.ShapeDtypeStruct(
        tuple(leaf["shape"]), jnp.dtype(leaf["dtype"])
    )
  return tree


def _table_trees():
  """The trees of docs/layouts.md's table: model name prefix → (params, muon
  kwargs per heads setting)."""
  boxed = real_trees.maxtext_like()
  maxtext = {
      h: dict(
          muon_weight_dimension_numbers=om.infer_dimension_numbers(
              boxed, om.Routing(heads=h)
          )
      )
      for h in ("whole", "per_head")
  }
  no_kwargs = {"whole": {}, "per_head": {}}
  return {
      "Gemma 3 1B": (load("gemma_Gemma3_1B")[0], no_kwargs),
      "Gemma 2 2B": (load("gemma_Gemma2_2B")[0], no_kwargs),
      "Gemma 3 4B": (load("gemma_Gemma3_4B")[0], no_kwargs),
      "Flax `nn.": (real_trees.flax_linen_attention(), no_kwargs),
      "Flax `nnx.": (
          nnx.state(real_trees.flax_nnx_attention(), nnx.Param),
          no_kwargs,
      ),
      "MaxText 0.2.5 llama3-8b": (
          _maxtext_shapes("maxtext_llama3_8b_scanned"),
          no_kwargs,
      ),
      "MaxText 0.2.5 deepseek3-tiny": (
          _maxtext_shapes("maxtext_deepseek3_tiny"),
          no_kwargs,
      ),
      "MaxText 0.2.5 qwen3-next": (
          _maxtext_shapes("maxtext_qwen3_next_80b_a3b"),
          no_kwargs,
      ),
      "MaxText": (nn.unbox(boxed), maxtext),
      "Equinox": (real_trees.equinox_model(), no_kwargs),
  }


@pytest.mark.slow
def test_the_layouts_page_table_is_what_summarize_shows():
  page = (real_trees.TREES.parents[1] / "docs" / "layouts.md").read_text()
  lines = [
      l
      for l in page.splitlines()
      if l.startswith("| ") and "`" in l.split("|")[2]
  ]
  assert len(lines) >= 20
  trees = _table_trees()
  summaries = {}
  for line in lines:
    model, leaf, shape, *cells = [c.strip() for c in line.strip("|").split("|")]
    name = next(n for n in trees if model.startswith(n))
    path = re.match(r"`([^`]+)`", leaf).group(1)
    for heads, cell in zip(("whole", "per_head"), cells):
      if (name, heads) not in summaries:
        params, kwargs = trees[name]
        tx = om.muon(0.02, routing=om.Routing(heads=heads), **kwargs[heads])
        summaries[name, heads] = {
            r.path: r for r in om.summarize(params, tx).rows
        }
      row = summaries[name, heads][path]
      assert "×".join(map(str, row.shape)) == shape, (path, row.shape)
      if cell.startswith("AdamW"):
        assert row.optimizer == "adam", (path, heads, row.reason)
        continue
      batch, n_in, n_out, scale = re.fullmatch(
          r"(\d+) × (\d+)→(\d+), scale ([\d.]+)", cell
      ).groups()
      assert row.optimizer == "muon" and row.batch == int(batch), (
          path,
          heads,
          row,
      )
      assert row.ns_matrix == tuple(sorted((int(n_in), int(n_out)))), (
          path,
          heads,
          row,
      )
      # The factor tells the sides apart: sqrt(max(1, n_out / n_in)).
      assert row.scale == pytest.approx(
          math.sqrt(max(1, int(n_out) / int(n_in))), abs=1e-9
      )
      assert (
          f"{row.scale:.3g}".rstrip("0").rstrip(".") == scale
          or abs(row.scale - float(scale)) < 0.005
      ), (path, heads, row.scale, scale)


def test_muon_leaves_on_an_auto_mesh_without_shardings_are_warned_about_once():
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: PLC0415

  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
  params = {
      "w": jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("fsdp")))
  }
  tx = om.muon(0.02)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    state = tx.init(params)
    tx.update(params, state, params)
  messages = [str(w.message) for w in caught]
  assert (
      len(messages) == 1
      and "'w'" in messages[0]
      and "param_shardings" in messages[0]
  )
  assert caught[0].filename == __file__


def test_stacked_norm_scales_stay_on_adamw():
  """A scanned model's norm scales are (layers, d): 2-D, but not matrices."""
  params = {
      "blocks": {
          "attn_norm": jnp.ones((4, 16)),
          "w": jnp.zeros((4, 16, 16)),
          "ln": {"scale": jnp.ones((4, 16))},
      }
  }
  tx = om.muon(
      0.02,
      muon_weight_dimension_numbers={
          "blocks": {"attn_norm": None, "w": DN(1, 2), "ln": {"scale": None}}
      },
  )
  rows = _rows(
      params, tx
  )  # no warning: the None entries agree with the default rule
  assert rows["blocks/attn_norm"].optimizer == "adam"
  assert rows["blocks/ln/scale"].optimizer == "adam"
  vectors = {"blocks": {k: v for k, v in params["blocks"].items() if k != "w"}}
  defaults = {r.path: r.optimizer for r in om.route(vectors)}
  assert defaults["blocks/attn_norm"] == defaults["blocks/ln/scale"] == "adam"


def test_a_leaf_named_b_is_a_bias_only_beside_a_kernel():
  """Haiku's linear is {w, b}; optax's own tests name plain matrices b."""
  params = {
      "linear": {"w": jnp.zeros((8, 16)), "b": jnp.zeros((2, 16))},
      "pair": {"a": jnp.zeros((8, 16)), "b": jnp.zeros((8, 16))},
  }
  routes = {r.path: r.optimizer for r in om.route(params)}
  assert routes == {
      "linear/b": "adam",
      "linear/w": "muon",
      "pair/a": "muon",
      "pair/b": "muon",
  }


# Scanned layers
# ----------------------------------------------------------------------------


def _scanned_mlp():
  """A linen MLP of 3 blocks under ``nn.scan`` (the layers first, its
  default), and the (3, 16, 64) kernel of its first layer."""

  class Block(nn.Module):

    @nn.compact
    def __call__(self, x, _):
      h = nn.Dense(64, name="up")(x)
      return nn.Dense(16, name="down")(nn.gelu(h)) + x, None

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      scanned = nn.scan(
          Block,
          variable_axes={"params": 0},
          split_rngs={"params": True},
          length=3,
      )
      x, _ = scanned(name="blocks")(x, None)
      return nn.LayerNorm(name="final_norm")(x)

  return Model().init(jax.random.PRNGKey(0), jnp.ones((2, 16)))["params"]


@requires_contrib_api
def test_a_layer_stack_reads_nn_scan_layers_as_one_matrix_each():
  params = _scanned_mlp()
  assert params["blocks"]["up"]["kernel"].shape == (3, 16, 64)
  with pytest.warns(UserWarning, match=r"blocks/up/kernel \(3×16×64\)"):
    unstacked = {r.path: r for r in om.route(params)}
  assert unstacked["blocks/up/kernel"].optimizer == "adam"
  stack = om.LayerStack(r"^blocks/", 0, "nn.scan blocks")
  routing = om.Routing(layer_stacks=(stack, *om.Routing().layer_stacks))
  tx = om.muon(0.02, routing=routing, **_CONTRIB_NS)
  rows = _rows(params, tx)
  up, bias = rows["blocks/up/kernel"], rows["blocks/up/bias"]
  assert (up.optimizer, up.batch, up.ns_matrix) == ("muon", 3, (16, 64))
  assert up.reason == "a matrix per layer (nn.scan blocks)"
  assert (
      bias.optimizer == "adam" and rows["final_norm/scale"].optimizer == "adam"
  )
  # Each layer is its own matrix: the update equals optax.contrib's with the
  # layers as a batch axis.
  dims = jax.tree.map(
      lambda x: optax.contrib.MuonDimensionNumbers(1, 2)
      if x.ndim == 3
      else None,
      params,
  )
  theirs = optax.contrib.muon(
      0.02, **_CONTRIB_NS, muon_weight_dimension_numbers=dims
  )
  grads = random_grads(params, 0)
  ours_u = jax.jit(tx.update)(grads, tx.init(params), params)[0]
  theirs_u = jax.jit(theirs.update)(grads, theirs.init(params), params)[0]
  for (path, x), y in zip(
      jax.tree_util.tree_leaves_with_path(ours_u), jax.tree.leaves(theirs_u)
  ):
    assert rel_err(x, y) < 1e-5, path


def test_a_scope_whose_layer_counts_differ_is_not_read_as_stacked():
  params = {
      "decoder": {
          "layers": {
              "mlp": {"wi": {"kernel": jnp.zeros((16, 3, 64))}},
              "other": {"kernel": jnp.zeros((16, 5, 64))},
          }
      }
  }
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    routes = {r.path: r for r in om.route(params)}
  messages = " ".join(str(w.message) for w in caught)
  assert "'decoder/layers/'" in messages and "sizes 3, 5" in messages
  assert routes["decoder/layers/mlp/wi/kernel"].reason.name == "UNDESCRIBED"


def test_layer_stack_arguments_are_checked():
  with pytest.raises(ValueError, match="LayerStack.pattern"):
    om.LayerStack("(", 0, "x")
  with pytest.raises(ValueError, match="LayerStack.axes"):
    om.LayerStack("a", 1.0, "x")
  with pytest.raises(ValueError, match="LayerStack.axes"):
    om.LayerStack("a", (), "x")
  with pytest.raises(ValueError, match="Routing.layer_stacks"):
    om.Routing(layer_stacks=om.LayerStack("a", 0, "x"))


def test_a_mesh_of_one_device_is_not_warned_about():
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: PLC0415

  mesh = jax.make_mesh(
      (1, 1), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2
  )
  params = {"w": jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P()))}
  tx = om.muon(0.02)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx.update(params, tx.init(params), params)


_PER_LAYER = {
    # kind: (leaf name, per-layer shape, per-layer (reduction, output) axes)
    "matrix": ("mlp/wi/kernel", (24, 40), ((0,), (1,))),
    "attention": ("attn/query/kernel", (24, 4, 8), ((0,), (1, 2))),
    "attention_out": ("attn/out/kernel", (4, 8, 24), ((0, 1), (2,))),
    "experts": ("routed_experts/wi_0", (6, 24, 40), ((1,), (2,))),
}


def _insert(shape: tuple, axes: tuple[int, ...], sizes: tuple[int, ...]):
  """``shape`` with ``sizes`` inserted so that they sit at ``axes`` of the
  result (sorted)."""
  out, rest = [], iter(shape)
  placed = dict(zip(axes, sizes))
  for a in range(len(shape) + len(axes)):
    out.append(placed[a] if a in placed else next(rest))
  return tuple(out)


def _at_path(path: str, leaf) -> dict:
  """``{"a": {"b": leaf}}`` for the path ``"a/b"``."""
  for key in reversed(path.split("/")):
    leaf = {key: leaf}
  return leaf


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    kinds=st.lists(st.sampled_from(sorted(_PER_LAYER)), min_size=1, max_size=4),
    nested=st.booleans(),
    data=st.data(),
)
def test_a_layer_stack_anywhere_reads_each_layer_alone(kinds, nested, data):
  """Layer axes drawn anywhere (one, or two for a scan inside a scan), one
  stack per leaf: each leaf reads as the same leaf of one layer would, its
  layer axes batch axes (the expected axes computed here, not by
  ``LayerStack.lift``)."""
  sizes = (3, 2) if nested else (3,)
  params, stacks, expected = {}, [], {}
  for i, kind in enumerate(dict.fromkeys(kinds)):
    name, shape, dims = _PER_LAYER[kind]
    ndim = len(shape) + len(sizes)
    axes = tuple(
        sorted(
            data.draw(
                st.lists(
                    st.integers(0, ndim - 1),
                    min_size=len(sizes),
                    max_size=len(sizes),
                    unique=True,
                ),
                label=f"{kind} layer axes",
            )
        )
    )
    path = f"block{i}/{name}"
    params[f"block{i}"] = _at_path(name, jnp.zeros(_insert(shape, axes, sizes)))
    # Negative axes count from the end, as a user may write them.
    written = tuple(a - ndim if a % 2 else a for a in axes)
    stacks.append(om.LayerStack(rf"^block{i}/", written, f"stack {i}"))
    kept = [a for a in range(ndim) if a not in axes]
    expected[path] = tuple(tuple(kept[a] for a in side) for side in dims)
  routing = om.Routing(layer_stacks=tuple(stacks))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    routes = {r.path: r for r in om.route(params, routing)}
  for path, want in expected.items():
    r = routes[path]
    assert r.optimizer == "muon", r
    got = tuple(
        tuple(sorted((a,) if isinstance(a, int) else a))
        for a in (
            r.dimension_numbers.reduction_axis,
            r.dimension_numbers.output_axis,
        )
    )
    assert got == want, (path, got, want)
