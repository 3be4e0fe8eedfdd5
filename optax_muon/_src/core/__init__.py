"""What both optimizers share, one module per concern:

* ``tree_utils``: leaf paths, frozen prefix trees, broadcasting with errors that
  name the leaf;
* ``user_warnings``: warnings that point at the user's line;
* ``dtypes``: the dtype optimizer state is kept in;
* ``matrices``: ``MuonDimensionNumbers`` and ``MatrixLayout``, a leaf as a batch
  of matrices;
* ``layout_rules``: how real libraries lay out their weights (``LayoutRule``,
  ``KNOWN_LAYOUTS``, logical axis names);
* ``profiles``: ``CostModel``, how fast a device computes and communicates;
* ``options``: ``Routing`` and ``ShardingOptions``, and the checks of numbers
  and choices;
* ``routing``: which leaf goes to the matrix optimizer and which to AdamW, and
  why;
* ``sharding``: reading shardings, placing state, sums over matrices;
* ``spec``: ``TreeOptions`` and ``tree_spec``, the static per-leaf decisions;
* ``scaling``: the shape factor and ``scale_by_shape``;
* ``weight_decay``: cautious weight decay;
* ``qk_clipping``: QK-clip (MuonClip);
* ``reporting``: the ``Report`` a transformation hands the tools, and the
  summary table's shared rows;
* ``assembly``: a full optimizer around a matrix direction.
"""
