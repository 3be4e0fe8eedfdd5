"""Record the parameter trees of real Gemma models as JSON (shapes only, no
weights).

The models are built from Google DeepMind's own ``gemma`` library (PyPI package
``gemma``), and their parameter trees are obtained with ``jax.eval_shape`` of
the Flax ``init``: nothing is allocated and no checkpoint is downloaded. The
JSON files written next to this script let the package's tests (which run
without ``gemma``) check routing on the real trees.

The ``gemma`` library needs Python >= 3.12 (and pulls TensorFlow), so this
script is run by hand in a separate virtualenv outside the repository, never by
the tests::

  /root/.pyenv/versions/3.12.1/bin/python -m venv /tmp/gemma-venv
  /tmp/gemma-venv/bin/pip install gemma==4.0.1 jax sentencepiece==0.2.1
  /tmp/gemma-venv/bin/python tests/trees/record_gemma.py   # from the repo root

(``sentencepiece==0.2.1``: the newest, 0.2.3, ships protobuf-7 generated code
while the resolver picks protobuf 6.x for TensorFlow, and ``import gemma.gm.nn``
then fails with ``VersionError: Detected incompatible Protobuf Gencode/Runtime
versions``.) The files in this folder were made with gemma 4.0.1, jax/jaxlib
0.12.0.1, flax 0.12.12.

Optional arguments: class names of ``gemma.gm.nn`` to record (default: all of
``MODELS``), e.g. ``... record_gemma.py Gemma3_1B``.

Each output file ``gemma_<model>.json`` holds::

  {"library": "gemma", "version": ..., "jax_version": ..., "model": <class name>,
   "created_by": "tests/trees/record_gemma.py",
   "leaves": [{"path": [...], "shape": [...], "dtype": ..., "names": ...}, ...]}

``path`` lists the keys of ``jax.tree_util`` key paths as strings (the dict key,
the attribute name or the sequence index), ``dtype`` is the dtype the model's
default constructor initializes that leaf with, and ``names`` is the leaf's
logical axis names when the param is a boxed Flax ``AxisMetadata``
(``nn.Partitioned`` / ``nn.LogicallyPartitioned``), else ``null``. Leaves are in
``jax.tree_util`` flatten order (where boxed metadata is present, each box
counts as one leaf).

This module imports nothing beyond the standard library at import time, so that
pytest's ``--doctest-modules`` collection can import it on Python 3.11 without
``gemma``.
"""

import pathlib
import sys

from recording import key_str, write_record

# Class names in `gemma.gm.nn` (gemma 4.0.1), each built with its default
# constructor.
MODELS = ("Gemma2_2B", "Gemma3_270M", "Gemma3_1B", "Gemma3_4B")

OUT_DIR = pathlib.Path(__file__).resolve().parent


def _leaf_names(leaf):
  """The logical axis names carried by a boxed param, or None."""
  names = getattr(leaf, "names", None)
  if names is None:
    # Other annotations: a sharding recorded on the abstract value.
    sharding = getattr(leaf, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
      return None
    names = tuple(spec)
  return [
      None if n is None else (list(n) if isinstance(n, tuple) else str(n))
      for n in names
  ]


def _abstract_params(model):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  tokens = jnp.zeros((1, 8), jnp.int32)
  variables = jax.eval_shape(
      lambda: model.init(jax.random.key(0), tokens=tokens)
  )
  return variables["params"]


def record(model_name):
  """Builds `gm.nn.<model_name>()`, writes its param tree, returns the file
  path."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import gemma  # pylint: disable=import-outside-toplevel
  from gemma import gm  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  model = getattr(gm.nn, model_name)()
  params = _abstract_params(model)
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
  flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)
  leaves = []
  for path, leaf in flat:
    value = leaf.unbox() if is_box(leaf) else leaf
    leaves.append(
        {
            "path": [key_str(k) for k in path],
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "names": _leaf_names(leaf),
        }
    )
  doc = {
      "library": "gemma",
      "version": gemma.__version__,
      "jax_version": jax.__version__,
      "model": type(model).__name__,
      "created_by": "tests/trees/record_gemma.py",
  }
  out = OUT_DIR / f"gemma_{model_name}.json"
  write_record(out, doc, leaves)
  return out, len(leaves)


def main(argv):
  names = argv[1:] or MODELS
  failed = []
  for name in names:
    try:
      out, n = record(name)
      print(f"{name}: {n} leaves -> {out}")
    except Exception as e:  # pylint: disable=broad-except
      failed.append(name)
      print(f"{name}: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
