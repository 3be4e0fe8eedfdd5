"""What a user reads when the call is wrong: errors name the leaf, and the tools
name what they were given in the user's terms."""

import jax.numpy as jnp
import optax
import pytest

import optax_muon as om


def _params():
  return {
      "blocks": {"w": jnp.zeros((8, 16)), "z": jnp.zeros((16, 8))},
      "b": jnp.zeros(8),
  }


@pytest.mark.parametrize("make", [lambda: om.muon(0.02), lambda: om.dion(0.02)])
def test_a_gradient_tree_missing_a_key_names_the_leaf(make):
  tx = make()
  params = _params()
  state = tx.init(params)
  grads = {"blocks": {"w": jnp.ones((8, 16))}, "b": jnp.ones(8)}
  with pytest.raises(
      ValueError, match=r"missing from the updates: \['blocks/z'\]"
  ):
    tx.update(grads, state, params)
  extra = {**params, "c": jnp.ones(3)}
  with pytest.raises(ValueError, match=r"not in the param: \['c'\]"):
    tx.update(extra, state, params)


def test_summarize_of_a_transformation_without_muon_names_no_optax_internals():
  with pytest.raises(ValueError, match="no optax_muon transformation") as err:
    om.summarize(_params(), optax.adam(1e-3))
  assert "GradientTransformation" not in str(err.value)
  with pytest.raises(ValueError, match="expected an optax transformation"):
    om.summarize(_params(), "adam")
