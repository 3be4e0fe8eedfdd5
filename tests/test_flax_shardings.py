"""param_shardings in the forms Flax users hold, on Auto meshes built with
``Mesh``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import nnx_auto_mesh
import optax_muon as om
from helpers import normal, rel_err

pytestmark = (
    pytest.mark.slow
)  # compiles or trains real models: the full suite only


def _auto_mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def test_nnx_auto_mesh_example_trains_with_get_named_sharding():
  out = nnx_auto_mesh.main(["--steps", "30"])
  losses = out["losses"]
  assert np.mean(losses[-5:]) < losses[0] - 2.0  # 6.26 → about 3 nats
  # The params keep the shardings their metadata gave them.
  given = nnx.to_pure_dict(out["param_shardings"])
  final = nnx.to_pure_dict(out["final_shardings"])
  for (path, want), got in zip(
      jax.tree_util.tree_leaves_with_path(given), jax.tree.leaves(final)
  ):
    assert got.is_equivalent_to(want, len(want.spec)), jax.tree_util.keystr(
        path
    )
  # Every Muon leaf is placed by the plan, not left to XLA.
  rows = {r.path: r for r in out["summary"].rows}
  assert out["summary"].plan is not None
  for path in ("hidden/kernel", "mix/kernel"):
    assert rows[path].optimizer == "muon"
    assert rows[path].placement.startswith("all-to-all over data×model")


def _nnx_model(mesh):
  with jax.set_mesh(mesh):
    return nnx_auto_mesh.ShardedMLPLM(16, 4, nnx.Rngs(0))


def _update(tx, params, grads, mesh):
  with jax.set_mesh(mesh):
    state = jax.jit(tx.init)(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
  return updates


def _pure(state):
  """The State's arrays without Variable wrappers (``nnx.as_pure`` from Flax
  0.12.1 on)."""
  return (
      nnx.as_pure(state) if hasattr(nnx, "as_pure") else nnx.to_pure_dict(state)
  )


def _grads_like(params, seed=3):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(
      treedef,
      [
          jax.device_put(normal(k, x.shape), x.sharding)
          for k, x in zip(keys, leaves)
      ],
  )


def _nnx_forms(state, mesh):
  named = nnx.get_named_sharding(state, mesh)
  specs = nnx.get_partition_spec(state)
  return {
      "nnx.get_named_sharding": named,
      "pure dict of NamedSharding": nnx.to_pure_dict(named),
      "nnx.State of PartitionSpec": specs,
      "pure dict of PartitionSpec": nnx.to_pure_dict(specs),
      "prefix: one PartitionSpec per module": {
          "embed": P("model", "data"),
          "mix": {"kernel": P("data", "model"), "bias": P("model")},
          "hidden": P("model", "data"),
          "norm": P("model"),
          "lm_head": P("data", "model"),
      },
  }


def test_every_nnx_form_gives_the_same_planned_update():
  mesh = _auto_mesh()
  model = _nnx_model(mesh)
  state = nnx.state(model, nnx.Param)
  params = _pure(state)
  grads = _grads_like(params)
  host = lambda tree: jax.tree.map(np.asarray, tree)
  single = om.muon(0.1, ns_options=om.NSOptions(method="standard"))
  reference = single.update(
      host(grads), single.init(host(params)), host(params)
  )[0]
  for name, form in _nnx_forms(state, mesh).items():
    tx = om.muon(
        0.1, ns_options=om.NSOptions(method="standard"), param_shardings=form
    )
    with jax.set_mesh(mesh):
      assert om.summarize(state, tx).plan is not None, name
    updates = _update(tx, params, grads, mesh)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(updates), jax.tree.leaves(reference)
    ):
      assert rel_err(a, b) < 1e-5, (name, jax.tree_util.keystr(path))


class _LinenMLP(nn.Module):
  logical: bool

  @nn.compact
  def __call__(self, x):
    part = (
        nn.with_logical_partitioning if self.logical else nn.with_partitioning
    )
    axes = (
        (("embed", "mlp"), ("mlp", "embed"))
        if self.logical
        else (("data", "model"), ("model", "data"))
    )
    init = nn.initializers.lecun_normal()
    x = nn.Dense(32, kernel_init=part(init, axes[0]), use_bias=False)(x)
    return nn.Dense(16, kernel_init=part(init, axes[1]), use_bias=False)(
        jax.nn.gelu(x)
    )


@pytest.mark.parametrize("logical", [False, True])
def test_linen_shardings(logical):
  """``nn.get_sharding`` (mesh axes) and ``nn.logical_to_mesh_sharding``
  (logical axes)."""
  mesh = _auto_mesh()
  variables = _LinenMLP(logical).init(jax.random.PRNGKey(0), jnp.ones((2, 16)))
  rules = (("embed", "data"), ("mlp", "model"))
  if logical:
    shardings = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(variables), mesh, rules
    )
  else:
    shardings = nn.get_sharding(variables, mesh)
  params = nn.unbox(variables)["params"]
  put = lambda tree: jax.tree.map(
      jax.device_put, tree, nn.unbox(shardings)["params"]
  )
  grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
  single = om.muon(0.1, ns_options=om.NSOptions(method="standard"))
  reference = single.update(grads, single.init(params), params)[0]
  tx = om.muon(
      0.1,
      ns_options=om.NSOptions(method="standard"),
      param_shardings=shardings["params"],
  )
  with jax.set_mesh(mesh):
    assert om.summarize(params, tx).plan is not None
  updates = _update(tx, put(params), put(grads), mesh)
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(reference)):
    assert rel_err(a, b) < 1e-5
  # Boxed params (what linen's TrainState holds) match the same shardings.
  boxed = om.muon(0.1, param_shardings=shardings["params"])
  with jax.set_mesh(mesh):
    plan = om.summarize(variables["params"], boxed).plan
  assert len(plan.leaves) == 2 and all(
      p.sharding is not None for p in plan.leaves
  )


def test_mismatch_names_the_leaf_and_shows_both_structures():
  mesh = _auto_mesh()
  state = nnx.state(_nnx_model(mesh), nnx.Param)
  shardings = nnx.to_pure_dict(nnx.get_named_sharding(state, mesh))
  del shardings["norm"]
  tx = om.muon(0.1, param_shardings=shardings)
  with pytest.raises(
      ValueError,
      match=r"no entry for leaf 'norm/scale'.*The params have "
      r"leaves \['embed/embedding', .*param_shardings has entries "
      r"\['embed/embedding'",
  ):
    tx.update(_pure(state), tx.init(_pure(state)), _pure(state))


def test_partition_specs_need_a_mesh():
  params = {"w": jnp.ones((16, 8))}
  tx = om.scale_by_muon(param_shardings={"w": P("data")})
  with pytest.raises(
      ValueError, match="param_shardings holds PartitionSpecs but no mesh"
  ):
    tx.update(params, tx.init(params))
  mesh = _auto_mesh()
  with jax.set_mesh(mesh):
    sharded = jax.device_put(params, NamedSharding(mesh, P("data")))
    u, _ = jax.jit(tx.update)(sharded, tx.init(sharded))
  assert np.all(np.isfinite(u["w"]))
