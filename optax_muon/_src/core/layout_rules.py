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


@dataclasses.dataclass(frozen=True)
class LayerStack:
  """Leaves that hold one slice per layer along one or more axes (scanned
  layers).

  ``nn.scan`` and MaxText's scanned decoders stack the params of equal layers
  into one leaf with a layer axis: MaxText's scanned query kernel is (d_model,
  layers, heads, head_dim) (``param_scan_axis=1``), ``nn.scan``'s default puts
  the layers first, and a scan nested in a scan (Qwen3-Next's local layers in
  MaxText) adds a second layer axis. Under a ``LayerStack`` the layer axes are
  batch axes (each layer its own matrix), and the rest of the leaf is read as
  if the layer were alone: a layout rule for the per-layer shape, the plain
  2-D rule, or AdamW for a vector per layer (a stacked norm scale).

  Attributes:
    pattern: a regular expression searched in the leaf's path; the path up
      to the end of the match is the scope (``"decoder/layers/"``). A scope
      is read as stacked only if one of its leaves is a matrix per layer or
      more (rank ≥ 2 without the layer axes), and all its leaves have the
      same sizes along ``axes`` (the layer counts); a scope whose sizes
      differ is read as unstacked, with a warning.
    axes: the layer axis, or several (an int or a tuple of ints; negative
      counts from the end).
    name: what the stack describes, shown by ``summarize``.

  Examples:
    >>> import optax_muon
    >>> stack = optax_muon.LayerStack(r"^blocks/", 0, "nn.scan over blocks")
    >>> stack.per_layer_shape((12, 64, 256))
    (64, 256)
    >>> tuple(stack.lift(optax_muon.MuonDimensionNumbers(0, 1), 3))
    ((1,), (2,))
  """

  pattern: str
  axes: int | tuple[int, ...]
  name: str

  def __post_init__(self):
    try:
      re.compile(self.pattern)
    except (re.error, TypeError) as e:
      raise ValueError(
          "LayerStack.pattern must be a regular expression, got "
          f"{self.pattern!r} ({e})."
      ) from None
    axes = (self.axes,) if _is_int(self.axes) else self.axes
    if (
        not isinstance(axes, (tuple, list))
        or not axes
        or not all(_is_int(a) for a in axes)
    ):
      raise ValueError(
          "LayerStack.axes must be an int or a non-empty tuple of ints, got"
          f" {self.axes!r}."
      )
    object.__setattr__(self, "axes", tuple(axes))

  def scope(self, path: str, ndim: int) -> str | None:
    """The scope of the leaf at ``path`` of rank ``ndim`` (None: not under
    this stack, or without its layer axes)."""
    found = re.search(self.pattern, path)
    if found is None or not all(-ndim <= a < ndim for a in self.axes):
      return None
    if len(self.layer_axes(ndim)) < len(self.axes):
      return None
    return path[: found.end()]

  def layer_axes(self, ndim: int) -> tuple[int, ...]:
    """The layer axes of a rank-``ndim`` leaf, counted from the start."""
    return tuple(sorted({a % ndim for a in self.axes}))

  def layer_sizes(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The leaf's sizes along its layer axes."""
    return tuple(shape[a] for a in self.layer_axes(len(shape)))

  def per_layer_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` without its layer axes."""
    layers = self.layer_axes(len(shape))
    return tuple(n for a, n in enumerate(shape) if a not in layers)

  def lift(self, dims: MuonDimensionNumbers, ndim: int) -> MuonDimensionNumbers:
    """Dimension numbers of one layer (rank ``ndim`` minus the layer axes) as
    dimension numbers of the stacked leaf (rank ``ndim``): the layer axes are
    batch axes."""
    layers = self.layer_axes(ndim)
    kept = [a for a in range(ndim) if a not in layers]

    def lifted(axes) -> tuple[int, ...]:
      axes = (axes,) if isinstance(axes, int) else tuple(axes)
      return tuple(kept[a % len(kept)] for a in axes)

    return MuonDimensionNumbers(
        lifted(dims.reduction_axis), lifted(dims.output_axis)
    )


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


#: The scanned layers ``muon``'s default routing knows
#: (``Routing.layer_stacks``): MaxText's scanned decoders, whose layer axis is
#: axis 1 (``param_scan_axis=1``, MaxText's default): ``decoder/layers``,
#: DeepSeek's ``decoder/dense_layers`` and ``decoder/moe_layers``, the scanned
#: blocks of interleaved models (``decoder/layers/layers_0``,
#: ``decoder/scanned_blocks``), and the local layers of Qwen3-Next and Gemma 4,
#: scanned inside each scanned block (axes 1 and 2).
KNOWN_LAYER_STACKS: tuple[LayerStack, ...] = (
    LayerStack(
        r"(^|/)decoder/(layers|scanned_blocks)/local_layers/",
        (1, 2),
        "MaxText scanned layers, local layers scanned inside (axes 1, 2)",
    ),
    LayerStack(
        r"(^|/)decoder/(layers|dense_layers|moe_layers|scanned_blocks)/(?!\d)",
        1,
        "MaxText scanned layers, axis 1",
    ),
)


# The modules that hold MaxText's routed experts.
_MAXTEXT_EXPERTS = (
    r"(MoeBlock_\d+|moe_block|routed_experts|routed_moe|GptOssMlp)"
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
#: (``nn.MultiHeadDotProductAttention``, ``nnx.MultiHeadAttention``),
#: MaxText's attention, MLA and MoE kernels, and Equinox's layers (``Linear``,
#: ``Conv``, ``Embedding``). Under a ``LayerStack`` a rule reads the shape of
#: one layer.
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
    # MaxText: its DenseGeneral kernels read as Flax's (above); MLA's up
    # projections, the routed experts (a batch of matrices), the router, and
    # the leaves MaxText keeps element-wise.
    LayoutRule(
        r"(^|/)(wq_b|wkv_b)/kernel$",
        "iOo",
        "MaxText MLA up projection (rank, heads, head_dim)",
    ),
    LayoutRule(
        r"(^|/)wkv/kernel$",
        "iOo",
        "MaxText DeepSeek-V4 joint key-value (d_model, heads, head_dim)",
    ),
    LayoutRule(
        r"(^|/)o_a_proj/kernel$",
        "bio",
        "MaxText DeepSeek-V4 grouped output (groups, heads·head_dim, rank)",
    ),
    LayoutRule(
        r"(^|/)(csa|hca)_compressor/(indexer/)?position_bias$",
        "io",
        "MaxText DeepSeek-V4 compressor position table (ratio, head_dim),"
        " a matrix as MaxText reads it",
    ),
    LayoutRule(
        rf"(^|/){_MAXTEXT_EXPERTS}/(wi|wi_0|wi_1|gate_up_proj)$",
        "bio",
        "MaxText experts in (experts, d_model, hidden)",
    ),
    LayoutRule(
        rf"(^|/){_MAXTEXT_EXPERTS}/wo$",
        "bio",
        "MaxText experts out (experts, hidden, d_model)",
    ),
    LayoutRule(
        rf"(^|/){_MAXTEXT_EXPERTS}/(gate|router)/kernel$",
        "io",
        "MaxText router (d_model, experts)",
    ),
    LayoutRule(
        r"(^|/)(shared_expert_gate|conv1d)(/|$)"
        r"|(^|/)(A_log|sinks|tid2eid|hc_base|(pre|post|res)_beta)$",
        None,
        "MaxText element-wise leaves (shared-expert gate, convolution,"
        " state-space and attention-sink scalars)",
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
            "embed_attn",
            "embed_moe",
            "embed_router",
            "embed_vocab",
            "activation_embed",
            "activation_embed_attn",
            "activation_embed_moe",
            "d_model",
            "emb",
            "model",
            "features",
            "norm",
        ),
        "model",
    ),
    **dict.fromkeys(
        (
            "heads",
            "q_heads",
            "kv_heads",
            "num_heads",
            "activation_heads",
            "activation_kv_heads",
        ),
        "heads",
    ),
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
            "activation_kv",
            "activation_kv_head_dim",
        ),
        "head_dim",
    ),
    **dict.fromkeys(
        (
            "mlp",
            "mlp_no_fsdp",
            "mlp_moe",
            "activation_mlp",
            "activation_mlp_moe",
            "hidden",
            "ffn",
            "intermediate",
            "q_lora",
            "kv_lora",
            "q_lora_up_proj",
            "kv_lora_up_proj",
            "o_lora_up_proj",
            "gdn_head",
            "indexer_q",
            "indexer_weights",
            "engram_dim",
            "mhc",
        ),
        "hidden",
    ),
    **dict.fromkeys(
        (
            "layers",
            "dense_layers",
            "moe_layers",
            "local_layers",
            "layers_remainder",
            "scanned_blocks",
            "circular_repeats",
            "stage",
            "exp",
            "exp_with_fsdp",
            "activation_exp",
            "expert",
            "experts",
            "num_activations",
            "o_groups",
            "qkv",
            "num_layers",
        ),
        "batch",
    ),
    **dict.fromkeys(("vocab", "vocab_size", "activation_vocab"), "vocab"),
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


class UnknownAxisNames(ValueError):
  """Logical axis names without a role (``from_logical_names``).

  Attributes:
    path: the leaf's path.
    names: the leaf's names.
    unknown: those without a role.
  """

  def __init__(self, path: str, names: tuple, unknown: list[str]):
    self.path, self.names, self.unknown = path, names, unknown
    super().__init__(
        f"{path}: logical axis names {unknown} (of {names}) have no role; give"
        f" them one with axis_roles={{name: role}}, role one of {ROLES}."
    )


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
  the others the input. An unnamed axis (``None``, as MaxText names a router's
  experts) is a matrix axis of the ``"hidden"`` role.

  Args:
    path: the leaf's path, for messages.
    names: one logical name (or None) per axis.
    shape: the leaf's shape.
    roles: name → role (``check_axis_roles``).
    heads: ``"whole"`` or ``"per_head"``.

  Returns:
    The dimension numbers, or None for a leaf with a ``"vocab"`` axis (an
    embedding or output head) or fewer than two matrix axes.

  Raises:
    UnknownAxisNames: (a ValueError) naming the leaf, for names without a role.
    ValueError: naming the leaf, for a count that does not match its rank.
  """
  names = tuple(names)
  if len(names) != len(shape):
    raise ValueError(
        f"{path}: logical names {names} do not match the leaf's shape {shape}."
    )
  unknown = [n for n in names if n is not None and n not in roles]
  if unknown:
    raise UnknownAxisNames(path, names, unknown)
  kinds = ["hidden" if n is None else roles[n] for n in names]
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
