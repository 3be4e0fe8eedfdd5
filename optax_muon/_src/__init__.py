"""The implementation of ``optax_muon``; users import the package face instead.

Three layers, each importing only the ones below it:

* ``core``: what both optimizers share: how a leaf is seen as matrices, the
  layout rules of real libraries, routing, options, the static spec of a tree,
  shardings, the reports tools read, and the assembly of a full optimizer
  around a matrix direction (shape factor, weight decay, AdamW, QK-clip);
* ``muon`` and ``dion``: the two optimizers, siblings that never import each
  other: each has its direction (``scale_by_muon``, ``scale_by_dion``), its
  alias (``muon``, ``dion``), its costs and its report;
* ``tools``: ``summarize`` and ``diagnostics``, which read either optimizer
  through the report its ``init`` hands over (``core.reporting``).
"""
