"""The static orthogonalization plan: which device orthogonalizes which matrix.

One module per concern:

* ``model``: the data model (``LeafPlacement``, ``Bucket``, ``TeamRun``,
  ``Exchange``, ``Group``, ``Plan``), the model of exchange, batch and replica
  axes in words, and the figures they imply (each exchange's FLOPs per worker,
  each device's NS FLOPs, received bytes and modelled time: ``Plan``'s
  methods);
* ``grouping``: each leaf's axes, the groups of leaves that share them, their
  buckets;
* ``owners``: which worker orthogonalizes each whole matrix (longest processing
  time first);
* ``redeal``: fewer distinct programs where that costs nothing;
* ``teams``: which matrices teams of devices share, and the team size;
* ``exchanges``: each worker's and each team's program;
* ``build``: ``build_plan``, which runs them in that order.
"""

from optax_muon._src.muon.plan.build import build_plan
from optax_muon._src.muon.plan.model import (
    Bucket,
    Exchange,
    Group,
    LeafPlacement,
    Plan,
    Program,
    Run,
    TeamProgram,
    TeamRun,
    TeamRunKey,
)

__all__ = [
    "Bucket",
    "Exchange",
    "Group",
    "LeafPlacement",
    "Plan",
    "Program",
    "Run",
    "TeamProgram",
    "TeamRun",
    "TeamRunKey",
    "build_plan",
]
