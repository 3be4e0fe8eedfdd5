"""How a parameter leaf is seen as a batch of matrices: dimension numbers and
layouts.

A ``MatrixLayout`` is static per-leaf metadata (Python values only, never
arrays), computed once per tree from the leaf's shape and its
``MuonDimensionNumbers`` (see ``spec``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax.contrib


def ns_orientation(rows: int, cols: int) -> tuple[tuple[int, int], bool]:
  """Which side Newton–Schulz runs on: the (m, n) matrix it iterates on, m ≤ n,
  and whether that is the transpose of the rows × cols input. The one place this
  is decided."""
  return (min(rows, cols), max(rows, cols)), rows > cols


class MuonDimensionNumbers(NamedTuple):
  """Which axes of a weight form the matrix Muon orthogonalizes.

  The same fields as ``optax.contrib.MuonDimensionNumbers`` (instances of either
  are accepted everywhere). All axes that are neither reduction nor output axes
  are batch axes: each index along them is an independent matrix.

  Attributes:
    reduction_axis: the input axis or axes (``n_in``, contracted in ``x @ W``).
    output_axis: the output axis or axes (``n_out``).

  A stacked (L, d_in, d_out) kernel is ``MuonDimensionNumbers(1, 2)``; a conv
  kernel (kh, kw, c_in, c_out) as one matrix is ``MuonDimensionNumbers((0, 1,
  2), 3)``; a fused per-head projection (d, heads, head_dim) orthogonalized per
  head is ``MuonDimensionNumbers(0, 2)``.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> DN = optax_muon.MuonDimensionNumbers
    >>> params = {"stack": jnp.zeros((4, 32, 128)),
    ...           "conv": jnp.zeros((3, 3, 8, 16))}
    >>> tx = optax_muon.scale_by_muon(
    ...     weight_dimension_numbers={"stack": DN(1, 2),
    ...                               "conv": DN((0, 1, 2), 3)})
    >>> rows = optax_muon.summarize(params, tx).rows
    >>> [(r.path, r.ns_matrix, r.batch) for r in rows]
    [('conv', (16, 72), 1), ('stack', (32, 128), 4)]
  """

  reduction_axis: Sequence[int] | int = 0
  output_axis: Sequence[int] | int = 1


# optax.contrib's own type is accepted too (optax ≥ 0.2.6 has one).
DIMENSION_NUMBER_TYPES = (MuonDimensionNumbers,) + tuple(
    t
    for t in (getattr(optax.contrib, "MuonDimensionNumbers", None),)
    if t is not None
)


def is_dimension_numbers(x: Any) -> bool:
  return isinstance(x, DIMENSION_NUMBER_TYPES)


def portable_dimension_numbers(dims: Any) -> Any:
  """``dims`` as optax.contrib's own type where the installed optax has one (a
  tree of them then works for ``optax.contrib.muon`` too, which knows no other
  type), else as they are."""
  if dims is None or not is_dimension_numbers(dims):
    return dims
  return DIMENSION_NUMBER_TYPES[-1](*dims)


def _normalize_axes(axes, ndim: int, path: str, field: str) -> tuple[int, ...]:
  axes = (axes,) if isinstance(axes, int) else tuple(axes)
  if not axes:
    raise ValueError(f"{path}: {field} must name at least one axis.")
  for ax in axes:
    if (
        isinstance(ax, bool)
        or not isinstance(ax, int)
        or not -ndim <= ax < ndim
    ):
      raise ValueError(
          f"{path}: {field} {ax!r} is out of range for a leaf of rank {ndim}."
      )
  normalized = tuple(ax % ndim for ax in axes)
  if len(set(normalized)) != len(normalized):
    raise ValueError(f"{path}: {field} {axes} names an axis twice.")
  return normalized


@dataclasses.dataclass(frozen=True)
class MatrixLayout:
  """A leaf seen as ``batch`` independent ``n_in × n_out`` matrices.

  Attributes:
    path: the leaf's path, for messages.
    shape: the leaf's shape.
    dtype: the leaf's dtype.
    batch_axes, reduction_axes, output_axes: a partition of
      ``range(len(shape))``.
  """

  path: str
  shape: tuple[int, ...]
  dtype: Any
  batch_axes: tuple[int, ...]
  reduction_axes: tuple[int, ...]
  output_axes: tuple[int, ...]

  @property
  def batch(self) -> int:
    return math.prod(self.shape[a] for a in self.batch_axes)

  @property
  def n_in(self) -> int:
    return math.prod(self.shape[a] for a in self.reduction_axes)

  @property
  def n_out(self) -> int:
    return math.prod(self.shape[a] for a in self.output_axes)

  @property
  def ns_shape(self) -> tuple[int, int]:
    """The (m, n) matrix Newton–Schulz iterates on: short side first."""
    return ns_orientation(self.n_in, self.n_out)[0]

  @property
  def transposed(self) -> bool:
    """Whether NS runs on the transpose of the ``n_in × n_out`` matrix."""
    return ns_orientation(self.n_in, self.n_out)[1]

  @property
  def _perm(self) -> tuple[int, ...]:
    return self.batch_axes + self.reduction_axes + self.output_axes

  def to_matrices(self, x: jax.Array) -> jax.Array:
    """Leaf → ``(batch, n_in, n_out)``."""
    return jnp.transpose(x, self._perm).reshape(
        self.batch, self.n_in, self.n_out
    )


def make_layout(path: str, leaf: Any, dims: Any | None) -> MatrixLayout:
  """Builds and validates the layout of one Muon leaf.

  Args:
    path: the leaf's path, used in error messages.
    leaf: an array or ``jax.ShapeDtypeStruct``.
    dims: ``MuonDimensionNumbers`` or ``None`` (a plain 2-D ``x @ W`` matrix).

  Returns:
    The leaf's ``MatrixLayout``.

  Raises:
    ValueError: for a leaf that is neither floating point nor complex, a 0-D/1-D
      leaf, axes out of range or overlapping, or dimension numbers that are not
      ``MuonDimensionNumbers``.
  """
  shape, dtype = tuple(leaf.shape), jnp.dtype(leaf.dtype)
  if not jnp.issubdtype(dtype, jnp.inexact):
    raise ValueError(
        f"{path}: Muon needs a floating-point or complex leaf; got dtype"
        f" {dtype} (shape {shape}). Route it elsewhere with `labels`."
    )
  if dims is None:
    if len(shape) != 2:
      raise ValueError(
          f"{path}: Muon needs a matrix; got a {len(shape)}-D leaf of shape"
          f" {shape}. Route it to AdamW, or describe it with"
          " MuonDimensionNumbers."
      )
    dims = MuonDimensionNumbers()
  elif not is_dimension_numbers(dims):
    raise ValueError(
        f"{path}: expected MuonDimensionNumbers or None, got {dims!r}."
    )
  if len(shape) < 2:
    raise ValueError(
        f"{path}: Muon needs at least 2 dimensions; got shape {shape}."
    )
  reduction = _normalize_axes(
      dims.reduction_axis, len(shape), path, "reduction_axis"
  )
  output = _normalize_axes(dims.output_axis, len(shape), path, "output_axis")
  if set(reduction) & set(output):
    raise ValueError(
        f"{path}: reduction axes {reduction} and output axes {output} overlap "
        f"(shape {shape})."
    )
  batch = tuple(a for a in range(len(shape)) if a not in reduction + output)
  return MatrixLayout(path, shape, dtype, batch, reduction, output)
