"""What the recorders in this folder share (each runs by hand in its library's
own environment, with this folder on ``sys.path``): key paths as strings, and
the JSON layout of a record (a header, then one leaf per line)."""

import json


def key_str(k):
  """One entry of a jax.tree_util key path, as a string."""
  import jax  # pylint: disable=import-outside-toplevel

  if isinstance(k, jax.tree_util.DictKey):
    return str(k.key)
  if isinstance(k, jax.tree_util.GetAttrKey):
    return str(k.name)
  if isinstance(k, jax.tree_util.SequenceKey):
    return str(k.idx)
  if isinstance(k, jax.tree_util.FlattenedIndexKey):
    return str(k.key)
  return str(k)


def by_path(tree, is_leaf=None):
  """The leaves of ``tree`` keyed by their paths (tuples of strings)."""
  import jax  # pylint: disable=import-outside-toplevel

  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return {tuple(key_str(k) for k in path): leaf for path, leaf in flat}


def write_record(path, header: dict, leaves: list[dict]) -> None:
  """Writes ``header`` with a ``"leaves"`` list, one leaf per line."""
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps(header, separators=(",", ":"))[:-1])
    f.write(',"leaves":[\n')
    f.write(",\n".join(json.dumps(l, separators=(",", ":")) for l in leaves))
    f.write("\n]}\n")
