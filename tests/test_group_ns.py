"""Newton–Schulz of one matrix by a team of devices, each holding a block of its
columns: equal to the whole-matrix iteration, with the FLOPs and collectives the
model predicts."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_cost
import optax_muon as om
from optax_muon._src.muon import costs
from optax_muon._src.muon.coefficients import resolve_coefficients
from optax_muon._src.muon.costs import ns_flops
from helpers import normal, rel_err
from optax_muon._src.muon.newton_schulz import MeshTeam, orthogonalize_block

M, N = 24, 96


def _team_run(x, table, k, **kw):
  """x: (batch, M, N) canonical; batch over 8/k teams, columns over k members.
  The team's collectives run over both mesh axes, grouped by team (the shard_map
  checks replication)."""
  mesh = jax.make_mesh((8 // k, k), ("teams", "members"))
  spec = P("teams", None, "members")
  team = MeshTeam(("teams", "members"), devices=8, size=k)
  fn = jax.jit(
      jax.shard_map(
          lambda block: orthogonalize_block(block, table, team=team, **kw),
          mesh=mesh,
          in_specs=spec,
          out_specs=spec,
      )
  )
  x = jax.device_put(x, NamedSharding(mesh, spec))
  compiled = fn.lower(x).compile()
  return compiled(x), compiled


def _team_cases():
  """Both methods with k = 4 and the Frobenius scaling (the fast tier); k = 2
  and 8, and the other three scalings, each once in the full suite."""
  for method in ("standard", "gram"):
    yield pytest.param(4, method, "frobenius")
  for k, method, preconditioning in [
      (2, "gram", "frobenius"),
      (8, "standard", "frobenius"),
      (4, "gram", "spectral"),
      (4, "standard", "aol"),
      (4, "gram", "schatten"),
  ]:
    yield pytest.param(k, method, preconditioning, marks=pytest.mark.slow)


@pytest.mark.parametrize("k, method, preconditioning", list(_team_cases()))
def test_team_equals_one_device(k, method, preconditioning):
  x = normal(jax.random.PRNGKey(k), (8 // k, M, N))
  table = resolve_coefficients("polar_express", 6)
  kw = dict(method=method, preconditioning=preconditioning)
  whole = om.newton_schulz(x, table, **kw)
  split, _ = _team_run(x, table, k, **kw)
  assert rel_err(split, whole) < 1e-5


def test_team_flops_and_collectives_are_the_model():
  """Standard iteration, k = 4: per device (4·m²·n + 2·m³)/k per step; inside
  the loop one all-reduce of the Gram matrix (reduce-scatter + all-gather) and
  one all-gather of the polynomial's rows per step."""
  k, steps = 4, 5
  x = normal(jax.random.PRNGKey(0), (2, M, N))
  table = resolve_coefficients("jordan", steps)
  _, compiled = _team_run(x, table, k, method="standard")
  cost = hlo_cost.analyze(compiled, 8)
  per_matrix = steps * (4 * M * M * N + 2 * M**3) // k
  assert cost.dot_flops == 1 * per_matrix  # 2 matrices over 2 teams: one each
  in_loop = [c for c in cost.collectives if c.in_loop]
  assert sorted(c.kind for c in in_loop) == [
      "all-gather",
      "all-gather",
      "reduce-scatter",
  ]
  assert all(c.multiplicity == steps for c in in_loop)


@pytest.mark.parametrize("k, steps, restart", [(4, 5, 3), (2, 6, 5)])
def test_team_gram_splits_every_product(k, steps, restart):
  """The Gram iteration in a team: each member's FLOPs are ``ns_flops(...,
  team=k)``, about 1/k of one device's (every m × m product split by rows, not
  only G and Q·X₀), and its collectives are ``team_collectives``'s."""
  x = normal(jax.random.PRNGKey(1), (8 // k, M, N))
  table = resolve_coefficients("jordan", steps)
  kw = dict(method="gram", gram_restart=restart)
  got, compiled = _team_run(x, table, k, **kw)
  assert rel_err(got, om.newton_schulz(x, table, **kw)) < 1e-5
  cost = hlo_cost.analyze(compiled, 8)
  assert cost.dot_flops == ns_flops(M, N, steps, True, restart, team=k)
  whole = ns_flops(M, N, steps, True, restart)
  assert (
      cost.dot_flops <= whole / k + steps * 2 * M**3 / k
  )  # the ⌈m/k⌉ rows' rounding
  model = costs.team_collectives(M, N, steps, k, True, restart)
  assert sum(c.multiplicity for c in cost.collectives) == len(model)
  assert sum(c.multiplicity for c in cost.collectives if c.in_loop) == sum(
      in_loop for _, in_loop in model
  )


def test_team_complex():
  key1, key2 = jax.random.split(jax.random.PRNGKey(3))
  x = normal(key1, (2, M, N)) + 1j * normal(key2, (2, M, N))
  x = x.astype(jnp.complex64)
  table = resolve_coefficients("polar_express", 8)
  split, _ = _team_run(x, table, 4)
  assert split.dtype == jnp.complex64
  assert rel_err(split, om.newton_schulz(x, table)) < 1e-5


def test_team_bf16_products_err_like_one_device():
  """bf16 products round differently split and whole; both stay as close to the
  float32 result as bf16 allows."""
  x = normal(jax.random.PRNGKey(4), (2, M, N))
  table = resolve_coefficients("polar_express", 8)
  exact = om.newton_schulz(x, table)
  whole = om.newton_schulz(x, table, compute_dtype=jnp.bfloat16)
  split, _ = _team_run(x, table, 4, compute_dtype=jnp.bfloat16)
  assert rel_err(split, exact) < 1.5 * rel_err(whole, exact) < 0.1
