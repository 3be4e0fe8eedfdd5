"""Dion: low-rank power iteration with error feedback, one module per concern:

* ``step``: one Dion step on one leaf, where the leaf lies;
* ``costs``: what one Dion step costs per device;
* ``settings``: ``DionSettings``, Dion's static options;
* ``report``: Dion's summary table;
* ``transform``: ``scale_by_dion``;
* ``alias``: ``dion``, the full optimizer.
"""
