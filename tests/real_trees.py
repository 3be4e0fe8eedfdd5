"""Parameter trees recorded from real libraries (``tests/trees/*.json``), as trees of
``jax.ShapeDtypeStruct`` (or of zeros, for a numerical check)."""

import json
import pathlib

import jax
import jax.numpy as jnp

TREES = pathlib.Path(__file__).resolve().parent / "trees"


def load(name: str) -> tuple[dict, dict]:
  """The tree recorded in ``tests/trees/<name>.json`` (nested dicts of
  ``jax.ShapeDtypeStruct``), and the record's header (library, version, model)."""
  record = json.loads((TREES / f"{name}.json").read_text())
  tree: dict = {}
  for leaf in record.pop("leaves"):
    node = tree
    for key in leaf["path"][:-1]:
      node = node.setdefault(key, {})
    node[leaf["path"][-1]] = jax.ShapeDtypeStruct(tuple(leaf["shape"]), jnp.dtype(leaf["dtype"]))
  return tree, record


def paths_and_leaves(tree) -> list[tuple[str, jax.ShapeDtypeStruct]]:
  return [("/".join(str(k.key) for k in path), leaf)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]
