"""optax_muon: Muon (momentum orthogonalized by Newton–Schulz) for JAX and
Optax.

Optimizers: ``muon`` (Muon on the matrices, AdamW on the rest) and its building
blocks ``scale_by_muon`` and ``scale_by_shape`` (compose them in
``optax.chain``); ``dion`` and ``scale_by_dion`` put Dion's low-rank direction
in Newton–Schulz's place (with ``replica_axes``, data-parallel replicas sync
only its rank-r factors: ``per_replica`` makes their gradients,
``average_replicas`` checkpoints their buffers). Both take every argument of
their ``optax.contrib`` namesakes; this package's own options come as the
objects ``NSOptions``, ``ShardingOptions``, ``NorMuon``, ``Routing`` and
``QKClip``.

Newton–Schulz: ``newton_schulz`` with the coefficient presets in
``PRESET_NAMES`` or a generated ``polar_express_coefficients`` table
(``singular_value_range`` tells where a table puts the singular values), and
``msign``, its SVD reference.

Routing (``Routing``, ``route``): embeddings, output heads, biases and vectors
to AdamW; attention, MoE and fused kernels read by ``KNOWN_LAYOUTS`` (Gemma,
Flax, MaxText, Equinox), your own ``LayoutRule``\\ s, or logical axis names
(``infer_dimension_numbers``); scanned layers by ``Routing.layer_stacks``
(MaxText's by default) or your own ``LayerStack``\\ s.

Tools: ``summarize`` shows where every leaf goes and what it costs there;
``diagnostics`` gives per-step scalars to log; ``qk_clip`` (MuonClip) caps
attention logits by rescaling query and key heads.

The implementation lives in ``optax_muon._src`` (shared core, the two
optimizers, the tools); only the names below are the public API.
"""

from optax_muon._src.core.layout_rules import (
    KNOWN_LAYOUTS,
    LOGICAL_AXIS_ROLES,
    LayerStack,
    LayoutRule,
)
from optax_muon._src.core.matrices import MuonDimensionNumbers
from optax_muon._src.core.options import Routing, ShardingOptions
from optax_muon._src.core.profiles import CostModel
from optax_muon._src.core.qk_clipping import QKClip, QKClipHeads, qk_clip
from optax_muon._src.core.replicas import per_replica
from optax_muon._src.core.routing import infer_dimension_numbers, route
from optax_muon._src.core.scaling import scale_by_shape
from optax_muon._src.core.weight_decay import add_cautious_decayed_weights
from optax_muon._src.dion.alias import dion
from optax_muon._src.dion.replicas import average_replicas
from optax_muon._src.dion.transform import DionState, scale_by_dion
from optax_muon._src.muon.alias import muon
from optax_muon._src.muon.coefficients import (
    PRESET_NAMES,
    NSCoefficients,
    polar_express_coefficients,
    singular_value_range,
)
from optax_muon._src.muon.newton_schulz import msign, newton_schulz
from optax_muon._src.muon.options import NorMuon, NSOptions
from optax_muon._src.muon.transform import MuonState, scale_by_muon
from optax_muon._src.tools.diagnostics import diagnostics
from optax_muon._src.tools.summary import summarize

__version__ = "0.3.0"

__all__ = [
    "CostModel",
    "DionState",
    "KNOWN_LAYOUTS",
    "LOGICAL_AXIS_ROLES",
    "LayerStack",
    "LayoutRule",
    "MuonDimensionNumbers",
    "MuonState",
    "NSCoefficients",
    "NSOptions",
    "NorMuon",
    "PRESET_NAMES",
    "QKClip",
    "QKClipHeads",
    "Routing",
    "ShardingOptions",
    "add_cautious_decayed_weights",
    "average_replicas",
    "diagnostics",
    "dion",
    "infer_dimension_numbers",
    "msign",
    "muon",
    "newton_schulz",
    "per_replica",
    "polar_express_coefficients",
    "qk_clip",
    "route",
    "scale_by_dion",
    "scale_by_muon",
    "scale_by_shape",
    "singular_value_range",
    "summarize",
]
