"""Dion's compressed data-parallel sync (``replica_axes``): each replica's own
gradient in, only rank-r factors over the replica axes, the updates of Dion on
the replicas' mean gradient out, under ``jax.jit`` and inside ``shard_map``; the
averaged buffers a lossless checkpoint that continues on another replica count;
``per_replica``'s gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import hlo_cost
import optax_muon as om
from helpers import random_like, rel_err
from optax_muon._src.core.matrices import make_layout
from optax_muon._src.dion.matrix import compresses, rank_of
from trees import gpt_tree

D, STEPS = 32, 5

# (mesh shape, axis names, the params' specs): replica × FSDP, and replica ×
# FSDP × TP (column-parallel q, k, v, mlp_in; row-parallel o, mlp_out).
MESHES = {
    "replica2xfsdp4": ((2, 4), ("replica", "fsdp")),
    "replica2xfsdp2xtp2": ((2, 2, 2), ("replica", "fsdp", "tp")),
}


def _specs(params, names):
  def spec(path, x):
    if "tp" not in names:
      return P("fsdp") if x.shape[0] % 4 == 0 else P()
    if x.ndim == 1:
      return P()
    return (
        P("tp", "fsdp") if path[-1].key in ("o", "mlp_out") else P("fsdp", "tp")
    )

  return jax.tree_util.tree_map_with_path(spec, params)


def _rank_fractions(params):
  """1/4 for every matrix but the first layer's q (3/4: (m + n)·r ≥ m·n, so its
  gradient is averaged instead)."""
  fractions = jax.tree.map(lambda x: 0.25, params)
  fractions["blocks"]["0"]["q"] = 0.75
  return fractions


def _by_path(tree):
  return {
      jax.tree_util.keystr(p, simple=True, separator="/"): x
      for p, x in jax.tree_util.tree_leaves_with_path(tree)
  }


def _dion_state(state):
  return state.inner_states["muon"].inner_state[0]


@pytest.fixture(scope="module")
def case():
  """The GPT-like tree, each step's two replicas' gradients, and the reference:
  Dion on their mean, one device (updates per step, the final Dion state)."""
  params = gpt_tree(D, 2)
  grads = [
      [random_like(params, 100 * t + i) for i in range(2)] for t in range(STEPS)
  ]
  mean = [jax.tree.map(lambda a, b: (a + b) / 2, *pair) for pair in grads]
  tx = om.dion(0.1, rank_fraction=_rank_fractions(params), weight_decay=0.01)
  state = tx.init(params)
  update = jax.jit(tx.update)
  reference = []
  for g in mean:
    u, state = update(g, state, params)
    reference.append(u)
  return params, grads, mean, reference, state


def _mesh_and_shardings(name, params, axis_type=AxisType.Explicit):
  shape, names = MESHES[name]
  mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))
  specs = _specs(params, names)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  return mesh, specs, shardings


def _per_replica(pair, specs, mesh):
  """The two replicas' gradients as one tree of (2, *shape) leaves, split over
  the replica axis."""
  return jax.tree.map(
      lambda a, b, s: jax.device_put(
          jnp.stack([a, b]), NamedSharding(mesh, P("replica", *s))
      ),
      *pair,
      specs,
  )


def _compare(updates, want, tolerance=1e-5):
  got, want = _by_path(updates), _by_path(want)
  assert set(got) == set(want)
  for path, u in got.items():
    assert rel_err(u, want[path]) < tolerance, path


def _compare_buffers(state, reference_state):
  """The replicas' averaged buffers equal the averaged-gradient run's."""
  averaged = _dion_state(om.average_replicas(state))
  want = _dion_state(reference_state)
  assert isinstance(averaged, om.DionState)
  _compare(averaged.momentum, want.momentum)
  _compare(averaged.q, want.q)


@pytest.mark.parametrize(
    "mesh_name, mode",
    [
        ("replica2xfsdp4", "jit"),
        pytest.param("replica2xfsdp2xtp2", "jit", marks=pytest.mark.slow),
        pytest.param("replica2xfsdp4", "shard_map", marks=pytest.mark.slow),
        pytest.param("replica2xfsdp2xtp2", "shard_map", marks=pytest.mark.slow),
        ("replica2xfsdp4", "shard_map over the replicas"),
        pytest.param(
            "replica2xfsdp2xtp2",
            "shard_map over the replicas",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_compressed_sync_equals_dion_on_averaged_gradients(
    case, mesh_name, mode
):
  """Five steps in which the two replicas' gradients differ: the updates equal
  those of Dion on their mean (1e-5, float32), at rank 1/4 and, for one matrix
  whose factors would outweigh its gradient, 3/4 (gradient averaged); the
  replicas' averaged buffers equal the averaged run's buffer. Modes: under
  ``jax.jit`` (gradients with a replica axis), inside ``shard_map`` over every
  mesh axis and over the replica axis only (FSDP and TP left to the compiler);
  the buffers lie (replicas, *param) split over (replica, the param's axes),
  but the averaged gradient's, which lies like its param."""
  params, grads, _, reference, reference_state = case
  mesh, specs, shardings = _mesh_and_shardings(mesh_name, params)
  sharded = jax.tree.map(jax.device_put, params, shardings)
  tx = om.dion(
      0.1,
      rank_fraction=_rank_fractions(params),
      weight_decay=0.01,
      replica_axes="replica",
      param_shardings=None if mode == "jit" else shardings,
  )
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    own = _by_path(_dion_state(state).replica_momentum)
    shared = _by_path(_dion_state(state).momentum)
    assert set(shared) == {"blocks/0/q"}  # 3/4: its gradient is averaged
    assert len(own) == 11  # the other matrices: a buffer per replica
    for path, spec in _by_path(specs).items():
      if path in own:
        assert own[path].shape == (2,) + _by_path(params)[path].shape
        assert own[path].sharding.is_equivalent_to(
            NamedSharding(mesh, P("replica", *spec)), own[path].ndim
        ), path
      if path in shared:
        assert shared[path].sharding.is_equivalent_to(
            NamedSharding(mesh, spec), shared[path].ndim
        ), path
    if mode == "jit":
      step = jax.jit(tx.update)
    else:
      manual = set(mesh.axis_names) if mode == "shard_map" else {"replica"}
      keep = lambda spec: P(
          *[
              e if e is not None and set(np.atleast_1d(e)) <= manual else None
              for e in spec
          ]
      )
      state_specs = jax.tree.map(
          lambda x: keep(jax.typeof(x).sharding.spec), state
      )
      param_specs = jax.tree.map(keep, specs)
      step = jax.jit(
          jax.shard_map(
              lambda g, s, p: tx.update(jax.tree.map(lambda x: x[0], g), s, p),
              mesh=mesh,
              in_specs=(
                  jax.tree.map(lambda s: P("replica", *s), param_specs),
                  state_specs,
                  param_specs,
              ),
              out_specs=(param_specs, state_specs),
              axis_names=manual,
          )
      )
    for t in range(STEPS):
      updates, state = step(_per_replica(grads[t], specs, mesh), state, sharded)
      _compare(updates, reference[t])
  _compare_buffers(state, reference_state)


def _replica_bound(params, specs, mesh, fractions):
  """Bytes a device may receive across the replica axis per step: for each
  compressed matrix the ring all-reduce over the 2 replicas of its (m + n)·r
  factors, for every other leaf that of its gradient's block."""
  ring = lambda nbytes: 2 * nbytes * (2 - 1) / 2
  total = 0.0
  for (path, x), spec, fraction in zip(
      _by_path(params).items(),
      _by_path(specs).values(),
      _by_path(fractions).values(),
  ):
    if x.ndim == 2 and path not in ("embed", "lm_head"):
      layout = make_layout(path, x, None)
      m, n = layout.ns_shape
      r = rank_of(fraction, layout)
      if compresses(m, n, r):
        total += ring(4 * (m + n) * r)
        continue
    block = NamedSharding(mesh, spec).shard_shape(x.shape)
    total += ring(4 * math.prod(block))
  return total


@pytest.mark.parametrize(
    "mesh_name",
    [
        "replica2xfsdp4",
        pytest.param("replica2xfsdp2xtp2", marks=pytest.mark.slow),
    ],
)
def test_only_factors_cross_the_replica_axis(case, mesh_name):
  """In the compiled update the bytes a device receives across the replica
  axis (``hlo_cost.crossing_bytes``: of a collective over g devices spanning c
  replicas, the share (c − 1)/(g − 1) of its ring bytes) are at most 1.25 × the
  bound: the ring all-reduce of each compressed matrix's (m + n)·r factors plus
  the other leaves' gradient blocks (AdamW's and the rank-3/4 q's); nothing of
  a compressed matrix's m·n size crosses. They equal ``summarize``'s model."""
  params = case[0]
  mesh, specs, shardings = _mesh_and_shardings(mesh_name, params)
  fractions = _rank_fractions(params)
  sharded = jax.tree.map(jax.device_put, params, shardings)
  tx = om.dion(0.1, rank_fraction=fractions, replica_axes="replica")
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(sharded)
    grads = _per_replica(case[1][0], specs, mesh)
    compiled = jax.jit(tx.update).lower(grads, state, sharded).compile()
  cost = hlo_cost.analyze(compiled, 8)
  replica = hlo_cost.mesh_coordinate(mesh.devices.shape, (0,))
  crossing = sum(
      hlo_cost.crossing_bytes(c, replica, 8) for c in cost.collectives
  )
  bound = _replica_bound(params, specs, mesh, fractions)
  assert 0 < crossing <= 1.25 * bound, (crossing, bound)
  assert cost.collectives_in_loops == 0
  summary = om.summarize(sharded, tx)
  modelled = sum(r.replica_bytes for r in summary.rows)
  assert crossing == pytest.approx(modelled, rel=1e-6)
  assert "replica MB" in str(summary)


@pytest.mark.slow
def test_checkpoint_restores_onto_half_the_replicas(case, tmp_path):
  """Three steps on 2 replicas × FSDP 4; ``average_replicas`` saved with orbax;
  restored onto 1 replica × FSDP 8 (``average_replicas(restored, like=...)``); two more steps (the
  one replica's gradient: the mean) equal the averaged-gradient run's updates
  (1e-5)."""
  params, grads, mean, reference, _ = case
  fractions = _rank_fractions(params)
  mesh, specs, shardings = _mesh_and_shardings("replica2xfsdp4", params)
  tx = om.dion(
      0.1, rank_fraction=fractions, weight_decay=0.01, replica_axes="replica"
  )
  with jax.set_mesh(mesh):
    sharded = jax.tree.map(jax.device_put, params, shardings)
    state = jax.jit(tx.init)(sharded)
    step = jax.jit(tx.update)
    for t in range(3):
      _, state = step(_per_replica(grads[t], specs, mesh), state, sharded)
    averaged = jax.jit(om.average_replicas)(state)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "dion", averaged)
  checkpointer.wait_until_finished()

  one = jax.make_mesh(
      (1, 8), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )
  one_specs = jax.tree.map(
      lambda x: P("fsdp") if x.shape[0] % 8 == 0 else P(), params
  )
  one_shardings = jax.tree.map(lambda s: NamedSharding(one, s), one_specs)
  with jax.set_mesh(one):
    sharded = jax.tree.map(jax.device_put, params, one_shardings)
    like = jax.jit(tx.init)(sharded)  # the new run's state: where it lies
    restored = checkpointer.restore(
        tmp_path / "dion",
        jax.tree.map(
            ocp.utils.to_shape_dtype_struct, om.average_replicas(like)
        ),
    )
    state = om.average_replicas(restored, like=like)
    own = _dion_state(state).replica_momentum["blocks"]["0"]["k"]
    assert own.shape == (1, D, D)
    step = jax.jit(tx.update)
    for t in range(3, STEPS):
      g = jax.tree.map(
          lambda x, s: jax.device_put(
              x[None], NamedSharding(one, P("replica", *s))
          ),
          mean[t],
          one_specs,
      )
      updates, state = step(g, state, sharded)
      _compare(updates, reference[t])


@pytest.mark.skipif(
    tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 8),
    reason=(
        "jax < 0.8 refuses a batch split over (replica, fsdp) inside a"
        " shard_map over the replica axis of an Explicit mesh"
    ),
)
def test_per_replica_gradients_train_like_averaged_ones():
  """``per_replica(jax.value_and_grad(loss), "replica")`` under ``jax.jit``:
  each replica's loss and gradient of its half of the batch; a train step with
  them and ``replica_axes`` equals Dion on the whole batch's gradient."""
  mesh = jax.make_mesh(
      (2, 4), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )
  rng = np.random.default_rng(0)
  params = {
      "w1": jnp.asarray(rng.standard_normal((16, 64)), jnp.float32) / 4,
      "w2": jnp.asarray(rng.standard_normal((64, 8)), jnp.float32) / 8,
  }
  x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
  loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"] ** 2)
  routing = om.Routing(adam_pattern=None)
  tx = om.dion(0.1, 0.5, replica_axes="replica", routing=routing)
  reference_tx = om.dion(0.1, 0.5, routing=routing)
  grads = jax.grad(loss)(params, x)
  want, _ = jax.jit(reference_tx.update)(
      grads, reference_tx.init(params), params
  )
  shard = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    sharded = shard(params, P("fsdp"))
    losses, per_replica = jax.jit(
        om.per_replica(jax.value_and_grad(loss), "replica")
    )(sharded, shard(x, P(("replica", "fsdp"))))
    assert losses.shape == (2,)
    for i, half in enumerate((x[:16], x[16:])):
      own = jax.grad(loss)(params, half)
      _compare(
          jax.tree.map(lambda g, i=i: np.asarray(g)[i], per_replica), own, 1e-6
      )
    assert per_replica["w1"].sharding.spec[0] == "replica"
    updates, _ = jax.jit(tx.update)(
        per_replica, jax.jit(tx.init)(sharded), sharded
    )
  _compare(updates, want)


def test_replica_errors():
  """Clear errors: a gradient without its replica axis (naming the leaf), a
  replica axis the mesh lacks, one that splits the param, a plain DionState
  where a replica state is expected (pointing to average_replicas), params
  without a mesh, a malformed replica_axes, per_replica without a mesh."""
  mesh = jax.make_mesh(
      (2, 4), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2
  )
  w = jax.device_put(jnp.zeros((16, 64)), NamedSharding(mesh, P("fsdp")))
  tx = om.scale_by_dion(0.25, replica_axes="replica")
  with jax.set_mesh(mesh):
    state = tx.init({"w": w})
    with pytest.raises(ValueError, match="w: with replica_axes=.* got shape"):
      jax.jit(tx.update)({"w": jnp.ones((3, 16, 64))}, state)
    with pytest.raises(ValueError, match=r"average_replicas\(restored"):
      jax.jit(tx.update)(
          {"w": jnp.ones((2, 16, 64))}, om.average_replicas(state)
      )
    with pytest.raises(
        ValueError, match="w: replica axes .* not axes of the mesh"
    ):
      om.scale_by_dion(0.25, replica_axes="data").init({"w": w})
    split = jax.device_put(w, NamedSharding(mesh, P("replica")))
    with pytest.raises(ValueError, match="w: replica_axes .* must not split"):
      tx.init({"w": split})
  with pytest.raises(ValueError, match="w: replica_axes=.* needs the params"):
    tx.init({"w": jnp.zeros((16, 64))})
  with pytest.raises(ValueError, match="replica_axes must be a mesh axis name"):
    om.dion(0.1, replica_axes=("replica", "replica"))
  with pytest.raises(
      ValueError, match="per_replica: replica_axes=.* needs a mesh"
  ):
    om.per_replica(lambda p, x: p, "replica")(w, w)
