"""``DionMatrix``: the static facts of one matrix leaf for Dion (its axes, rank,
where its blocks lie and which mesh axes each sum runs over).

A leaf is seen as ``batch`` matrices of ``rows × cols`` (the layout's
Newton–Schulz orientation: rows the short side), without reshaping: its axes
are permuted to (batch axes, row axes, column axes), the *view*, which moves
nothing between devices. Four groups of mesh axes matter:

* the row axes split the rows: P = M·Q is split like them, R = Mᵀ·P is summed
  over them, and P is orthonormalized across them;
* the column axes split the columns: P = M·Q is summed over them;
* the batch axes split the batch: nothing crosses them;
* the replica axes (data parallelism) hold one replica of the param each; with
  a compressed sync each replica keeps its own buffer, and P's and R's sums
  run over them too.

Q (columns × r) lies like the param's columns and, where the row axes can split
one of its column axes evenly, over the row axes too (``q_split``): a device
holds n·r / (row shards · column shards) values of it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import PartitionSpec

from optax_muon._src.core.matrices import MatrixLayout
from optax_muon._src.core.sharding import LeafSharding

_BATCH, _ROWS, _COLS = "abcdefg", "hijkl", "mnopq"


def rank_of(fraction: float, layout: MatrixLayout) -> int:
  """The rank for a matrix: ``ceil(fraction · min(m, n))``, at least 1 (0 for
  empty)."""
  short = min(layout.n_in, layout.n_out)
  if short == 0:
    return 0
  return min(short, max(1, math.ceil(fraction * short - 1e-9)))


def compresses(m: int, n: int, rank: int) -> bool:
  """Whether syncing P and R, (m + n)·r values, moves less than the m·n of the
  gradient (microsoft/dion's rule for its compressed data-parallel sync)."""
  return (m + n) * rank < m * n


def _spec_entry(axes: tuple[str, ...]) -> Any:
  return None if not axes else axes[0] if len(axes) == 1 else axes


@dataclasses.dataclass(frozen=True, kw_only=True)
class DionMatrix:
  """Static facts of one leaf for Dion.

  Attributes:
    path: the leaf's path, for messages.
    perm: the leaf's axes in view order (batch axes, row axes, column axes).
    view: the leaf's global shape in that order.
    batch, rows, cols: how many axes of each kind.
    rank: r.
    dim_axes: per axis of ``view``, the mesh axes that split it, major to minor
      (empty without sharding).
    mesh: the mesh, or None without sharding.
    replica_axes: the mesh axes over which the params are replicated and the
      gradients differ (data parallelism); empty without a replica sync.
    replicas: the number of replicas (the product of those axes' sizes).
    compressed: whether the replicas sync P's and R's sums (each keeps its own
      buffer) rather than the averaged gradient.
    q_split: the view axis of a column whose Q axis the row axes split too, or
      None.
    product_dtype: the operands' dtype of the four m × n × r products, or None
      (the state's dtype at full precision).
    power_iterations: subspace-iteration steps per optimizer step (Dion: 1).
    orthonormal_precision: the precision of the orthonormalization's
      products.
  """

  path: str
  perm: tuple[int, ...]
  view: tuple[int, ...]
  batch: int
  rows: int
  cols: int
  rank: int
  dim_axes: tuple[tuple[str, ...], ...]
  mesh: Any = None
  replica_axes: tuple[str, ...] = ()
  replicas: int = 1
  compressed: bool = False
  q_split: int | None = None
  product_dtype: Any = None
  power_iterations: int = 1
  orthonormal_precision: Any = jax.lax.Precision.HIGHEST

  @classmethod
  def of(
      cls,
      layout: MatrixLayout,
      sharding: LeafSharding | None,
      rank: int,
      *,
      replica_axes: tuple[str, ...] = (),
      product_dtype: Any = None,
      power_iterations: int = 1,
      orthonormal_precision: Any = jax.lax.Precision.HIGHEST,
  ) -> DionMatrix:
    """The facts of ``layout``'s leaf at ``rank`` (see the attributes).

    Raises:
      ValueError: for more axes than Dion's products name, or replica axes
        that split the leaf.
    """
    rows, cols = layout.reduction_axes, layout.output_axes
    if layout.transposed:
      rows, cols = cols, rows
    perm = layout.batch_axes + rows + cols
    if len(layout.batch_axes) > len(_BATCH) or max(len(rows), len(cols)) > len(
        _ROWS
    ):
      raise ValueError(
          f"{layout.path}: Dion takes up to {len(_BATCH)} batch axes and "
          f"{len(_ROWS)} axes per matrix side; got shape {layout.shape}."
      )
    dim_axes = tuple(
        () if sharding is None else sharding.dim_axes[a] for a in perm
    )
    if sharding is not None and set(replica_axes) & sharding.used_axes:
      raise ValueError(
          f"{layout.path}: replica_axes {replica_axes} must not split the"
          f" param, but it lies as {sharding.spec}."
      )
    view = tuple(layout.shape[a] for a in perm)
    m = math.prod(
        view[len(layout.batch_axes) : len(layout.batch_axes) + len(rows)]
    )
    n = math.prod(view[len(layout.batch_axes) + len(rows) :])
    mesh = None if sharding is None else sharding.mesh
    replicas = math.prod(mesh.shape[a] for a in replica_axes) if mesh else 1
    matrix = cls(
        path=layout.path,
        perm=perm,
        view=view,
        batch=len(layout.batch_axes),
        rows=len(rows),
        cols=len(cols),
        rank=rank,
        dim_axes=dim_axes,
        mesh=mesh,
        replica_axes=tuple(replica_axes) if mesh else (),
        replicas=replicas,
        compressed=bool(replica_axes) and compresses(m, n, rank),
        product_dtype=product_dtype,
        power_iterations=power_iterations,
        orthonormal_precision=orthonormal_precision,
    )
    return dataclasses.replace(matrix, q_split=matrix._q_split())

  # ------------------------------------------------------------ the matrices

  @property
  def m(self) -> int:
    """Rows per matrix."""
    return math.prod(self.view[self.batch : self.batch + self.rows])

  @property
  def n(self) -> int:
    """Columns per matrix."""
    return math.prod(self.view[self.batch + self.rows :])

  @property
  def count(self) -> int:
    """Matrices in the leaf."""
    return math.prod(self.view[: self.batch])

  @property
  def batch_dims(self) -> tuple[int, ...]:
    return tuple(range(self.batch))

  @property
  def row_dims(self) -> tuple[int, ...]:
    return tuple(range(self.batch, self.batch + self.rows))

  @property
  def col_dims(self) -> tuple[int, ...]:
    return tuple(range(self.batch + self.rows, len(self.view)))

  # -------------------------------------------------------- the einsum letters

  @property
  def b(self) -> str:
    return _BATCH[: self.batch]

  @property
  def i(self) -> str:
    return _ROWS[: self.rows]

  @property
  def o(self) -> str:
    return _COLS[: self.cols]

  # ---------------------------------------------------------- the mesh's axes

  def axes_of(self, dims: tuple[int, ...]) -> tuple[str, ...]:
    """The mesh axes that split any of the view's ``dims``, in view order."""
    return tuple(a for d in dims for a in self.dim_axes[d])

  @property
  def row_axes(self) -> tuple[str, ...]:
    return self.axes_of(self.row_dims)

  @property
  def col_axes(self) -> tuple[str, ...]:
    return self.axes_of(self.col_dims)

  @property
  def used_axes(self) -> frozenset[str]:
    """Every mesh axis this leaf's step runs over (replica axes included)."""
    return frozenset(self.axes_of(tuple(range(len(self.view))))) | frozenset(
        self.replica_axes
    )

  def size(self, axes: tuple[str, ...]) -> int:
    return math.prod(self.mesh.shape[a] for a in axes) if axes else 1

  def local(self, dim: int) -> int:
    """The size of view axis ``dim`` on one device."""
    return self.view[dim] // self.size(self.dim_axes[dim])

  @property
  def local_batch(self) -> int:
    return math.prod(self.local(d) for d in self.batch_dims)

  @property
  def local_m(self) -> int:
    return math.prod(self.local(d) for d in self.row_dims)

  @property
  def local_n(self) -> int:
    return math.prod(self.local(d) for d in self.col_dims)

  def _q_split(self) -> int | None:
    """The first column axis whose local size the row axes divide evenly."""
    shards = self.size(self.row_axes)
    if self.mesh is None or shards == 1:
      return None
    return next((d for d in self.col_dims if self.local(d) % shards == 0), None)

  # ----------------------------------------------------------------- layouts

  @property
  def q_shape(self) -> tuple[int, ...]:
    """The right factor Q: (batch…, cols…, r)."""
    return (
        self.view[: self.batch]
        + self.view[self.batch + self.rows :]
        + (self.rank,)
    )

  @property
  def q_dim_axes(self) -> tuple[tuple[str, ...], ...]:
    """Per axis of Q, the mesh axes that split it."""
    cols = tuple(
        self.dim_axes[d] + (self.row_axes if d == self.q_split else ())
        for d in self.col_dims
    )
    return tuple(self.dim_axes[d] for d in self.batch_dims) + cols + ((),)

  @property
  def q_axis(self) -> int | None:
    """The axis of Q that ``q_split`` names, or None."""
    return None if self.q_split is None else self.q_split - self.rows

  def leaf_spec(self, replica: bool = False) -> PartitionSpec:
    """The leaf's PartitionSpec in its own axis order (with ``replica``: after a
    leading replica axis)."""
    back = sorted(range(len(self.perm)), key=lambda a: self.perm[a])
    entries = [self.dim_axes[d] for d in back]
    lead = [self.replica_axes] if replica else []
    return PartitionSpec(*[_spec_entry(a) for a in lead + entries])

  @property
  def q_spec(self) -> PartitionSpec:
    return PartitionSpec(*[_spec_entry(a) for a in self.q_dim_axes])

  @property
  def back(self) -> tuple[int, ...]:
    """The permutation from view order back to the leaf's own."""
    return tuple(sorted(range(len(self.perm)), key=lambda a: self.perm[a]))
