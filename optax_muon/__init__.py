"""optax_muon: Muon (momentum orthogonalized by Newton–Schulz) for JAX and Optax.

Building block: ``scale_by_muon`` (compose it in ``optax.chain``, with ``scale_by_shape``).
Full optimizer: ``muon`` (Muon on matrices, AdamW on the rest). Both take every argument
of their ``optax.contrib`` namesakes. Newton–Schulz: ``newton_schulz`` with the coefficient
presets in ``PRESET_NAMES`` or a generated ``polar_express_coefficients`` table, and
``msign``, its SVD reference. ``summarize`` shows where every leaf goes. ``qk_clip``
(MuonClip) caps attention logits by rescaling query and key heads.
"""

from optax_muon.alias import muon
from optax_muon.coefficients import (PRESET_NAMES, NSCoefficients, polar_express_coefficients,
                                     resolve_coefficients, singular_value_range)
from optax_muon.diagnostics import diagnostics
from optax_muon.layout import MuonDimensionNumbers, scale_factor
from optax_muon.newton_schulz import PRECONDITIONINGS, msign, newton_schulz, ns_flops
from optax_muon.qk_clip import QKClipHeads, qk_clip
from optax_muon.routing import DEFAULT_ADAM_PATTERN, Route, route
from optax_muon.summary import LeafSummary, RoutingSummary, summarize
from optax_muon.transform import MuonState, MuonTransformation, scale_by_muon, scale_by_shape
from optax_muon.weight_decay import add_cautious_decayed_weights

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ADAM_PATTERN",
    "LeafSummary",
    "MuonDimensionNumbers",
    "MuonState",
    "MuonTransformation",
    "NSCoefficients",
    "PRECONDITIONINGS",
    "PRESET_NAMES",
    "QKClipHeads",
    "Route",
    "RoutingSummary",
    "add_cautious_decayed_weights",
    "diagnostics",
    "msign",
    "muon",
    "newton_schulz",
    "ns_flops",
    "polar_express_coefficients",
    "qk_clip",
    "resolve_coefficients",
    "route",
    "scale_by_muon",
    "scale_by_shape",
    "scale_factor",
    "singular_value_range",
    "summarize",
]
