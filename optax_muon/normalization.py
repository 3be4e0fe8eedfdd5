"""NorMuon: neuron-wise normalization of the orthogonalized update.

For one matrix O of a Muon leaf (the Newton–Schulz output, Flax layout ``n_in × n_out``),
with one second moment v_j per output neuron j kept in the optimizer state::

  v_j ← β₂·v_j + (1−β₂)·mean_i O_ij²        (mean over the n_in input coordinates)
  Ô_ij = O_ij / (√v_j + 1e-8)
  Ô ← Ô·‖O‖_F / ‖Ô‖_F                       (the matrix keeps its Frobenius norm)

The input and output axes are the leaf's dimension numbers; every index along its batch
axes is its own matrix (own v, own norms). v has the leaf's shape with its input axes
reduced to size 1, so it shards like the params' output and batch axes: under ``jit`` the
reductions are plain ``jnp`` (XLA inserts the small all-reduces); inside ``shard_map`` they
are ``psum``s over the mesh axes that split the reduced dimensions. No whole matrix is
gathered.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding

from optax_muon.layout import MatrixLayout
from optax_muon.sharding import LeafSharding, dim_axes_of

NORMALIZATIONS = (None, "neuron")

#: Added to √v before dividing (NorMuon's and Dion's value).
NEURON_EPS = 1e-8


def moment_shape(layout: MatrixLayout) -> tuple[int, ...]:
  """The shape of a leaf's per-neuron second moment: its input axes reduced to size 1."""
  return tuple(1 if d in layout.reduction_axes else size
               for d, size in enumerate(layout.shape))


def moment_sharding(sharding: Any, layout: MatrixLayout) -> NamedSharding | None:
  """The leaf's ``NamedSharding`` with its input axes replicated (None for no sharding)."""
  if not isinstance(sharding, NamedSharding):
    return None
  dims = dim_axes_of(sharding.spec, len(layout.shape))
  kept = tuple(() if d in layout.reduction_axes else axes for d, axes in enumerate(dims))
  return NamedSharding(sharding.mesh, LeafSharding(sharding.mesh, kept).spec)


def init_moment(layout: MatrixLayout, dtype: Any, sharding: Any = None, *,
                traced: bool = False) -> jax.Array:
  """Zeros of ``moment_shape(layout)``, sharded like the leaf's output and batch axes.

  Args:
    layout: the leaf's layout.
    dtype: the moment's (real) dtype.
    sharding: the leaf's ``NamedSharding``, or None.
    traced: whether this runs under a trace (``jit``): the sharding is then a type
      (Explicit meshes) or a constraint (Auto meshes) rather than a placement.

  Returns:
    The initial second moment.
  """
  shape, target = moment_shape(layout), moment_sharding(sharding, layout)
  if target is None:
    return jnp.zeros(shape, dtype)
  if not traced:
    return jnp.zeros(shape, dtype, device=target)
  if all(t == AxisType.Explicit for t in target.mesh.axis_types):
    return jnp.zeros(shape, dtype, out_sharding=target)
  return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), target)


def _sum(x: jax.Array, axes: tuple[int, ...], mesh_axes: tuple[str, ...]) -> jax.Array:
  partial = jnp.sum(x, axis=axes, keepdims=True)
  return jax.lax.psum(partial, mesh_axes) if mesh_axes else partial


def normalize_neurons(o: jax.Array, nu: jax.Array, beta: jax.typing.ArrayLike,
                      layout: MatrixLayout, sharding: LeafSharding | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """NorMuon's step for one leaf: new second moments and the normalized update.

  Args:
    o: the leaf's Newton–Schulz output (the global array, or its local block inside
      ``shard_map``).
    nu: its second moment, shaped ``moment_shape(layout)`` (or the local block of it).
    beta: β₂, in [0, 1); may be traced.
    layout: the leaf's global layout.
    sharding: inside ``shard_map``, how the leaf is split over the mesh (the sums over
      split dimensions are completed with ``psum``); None for global arrays.

  Returns:
    (Ô in ``o``'s dtype, the new ``nu``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from optax_muon.layout import make_layout
    >>> from optax_muon.normalization import normalize_neurons
    >>> o = jnp.array([[3.0, 0.1], [4.0, 0.0]])  # neuron 0 is 50× louder than neuron 1
    >>> layout = make_layout("w", o, None)
    >>> o_hat, nu = normalize_neurons(o, jnp.zeros((1, 2)), 0.95, layout)
    >>> [round(float(x), 3) for x in jnp.linalg.norm(o_hat, axis=0)]  # now equal
    [3.536, 3.536]

  References:
    Li et al., `NorMuon: Making Muon more efficient and scalable
    <https://arxiv.org/abs/2510.05491>`_, 2025.
  """
  reduced, matrix = layout.reduction_axes, layout.reduction_axes + layout.output_axes
  split = lambda axes: (tuple(sorted({a for d in axes for a in sharding.dim_axes[d]}))
                        if sharding is not None else ())
  wide = o.astype(jnp.promote_types(o.dtype, nu.dtype))
  square = jnp.real(wide * jnp.conj(wide))
  mean_square = _sum(square, reduced, split(reduced)) / max(1, layout.n_in)
  nu = (beta * nu + (1 - beta) * mean_square).astype(nu.dtype)
  normalized = wide / (jnp.sqrt(nu) + NEURON_EPS)
  norm = jnp.sqrt(_sum(square, matrix, split(matrix)))
  new_norm = jnp.sqrt(_sum(jnp.real(normalized * jnp.conj(normalized)), matrix, split(matrix)))
  normalized = normalized * (norm / jnp.where(new_norm > 0, new_norm, 1))
  return normalized.astype(o.dtype), nu
