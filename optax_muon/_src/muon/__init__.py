"""Muon: momentum, orthogonalized by Newton–Schulz, one module per concern:

* ``coefficients``: the coefficient presets and the Polar Express generator;
* ``newton_schulz``: the iteration (one device or a team) and its SVD
  reference;
* ``momentum``: the momentum stage;
* ``normuon``: NorMuon's neuron-wise normalization;
* ``costs``: NS FLOPs and team collectives of one matrix;
* ``options``: ``NSOptions``, ``NorMuon``, ``MuonOptions``;
* ``plan``: which device orthogonalizes which matrix (see its face);
* ``spec``: ``MuonTreeSpec``, the shared spec with the plan;
* ``executor``: runs the plan (all-to-alls, NS where the plan says);
* ``report``: Muon's summary table;
* ``transform``: ``scale_by_muon``;
* ``alias``: ``muon``, the full optimizer.
"""
