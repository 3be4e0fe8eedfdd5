"""The option objects of this package: frozen, validated once, compared by
value.

``scale_by_muon`` and ``muon`` take optax.contrib's arguments as they are; what
this package adds comes grouped here, one object per concept: how Newton–Schulz
runs (``NSOptions``), how sharded leaves are exchanged (``ShardingOptions``),
NorMuon (``NorMuon``) and which leaf goes to which optimizer (``Routing``).
QK-clip's options live with it (``qk_clipping.QKClip``). Every field is checked
when the object is made, with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from optax_muon._src.core import tree_utils
from optax_muon._src.core.profiles import CostModel
from optax_muon._src.core.layout_rules import (
    HEADS,
    KNOWN_LAYER_STACKS,
    KNOWN_LAYOUTS,
    LayerStack,
    LayoutRule,
)

REPLICA_POLICIES = ("split", "redundant")
EXCHANGES = ("combined", "per_shape")

#: Leaves whose path matches this go to AdamW under the default routing:
#: embeddings and output heads (any path component containing "embed", or named
#: lm_head, logits_dense (MaxText's), wte, wpe, head), and norm scales however
#: they are stacked (a component containing "norm", one named ln, ln1, ln_2,
#: ln_f..., or a leaf named scale or ending in _scale, as ln_scale).
DEFAULT_ADAM_PATTERN = (
    r"(?i)embed|norm|(^|/)(lm_head|logits_dense|wte|wpe|head|ln[_\d]*f?)"
    r"(/|$)|(^|[/_])scale$"
)


def check_number(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_closed: bool = False,
) -> None:
  """Raises ValueError if a Python number lies outside [low, high).

  ``low_open`` excludes ``low``, ``high_closed`` includes ``high``. Arrays and
  traced values (``optax.inject_hyperparams``) pass unchecked.
  """
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return
  too_low = value <= low if low_open else value < low
  too_high = high is not None and (
      value > high if high_closed else value >= high
  )
  if too_low or too_high or value != value:
    interval = (
        f"{'(' if low_open else '['}{low},"
        f" {high if high is not None else 'inf'}{']' if high_closed else ')'}"
    )
    raise ValueError(f"{name} must lie in {interval}, got {value!r}.")


def check_choice(owner: str, name: str, value: Any, choices: tuple) -> None:
  if value not in choices:
    raise ValueError(f"{owner}.{name} must be one of {choices}, got {value!r}.")


def dtype_or_none(value: Any) -> np.dtype | None:
  return None if value is None else jnp.dtype(value)


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
  """How the plan moves sharded matrices to their owners (see
  ``optax_muon._src.muon.plan``).

  Attributes:
    replica_policy: for leaves replicated over some mesh axes: ``"split"`` the
      NS work among the replicas and all-gather the results, or compute it
      ``"redundant"`` on each.
    wire_dtype: dtype of the all-to-all buffers (``jnp.bfloat16`` halves the
      bytes); ``None`` keeps the leaves'.
    exchange: ``"combined"``: one all-to-all each way for all leaves that share
      their mesh axes, owners balanced over every shape at once (on FSDP and
      FSDP × TP meshes one for the whole tree); ``"per_shape"``: one each way
      per same-shape set of matrices, each spread evenly, so that only one set's
      buffers are alive at a time (less balance).
    cost_model: how fast the devices compute and communicate (``CostModel``);
      the plan splits a matrix over a team of devices where that shortens the
      modelled critical path of the whole tree. ``None``: the profile of the
      planned mesh's devices, by their ``device_kind`` (a topology's too, for
      ahead-of-time compilation; an abstract mesh has none, then
      ``jax.devices()``'s), at the NS compute dtype's rate (see
      ``CostModel.profile``).
    exchange_stages: split each exchange by matrix into this many stages (a
      team's matrices like an owner's): one stage is orthogonalized while the
      next moves out and the previous one comes back (at most as many as the
      busiest worker has matrices). Stages that share a program run as one
      loop (the NS code compiled once per distinct program, whatever the
      count), stages with none in common in line (each moves only its own
      matrices); ``None``: as many as shorten the cost model's modelled time
      without compiling more than one NS program more (one on
      XLA:CPU, whose collectives cannot overlap compute). TPUs need asynchronous
      all-to-alls for the overlap (``LIBTPU_INIT_ARGS=
      --xla_tpu_enable_async_all_to_all=true``), GPUs the latency-hiding
      scheduler (``XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true``).

  Examples:
    >>> import optax_muon
    >>> optax_muon.ShardingOptions(replica_policy="redundant").exchange
    'combined'
  """

  replica_policy: str = "split"
  wire_dtype: Any = None
  exchange: str = "combined"
  cost_model: CostModel | None = None
  exchange_stages: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "wire_dtype", dtype_or_none(self.wire_dtype))
    stages = self.exchange_stages
    if stages is not None and (
        isinstance(stages, bool) or not isinstance(stages, int) or stages < 1
    ):
      raise ValueError(
          "ShardingOptions.exchange_stages must be a positive int or None, got"
          f" {stages!r}."
      )
    if self.cost_model is not None and not isinstance(
        self.cost_model, CostModel
    ):
      raise ValueError(
          "ShardingOptions.cost_model must be an optax_muon.CostModel or None,"
          f" got {self.cost_model!r}."
      )
    check_choice(
        "ShardingOptions",
        "replica_policy",
        self.replica_policy,
        REPLICA_POLICIES,
    )
    check_choice("ShardingOptions", "exchange", self.exchange, EXCHANGES)


def _is_label(x: Any) -> bool:
  return isinstance(x, str)


@dataclasses.dataclass(frozen=True)
class Routing:
  """Which leaves ``muon`` sends to Muon and which to AdamW, and how a Muon leaf
  is read as matrices (see ``routing.route`` and the layouts page of the docs).

  Attributes:
    labels: ``"muon"``/``"adam"`` per leaf: a tree, prefix tree, single label or
      callable ``params -> such a tree``; overrides every other rule.
    adam_pattern: a regular expression searched in each leaf's path: leaves that
      match go to AdamW (embeddings, output heads); ``None`` disables it.
    biases: biases go to AdamW: leaves named ``bias``, ``*_bias`` (and ``b``
      beside a ``w``, as Haiku names them), and leaves beside a kernel
      (``kernel``, ``w``, ``weight``) whose shape ends with theirs (the (heads,
      head_dim) biases of Flax's attention).
    layouts: the ``LayoutRule``s that say how ≥3-D (and Equinox's) kernels are
      read as matrices; the first rule that matches a leaf applies.
      ``KNOWN_LAYOUTS`` (Gemma, Flax attention, MaxText, Equinox) by default;
      put your own first: ``layouts=(LayoutRule(...),
      *optax_muon.KNOWN_LAYOUTS)``.
    layer_stacks: the ``LayerStack``s that say which leaves hold a layer axis
      (scanned layers) and where; the first that matches a leaf applies.
      MaxText's scanned decoders (layer axis 1) by default; add your own:
      ``layer_stacks=(LayerStack(r"^blocks/", 0, "my scan"),
      *Routing().layer_stacks)``.
    heads: attention heads in a layout rule or logical names: ``"whole"``
      orthogonalizes the whole d_model × heads·head_dim projection (Moonlight,
      Kimi K2), ``"per_head"`` each head's own matrix.

  With ``Routing(adam_pattern=None, biases=False, layouts=(),
  layer_stacks=())`` every floating 2-D leaf goes to Muon and every other leaf
  to AdamW, as in ``optax.contrib.muon``.

  Examples:
    >>> import optax_muon
    >>> routing = optax_muon.Routing(labels={"w": "muon", "b": "adam"})
    >>> routing.adam_pattern is not None
    True
    >>> optax_muon.Routing(heads="per_head").layouts == optax_muon.KNOWN_LAYOUTS
    True
  """

  labels: Any = None
  adam_pattern: str | None = DEFAULT_ADAM_PATTERN
  biases: bool = True
  layouts: tuple[LayoutRule, ...] = KNOWN_LAYOUTS
  layer_stacks: tuple[LayerStack, ...] = KNOWN_LAYER_STACKS
  heads: str = "whole"

  def __post_init__(self):
    object.__setattr__(
        self,
        "labels",
        tree_utils.freeze_prefix(
            self.labels, is_value=_is_label, what="labels"
        ),
    )
    if self.adam_pattern is not None and not isinstance(self.adam_pattern, str):
      raise ValueError(
          "Routing.adam_pattern must be a regular expression (str) or None, "
          f"got {self.adam_pattern!r}."
      )
    if not isinstance(self.biases, bool):
      raise ValueError(
          f"Routing.biases must be True or False, got {self.biases!r}."
      )
    for field, kind in (("layouts", LayoutRule), ("layer_stacks", LayerStack)):
      value = getattr(self, field)
      if isinstance(value, kind) or not all(
          isinstance(r, kind) for r in _iterable(value)
      ):
        raise ValueError(
            f"Routing.{field} must be a sequence of optax_muon.{kind.__name__},"
            f" got {value!r}."
        )
      object.__setattr__(self, field, tuple(value))
    check_choice("Routing", "heads", self.heads, HEADS)


def _iterable(x: Any) -> tuple:
  try:
    return tuple(x)
  except TypeError:
    return (None,)


def check_option(name: str, value: Any, kind: type, default: Any = None) -> Any:
  """``value``, or ``default`` when it is None.

  Raises:
    ValueError: naming the argument, if ``value`` is neither None nor a
      ``kind``.
  """
  if value is None:
    return default
  if not isinstance(value, kind):
    raise ValueError(
        f"{name} must be an optax_muon.{kind.__name__} or None, got "
        f"{type(value).__name__}: {value!r}."
    )
  return value
