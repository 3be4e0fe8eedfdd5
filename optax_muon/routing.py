"""Which leaves go to Muon and which to AdamW, and why (the reason is data, not text)."""

from __future__ import annotations

import dataclasses
import enum
import re
import warnings
from typing import Any

import jax.numpy as jnp

from optax_muon import tree_utils
from optax_muon.layout import is_dimension_numbers
from optax_muon.options import Routing

MUON, ADAM = "muon", "adam"


class Reason(enum.Enum):
  """Why a leaf went where it went; ``describe`` gives the words ``summarize`` shows."""

  LABELS = "labels"
  DIMENSION_NUMBERS = "dimension numbers"
  NO_DIMENSION_NUMBERS = "dimension numbers are None"
  NOT_INEXACT = "not floating point or complex"
  FEWER_THAN_2_D = "{ndim}-D"
  PATTERN = "path matches embedding/head pattern"
  MATRIX = "2-D"
  UNDESCRIBED = "{ndim}-D without dimension numbers"
  GIVEN_TO_SCALE_BY_MUON = "scale_by_muon"

  def describe(self, ndim: int) -> str:
    return self.value.format(ndim=ndim)


@dataclasses.dataclass(frozen=True)
class Route:
  """Where one leaf goes.

  Attributes:
    path: the leaf's path.
    optimizer: ``"muon"`` or ``"adam"``.
    reason: why (a ``Reason``).
  """

  path: str
  optimizer: str
  reason: Reason


def _default_route(path: str, leaf: Any, pattern: re.Pattern | None) -> Route:
  if not jnp.issubdtype(leaf.dtype, jnp.inexact):
    return Route(path, ADAM, Reason.NOT_INEXACT)
  if leaf.ndim < 2:
    return Route(path, ADAM, Reason.FEWER_THAN_2_D)
  if pattern is not None and pattern.search(path):
    return Route(path, ADAM, Reason.PATTERN)
  if leaf.ndim == 2:
    return Route(path, MUON, Reason.MATRIX)
  return Route(path, ADAM, Reason.UNDESCRIBED)


def route(params: Any, routing: Routing | None = None, weight_dimension_numbers: Any = None
          ) -> list[Route | None]:
  """Decides Muon or AdamW for every leaf.

  Rules, first that applies:
    1. ``routing.labels`` (``"muon"``/``"adam"`` per leaf) decides.
    2. ``weight_dimension_numbers`` given (tree, prefix tree or callable, as in
       ``optax.contrib.muon``): leaves with ``MuonDimensionNumbers`` go to Muon, leaves with
       ``None`` to AdamW.
    3. Default: floating 2-D leaves go to Muon unless their path matches
       ``routing.adam_pattern`` (embeddings, output heads); everything else goes to AdamW.
       ≥3-D leaves without dimension numbers trigger a warning, since they are often stacked
       layers.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct`` objects).
    routing: the ``Routing`` options; ``None`` is ``Routing()``.
    weight_dimension_numbers: see rule 2.

  Returns:
    One ``Route`` per position of ``tree_utils.flatten_positions(params)`` (None for
    placeholders).

  Raises:
    ValueError: if the labels or dimension numbers don't match the params, or a label is not
      ``"muon"``/``"adam"``.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> params = {"lm_head": jnp.zeros((64, 256)), "w": jnp.zeros((64, 64)),
    ...           "b": jnp.zeros(64)}
    >>> [(r.path, r.optimizer, r.reason.name) for r in optax_muon.route(params)]
    [('b', 'adam', 'FEWER_THAN_2_D'), ('lm_head', 'adam', 'PATTERN'), ('w', 'muon', 'MATRIX')]
  """
  dims = None
  if weight_dimension_numbers is not None:
    dims = tree_utils.resolve_prefix(
        tree_utils.freeze_prefix(weight_dimension_numbers, is_value=is_dimension_numbers,
                                 what="muon_weight_dimension_numbers"),
        params, is_value=is_dimension_numbers, what="muon_weight_dimension_numbers")
  return decide(params, routing or Routing(), dims)


def decide(params: Any, routing: Routing, dims: list[Any] | None) -> list[Route | None]:
  """``route`` with the dimension numbers already resolved (one entry per position, or
  None when none were given)."""
  positions, _ = tree_utils.flatten_positions(params)
  paths = [tree_utils.path_str(p) for p, _ in positions]
  if routing.labels is not None:
    labels = tree_utils.resolve_prefix(routing.labels, params,
                                       is_value=lambda x: isinstance(x, str), what="labels")
    for path, label in zip(paths, labels):
      if label not in (MUON, ADAM):
        raise ValueError(f"labels: leaf '{path}' has label {label!r}; expected '{MUON}' or "
                         f"'{ADAM}'.")
    routes = [Route(path, label, Reason.LABELS) for path, label in zip(paths, labels)]
  elif dims is not None:
    routes = [Route(path, MUON, Reason.DIMENSION_NUMBERS) if is_dimension_numbers(d)
              else Route(path, ADAM, Reason.NO_DIMENSION_NUMBERS)
              for path, d in zip(paths, dims)]
  else:
    pattern = re.compile(routing.adam_pattern) if routing.adam_pattern else None
    routes = [_default_route(path, leaf, pattern) if tree_utils.is_array_leaf(leaf) else None
              for path, (_, leaf) in zip(paths, positions)]
    undescribed = [r.path for r in routes if r is not None and r.reason == Reason.UNDESCRIBED]
    if undescribed:
      warnings.warn(f"optax_muon: leaves of rank >= 3 go to AdamW because no "
                    f"MuonDimensionNumbers describe them: {tree_utils.listing(undescribed)}. "
                    "If they are stacked layers, conv kernels or experts, pass "
                    "muon_weight_dimension_numbers.", stacklevel=2)
  return [r if tree_utils.is_array_leaf(leaf) else None
          for r, (_, leaf) in zip(routes, positions)]
