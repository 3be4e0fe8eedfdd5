"""optax_muon: Muon (momentum orthogonalized by Newton–Schulz) for JAX and Optax.

Building block: ``scale_by_muon`` (compose it in ``optax.chain``, with ``scale_by_shape``).
Full optimizer: ``muon`` (Muon on matrices, AdamW on the rest); ``dion`` and
``scale_by_dion`` put Dion's low-rank direction in Newton–Schulz's place. Both take every argument
of their ``optax.contrib`` namesakes; this package's own options come as the objects
``NSOptions``, ``ShardingOptions``, ``NorMuon``, ``Routing`` and ``QKClip``.
Newton–Schulz: ``newton_schulz`` with the coefficient presets in ``PRESET_NAMES`` or a
generated ``polar_express_coefficients`` table, and ``msign``, its SVD reference.
Routing (``Routing``, ``route``): embeddings, output heads, biases and vectors to AdamW;
attention and fused kernels read by ``KNOWN_LAYOUTS`` (Gemma, Flax, Equinox), your own
``LayoutRule``s, or logical axis names (``infer_dimension_numbers``).
``summarize`` shows where every leaf goes; ``diagnostics`` gives per-step scalars to log.
``qk_clip`` (MuonClip) caps attention logits by rescaling query and key heads.
"""

from optax_muon.alias import muon
from optax_muon.coefficients import (PRESET_NAMES, NSCoefficients, polar_express_coefficients,
                                     resolve_coefficients, singular_value_range)
from optax_muon.dion_transform import DionState, dion, scale_by_dion
from optax_muon.costs import PROFILES, CostModel, default_cost_model, ns_flops
from optax_muon.layout import MuonDimensionNumbers
from optax_muon.layouts import KNOWN_LAYOUTS, LOGICAL_AXIS_ROLES, LayoutRule
from optax_muon.orthogonalization import PRECONDITIONINGS, msign, newton_schulz
from optax_muon.options import DEFAULT_ADAM_PATTERN, NorMuon, NSOptions, Routing, ShardingOptions
from optax_muon.qk_clipping import QKClip, QKClipHeads, qk_clip
from optax_muon.routing import Reason, Route, infer_dimension_numbers, route
from optax_muon.scaling import scale_factor
from optax_muon.step_diagnostics import diagnostics
from optax_muon.summary import LeafSummary, RoutingSummary, summarize
from optax_muon.transform import MuonState, scale_by_muon, scale_by_shape
from optax_muon.weight_decay import add_cautious_decayed_weights

__version__ = "0.2.0"

__all__ = [
    "CostModel",
    "DEFAULT_ADAM_PATTERN",
    "DionState",
    "KNOWN_LAYOUTS",
    "LOGICAL_AXIS_ROLES",
    "LayoutRule",
    "LeafSummary",
    "MuonDimensionNumbers",
    "MuonState",
    "NSCoefficients",
    "NSOptions",
    "NorMuon",
    "PRECONDITIONINGS",
    "PRESET_NAMES",
    "PROFILES",
    "QKClip",
    "QKClipHeads",
    "Reason",
    "Route",
    "Routing",
    "RoutingSummary",
    "ShardingOptions",
    "add_cautious_decayed_weights",
    "default_cost_model",
    "diagnostics",
    "dion",
    "infer_dimension_numbers",
    "msign",
    "muon",
    "newton_schulz",
    "ns_flops",
    "polar_express_coefficients",
    "qk_clip",
    "resolve_coefficients",
    "route",
    "scale_by_dion",
    "scale_by_muon",
    "scale_by_shape",
    "scale_factor",
    "singular_value_range",
    "summarize",
]
