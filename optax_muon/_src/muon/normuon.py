"""NorMuon: neuron-wise normalization of the orthogonalized update.

For one matrix O of a Muon leaf (the Newton–Schulz output, Flax layout ``n_in ×
n_out``), with one second moment v_j per output neuron j kept in the optimizer
state::

  v_j ← β₂·v_j + (1−β₂)·mean_i O_ij²   (mean over the n_in input coordinates)
  Ô_ij = O_ij / (√v_j + 1e-8)
  Ô ← Ô·‖O‖_F / ‖Ô‖_F                  (the matrix keeps its Frobenius norm)

The input and output axes are the leaf's dimension numbers; every index along
its batch axes is its own matrix (own v, own norms). v has the leaf's shape with
its input axes reduced to size 1, so it shards like the params' output and batch
axes: under ``jit`` the reductions are plain ``jnp`` (XLA inserts the small
all-reduces); inside ``shard_map`` they are ``psum`` over the mesh axes that
split the reduced dimensions. No whole matrix is gathered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optax_muon._src.core.matrices import MatrixLayout
from optax_muon._src.core.sharding import LeafSharding, sum_over, zeros

#: Added to √v before dividing (NorMuon's and Dion's value).
NEURON_EPS = 1e-8


def init_moment(
    shape: tuple[int, ...],
    reduction_axes: tuple[int, ...],
    dtype,
    sharding: LeafSharding | None,
    like: jax.Array,
) -> jax.Array:
  """Zeros of the leaf's shape with its input axes reduced to size 1, sharded
  like the leaf's output and batch axes.

  Args:
    shape: the leaf's shape (its local shape inside ``shard_map``).
    reduction_axes: its input axes.
    dtype: the moment's (real) dtype.
    sharding: the leaf's sharding, or None.
    like: the leaf (tells whether this runs under a trace).
  """
  moment = tuple(
      1 if d in reduction_axes else size for d, size in enumerate(shape)
  )
  return zeros(
      moment,
      dtype,
      None if sharding is None else sharding.without(reduction_axes),
      like,
  )


def normalize_neurons(
    o: jax.Array,
    nu: jax.Array,
    beta: jax.typing.ArrayLike,
    layout: MatrixLayout,
    sharding: LeafSharding | None = None,
) -> tuple[jax.Array, jax.Array]:
  """NorMuon's step for one leaf: new second moments and the normalized update.

  Args:
    o: the leaf's Newton–Schulz output (the global array, or its local block
      inside ``shard_map``).
    nu: its second moment, ``o``'s shape with the input axes of size 1 (or its
      local block).
    beta: β₂, in [0, 1); may be traced.
    layout: the leaf's (global) layout: its input and output axes.
    sharding: the leaf's sharding (inside ``shard_map`` the sums over split axes
      are completed with ``psum``), or None.

  Returns:
    (Ô in ``o``'s dtype, the new ``nu``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_muon._src.core.matrices import make_layout
    >>> from optax_muon._src.muon.normuon import normalize_neurons
    >>> # neuron 0 is 50× louder than neuron 1
    >>> o = jnp.array([[3.0, 0.1], [4.0, 0.0]])
    >>> layout = make_layout("w", o, None)
    >>> o_hat, nu = normalize_neurons(o, jnp.zeros((1, 2)), 0.95, layout)
    >>> # now equal
    >>> [round(float(x), 3) for x in jnp.linalg.norm(o_hat, axis=0)]
    [3.536, 3.536]

  References:
    Li et al., `NorMuon: Making Muon more efficient and scalable
    <https://arxiv.org/abs/2510.05491>`_, 2025.
  """
  reduced = layout.reduction_axes
  matrix = reduced + layout.output_axes
  wide = o.astype(jnp.promote_types(o.dtype, nu.dtype))
  square = jnp.real(wide * jnp.conj(wide))
  mean_square = sum_over(square, reduced, sharding) / max(1, layout.n_in)
  nu = (beta * nu + (1 - beta) * mean_square).astype(nu.dtype)
  normalized = wide / (jnp.sqrt(nu) + NEURON_EPS)
  norm = jnp.sqrt(sum_over(square, matrix, sharding))
  new_norm = jnp.sqrt(
      sum_over(jnp.real(normalized * jnp.conj(normalized)), matrix, sharding)
  )
  normalized = normalized * (norm / jnp.where(new_norm > 0, new_norm, 1))
  return normalized.astype(o.dtype), nu
