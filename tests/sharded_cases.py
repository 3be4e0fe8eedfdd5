"""The sharded Muon cases that test_sharded, test_group_plan and test_stages
share: GPT-like trees on 8 virtual devices, their PartitionSpecs, and the
single-device update each sharded run is compared with.

A case's single-device reference depends only on its tree (the mesh and the
replica policy change nothing on one device), so the ``case_reference`` fixture
(``conftest.py``) computes it once per tree for the whole session.
"""

import jax
from jax.sharding import PartitionSpec as P

import optax_muon as om
from helpers import random_like, rel_err
from trees import gpt_tree, muon_dims

D, LAYERS = 32, 4


def mesh(shape, names, axis_type):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def fsdp_specs(params, axis="fsdp"):
  """FSDP: every leaf split on its first axis (stacked: on the matrix's first
  axis)."""

  def spec(x):
    if x.ndim == 3:
      return P(None, axis, None)
    return P(axis) if x.shape[0] % 8 == 0 else P()

  return jax.tree.map(spec, params)


def megatron_specs(params):
  """FSDP × TP: column-parallel (q, k, v, mlp_in) P(fsdp, tp), row-parallel
  P(tp, fsdp)."""

  def spec(path, x):
    name = path[-1].key
    if x.ndim == 1:
      return P()
    if name in ("o", "mlp_out"):
      return P("tp", "fsdp")
    return P("fsdp", "tp")

  return jax.tree_util.tree_map_with_path(spec, params)


def layer_axis_specs(params):
  return jax.tree.map(
      lambda x: P("fsdp", None, None) if x.ndim == 3 else P(), params
  )


def replicated_over_dp(params):
  return jax.tree.map(lambda x: P("fsdp") if x.ndim == 2 else P(), params)


CASES = {
    # name: (mesh shape, axis names, tree kind, specs fn, replica policy)
    "fsdp8": ((8,), ("fsdp",), False, fsdp_specs, "split"),
    "fsdp8-3-layers": ((8,), ("fsdp",), 3, fsdp_specs, "split"),
    "fsdp4xtp2-3-layers": ((4, 2), ("fsdp", "tp"), 3, megatron_specs, "split"),
    "fsdp8-stacked-matrix-axis": ((8,), ("fsdp",), True, fsdp_specs, "split"),
    "fsdp8-stacked-layer-axis": (
        (8,),
        ("fsdp",),
        True,
        layer_axis_specs,
        "split",
    ),
    "fsdp4xtp2": ((4, 2), ("fsdp", "tp"), False, megatron_specs, "split"),
    "dp2xfsdp4-split": (
        (2, 4),
        ("dp", "fsdp"),
        False,
        replicated_over_dp,
        "split",
    ),
    "dp2xfsdp4-redundant": (
        (2, 4),
        ("dp", "fsdp"),
        False,
        replicated_over_dp,
        "redundant",
    ),
    "replicated-dp8": (
        (8,),
        ("dp",),
        False,
        lambda p: jax.tree.map(lambda _: P(), p),
        "split",
    ),
}


def case_tree(kind):
  """(params, dimension numbers) of a tree kind: False (per-layer, 4 layers),
  True (stacked, 8 layers) or a layer count."""
  stacked = kind is True
  layers = 8 if stacked else (LAYERS if kind is False else kind)
  params = gpt_tree(D, layers, stacked=stacked)
  return params, (
      muon_dims(params, adam=("embed", "lm_head")) if stacked else None
  )


def case_grads(params, steps=2):
  """The gradients of a case's steps (one draw per step)."""
  return [random_like(params, 10 + t) for t in range(steps)]


STANDARD = om.NSOptions(method="standard")


def standard_muon(dims=None, policy="split", **kw):
  """Muon with the standard NS iteration (the per-device FLOPs the tests
  read)."""
  return om.muon(
      0.1,
      muon_weight_dimension_numbers=dims,
      ns_options=STANDARD,
      sharding=om.ShardingOptions(replica_policy=policy),
      **kw,
  )


#: NorMuon, cautious weight decay and both decays: the options that add state
#: and collectives beside NS.
VARIANTS = dict(
    normalization=om.NorMuon(),
    cautious_weight_decay=True,
    weight_decay=0.1,
    adam_weight_decay=0.1,
)


def ns_cost(m, n, dtype):
  """The standard iteration's FLOPs for one m × n matrix (the planner's cost
  function)."""
  return STANDARD.flops(m, n, dtype, steps=5)


def single_device_steps(params, grads, dims, steps=2, **kw):
  """(updates, state) after ``steps`` jitted steps of ``standard_muon`` on one
  device."""
  tx = standard_muon(dims, **kw)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(steps):
    updates, state = update(grads[t], state, params)
  return updates, state


def single_device(params, grads, dims, steps=2, **kw):
  """The updates of ``steps`` jitted steps of ``standard_muon`` on one
  device."""
  return single_device_steps(params, grads, dims, steps, **kw)[0]


def compare(updates, reference):
  """Leaf by leaf within 1e-5 of the reference's largest entry, the trees
  alike."""
  assert jax.tree.structure(updates) == jax.tree.structure(reference)
  for (path, a), b in zip(
      jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(reference)
  ):
    assert rel_err(a, b) < 1e-5, jax.tree_util.keystr(path)


def sharded_steps(tx, mesh, params, grads):
  """(updates, state, compiled update) after one jitted step per gradient on
  ``mesh``."""
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(params)
    update = jax.jit(tx.update)
    for g in grads:
      updates, state = update(g, state, params)
    compiled = update.lower(grads[0], state, params).compile()
  return updates, state, compiled
