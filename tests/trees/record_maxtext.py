"""Record MaxText parameter trees, shrunk to small sizes, as JSON (shapes only,
no weights), with MaxText's own Muon dimension numbers for each leaf.

Each model is MaxText's own config (``configs/models/<model_name>.yml`` on top
of ``configs/base.yml``, loaded by ``maxtext.configs.pyconfig.initialize``)
with its widths, head counts, expert counts, LoRA ranks and vocabulary
overridden to small values and its layer counts cut down, while every knob that
shapes the tree is kept: layer scanning, dense layers before MoE layers,
blocks of scanned layers plus a remainder, interleaved MoE layers, shared
experts, MLA, tied or untied embeddings, and the sharding variants of the MoE
kernels. Nothing is allocated: the model is built with
``maxtext.utils.model_creation_utils.create_nnx_abstract_model`` (the abstract
NNX model that MaxText's trainer builds), or, for the files whose ``api`` is
``"linen"``, with ``jax.eval_shape`` of the Linen wrapper's ``init``
(``maxtext.utils.maxtext_utils.get_abstract_param``). The JSON files let the
package's tests (which run without MaxText) check routing and run Muon updates
on MaxText's real tree structures.

MaxText needs Python >= 3.12 and its declared dependencies include TensorFlow
and a GPU or TPU stack, so this script is run by hand in a separate virtualenv
outside the repository, never by the tests. MaxText is installed without its
dependencies, then only the packages that its imports need (CPU jax)::

  /root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/maxtext-venv
  /tmp/maxtext-venv/bin/pip install --no-deps maxtext==0.2.5
  /tmp/maxtext-venv/bin/pip install jax==0.12.0.1 flax==0.12.12 optax==0.2.8 \
      omegaconf pydantic packaging pathwaysutils jinja2 huggingface_hub \
      transformers grain drjax jaxtyping qwix aqtp pillow tokamax tiktoken \
      sentencepiece sympy
  /tmp/maxtext-venv/bin/python tests/trees/record_maxtext.py  # from repo root

No module is stubbed. The files in this folder were made with maxtext 0.2.5,
jax/jaxlib 0.12.0.1, flax 0.12.12, optax 0.2.8 (CPU, one device).

Optional arguments: keys of ``RECORDINGS`` to record (default: all), e.g.
``... record_maxtext.py llama3_8b_scanned``.

Each output file ``maxtext_<key>.json`` holds::

  {"library": "maxtext", "version": ..., "jax_version": ..., "flax_version": ...,
   "model": <model_name>, "overrides": {...}, "api": "nnx" or "linen",
   "tree": <what tree the leaves are>, "created_by": ...,
   "mesh_axes": [...], "logical_axis_rules": [[name, [mesh axes]], ...],
   "leaves_count": ..., "maxtext_on_muon": ...,
   "leaves": [{"path": [...], "shape": [...], "dtype": ..., "names": ...,
               "maxtext_dims": ...}, ...]}

``overrides`` is every ``key=value`` passed to ``pyconfig.initialize`` after
``base.yml`` (``override_model_config=True`` lets them replace the model yml's
values). ``mesh_axes`` and ``logical_axis_rules`` are the config's
(``config.mesh_axes``, ``config.logical_axis_rules``), each rule's mesh axes
written as a list (a single mesh axis ``"x"`` becomes ``["x"]``, none becomes
``[]``).

The tree (``"tree"`` in the header) is the one optax sees. For ``"nnx"``,
MaxText 0.2.5's trainer wraps the model in ``nnx.Optimizer(model, tx,
wrt=nnx.Param)``, whose ``update`` passes ``tx.update`` the plain
``nnx.as_pure(nnx.state(model, nnx.Param))``: an ``nnx.State`` of arrays with
string keys and no ``"params"`` level (``tx.init`` gets the same State with
``nnx.Param`` leaves, each flattening to its value). For ``"linen"``, it is the
unboxed variables dict of ``init``, ``{"params": {...}}``, which a Linen
``TrainState`` holds as ``params``.

Per leaf: ``path`` lists the keys of its ``jax.tree_util`` key path as strings,
``dtype`` is the dtype the model initializes it with, ``names`` is its logical
axis names (``null`` for an unnamed axis). For NNX they are the param's
``out_sharding`` (else ``sharding_names``, else ``sharding``) metadata, with
the scanned-layers axis inserted at ``param_scan_axis`` where missing and
trailing unnamed axes padded, as MaxText's
``sharding.get_nnx_var_named_sharding_with_scan_axis`` does; for Linen they are
the ``nn.LogicallyPartitioned`` names. ``maxtext_dims`` is what MaxText's
``muon_utils`` gives that leaf, ``{"reduction_axis": [...], "output_axis":
[...]}`` (axes as MaxText writes them, possibly negative), or ``null`` where it
gives ``None`` (MaxText's Muon then updates the leaf with AdamW). For NNX that
is ``muon_utils.get_muon_weight_dimension_numbers(model, config)``, the tree
MaxText's ``optimizers.get_optimizer`` hands ``optax.contrib.muon`` as
``muon_weight_dimension_numbers`` (``muon_type="optax_muon"``, the default;
in 0.2.5 it accepts only NNX modules); for Linen it is
``muon_utils.get_transform_tree`` of the abstract variables, the same rules on
the Linen paths. ``maxtext_on_muon`` counts the leaves with non-null
``maxtext_dims``. Leaves are in ``jax.tree_util`` flatten order of the plain
tree.

This module imports nothing beyond the standard library at import time, so that
pytest's ``--doctest-modules`` collection can import it on Python 3.11 without
MaxText.
"""

import os
import pathlib
import sys

from recording import by_path, write_record

OUT_DIR = pathlib.Path(__file__).resolve().parent

# Passed to every recording: let overrides replace the model yml's values, use
# the plain attention kernel (CPU), and skip jax.distributed.
COMMON = {
    "override_model_config": True,
    "attention": "dot_product",
    "skip_jax_distributed_system": True,
}

# Small, mutually distinct sizes, so that tests can tell the axes apart.
_LLAMA = {
    "base_emb_dim": 64,
    "base_mlp_dim": 96,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "base_num_decoder_layers": 3,
}

# DeepSeek-V3 tiny: 2 dense layers, then 3 MoE layers with 8 routed experts and
# one shared expert; MLA with q and kv LoRA.
_DEEPSEEK3 = {
    "base_emb_dim": 64,
    "base_mlp_dim": 96,
    "base_moe_mlp_dim": 32,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 4,
    "vocab_size": 256,
    "base_num_decoder_layers": 5,
    "first_num_dense_layers": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
}

_MOE = {
    "base_emb_dim": 64,
    "base_mlp_dim": 96,
    "base_moe_mlp_dim": 32,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "base_num_decoder_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}

_GEMMA = {**_LLAMA, "head_dim": 32}

# Gated DeltaNet layers (Qwen3-Next, Qwen3.5) with MoE, cycles of 4.
_GATED_DELTA_MOE = {
    **_MOE,
    "base_mlp_dim": 32,
    "base_num_decoder_layers": 4,
    "gdn_key_head_dim": 16,
    "gdn_value_head_dim": 12,
    "gdn_num_key_heads": 2,
    "gdn_num_value_heads": 4,
}

# key -> (MaxText model_name, overrides beyond COMMON, api).
RECORDINGS = {
    "llama3_8b_scanned": ("llama3-8b", _LLAMA, "nnx"),
    "llama3_8b_unscanned": (
        "llama3-8b",
        {**_LLAMA, "scan_layers": False},
        "nnx",
    ),
    "llama3_8b_scanned_linen": ("llama3-8b", _LLAMA, "linen"),
    "deepseek3_tiny": ("deepseek3-tiny", _DEEPSEEK3, "nnx"),
    "deepseek3_tiny_unscanned": (
        "deepseek3-tiny",
        {**_DEEPSEEK3, "scan_layers": False},
        "nnx",
    ),
    "deepseek3_tiny_shard_exp_on_fsdp": (
        "deepseek3-tiny",
        {**_DEEPSEEK3, "shard_exp_on_fsdp": True},
        "nnx",
    ),
    "deepseek3_tiny_2d_fsdp": (
        "deepseek3-tiny",
        {**_DEEPSEEK3, "use_2d_fsdp_sharding": True},
        "nnx",
    ),
    # 8 layers: one scanned block of 6 (5 local, 1 global) plus a remainder of
    # 2; tied embeddings.
    "gemma3_4b": ("gemma3-4b", {**_GEMMA, "base_num_decoder_layers": 8}, "nnx"),
    # Each layer is a (local, global) pair; tied embeddings.
    "gemma2_2b": ("gemma2-2b", {**_GEMMA, "base_num_decoder_layers": 3}, "nnx"),
    "mixtral_8x7b": (
        "mixtral-8x7b",
        {**_MOE, "num_experts": 4, "base_moe_mlp_dim": 96},
        "nnx",
    ),
    "qwen3_30b_a3b": ("qwen3-30b-a3b", _MOE, "nnx"),
    # MLA without q LoRA; 1 dense layer, then 3 MoE layers with 2 shared
    # experts.
    "deepseek2_16b": (
        "deepseek2-16b",
        {
            **_DEEPSEEK3,
            "q_lora_rank": 0,
            "base_num_decoder_layers": 4,
            "first_num_dense_layers": 1,
        },
        "nnx",
    ),
    # Kimi K2: DeepSeek-V3 layout with one dense layer.
    "kimi_k2_1t": (
        "kimi-k2-1t",
        {
            **_DEEPSEEK3,
            "base_num_decoder_layers": 4,
            "first_num_dense_layers": 1,
        },
        "nnx",
    ),
    # Every layer MoE (top-1 routing, 1 shared expert); layers come in scanned
    # cycles of 4 (every 4th layer without RoPE).
    "llama4_17b_16e": (
        "llama4-17b-16e",
        {
            **_MOE,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "base_num_decoder_layers": 8,
        },
        "nnx",
    ),
    # Dense and MoE layers alternate within each cycle of 4.
    "llama4_17b_128e": (
        "llama4-17b-128e",
        {**_MOE, "num_experts_per_tok": 1, "base_num_decoder_layers": 8},
        "nnx",
    ),
    # Attention sinks and biases, biased experts, cycles of 2 layers.
    "gpt_oss_20b": (
        "gpt-oss-20b",
        {
            **_MOE,
            "base_mlp_dim": 32,
            "num_experts": 4,
            "base_num_decoder_layers": 4,
        },
        "nnx",
    ),
    # Sliding-window and full attention in cycles of 4, QK norms.
    "olmo3_7b": (
        "olmo3-7b",
        {**_LLAMA, "base_num_kv_heads": 4, "base_num_decoder_layers": 4},
        "nnx",
    ),
    # DeepSeek-V3.2: MLA with the lightning indexer.
    "deepseek3_2_671b": (
        "deepseek3.2-671b",
        {
            **_DEEPSEEK3,
            "base_num_decoder_layers": 4,
            "first_num_dense_layers": 1,
            "indexer_n_heads": 2,
            "indexer_head_dim": 8,
            "indexer_topk": 4,
        },
        "nnx",
    ),
    # DeepSeek-V4: compressed attention with grouped output LoRA (o_a_proj),
    # hash-routed first layers, manifold-constrained hyper-connections.
    "deepseek4_tiny": (
        "deepseek4-tiny",
        {
            "vocab_size": 256,
            "base_num_decoder_layers": 5,
            "compress_ratios": [0, 0, 4, 128, 4],
        },
        "nnx",
    ),
    # Qwen3.5: Gated DeltaNet and full attention in cycles of 4, MoE.
    "qwen3_5_35b_a3b": (
        "qwen3.5-35b-a3b",
        {
            **_GATED_DELTA_MOE,
            # A quarter of head_dim rotates: 8 frequencies over 3 sections.
            "head_dim": 64,
            "mrope_section": [3, 3, 2],
        },
        "nnx",
    ),
    # Gemma 4: local and global attention (shared k/v projections), MoE.
    "gemma4_26b": (
        "gemma4-26b",
        {
            **_MOE,
            "head_dim": 32,
            "global_head_dim": 64,
            "global_num_kv_heads": 1,
            "base_num_decoder_layers": 6,
        },
        "nnx",
    ),
    # Gated DeltaNet layers interleaved with full attention, cycles of 4.
    "qwen3_next_80b_a3b": (
        "qwen3-next-80b-a3b",
        _GATED_DELTA_MOE,
        "nnx",
    ),
}


def _name_list(names):
  return [
      None if n is None else (list(n) if isinstance(n, tuple) else str(n))
      for n in names
  ]


def _nnx_names(var):
  """Logical axis names of an NNX param, with the scanned-layers axis.

  Follows MaxText's `sharding.get_nnx_var_named_sharding_with_scan_axis`.
  """
  metadata = var.get_metadata()
  shape = var.get_value().shape
  names = (
      metadata.get("out_sharding")
      or metadata.get("sharding_names")
      or metadata.get("sharding")
  )
  if not names:
    return None
  names = [names] if isinstance(names, str) else list(names)
  if "param_scan_axis" in metadata and "partition_name" in metadata:
    if metadata["partition_name"] not in names:
      names.insert(metadata["param_scan_axis"], metadata["partition_name"])
  elif len(shape) > len(names):
    names += [None] * (len(shape) - len(names))
  return _name_list(names)


def _dims(mdn):
  """MaxText's MuonDimensionNumbers for one leaf, as JSON."""
  if mdn is None:
    return None

  def ints(axes):
    return [int(axes)] if isinstance(axes, int) else [int(a) for a in axes]

  return {
      "reduction_axis": ints(mdn.reduction_axis),
      "output_axis": ints(mdn.output_axis),
  }


def _config(model_name, overrides):
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.utils import globals as mt_globals  # pylint: disable=import-outside-toplevel

  argv = [
      None,
      os.path.join(mt_globals.MAXTEXT_PKG_DIR, "configs", "base.yml"),
      f"model_name={model_name}",
  ] + [f"{k}={v}" for k, v in overrides.items()]
  return pyconfig.initialize(argv)


def _mesh(config):
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  devices = maxtext_utils.create_device_mesh(config)
  return jax.sharding.Mesh(devices, config.mesh_axes)


def _nnx_leaves(config):
  """Leaves of the NNX model's plain param State, with names and dims."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.utils import model_creation_utils  # pylint: disable=import-outside-toplevel
  from maxtext.utils import muon_utils  # pylint: disable=import-outside-toplevel
  from optax.contrib import MuonDimensionNumbers  # pylint: disable=import-outside-toplevel

  _, model = model_creation_utils.create_nnx_abstract_model(
      config, _mesh(config)
  )
  state = nnx.state(model, nnx.Param)
  variables = by_path(state, lambda x: isinstance(x, nnx.Variable))
  dims = by_path(
      muon_utils.get_muon_weight_dimension_numbers(model, config),
      lambda x: x is None or isinstance(x, MuonDimensionNumbers),
  )
  leaves = []
  for key, leaf in by_path(nnx.as_pure(state)).items():
    leaves.append(
        {
            "path": list(key),
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "names": _nnx_names(variables[key]),
            "maxtext_dims": _dims(dims[key]),
        }
    )
  if len(dims) != len(leaves):
    raise ValueError(f"{len(dims)} dimension numbers for {len(leaves)} leaves")
  return leaves


def _linen_leaves(config):
  """Leaves of the Linen model's unboxed variables, with names and dims."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel
  from maxtext.utils import model_creation_utils  # pylint: disable=import-outside-toplevel
  from maxtext.utils import muon_utils  # pylint: disable=import-outside-toplevel
  from optax.contrib import MuonDimensionNumbers  # pylint: disable=import-outside-toplevel

  model = model_creation_utils.from_config(config, mesh=_mesh(config))
  boxed = maxtext_utils.get_abstract_param(model, config)
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
  names = by_path(boxed, is_box)
  dims = by_path(
      muon_utils.get_transform_tree(boxed),
      lambda x: x is None or isinstance(x, MuonDimensionNumbers),
  )
  leaves = []
  for key, leaf in by_path(nn.unbox(boxed)).items():
    box = names[key]
    leaves.append(
        {
            "path": list(key),
            "shape": list(leaf.shape),
            "dtype": str(leaf.dtype),
            "names": _name_list(box.names) if is_box(box) else None,
            "maxtext_dims": _dims(dims[key]),
        }
    )
  if len(dims) != len(leaves):
    raise ValueError(f"{len(dims)} dimension numbers for {len(leaves)} leaves")
  return leaves


_TREES = {
    "nnx": (
        "nnx.as_pure(nnx.state(model, nnx.Param)): the plain nnx.State that"
        " nnx.Optimizer(model, tx, wrt=nnx.Param).update passes to tx.update"
    ),
    "linen": (
        "the unboxed variables of model.init ({'params': ...}), a Linen"
        " TrainState's params"
    ),
}


def record(key):
  """Builds `RECORDINGS[key]`, writes its tree, returns (path, leaves)."""
  import flax  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import maxtext  # pylint: disable=import-outside-toplevel

  model_name, extra, api = RECORDINGS[key]
  overrides = {**COMMON, **extra}
  config = _config(model_name, overrides)
  leaves = _nnx_leaves(config) if api == "nnx" else _linen_leaves(config)
  rules = [
      [str(name), [axes] if isinstance(axes, str) else list(axes or ())]
      for name, axes in config.logical_axis_rules
  ]
  doc = {
      "library": "maxtext",
      "version": maxtext.__version__,
      "jax_version": jax.__version__,
      "flax_version": flax.__version__,
      "model": model_name,
      "overrides": overrides,
      "api": api,
      "tree": _TREES[api],
      "created_by": "tests/trees/record_maxtext.py",
      "mesh_axes": list(config.mesh_axes),
      "logical_axis_rules": rules,
      "leaves_count": len(leaves),
      "maxtext_on_muon": sum(l["maxtext_dims"] is not None for l in leaves),
  }
  out = OUT_DIR / f"maxtext_{key}.json"
  write_record(out, doc, leaves)
  return out, leaves


def main(argv):
  keys = argv[1:] or list(RECORDINGS)
  failed = []
  for key in keys:
    try:
      out, leaves = record(key)
      n_muon = sum(l["maxtext_dims"] is not None for l in leaves)
      size = sum(_prod(l["shape"]) for l in leaves)
      print(f"{key}: {len(leaves)} leaves, {n_muon} on Muon, {size} params")
      print(f"  -> {out}")
    except Exception as e:  # pylint: disable=broad-except
      failed.append(key)
      print(f"{key}: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
  return 1 if failed else 0


def _prod(shape):
  n = 1
  for d in shape:
    n *= d
  return n


if __name__ == "__main__":
  sys.exit(main(sys.argv))
