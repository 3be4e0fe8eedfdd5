"""Newton–Schulz orthogonalization and its SVD reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.muon.coefficients import (
    CoefficientsLike,
    NSCoefficients,
    resolve_coefficients,
)
from optax_muon._src.muon.costs import GRAM_RESTART, uses_gram
from optax_muon._src.core.matrices import ns_orientation

#: How ``newton_schulz`` may scale its input before the first step
#: (``preconditioning``).
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")


class Team:
  """The devices that orthogonalize one matrix together, each holding a block of
  its columns (canonical orientation: m ≤ n, the n side split). This base class
  is a team of one: the whole matrix on one device, every collective the
  identity.

  A team of k splits every long-side product by k (each member multiplies its
  own columns) and the short-side ones by k too (each member computes a block of
  rows of the m × m polynomial, then the blocks are gathered): per member
  4·m²·n/k + 2·⌈m/k⌉·m² FLOPs per step. Collectives per step: the Gram matrix's
  all-reduce (a reduce-scatter and an all-gather, (k − 1)/k·m² elements received
  each) and the all-gather of the polynomial's rows ((k − 1)/k·m²). The Gram
  iteration splits all of its products the same way (see ``costs.ns_flops`` and
  ``costs.team_collectives``).
  """

  size = 1

  def sum(self, x: jax.Array) -> jax.Array:
    """Σ over the members of a small array (the norms' partial sums)."""
    return x

  def max(self, x: jax.Array) -> jax.Array:
    """max over the members of a small array."""
    return x

  def sum_rows(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Σ over the members of an (..., m, m) matrix: (this member's row block,
    the whole)."""
    return x, x

  def row_block(self, a: jax.Array) -> jax.Array:
    """This member's block of rows of an (..., m, m) matrix."""
    return a

  def gather_rows(self, block: jax.Array, rows: int) -> jax.Array:
    """The members' row blocks put together: (..., m, m) with m = ``rows``."""
    del rows
    return block


@dataclasses.dataclass(frozen=True)
class MeshTeam(Team):
  """Teams of ``size`` consecutive devices along mesh axes (inside
  ``shard_map``).

  The devices along ``axes`` (linear index in the order given, row-major) form
  teams [0, k), [k, 2k), …; every team runs the same program on its own
  matrices. Collectives are grouped by team (``axis_index_groups``); the
  all-reduce is a reduce-scatter followed by an all-gather, which also works
  inside a ``shard_map`` that checks replication.

  Attributes:
    axes: the mesh axes.
    devices: the devices along ``axes`` (a multiple of k).
    size: k, the members of each team.
  """

  axes: tuple[str, ...]
  devices: int
  size: int = 1

  @property
  def _groups(self) -> list[list[int]] | None:
    if self.size == self.devices:
      return None
    return [
        list(range(t, t + self.size)) for t in range(0, self.devices, self.size)
    ]

  def _gather(self, x: jax.Array, axis: int) -> jax.Array:
    return jax.lax.all_gather(
        x, self.axes, axis=axis, axis_index_groups=self._groups, tiled=True
    )

  def _member(self):
    return jax.lax.axis_index(self.axes) % self.size

  def _rows(self, m: int) -> int:
    return -(-m // self.size)

  def _padded(self, a: jax.Array) -> jax.Array:
    extra = self._rows(a.shape[-2]) * self.size - a.shape[-2]
    return jnp.pad(a, [(0, 0)] * (a.ndim - 2) + [(0, extra), (0, 0)])

  def sum(self, x):
    return jnp.sum(self._gather(x[None], 0), axis=0)

  def max(self, x):
    return jnp.max(self._gather(x[None], 0), axis=0)

  def sum_rows(self, x):
    m = x.shape[-2]
    block = jax.lax.psum_scatter(
        self._padded(x),
        self.axes,
        scatter_dimension=x.ndim - 2,
        axis_index_groups=self._groups,
        tiled=True,
    )
    return block, self.gather_rows(block, m)

  def row_block(self, a):
    r = self._rows(a.shape[-2])
    return jax.lax.dynamic_slice_in_dim(
        self._padded(a), self._member() * r, r, axis=a.ndim - 2
    )

  def gather_rows(self, block, rows):
    return self._gather(block, block.ndim - 2)[..., :rows, :]


ONE = Team()


def _mm(a: jax.Array, b: jax.Array, *, rounded: bool = True) -> jax.Array:
  """a @ b at the precision its dtype asks for, on every backend.

  32- and 64-bit operands: ``Precision.HIGHEST`` (a TPU's DEFAULT is one
  bfloat16 pass on the MXU, a GPU's allows TF32). 16-bit operands: products
  accumulated in float32, the result rounded to the operands' dtype
  (``rounded=False``: left in float32).
  """
  if a.dtype.itemsize > 2 or jnp.issubdtype(a.dtype, jnp.complexfloating):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
  out = jnp.matmul(a, b, preferred_element_type=jnp.float32)
  return out.astype(a.dtype) if rounded else out


def _gram(x: jax.Array, team: Team = ONE) -> tuple[jax.Array, jax.Array]:
  """X·Xᴴ for a (..., m, n) array (the conjugate transpose, so complex inputs
  work), summed over the team's column blocks: (this member's row block of it,
  all of it). The members' partial products are summed before rounding to a
  16-bit dtype, as one device's product is."""
  block, whole = team.sum_rows(
      _mm(x, jnp.conj(jnp.swapaxes(x, -1, -2)), rounded=False)
  )
  return block.astype(x.dtype), whole.astype(x.dtype)


def _precondition(
    x: jax.Array, kind: str, safety: float, eps: float, team: Team = ONE
) -> tuple[jax.Array, jax.Array | None]:
  """Scales x so that every singular value is at most 1, in float32 (or wider).

  Every kind first divides each matrix by its max |X|: all four scalings are
  invariant to that, and it keeps the sums of squares representable (a gradient
  of scale 1e-20 squares to zero in float32, fp16 squares overflow or underflow,
  1e37 squares overflow).

  * ``"frobenius"``: X / (‖X‖_F·(1 + safety) + eps).
  * ``"spectral"``: X / (‖X‖₂ + eps), ‖X‖₂² the largest eigenvalue of X·Xᴴ.
  * ``"aol"``: D·X with D = diag(1/√max(Σⱼ|Aᵢⱼ|, eps)), A = X·Xᴴ ("almost
    orthogonal layer" row scaling; Boissin et al. 2025).
  * ``"schatten"``: X / √max(‖A‖_F, eps), the Schatten-4 norm (Grishina et al.
    2025).

  Returns:
    (scaled X, its Gram matrix X·Xᴴ where the scaling already computed it, else
    None).
  """
  wide = jnp.promote_types(x.dtype, jnp.float32)
  real = jnp.finfo(wide).dtype
  x = x.astype(wide)
  amax = team.max(jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True))
  amax = jnp.where(amax > 0, amax, 1).astype(
      real
  )  # divided by: 1/amax can be subnormal
  if kind == "frobenius":  # one pass for the norm, one for the scaling
    norm = jnp.sqrt(
        team.sum(
            jnp.sum(jnp.square(jnp.abs(x / amax)), axis=(-2, -1), keepdims=True)
        )
    )
    return x / amax / (norm * (1 + safety) + eps), None
  x = x / amax
  _, gram = _gram(x, team)
  if kind == "spectral":
    top = jnp.linalg.eigvalsh(gram)[..., -1:, None]
    return x / (jnp.sqrt(jnp.maximum(top, 0)).astype(real) + eps), None
  if kind == "aol":
    s = jax.lax.rsqrt(jnp.maximum(jnp.sum(jnp.abs(gram), axis=-1), eps))[
        ..., :, None
    ]
    return x * s, gram * s * jnp.swapaxes(s, -1, -2)
  if kind == "schatten":
    s = jax.lax.rsqrt(
        jnp.maximum(
            jnp.sqrt(
                jnp.sum(jnp.square(jnp.abs(gram)), axis=(-2, -1), keepdims=True)
            ),
            eps,
        )
    )
    return x * s, gram * (s * s)
  raise ValueError(
      f"Unknown preconditioning {kind!r}; expected one of {PRECONDITIONINGS}."
  )


def _ns_iterations(
    x: jax.Array,
    rows: np.ndarray,
    gram: jax.Array | None = None,
    team: Team = ONE,
) -> jax.Array:
  """Applies X ← a·X + (b·A + c·A²)·X, A = X·Xᴴ, once per row; x has m ≤ n.

  ``gram``, when given, is the first step's A (the preconditioning computed it).
  In a team each member computes its block of rows of b·A + c·A², and the blocks
  are gathered.
  """
  rows = jnp.asarray(rows, dtype=x.dtype)
  m = x.shape[-2]

  def apply(x, block, gram, abc):
    poly = team.gather_rows(abc[1] * block + abc[2] * _mm(block, gram), m)
    return abc[0] * x + _mm(poly, x)

  if gram is not None:
    x, rows = apply(x, team.row_block(gram), gram, rows[0]), rows[1:]
  x, _ = jax.lax.scan(
      lambda x, abc: (apply(x, *_gram(x, team), abc), None), x, rows
  )
  return x


def _gram_iterations(
    x: jax.Array,
    rows: np.ndarray,
    gram: jax.Array | None = None,
    team: Team = ONE,
) -> jax.Array:
  """The same iteration carried out on m × m matrices; x has m ≤ n.

  Every X_k is Q_k·X_0 with Q_k a polynomial in G = X_0·X_0ᴴ, so everything
  commutes: P_k = a·I + b·A_k + c·A_k², Q_{k+1} = Q_k·P_k, A_{k+1} =
  (P_k·A_k)·P_k. Only G and the final Q·X_0 touch the long side: 4·m²·n + 8·m³
  per step instead of (4·m²·n + 2·m³) per step. ``gram``, when given, is G (the
  preconditioning computed it).

  In a team every product is split: each member computes its block of rows of P,
  A and Q (a row block of a product needs the whole right operand, so P and A
  are gathered after each step and Q once, for Q·X_0).
  """
  rows = jnp.asarray(rows, dtype=x.dtype)
  m = x.shape[-2]
  eye = team.row_block(jnp.eye(m, dtype=x.dtype))

  def poly(block, whole, abc):  # this member's rows of a·I + b·A + c·A²
    return abc[0] * eye + abc[1] * block + abc[2] * _mm(block, whole)

  def next_a(p_block, a, p):  # rows of A' = (P·A)·P, and all of it
    a_block = _mm(_mm(p_block, a), p)
    return a_block, team.gather_rows(a_block, m)

  def step(carry, abc):
    q_block, a_block, a = carry
    p_block = poly(a_block, a, abc)
    p = team.gather_rows(p_block, m)
    return (_mm(q_block, p), *next_a(p_block, a, p)), None

  g_block, g = _gram(x, team) if gram is None else (team.row_block(gram), gram)
  q_block = poly(
      g_block, g, rows[0]
  )  # Q_1 = P_0: no product with the identity.
  if len(rows) > 1:
    a_block, a = next_a(q_block, g, team.gather_rows(q_block, m))
    (q_block, a_block, a), _ = jax.lax.scan(
        step, (q_block, a_block, a), rows[1:-1]
    )
    q_block = _mm(
        q_block, team.gather_rows(poly(a_block, a, rows[-1]), m)
    )  # no last A
  return _mm(team.gather_rows(q_block, m), x)


def newton_schulz(
    x: jax.Array,
    ns_coeffs: CoefficientsLike = "jordan",
    *,
    ns_steps: int | None = None,
    compute_dtype: jnp.dtype | None = None,
    eps: float | None = None,
    preconditioning: str = "frobenius",
    method: str = "auto",
    gram_restart: int = GRAM_RESTART,
) -> jax.Array:
  """Approximates msign(x) = U·Vᴴ for every matrix in a batch.

  The iteration runs on the short side (x is transposed when rows > columns),
  starting from x scaled by ``preconditioning`` in float32. Complex matrices use
  conjugate transposes. A zero-size input is returned as it is.

  Args:
    x: array of shape ``(..., m, n)``; leading axes are a batch of independent
      matrices.
    ns_coeffs: a preset name, a triple, a table of triples, ``("polar_express",
      steps, ℓ)`` or an ``NSCoefficients`` (see ``resolve_coefficients``).
    ns_steps: number of NS steps; ``None`` takes the preset's own count.
    compute_dtype: dtype of the matrix products (e.g. ``jnp.bfloat16``);
      ``None`` keeps ``x.dtype``.
    eps: overrides the preset's epsilon in the normalization.
    preconditioning: how x is scaled before the first step: ``"frobenius"`` (the
      preset's normalization), ``"spectral"``, ``"aol"`` or ``"schatten"``, as
      in ``optax.contrib.muon`` (see ``PRECONDITIONINGS``).
    method: ``"standard"`` (X ← a·X + (b·A + c·A²)·X), ``"gram"`` (the same
      polynomial carried out on the m × m Gram matrix, restarted from X every
      ``gram_restart`` steps), or ``"auto"``: Gram where it needs fewer FLOPs
      (see ``uses_gram``).
    gram_restart: steps between Gram restarts (the Gram iteration drifts in
      float32 as singular values converge; a restart recomputes X = Q·X₀ and a
      fresh Gram matrix).

  Returns:
    An array of ``x``'s shape and dtype.

  Raises:
    ValueError: if ``x`` has fewer than 2 dimensions or is not floating point or
      complex, or the coefficients or options are invalid.

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (3, 16, 64))  # 3 matrices
    >>> y = optax_muon.newton_schulz(x, "polar_express", ns_steps=8)
    >>> s = jnp.linalg.svd(y, compute_uv=False)
    >>> bool(jnp.all(jnp.abs(s - 1) < 1e-3))
    True

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.

    Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their
    Application to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_,
    2025.

    Dao et al., `Gram Newton-Schulz: A Fast, Hardware-Aware Newton-Schulz
    Algorithm for Muon <https://tridao.me/blog/2026/gram-newton-schulz/>`_, 2026
    (iterating on X·Xᵀ, with restarts).

    Boissin et al., `Turbo-Muon <https://arxiv.org/abs/2512.04632>`_, 2025
    (AOL); Grishina et al., `Chebyshev-type polynomials for Newton-Schulz
    <https://arxiv.org/abs/2506.10935>`_, 2025 (Schatten-4 scaling).
  """
  table = resolve_coefficients(ns_coeffs, ns_steps, eps)
  if x.ndim < 2:
    raise ValueError(
        "newton_schulz expects an array of shape (..., m, n); got shape "
        f"{x.shape}."
    )
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise ValueError(
        "newton_schulz expects a floating-point or complex array; got "
        f"{x.dtype}."
    )
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(
        f"Unknown preconditioning {preconditioning!r}; expected one of "
        f"{PRECONDITIONINGS}."
    )
  if x.size == 0:
    return x
  _, transposed = ns_orientation(*x.shape[-2:])
  if transposed:
    x = jnp.swapaxes(x, -1, -2)
  x = orthogonalize_block(
      x,
      table,
      compute_dtype=compute_dtype,
      preconditioning=preconditioning,
      method=method,
      gram_restart=gram_restart,
  )
  return jnp.swapaxes(x, -1, -2) if transposed else x


def orthogonalize_block(
    x: jax.Array,
    table: NSCoefficients,
    *,
    team: Team = ONE,
    compute_dtype=None,
    preconditioning: str = "frobenius",
    method: str = "auto",
    gram_restart: int = GRAM_RESTART,
) -> jax.Array:
  """Newton–Schulz of canonical matrices (m ≤ n), each held by ``team`` in
  column blocks.

  Args:
    x: (..., m, n / k): this member's columns of each matrix (all of them for a
      team of one).
    table: the resolved coefficients.
    team: the devices holding the matrices' column blocks (``Team()``: one
      device).
    compute_dtype, preconditioning, method, gram_restart: as
      ``newton_schulz``'s.

  Returns:
    This member's columns of the result, in ``x``'s dtype.
  """
  out_dtype = x.dtype
  compute_dtype = jnp.dtype(compute_dtype or x.dtype)
  if jnp.issubdtype(out_dtype, jnp.complexfloating):
    compute_dtype = jnp.promote_types(compute_dtype, out_dtype)
  x, gram = _precondition(x, preconditioning, table.safety, table.eps, team)
  x = x.astype(compute_dtype)
  gram = None if gram is None else gram.astype(compute_dtype)
  rows = np.asarray(table.rows)
  m, n = x.shape[-2], x.shape[-1] * team.size
  if uses_gram(
      method, m, n, table.steps, gram_restart, compute_dtype, team.size
  ):
    for start in range(0, len(rows), gram_restart):
      x = _gram_iterations(
          x,
          rows[start : start + gram_restart],
          gram if start == 0 else None,
          team,
      )
  else:
    x = _ns_iterations(x, rows, gram, team)
  return x.astype(out_dtype)


def msign(x: jax.Array, *, rank_tol: float | None = None) -> jax.Array:
  """The exact polar factor U·Vᵀ by SVD: the reference Newton–Schulz
  approximates.

  Singular values below ``rank_tol·σ_max`` map to 0 (NS maps them there too), so
  the result is well defined for rank-deficient inputs.

  Args:
    x: array of shape ``(..., m, n)``.
    rank_tol: relative threshold; ``None`` uses ``max(m, n)·ε`` of the SVD
      dtype.

  Returns:
    U·diag(σ > tol)·Vᴴ in float32 or complex64 (64-bit types when x64 is enabled
    and ``x`` is 64-bit).

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> optax_muon.msign(jnp.array([[3.0, 0.0], [0.0, -0.5]]))
    Array([[ 1.,  0.],
           [ 0., -1.]], dtype=float32)
  """
  if x.ndim < 2:
    raise ValueError(
        f"msign expects an array of shape (..., m, n); got shape {x.shape}."
    )
  wide = jnp.promote_types(x.dtype, jnp.float32)
  u, s, vt = jnp.linalg.svd(x.astype(wide), full_matrices=False)
  if rank_tol is None:
    rank_tol = max(x.shape[-2:]) * float(jnp.finfo(wide).eps)
  keep = (s > rank_tol * s[..., :1]).astype(wide)
  return (u * keep[..., None, :]) @ vt
