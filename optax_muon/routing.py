"""Which leaves go to Muon and which to AdamW, and why."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import jax.numpy as jnp

from optax_muon import tree_utils
from optax_muon.layout import is_dimension_numbers, resolve_dimension_numbers

MUON, ADAM = "muon", "adam"

#: Leaves whose path matches this go to AdamW under the default rule: embeddings and output
#: heads (any path component containing "embed", or named lm_head, wte, wpe, head).
DEFAULT_ADAM_PATTERN = r"(?i)embed|(^|/)(lm_head|wte|wpe|head)(/|$)"


@dataclasses.dataclass(frozen=True)
class Route:
  """Where one leaf goes.

  Attributes:
    path: the leaf's path.
    label: ``"muon"`` or ``"adam"``.
    reason: why, in words (shown by ``summarize``).
  """

  path: str
  label: str
  reason: str


def _default_route(path: str, leaf: Any, pattern: re.Pattern | None) -> Route:
  if not jnp.issubdtype(leaf.dtype, jnp.inexact):
    return Route(path, ADAM, "not floating point or complex")
  if leaf.ndim < 2:
    return Route(path, ADAM, f"{leaf.ndim}-D")
  if pattern is not None and pattern.search(path):
    return Route(path, ADAM, "path matches embedding/head pattern")
  if leaf.ndim == 2:
    return Route(path, MUON, "2-D")
  return Route(path, ADAM, f"{leaf.ndim}-D without dimension numbers")


def _labels_from_user(labels: Any, params: Any) -> list[str]:
  if callable(labels):
    labels = labels(params)
  values = tree_utils.broadcast_prefix(labels, params, is_value=lambda x: isinstance(x, str),
                                       what="labels")
  positions, _ = tree_utils.flatten_positions(params)
  for (path, _), value in zip(positions, values):
    if value not in (MUON, ADAM):
      raise ValueError(f"labels: leaf '{tree_utils.path_str(path)}' has label {value!r}; "
                       f"expected '{MUON}' or '{ADAM}'.")
  return values


def route(params: Any, *, labels: Any = None, weight_dimension_numbers: Any = None,
          adam_pattern: str | None = DEFAULT_ADAM_PATTERN) -> list[Route | None]:
  """Decides Muon or AdamW for every leaf.

  Rules, first that applies:
    1. ``labels`` (a tree, prefix tree or callable of ``"muon"``/``"adam"``) decides.
    2. ``weight_dimension_numbers`` given (tree, prefix tree or callable, as in
       ``optax.contrib.muon``): leaves with ``MuonDimensionNumbers`` go to Muon, leaves with
       ``None`` to AdamW.
    3. Default: floating 2-D leaves go to Muon unless their path matches ``adam_pattern``
       (embeddings, output heads); everything else goes to AdamW. ≥3-D leaves without
       dimension numbers trigger a warning, since they are often stacked layers.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct``s).
    labels: see rule 1.
    weight_dimension_numbers: see rule 2; also gives Muon leaves their matrix layout.
    adam_pattern: regular expression searched in each leaf's path (rule 3); None disables.

  Returns:
    One ``Route`` per position of ``tree_utils.flatten_positions(params)`` (None for
    placeholders).

  Raises:
    ValueError: if ``labels`` or ``weight_dimension_numbers`` don't match the params, or a
      label is not ``"muon"``/``"adam"``.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> params = {"lm_head": jnp.zeros((64, 256)), "w": jnp.zeros((64, 64)),
    ...           "b": jnp.zeros(64)}
    >>> [(r.path, r.label, r.reason) for r in optax_muon.route(params)]
    [('b', 'adam', '1-D'), ('lm_head', 'adam', 'path matches embedding/head pattern'), ('w', 'muon', '2-D')]
  """
  positions, _ = tree_utils.flatten_positions(params)
  paths = [tree_utils.path_str(p) for p, _ in positions]
  dims = resolve_dimension_numbers(weight_dimension_numbers, params,
                                   "muon_weight_dimension_numbers")
  if labels is not None:
    user = _labels_from_user(labels, params)
    routes = [Route(path, label, "labels") for path, label in zip(paths, user)]
  elif weight_dimension_numbers is not None:
    routes = [Route(path, MUON, "dimension numbers") if is_dimension_numbers(d)
              else Route(path, ADAM, "dimension numbers are None")
              for path, d in zip(paths, dims)]
  else:
    pattern = re.compile(adam_pattern) if adam_pattern else None
    routes = [_default_route(path, leaf, pattern) if tree_utils.is_array_leaf(leaf) else None
              for path, (_, leaf) in zip(paths, positions)]
    unrouted = [r.path for r in routes if r is not None and r.reason.endswith("dimension numbers")]
    if unrouted:
      warnings.warn(f"optax_muon: {len(unrouted)} leaves of rank >= 3 go to AdamW because no "
                    f"MuonDimensionNumbers describe them: {unrouted}. If they are stacked "
                    "layers, conv kernels or experts, pass muon_weight_dimension_numbers.",
                    stacklevel=3)
  return [r if tree_utils.is_array_leaf(leaf) else None
          for r, (_, leaf) in zip(routes, positions)]
