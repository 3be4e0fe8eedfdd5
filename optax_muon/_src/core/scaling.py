"""The scale stage: the shape factor (``scale_factor``, the ``scale_by_shape``
stage both optimizers chain), and ``adaptive``'s dual-norm scaling."""

from __future__ import annotations

import math

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.core.options import check_number
from optax_muon._src.core.sharding import sum_over
from optax_muon._src.core.spec import TreeOptions, tree_spec

SCALE_KINDS = ("jordan", "spectral", None)


def check_shape_scale(
    scale: str | None, consistent_rms: jax.typing.ArrayLike | None
) -> None:
  """Raises ValueError, naming the argument, for an unknown ``scale`` or a
  Python ``consistent_rms`` that is not positive."""
  check_number("consistent_rms", consistent_rms, 0.0, low_open=True)
  if scale not in SCALE_KINDS:
    raise ValueError(f"scale must be one of {SCALE_KINDS}, got {scale!r}.")


def scale_factor(
    n_in: int,
    n_out: int,
    kind: str | None,
    *,
    consistent_rms: jax.typing.ArrayLike | None = None,
):
  """The factor multiplying an orthogonalized update of an n_in × n_out matrix.

  Args:
    n_in: reduction size.
    n_out: output size.
    kind: ``"jordan"`` sqrt(max(1, n_out/n_in)); ``"spectral"``
      sqrt(n_out/n_in); ``None`` 1. Ignored when ``consistent_rms`` is given.
    consistent_rms: k, for the factor k·sqrt(max(n_in, n_out)): the update's RMS
      is then about k whatever the shape (Moonlight uses 0.2 to match AdamW;
      DeepSeek-V4's γ is the same constant). May be a traced scalar.

  Returns:
    A Python float, or a scalar array when ``consistent_rms`` is traced.

  Raises:
    ValueError: for an unknown kind.

  Examples:
    >>> from optax_muon._src.core.scaling import scale_factor
    >>> scale_factor(256, 1024, "jordan")
    2.0
    >>> scale_factor(256, 1024, None, consistent_rms=0.2)
    6.4
  """
  if kind not in SCALE_KINDS:
    raise ValueError(
        f"Unknown update scale {kind!r}; expected one of {SCALE_KINDS}."
    )
  if consistent_rms is not None:
    return consistent_rms * math.sqrt(max(n_in, n_out))
  if (
      n_in == 0 or kind is None
  ):  # an empty matrix: its update is empty whatever the factor
    return 1.0
  if kind == "jordan":
    return math.sqrt(max(1.0, n_out / n_in))
  return math.sqrt(n_out / n_in)


def dual_norm_scale(o: jax.Array, n: jax.Array, sharding) -> jax.Array:
  """``adaptive``'s factor ⟨n, o⟩ = Σ conj(n)·o over the whole leaf (as
  ``optax.contrib``).

  Args:
    o: the leaf's orthogonalized update (or its local block inside
      ``shard_map``).
    n: the NS input (or its local block).
    sharding: the leaf's ``LeafSharding`` (the sum spans its shards), or None.

  Returns:
    The factor, with ``o``'s rank and size 1 on every axis.
  """
  return sum_over(
      jnp.conj(n).astype(o.dtype) * o, tuple(range(o.ndim)), sharding
  )


def scale_by_shape(
    weight_dimension_numbers: Any = None,
    consistent_rms: jax.typing.ArrayLike | None = None,
    *,
    scale: str | None = "jordan",
) -> optax.GradientTransformation:
  """Scales each update by its matrix shape, as ``optax.contrib``'s
  ``scale_by_shape``.

  Args:
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf (tree, prefix
      tree or callable); ``None`` entries mean a plain 2-D matrix.
    consistent_rms: k for the factor k·sqrt(max(n_in, n_out)); replaces
      ``scale``.
    scale: ``"jordan"`` sqrt(max(1, n_out/n_in)) (optax's), ``"spectral"``
      sqrt(n_out/n_in), or None (1).

  Returns:
    A stateless ``optax.GradientTransformation``.

  Raises:
    ValueError: for an unknown scale or a non-positive ``consistent_rms``, and
      (at update) for leaves that are not matrices under their dimension
      numbers, naming the leaf.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> tx = optax_muon.scale_by_shape()
    >>> u, _ = tx.update({"w": jnp.ones((16, 64))}, tx.init(None))
    >>> float(u["w"][0, 0])
    2.0
  """
  check_shape_scale(scale, consistent_rms)
  return shape_scaling(
      TreeOptions(weight_dimension_numbers=weight_dimension_numbers),
      consistent_rms,
      scale,
  )


def shape_scaling(
    options: TreeOptions,
    consistent_rms: jax.typing.ArrayLike | None,
    scale: str | None,
) -> optax.GradientTransformation:
  """``scale_by_shape`` of the Muon leaves ``options`` finds among the updates
  (with their layouts and, inside ``shard_map``, their global shapes from
  ``options.param_shardings``).

  Args:
    options: the matrix branch's options (``branch_options`` of the full
      optimizer's).
    consistent_rms: k of the RMS-matching factor, or None.
    scale: the shape factor's kind.

  Returns:
    A stateless ``optax.GradientTransformation``.
  """

  def update_fn(updates, state, params=None):
    del params
    spec = tree_spec(updates, options)
    out = [
        (
            scale_factor(
                leaf.layout.n_in,
                leaf.layout.n_out,
                scale,
                consistent_rms=consistent_rms,
            )
            * x
        ).astype(x.dtype)
        for x, leaf in zip(spec.take(updates), spec.muon_leaves)
    ]
    return spec.put(updates, out), state

  return optax.GradientTransformation(
      lambda params: optax.EmptyState(), update_fn
  )
