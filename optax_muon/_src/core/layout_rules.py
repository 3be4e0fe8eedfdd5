"""How real libraries lay out their weights: which axes of a leaf form Muon's
matrix.

A 2-D ``x @ W`` kernel needs no description. Attention and fused kernels do:
Gemma's ``q_einsum/w`` is (heads, d_model, head_dim), Flax's
``MultiHeadDotProductAttention`` query kernel is (d_model, heads, head_dim),
Equinox's ``Linear.weight`` is (out, in). Two sources say which axis is which:

- ``LayoutRule``: a leaf's path (and, for module trees such as Equinox's, the
  class of the layer holding it) names its layout, one letter per axis.
  ``KNOWN_LAYOUTS`` holds the rules for Gemma, Flax attention and Equinox;
  ``Routing(layouts=...)`` adds a user's own.
- Logical axis names (MaxText, ``nn.with_logical_partitioning``,
  ``nnx.with_partitioning``): each name has a role (``LOGICAL_AXIS_ROLES``), and
  the roles give the matrix (``from_logical_names``).

Either way, attention heads are part of the matrix by default
(``heads="whole"``: the d_model × heads·head_dim projection, as Moonlight and
Kimi K2 orthogonalize it) or batch axes (``heads="per_head"``: one head_dim-wide
matrix per head); the shape factor follows the matrix that is orthogonalized.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from optax_muon._src.core.matrices import MuonDimensionNumbers

HEADS = ("whole", "per_head")

#: Axis letters of a ``LayoutRule``.
AXIS_LETTERS = {
    "i": "an input axis (contracted with the layer's input)",
    "o": "an output axis",
    "I": "a head axis on the input side (per-head: a batch axis)",
    "O": "a head axis on the output side (per-head: a batch axis)",
    "b": (
        "a batch axis: each index is an independent matrix (stacked layers,"
        " experts, the parts of a fused kernel)"
    ),
}


def _letters_to_dimension_numbers(
    letters: str, heads: str
) -> MuonDimensionNumbers:
  head_side = {
      "I": "b" if heads == "per_head" else "i",
      "O": "b" if heads == "per_head" else "o",
  }
  roles = [head_side.get(c, c) for c in letters]
  return MuonDimensionNumbers(
      tuple(a for a, r in enumerate(roles) if r == "i"),
      tuple(a for a, r in enumerate(roles) if r == "o"),
  )


@dataclasses.dataclass(frozen=True)
class LayoutRule:
  """The layout of the leaves whose path matches ``pattern``.

  Attributes:
    pattern: a regular expression searched in the leaf's path
      (``"layer_0/attn/q_einsum/w"``).
    axes: one letter per axis of the leaf (see ``AXIS_LETTERS``): ``i`` input,
      ``o`` output, ``I``/``O`` attention heads on the input/output side, ``b``
      batch; or a callable ``shape -> letters`` for layouts that depend on the
      shape (returning ``""`` for shapes it does not describe); or None: the
      leaf is not a hidden matrix (an embedding) and goes to AdamW. A rule
      applies only to leaves of the rank its letters have.
    name: what the rule describes, shown by ``summarize``.
    owner: for trees of module objects (Equinox): a regular expression that one
      of the classes of the object holding the leaf must match
      (``"module.QualName"``); None: any owner.

  Examples:
    >>> import optax_muon
    >>> rule = optax_muon.LayoutRule(r"(^|/)attn/q$", "iOo", "my attention")
    >>> # (reduction_axis, output_axis)
    >>> tuple(rule.dimension_numbers((64, 4, 16)))
    ((0,), (1, 2))
    >>> # heads: batch
    >>> tuple(rule.dimension_numbers((64, 4, 16), heads="per_head"))
    ((0,), (2,))
  """

  pattern: str
  axes: str | Callable[[tuple[int, ...]], str] | None
  name: str
  owner: str | None = None

  def __post_init__(self):
    for field in ("pattern", "owner"):
      value = getattr(self, field)
      if value is not None:
        try:
          re.compile(value)
        except (re.error, TypeError) as e:
          raise ValueError(
              f"LayoutRule.{field} must be a regular expression, got "
              f"{value!r} ({e})."
          ) from None
    if isinstance(self.axes, str):
      _check_letters(self.axes, f"LayoutRule({self.pattern!r}).axes")
    elif self.axes is not None and not callable(self.axes):
      raise ValueError(
          "LayoutRule.axes must be a string of axis letters, a callable or "
          f"None, got {self.axes!r}."
      )

  def matches(
      self, path: str, shape: tuple[int, ...], owner: Sequence[str] = ()
  ) -> bool:
    """Whether the rule describes the leaf at ``path`` of ``shape``, held by an
    object of the classes ``owner``."""
    if not re.search(self.pattern, path):
      return False
    if self.owner is not None and not any(
        re.search(self.owner, c) for c in owner
    ):
      return False
    letters = self.letters(shape)
    return letters is None or len(letters) == len(shape)

  def letters(self, shape: tuple[int, ...]) -> str | None:
    """The letters for a leaf of ``shape``; ``""`` from a callable: not a leaf
    it describes."""
    if callable(self.axes):
      letters = self.axes(tuple(shape))
      if letters != "":
        _check_letters(
            letters, f"LayoutRule({self.pattern!r}).axes{tuple(shape)}"
        )
      return letters
    return self.axes

  def dimension_numbers(
      self, shape: tuple[int, ...], heads: str = "whole"
  ) -> MuonDimensionNumbers | None:
    """The leaf's dimension numbers; None for a leaf the rule sends to AdamW."""
    letters = self.letters(shape)
    return (
        None
        if letters is None
        else _letters_to_dimension_numbers(letters, heads)
    )


def _check_letters(letters: Any, what: str) -> None:
  if not isinstance(letters, str) or set(letters) - set(AXIS_LETTERS):
    raise ValueError(
        f"{what} must be a string of the letters {''.join(AXIS_LETTERS)}, got "
        f"{letters!r}."
    )
  sides = {c.lower() for c in letters} - {"b"}
  if sides != {"i", "o"}:
    raise ValueError(
        f"{what} = {letters!r} needs at least one input (i/I) and one output "
        "(o/O) axis."
    )


def _gemma_gating(shape: tuple[int, ...]) -> str:
  # (2, d_model, hidden) in Gemma 2, (2, hidden, d_model) in Gemma 3: the hidden
  # side is the wider one, and it is the output (gate and up projection).
  if len(shape) != 3:
    return ""
  return "bio" if shape[1] <= shape[2] else "boi"


def _equinox_conv(shape: tuple[int, ...]) -> str:
  return (
      "oi" + "i" * (len(shape) - 2) if len(shape) >= 2 else ""
  )  # (out, in, *kernel)


#: The layouts ``muon``'s default routing knows (``Routing.layouts``): Gemma's
#: einsum kernels (the ``gemma`` library), Flax's attention layers
#: (``nn.MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``) and
#: Equinox's layers (``Linear``, ``Conv``, ``Embedding``).
KNOWN_LAYOUTS: tuple[LayoutRule, ...] = (
    # Gemma: "BTD,NDH->BTNH" and friends (N heads, K kv heads, D d_model, H
    # head_dim).
    LayoutRule(
        r"(^|/)q_einsum/w$", "Oio", "Gemma query (heads, d_model, head_dim)"
    ),
    LayoutRule(
        r"(^|/)kv_einsum/w$",
        "bOio",
        "Gemma key/value (2, kv_heads, d_model, head_dim)",
    ),
    LayoutRule(
        r"(^|/)qkv_einsum/w$",
        "bOio",
        "Gemma fused q/k/v (3, heads, d_model, head_dim)",
    ),
    LayoutRule(
        r"(^|/)attn_vec_einsum/w$",
        "Iio",
        "Gemma attention output (heads, head_dim, d_model)",
    ),
    LayoutRule(
        r"(^|/)gating_einsum(/w)?$",
        _gemma_gating,
        "Gemma gate and up projections (2, d_model ↔ hidden)",
    ),
    # Flax: DenseGeneral kernels, inputs first, features (heads, head_dim) last.
    LayoutRule(
        r"(^|/)(query|key|value)/kernel$",
        "iOo",
        "Flax attention projection (d_model, heads, head_dim)",
    ),
    LayoutRule(
        r"(^|/)out/kernel$",
        "Iio",
        "Flax attention output (heads, head_dim, d_model)",
    ),
    # Equinox: PyTorch's order, outputs first.
    LayoutRule(
        r"(^|/)weight$",
        "oi",
        "Equinox Linear (out, in)",
        owner=r"^equinox\..*\.Linear$",
    ),
    LayoutRule(
        r"(^|/)weight$",
        _equinox_conv,
        "Equinox Conv (out, in, *kernel)",
        owner=r"^equinox\..*\.Conv$",
    ),
    LayoutRule(
        r"(^|/)weight$",
        None,
        "Equinox Embedding (vocab, d)",
        owner=r"^equinox\..*\.Embedding$",
    ),
)

#: Roles of logical axis names (MaxText's, T5X's, Flax examples'): ``"model"``
#: the residual width (d_model), ``"heads"`` attention heads, ``"head_dim"`` a
#: head's features, ``"hidden"`` other matrix features (MLP, low-rank
#: projections), ``"batch"`` independent matrices (stacked layers, experts,
#: fused parts), ``"vocab"`` an embedding's or output head's vocabulary (the
#: leaf goes to AdamW).
LOGICAL_AXIS_ROLES: Mapping[str, str] = {
    **dict.fromkeys(
        (
            "embed",
            "embed_no_exp",
            "d_model",
            "emb",
            "model",
            "features",
            "norm",
        ),
        "model",
    ),
    **dict.fromkeys(("heads", "q_heads", "kv_heads", "num_heads"), "heads"),
    **dict.fromkeys(
        (
            "kv",
            "head_dim",
            "kv_head_dim",
            "qk_head_dim",
            "v_head_dim",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "joined_kv",
        ),
        "head_dim",
    ),
    **dict.fromkeys(
        (
            "mlp",
            "mlp_no_fsdp",
            "hidden",
            "ffn",
            "intermediate",
            "q_lora",
            "kv_lora",
            "q_lora_up_proj",
            "kv_lora_up_proj",
        ),
        "hidden",
    ),
    **dict.fromkeys(
        (
            "layers",
            "stage",
            "exp",
            "expert",
            "experts",
            "num_activations",
            "qkv",
            "num_layers",
        ),
        "batch",
    ),
    **dict.fromkeys(("vocab", "vocab_size"), "vocab"),
}

ROLES = ("model", "heads", "head_dim", "hidden", "batch", "vocab")


def check_axis_roles(axis_roles: Mapping[str, str] | None) -> dict[str, str]:
  """``LOGICAL_AXIS_ROLES`` updated with ``axis_roles``.

  Raises:
    ValueError: for a role that is not one of ``ROLES``.
  """
  roles = dict(LOGICAL_AXIS_ROLES)
  for name, role in (axis_roles or {}).items():
    if role not in ROLES:
      raise ValueError(
          f"axis_roles: the role of {name!r} must be one of {ROLES}, got "
          f"{role!r}."
      )
    roles[name] = role
  return roles


def from_logical_names(
    path: str,
    names: Sequence[str | None],
    shape: tuple[int, ...],
    roles: Mapping[str, str],
    heads: str = "whole",
) -> MuonDimensionNumbers | None:
  """A leaf's dimension numbers from its logical axis names.

  The matrix axes (all but ``"batch"``; ``"heads"`` too with
  ``heads="per_head"``) split in two sides: the head axes with their
  ``head_dim`` axes, and the rest. The side holding the last matrix axis is the
  output (in ``x @ W`` layouts the features come last, also in Gemma's (heads,
  d_model, head_dim) query). With one side only, the last axis is the output and
  the others the input.

  Args:
    path: the leaf's path, for messages.
    names: one logical name per axis.
    shape: the leaf's shape.
    roles: name → role (``check_axis_roles``).
    heads: ``"whole"`` or ``"per_head"``.

  Returns:
    The dimension numbers, or None for a leaf with a ``"vocab"`` axis (an
    embedding or output head) or fewer than two matrix axes.

  Raises:
    ValueError: naming the leaf, for a name without a role or a count that does
      not match the leaf's rank.
  """
  names = tuple(names)
  if len(names) != len(shape):
    raise ValueError(
        f"{path}: logical names {names} do not match the leaf's shape {shape}."
    )
  unknown = [n for n in names if n not in roles]
  if unknown:
    raise ValueError(
        f"{path}: logical axis names {unknown} (of {names}) have no role; give "
        f"them one with axis_roles={{name: role}}, role one of {ROLES}."
    )
  kinds = [roles[n] for n in names]
  if "vocab" in kinds:
    return None
  batch = {"batch"} | ({"heads"} if heads == "per_head" else set())
  matrix = [a for a, k in enumerate(kinds) if k not in batch]
  if len(matrix) < 2:
    return None
  head_side = [a for a in matrix if kinds[a] in ("heads", "head_dim")]
  rest = [a for a in matrix if a not in head_side]
  if head_side and rest:
    output = head_side if matrix[-1] in head_side else rest
  else:
    output = [matrix[-1]]
  return MuonDimensionNumbers(
      tuple(a for a in matrix if a not in output), tuple(output)
  )
