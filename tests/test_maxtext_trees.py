"""MaxText's own parameter trees (``tests/trees/maxtext_*.json``, recorded with
MaxText itself by ``tests/trees/record_maxtext.py``), read by ``muon``'s
default routing leaf by leaf as MaxText's own Muon dimension numbers
(``muon_utils.get_muon_weight_dimension_numbers``) read them."""

import functools
import json
import math
import re
import warnings

import flax.linen as nn
import hlo_cost
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo_cost import compiled_device_flops
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from helpers import normal, rel_err, requires_contrib_api
from real_trees import TREES

import optax_muon as om
from optax_muon._src.core import routing, tree_utils
from optax_muon._src.muon.plan.model import in_line

RECORDS = sorted(p.stem for p in TREES.glob("maxtext_*.json"))
# The type MaxText's numbers come in (optax.contrib's; optax < 0.2.6 has none).
CONTRIB_DN = getattr(
    optax.contrib, "MuonDimensionNumbers", om.MuonDimensionNumbers
)
CONTRIB_NS = dict(ns_coeffs=(3.4445, -4.7750, 2.0315), ns_steps=5, eps=1e-8)

# Where ``muon`` reads a leaf otherwise than MaxText 0.2.5's muon_utils, and
# why. Gemma 2's attention lives in ``self_attention_global`` and
# ``self_attention_local``, which muon_utils' exact path-key test for
# ``self_attention`` misses; its fallback, (0,) → (-1,), makes the heads batch
# axes of the projections and reduces ``out`` over its heads with the head_dim
# as a batch axis. ``muon`` reads them as MaxText reads the same kernels under
# ``self_attention`` (Gemma 3, Llama): query/key/value (0,) → (-2, -1), out
# (0, -2) → (-1,).
MAXTEXT_ATTENTION = {"query": ((0,), (2, 3)), "key": ((0,), (2, 3))}
MAXTEXT_ATTENTION |= {"value": ((0,), (2, 3)), "out": ((0, 2), (3,))}


def _gemma2_attention(path: list[str]) -> tuple | None:
  if len(path) >= 3 and path[-3] in (
      "self_attention_global",
      "self_attention_local",
  ):
    return MAXTEXT_ATTENTION[path[-2]]
  return None


# Gemma 4's ``layer_scalar`` is one scalar per layer, (1, layers) and (1,
# layers, local layers). muon_utils' "scale" exclusion does not catch
# "scalar", so its fallback makes a 1×1 matrix of each global layer's scalar
# and a 1 × 5 matrix of the five local layers' scalars (Muon would normalize
# them together). ``muon`` keeps them element-wise.
def _gemma4_layer_scalar(path: list[str]) -> tuple | None:
  return "AdamW" if path[-1] == "layer_scalar" else None


DEVIATIONS = {
    "maxtext_gemma2_2b": _gemma2_attention,
    "maxtext_gemma4_26b": _gemma4_layer_scalar,
}


def _record(name: str) -> dict:
  return json.loads((TREES / f"{name}.json").read_text())


def _tree(record: dict, make) -> dict:
  """The plain params tree of a record, ``make(leaf record)`` at each leaf."""
  tree: dict = {}
  for leaf in record["leaves"]:
    node = tree
    for key in leaf["path"][:-1]:
      node = node.setdefault(key, {})
    node[leaf["path"][-1]] = make(leaf)
  return tree


def _shapes(record: dict) -> dict:
  return _tree(
      record,
      lambda l: jax.ShapeDtypeStruct(tuple(l["shape"]), jnp.dtype(l["dtype"])),
  )


def _axes(dims, ndim: int) -> tuple | None:
  """Dimension numbers as sorted non-negative axes (None: AdamW)."""
  if dims is None:
    return None
  sides = []
  for axes in (dims[0], dims[1]):
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    sides.append(tuple(sorted(a % ndim for a in axes)))
  return tuple(sides)


def _expected_axes(name: str, leaf: dict) -> tuple | None:
  """The matrix ``muon`` should read from the leaf (sorted non-negative axes;
  None: AdamW): MaxText's own, but for the ``DEVIATIONS``."""
  deviation = DEVIATIONS.get(name, lambda path: None)(leaf["path"])
  if deviation is not None:
    return None if deviation == "AdamW" else deviation
  dims = leaf["maxtext_dims"]
  if dims is None:
    return None
  return _axes(
      (dims["reduction_axis"], dims["output_axis"]), len(leaf["shape"])
  )


def _contrib_dims(name: str, record: dict):
  """MaxText's dimension numbers as optax.contrib takes them (the
  ``DEVIATIONS`` as ``muon`` reads them)."""

  def dims(leaf):
    axes = _expected_axes(name, leaf)
    return None if axes is None else optax.contrib.MuonDimensionNumbers(*axes)

  return _tree(record, dims)


def test_the_deviations_are_where_maxtext_falls_back():
  """Each deviation replaces MaxText's fallback numbers, (0,) → (-1,): on
  Gemma 2's eight attention kernels (rank 4, the rank MaxText's attention rule
  is written for) and Gemma 4's two layer scalars."""
  counts = {}
  for name, deviation in DEVIATIONS.items():
    record = _record(name)
    hit = [l for l in record["leaves"] if deviation(l["path"]) is not None]
    counts[name] = len(hit)
    for leaf in hit:
      assert leaf["maxtext_dims"] == {
          "reduction_axis": [0],
          "output_axis": [-1],
      }
      if deviation(leaf["path"]) == "AdamW":
        assert math.prod(leaf["shape"][:2]) == 1, leaf
      else:
        assert len(leaf["shape"]) == 4, leaf
  assert counts == {"maxtext_gemma2_2b": 8, "maxtext_gemma4_26b": 2}


def test_every_recorded_tree_is_maxtexts():
  assert len(RECORDS) >= 6, RECORDS
  for name in RECORDS:
    record = _record(name)
    assert record["library"] == "maxtext", name
    assert record["leaves_count"] == len(record["leaves"]), name
    on_muon = sum(l["maxtext_dims"] is not None for l in record["leaves"])
    assert on_muon == record["maxtext_on_muon"] > 0, name


@pytest.mark.parametrize("name", RECORDS)
def test_default_routing_reads_every_leaf_as_maxtext_does(name):
  """On the plain tree, with no dimension numbers and no warning: the leaves
  MaxText puts on Muon go to Muon as the same matrices, the others
  (embeddings, the output head, stacked norm scales) to AdamW."""
  record = _record(name)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    routes = {r.path: r for r in om.route(_shapes(record)) if r is not None}
  wrong = []
  for leaf in record["leaves"]:
    r = routes["/".join(leaf["path"])]
    ours = None
    if r.optimizer == "muon":
      ours = _axes(r.dimension_numbers or (0, 1), len(leaf["shape"]))
    if ours != _expected_axes(name, leaf):
      wrong.append((r.path, leaf["shape"], ours, _expected_axes(name, leaf)))
  assert not wrong, wrong


@pytest.mark.parametrize("name", RECORDS)
def test_logical_names_give_maxtexts_matrices(name):
  """The documented path, ``infer_dimension_numbers`` with the names MaxText
  boxes its params with (no ``axis_roles``) and then ``muon`` with its result:
  MaxText's matrices and no warning. Where the names say where an axis is
  sharded rather than what it is (``shard_exp_on_fsdp``,
  ``use_2d_fsdp_sharding``), the layout wins and the route says so."""
  record = _record(name)
  shapes = _shapes(record)
  names = _tree(
      record, lambda l: None if l["names"] is None else tuple(l["names"])
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    dims = om.infer_dimension_numbers(shapes, logical_names=names)
    tx = om.muon(0.02, muon_weight_dimension_numbers=dims)
    jax.eval_shape(tx.init, shapes)
  flat = dict(
      ("/".join(str(k.key) for k in p), d)
      for p, d in jax.tree_util.tree_flatten_with_path(
          dims, is_leaf=lambda x: x is None or hasattr(x, "reduction_axis")
      )[0]
  )
  wrong = [
      ("/".join(l["path"]), l["names"])
      for l in record["leaves"]
      if _axes(flat["/".join(l["path"])], len(l["shape"]))
      != _expected_axes(name, l)
  ]
  assert not wrong, wrong
  by_path = {"/".join(l["path"]): l["names"] for l in record["leaves"]}
  positions, _ = tree_utils.flatten_positions(shapes)
  routes = routing.decide(
      shapes,
      om.Routing(),
      None,
      logical_names=[
          None
          if by_path[tree_utils.path_str(p)] is None
          else tuple(by_path[tree_utils.path_str(p)])
          for p, _ in positions
      ],
  ).routes
  overruled = sorted(r.path for r in routes if "read otherwise" in r.describe())
  sharding_labels = record["overrides"].get("shard_exp_on_fsdp") or record[
      "overrides"
  ].get("use_2d_fsdp_sharding")
  if sharding_labels:
    experts = [
        "/".join(l["path"])
        for l in record["leaves"]
        if l["path"][-1] in ("wi_0", "wi_1", "wo")
    ]
    assert overruled == sorted(experts) and experts, overruled
  else:
    assert not overruled, overruled


def _values(shape: list[int], seed: int) -> jax.Array:
  """Values that depend on the shape alone: leaves of one shape and one matrix
  get the same update from optax.contrib.muon (one array per shape, shared)."""
  return _values_of(tuple(shape), seed)


@functools.cache
def _values_of(shape: tuple[int, ...], seed: int) -> jax.Array:
  key = jax.random.fold_in(jax.random.PRNGKey(seed), hash(shape) % 2**31)
  return normal(key, shape, jnp.float32)


@pytest.mark.slow
@requires_contrib_api
def test_update_equals_optax_contrib_with_maxtexts_numbers():
  """``muon`` with its default routing on every recorded tree at once, against
  ``optax.contrib.muon`` given MaxText's dimension numbers (the call MaxText
  makes): every leaf's update within 1e-5 (float32), Muon and AdamW leaves
  alike. Params and gradients depend on a leaf's shape only, so contrib runs
  once per distinct (shape, matrix), on a tree of those."""
  records = {name: _record(name) for name in RECORDS}
  params = {
      name: _tree(record, lambda l: _values(l["shape"], 0))
      for name, record in records.items()
  }
  grads = {
      name: _tree(record, lambda l: _values(l["shape"], 1))
      for name, record in records.items()
  }
  classes = {
      (tuple(l["shape"]), _expected_axes(name, l)): None
      for name, record in records.items()
      for l in record["leaves"]
  }
  keys = {c: f"leaf_{i}" for i, c in enumerate(classes)}
  contrib_dims = {
      keys[c]: None
      if c[1] is None
      else optax.contrib.MuonDimensionNumbers(*c[1])
      for c in classes
  }
  contrib_params = {keys[c]: _values(list(c[0]), 0) for c in classes}
  contrib_grads = {keys[c]: _values(list(c[0]), 1) for c in classes}
  theirs = optax.contrib.muon(
      0.02, **CONTRIB_NS, muon_weight_dimension_numbers=contrib_dims
  )
  reference = jax.jit(theirs.update)(
      contrib_grads, jax.jit(theirs.init)(contrib_params), contrib_params
  )[0]
  ours = om.muon(0.02, **CONTRIB_NS)
  updates = jax.jit(ours.update)(grads, ours.init(params), params)[0]
  far = []
  for name, record in records.items():
    for leaf in record["leaves"]:
      x = updates[name]
      for key in leaf["path"]:
        x = x[key]
      y = reference[keys[(tuple(leaf["shape"]), _expected_axes(name, leaf))]]
      if rel_err(x, y) >= 1e-5:
        far.append((name, "/".join(leaf["path"]), rel_err(x, y)))
  assert not far, far


@pytest.mark.parametrize("name", RECORDS)
def test_maxtexts_own_numbers_are_taken_without_a_warning(name):
  """``muon(..., muon_weight_dimension_numbers=<MaxText's>)``, the line MaxText
  writes today with this package's ``muon`` in it: every leaf where MaxText's
  numbers put it, and nothing to warn about."""
  record = _record(name)
  theirs = _tree(
      record,
      lambda l: None
      if l["maxtext_dims"] is None
      else CONTRIB_DN(
          tuple(l["maxtext_dims"]["reduction_axis"]),
          tuple(l["maxtext_dims"]["output_axis"]),
      ),
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    routes = {
        r.path: r
        for r in om.route(_shapes(record), weight_dimension_numbers=theirs)
    }
  for leaf in record["leaves"]:
    r = routes["/".join(leaf["path"])]
    dims = leaf["maxtext_dims"]
    assert (r.optimizer == "muon") == (dims is not None), r.path
    if dims is not None:
      assert r.dimension_numbers.reduction_axis == tuple(dims["reduction_axis"])
      assert r.dimension_numbers.output_axis == tuple(dims["output_axis"])


def _ints(text: str) -> list[int]:
  return [int(a) for a in text.split(",") if a.strip()]


def test_the_maxtext_page_table_is_the_record_and_what_muon_does():
  """docs/maxtext.md's leaf-by-leaf table of deepseek3-tiny: MaxText's column
  is the record's numbers, the last column ``summarize``'s rows for
  ``muon(0.02)``, every leaf of the tree listed."""
  page = (TREES.parents[1] / "docs" / "maxtext.md").read_text()
  section = page.split("## One model leaf by leaf")[1]
  lines = [l for l in section.splitlines() if l.startswith("| `")]
  record = _record("maxtext_deepseek3_tiny")
  leaves = {"/".join(l["path"]): l for l in record["leaves"]}
  shapes = _shapes(record)
  rows = {r.path: r for r in om.summarize(shapes, om.muon(0.02)).rows}
  routes = {r.path: r for r in om.route(shapes)}
  assert sorted(l.split("`")[1] for l in lines) == sorted(leaves)
  for line in lines:
    path, shape, maxtext, ours = [c.strip() for c in line.strip("|").split("|")]
    path = path.strip("`")
    leaf, row = leaves[path], rows[path]
    assert shape == "×".join(map(str, leaf["shape"])), path
    if leaf["maxtext_dims"] is None:
      assert maxtext == "None", path
    else:
      red, out = re.fullmatch(
          r"\(([-\d, ]+),?\) → \(([-\d, ]+),?\)", maxtext
      ).groups()
      assert _ints(red) == leaf["maxtext_dims"]["reduction_axis"], path
      assert _ints(out) == leaf["maxtext_dims"]["output_axis"], path
    if ours.startswith("AdamW"):
      assert row.optimizer == "adam" and row.reason in ours, path
      continue
    batch, n_in, n_out, scale = re.fullmatch(
        r"(\d+) × (\d+)→(\d+), scale ([\d.]+)", ours
    ).groups()
    dims = routes[path].dimension_numbers
    n_in_of, n_out_of = (
        math.prod(leaf["shape"][a] for a in axes)
        for axes in (dims.reduction_axis, dims.output_axis)
    )
    assert (row.batch, n_in_of, n_out_of) == (
        int(batch),
        int(n_in),
        int(n_out),
    ), path
    assert f"{row.scale:.3g}" == scale, path


def _maxtext_shardings(record: dict, mesh) -> dict:
  """Each leaf's ``NamedSharding`` from its logical names and the record's
  ``logical_axis_rules``, as MaxText's own ``logical_to_mesh`` reads them."""
  rules = tuple(
      (name, None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
      for name, axes in record["logical_axis_rules"]
  )

  def sharding(leaf):
    names = leaf["names"]
    if names is None or len(names) != len(leaf["shape"]):
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(names), rules))

  return _tree(record, sharding)


def _deepseek_tiny_as_maxtext_shards_it():
  """(record, mesh, shardings): deepseek3-tiny on MaxText's twelve-axis mesh
  (Auto, fsdp 4 × tensor 2), its leaves placed by MaxText's logical rules."""
  record = _record("maxtext_deepseek3_tiny")
  sizes = {"fsdp": 4, "tensor": 2}
  mesh = jax.make_mesh(
      tuple(sizes.get(a, 1) for a in record["mesh_axes"]),
      tuple(record["mesh_axes"]),
      axis_types=(AxisType.Auto,) * len(record["mesh_axes"]),
  )
  return record, mesh, _maxtext_shardings(record, mesh)


def _far_leaves(updates, reference, tolerance=1e-5):
  """(path, relative error) of each leaf of ``updates`` at least
  ``tolerance`` from ``reference``'s."""
  return [
      (jax.tree_util.keystr(p), rel_err(x, y))
      for (p, x), y in zip(
          jax.tree_util.tree_leaves_with_path(updates),
          jax.tree.leaves(reference),
      )
      if rel_err(x, y) >= tolerance
  ]


@pytest.mark.slow
@pytest.mark.parametrize("stages", [None, 3])
def test_maxtexts_own_shardings_on_an_auto_mesh_equal_one_device(stages):
  """deepseek3-tiny sharded as MaxText shards it (its logical axis rules on its
  twelve-axis mesh, Auto, fsdp 4 × tensor 2), with ``param_shardings``, its
  exchanges in one stage (XLA:CPU's choice) or forced into three (in line:
  each of its many kinds of matrix in one stage): the update
  equals the single-device one (1e-5), with no warning, and every NS FLOP each
  device runs is one the plan reports (nothing redundant)."""
  record, mesh, shardings = _deepseek_tiny_as_maxtext_shards_it()
  params = _tree(record, lambda l: _values(l["shape"], 0))
  grads = _tree(record, lambda l: _values(l["shape"], 1))
  single = om.muon(0.02)
  reference = jax.jit(single.update)(grads, single.init(params), params)[0]
  tx = om.muon(
      0.02,
      param_shardings=shardings,
      sharding=om.ShardingOptions(exchange_stages=stages),
  )
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("error")
    sharded_params = jax.device_put(params, shardings)
    sharded_grads = jax.device_put(grads, shardings)
    state = jax.jit(tx.init)(sharded_params)
    compiled = (
        jax.jit(tx.update).lower(sharded_grads, state, sharded_params).compile()
    )
    updates = compiled(sharded_grads, state, sharded_params)[0]
  far = _far_leaves(updates, reference)
  assert not far, far
  plan = om.summarize(sharded_params, tx).plan
  assert len(plan.leaves) == record["maxtext_on_muon"]
  cost = hlo_cost.analyze(compiled, 8)
  np.testing.assert_array_equal(
      compiled_device_flops(cost, plan), plan.device_ns_flops()
  )
  staged = [s for g in plan.groups for s in g.stages() if len(s) > 1]
  assert bool(staged) == (stages is not None)
  # A loop of stages moves them in its iterations; nothing else runs a
  # collective in a loop.
  assert cost.collectives_in_loops == sum(not in_line(s) for s in staged)


@pytest.mark.slow
def test_dion_on_maxtexts_own_shardings_equals_one_device():
  """``dion`` at rank 1/4 on deepseek3-tiny sharded as MaxText shards it (fsdp
  4 × tensor 2, Auto, ``param_shardings``): scanned layers, experts and 3-axis
  attention kernels, their P's dealt round the devices in shared buckets; two
  steps equal the single-device ones (1e-5), with no warning."""
  record, mesh, shardings = _deepseek_tiny_as_maxtext_shards_it()
  params = _tree(record, lambda l: _values(l["shape"], 0))
  grads = [_tree(record, lambda l, s=s: _values(l["shape"], s)) for s in (1, 2)]
  single = om.dion(0.02, rank_fraction=0.25)
  state, update = single.init(params), jax.jit(single.update)
  for g in grads:
    reference, state = update(g, state, params)
  tx = om.dion(0.02, rank_fraction=0.25, param_shardings=shardings)
  with jax.set_mesh(mesh), warnings.catch_warnings():
    warnings.simplefilter("error")
    sharded_params = jax.device_put(params, shardings)
    state, update = jax.jit(tx.init)(sharded_params), jax.jit(tx.update)
    for g in grads:
      updates, state = update(
          jax.device_put(g, shardings), state, sharded_params
      )
  far = _far_leaves(updates, reference)
  assert not far, far
