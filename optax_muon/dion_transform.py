"""``scale_by_dion``: Dion's direction (low-rank power iteration with error feedback), and
``dion``: the full optimizer, routed, scaled and decayed exactly as ``muon``.

Dion replaces Newton–Schulz by one warm-started step of subspace iteration at rank r per
matrix (see ``dion_step``): it never needs a whole matrix on one device, and its collectives
carry O((m + n)·r) values per matrix. The leaves' routing, layouts and shardings come from
the same spec as Muon's (``spec.tree_spec``); no plan is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon import tree_utils
from optax_muon.alias import AdamBranch, check_alias_arguments, matrices_and_adam
from optax_muon.dion_step import OVERSAMPLE, DionMatrix, dion_step, initial_q, rank_of
from optax_muon.layout import is_dimension_numbers
from optax_muon.momentum import moment_dtype
from optax_muon.options import Routing, check_number, check_option
from optax_muon.qk_clipping import QKClip
from optax_muon.sharding import placement_of, zeros
from optax_muon.spec import MuonOptions, TreeSpec, report_options, tree_spec
from optax_muon.transform import branch_options, static_or_injected
from optax_muon.tree_utils import check_same_shapes
from optax_muon.user_warnings import OncePerTransformation


@dataclasses.dataclass(frozen=True)
class DionSettings:
  """What ``init`` reports for ``summarize``: the options shared with Muon, and Dion's own.

  Attributes:
    options: the routing, dimension numbers and shardings (as ``muon`` takes them).
    rank_fraction: the frozen per-leaf rank fractions.
    oversample: sketch rows per unit of rank.
    product_dtype: the dtype of the large products' operands, or None.
    power_iterations: subspace-iteration steps per optimizer step.
  """

  options: MuonOptions
  rank_fraction: Any
  oversample: float
  product_dtype: Any = None
  power_iterations: int = 1

  def matrices(self, spec: TreeSpec, tree: Any) -> list[DionMatrix]:
    """Each Muon leaf's ``DionMatrix`` (``spec`` built from ``options``)."""
    return _matrices(spec, tree, self.rank_fraction, self.oversample, self.product_dtype,
                     self.power_iterations)


class DionState(NamedTuple):
  """State of ``scale_by_dion``."""

  count: jax.Array  # shape=(), dtype=int32; steps taken.
  # The buffer B: the params' tree and shapes, float32 (float64 for float64 params).
  momentum: optax.Updates
  # The right factors Q: the params' tree; per leaf (batch…, n…, r) with n the long side's
  # axes (the NS orientation's columns), in the buffer's dtype.
  q: optax.Updates


def _is_fraction(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_fraction(value: Any, where: str) -> None:
  if not _is_fraction(value) or not 0 < value <= 1:
    raise ValueError(f"{where}: rank_fraction must be a number in (0, 1], got {value!r}.")


def _matrices(spec: TreeSpec, tree: Any, rank_fraction: Any, oversample: float,
              product_dtype: Any = None, power_iterations: int = 1) -> list[DionMatrix]:
  """Each Muon leaf's ``DionMatrix``, its rank from ``rank_fraction``.

  Raises:
    ValueError: for a complex leaf or a rank fraction outside (0, 1], naming the leaf.
  """
  if not spec.muon_positions:  # nothing to resolve a fraction for (an empty tree too)
    return []
  fractions = tree_utils.resolve_prefix(rank_fraction, tree, is_value=_is_fraction,
                                        what="rank_fraction")
  out = []
  for i in spec.muon_positions:
    leaf = spec.leaves[i]
    if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
      raise ValueError(f"{leaf.path}: Dion takes real matrices; got dtype {leaf.dtype} "
                       f"(shape {leaf.shape}). Route it to AdamW with `labels`.")
    fraction = 1.0 if fractions[i] is None else fractions[i]
    _check_fraction(fraction, leaf.path)
    out.append(DionMatrix.of(leaf.layout, leaf.sharding, rank_of(fraction, leaf.layout),
                             oversample, spec.manual, product_dtype, power_iterations))
  return out


def dion_direction(settings: DionSettings, beta: Any, seed: int,
                   warnings: OncePerTransformation | None = None
                   ) -> optax.GradientTransformationExtraArgs:
  """Dion's direction P·Qᵀ for every Muon leaf it receives.

  Args:
    settings: the static options (``settings.options.routing`` is applied by ``dion``'s
      partition, not here) and Dion's own; ``init`` reports them for ``summarize``.
    beta: μ; may be traced.
    seed: seeds Q's initial values and the sketches.
    warnings: where ``init`` issues the spec's warnings (``dion`` issues its own).
  """
  received = branch_options(settings.options)
  base = jax.random.key(seed)

  def init_fn(params):
    report_options(settings)
    spec = tree_spec(params, received)
    if warnings is not None:
      warnings.warn(spec.notices)
    leaves = spec.take(params)
    matrices = settings.matrices(spec, params)
    momentum, q = [], []
    for k, (x, leaf, matrix) in enumerate(zip(leaves, spec.muon_leaves, matrices)):
      dtype = moment_dtype(x.dtype)
      momentum.append(zeros(x.shape, dtype, placement_of(x, leaf.sharding), x))
      q.append(initial_q(matrix, jax.random.fold_in(base, k), dtype))
    return DionState(jnp.zeros([], jnp.int32), spec.put(params, momentum),
                     spec.put(params, q))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    check_same_shapes(updates, state.momentum, "the optimizer state (made from the params)")
    spec = tree_spec(updates, received)
    matrices = settings.matrices(spec, updates)
    count = optax.safe_increment(state.count)
    step_key = jax.random.fold_in(base, count)
    out, momentum, q = [], [], []
    triples = zip(spec.take(updates), spec.take(state.momentum), spec.take(state.q))
    for k, ((g, b, q_old), matrix) in enumerate(zip(triples, matrices)):
      if matrix.rank == 0:
        out.append(g)
        momentum.append(b)
        q.append(q_old)
        continue
      d, b, q_new = dion_step(g, b, q_old, beta, jax.random.fold_in(step_key, k), matrix)
      out.append(d.astype(g.dtype))
      momentum.append(b)
      q.append(q_new)
    return spec.put(updates, out), DionState(count, spec.put(state.momentum, momentum),
                                             spec.put(state.q, q))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _settings(options: MuonOptions, rank_fraction: Any, oversample: float, product_dtype: Any,
              power_iterations: Any) -> DionSettings:
  """``DionSettings`` from the user's arguments, checked.

  Raises:
    ValueError: for a rank fraction, product dtype or iteration count out of range.
  """
  return DionSettings(options, _freeze_fraction(rank_fraction), oversample,
                      _product_dtype(product_dtype), _power_iterations(power_iterations))


def _product_dtype(dtype: Any) -> Any:
  """``dtype`` as a NumPy dtype (None stays None).

  Raises:
    ValueError: for a dtype that is not a real floating-point one.
  """
  if dtype is None:
    return None
  try:
    resolved = jnp.dtype(dtype)
  except TypeError:
    resolved = None
  if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
    raise ValueError(f"product_dtype must be a floating-point dtype such as 'bfloat16' or "
                     f"None, got {dtype!r}.")
  return resolved


def _power_iterations(count: Any) -> int:
  """Raises: ValueError unless ``count`` is an int ≥ 1."""
  if isinstance(count, bool) or not isinstance(count, int) or count < 1:
    raise ValueError(f"power_iterations must be an int ≥ 1, got {count!r}.")
  return count


def _freeze_fraction(rank_fraction: Any) -> Any:
  if _is_fraction(rank_fraction):
    _check_fraction(rank_fraction, "rank_fraction")
  return tree_utils.freeze_prefix(rank_fraction, is_value=_is_fraction, what="rank_fraction")


def scale_by_dion(
    rank_fraction: Any = 1.0,
    beta: jax.typing.ArrayLike = 0.95,
    *,
    weight_dimension_numbers: Any = None,
    param_shardings: Any = None,
    oversample: float = OVERSAMPLE,
    seed: int = 0,
    product_dtype: jax.typing.DTypeLike | None = None,
    power_iterations: int = 1,
) -> optax.GradientTransformationExtraArgs:
  """Dion's direction: a rank-r orthonormal update by warm-started power iteration.

  Every array leaf it receives is a matrix (or a batch of them, under its dimension
  numbers). Per matrix, with G the gradient, B the buffer, Q the n × r right factor kept
  from the last step, and m × n the matrix in Newton–Schulz orientation (m ≤ n)::

    M = B + G;  P = orthonormalize(M·Q);  R = Mᵀ·P
    B ← M − (1 − μ)·P·Rᵀ;  Q ← R with unit columns;  update = P·Qᵀ

  ``orthonormalize`` is a randomized Cholesky-QR (an oversampled Gaussian sketch, then
  Cholesky-QR), stable on ill-conditioned P. At rank ``min(m, n)`` and a fixed gradient the
  update converges to Muon's U·Vᵀ. On sharded leaves every product runs on the local
  blocks; only P's and R's partial sums, r × r Grams and column norms cross devices.

  Args:
    rank_fraction: r as a fraction of min(m, n), in (0, 1] (rounded up, at least 1): one
      number, a tree or prefix tree of numbers (None entries: 1), or a callable
      ``params -> such a tree``.
    beta: μ, the momentum decay, in [0, 1).
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf, as ``scale_by_muon``'s;
      batch axes (stacked layers, experts) are independent matrices.
    param_shardings: the params' shardings on Auto meshes, as ``scale_by_muon``'s; on
      Explicit meshes the leaves' types carry them.
    oversample: sketch rows per unit of rank in the orthonormalization, at least 1.
    seed: seeds Q's initial values (per leaf) and the sketches (per step and leaf).
    product_dtype: the operands' dtype of the four m × n × r products (M·Q, Mᵀ·P, P·Rᵀ,
      P·Qᵀ), accumulated in the state's dtype: ``"bfloat16"`` runs them at the device's
      bfloat16 rate. None (default): the state's dtype at full precision. The
      orthonormalization always runs in the state's dtype.
    power_iterations: subspace-iteration steps per optimizer step (P = orth(M·R),
      R = Mᵀ·P, from R = Q), at least 1; Dion takes 1, more bring the update closer to the
      rank-r polar factor at twice the products and collectives per extra step.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a ``DionState``.

  Raises:
    ValueError: for options out of range (naming the argument), and at init/update for
      complex leaves, leaves that are not matrices or rank fractions out of range (naming
      the leaf).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> tx = optax_muon.scale_by_dion(rank_fraction=1.0)
    >>> params = {"w": jnp.zeros((16, 32))}
    >>> state = tx.init(params)
    >>> g = {"w": jnp.eye(16, 32) * 0.5 ** jnp.arange(16)[:, None]}  # σ = 1, 1/2, 1/4…
    >>> update = jax.jit(tx.update)
    >>> for _ in range(30):
    ...   u, state = update(g, state)
    >>> s = jnp.linalg.svd(u["w"], compute_uv=False)  # → U·Vᵀ: every σ = 1
    >>> bool(jnp.allclose(s, 1.0, atol=1e-3))
    True

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates
    <https://arxiv.org/abs/2504.05295>`_, 2025.
  """
  check_number("beta", beta, 0.0, 1.0)
  check_number("oversample", oversample, 1.0)
  options = MuonOptions(0, weight_dimension_numbers=weight_dimension_numbers,
                        param_shardings=param_shardings)
  return dion_direction(_settings(options, rank_fraction, oversample, product_dtype,
                                  power_iterations), beta, seed, OncePerTransformation())


def dion(
    learning_rate: optax.ScalarOrSchedule,
    rank_fraction: Any = 1.0,
    beta: jax.typing.ArrayLike = 0.95,
    eps: float | None = None,
    weight_decay: jax.typing.ArrayLike = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adam_b1: jax.typing.ArrayLike = 0.9,
    adam_b2: jax.typing.ArrayLike = 0.999,
    adam_eps_root: jax.typing.ArrayLike = 0.0,
    adam_weight_decay: jax.typing.ArrayLike = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: jax.typing.ArrayLike | None = None,
    scale: str | None = "jordan",
    routing: Routing | None = None,
    param_shardings: Any = None,
    adam_weight_decay_mask: Any = None,
    cautious_weight_decay: bool = False,
    qk_clip: QKClip | None = None,
    oversample: float = OVERSAMPLE,
    seed: int = 0,
    product_dtype: jax.typing.DTypeLike | None = None,
    power_iterations: int = 1,
) -> optax.GradientTransformationExtraArgs:
  """Dion for the network's matrices, AdamW (NAdamW with ``nesterov``) for the rest.

  Routed, shape-scaled and decayed exactly as ``muon`` (the same arguments mean the same
  things): only the matrices' direction differs, ``scale_by_dion``'s instead of Newton–
  Schulz's. Muon leaves: W ← W − η·(scale(n_in, n_out)·P·Qᵀ + λ·W).

  Args:
    learning_rate: the matrices' learning rate η, a scalar or an ``optax.Schedule``.
    rank_fraction: see ``scale_by_dion``.
    beta: μ, Dion's momentum decay, in [0, 1).
    eps: AdamW's epsilon (``None``: 1e-8).
    weight_decay, weight_decay_mask: λ for the matrices, and which are decayed.
    mu_dtype: AdamW's first moment's dtype (Dion's state is float32, float64 for float64
      params).
    nesterov: NAdamW rather than AdamW on the other leaves (Dion's momentum has no
      look-ahead).
    adam_b1, adam_b2, adam_eps_root, adam_weight_decay: AdamW's, as in ``muon``.
    adam_learning_rate, adam_weight_decay_mask: as in ``muon``.
    muon_weight_dimension_numbers, consistent_rms, scale, routing: as in ``muon``.
    param_shardings, cautious_weight_decay, qk_clip: as in ``muon``.
    oversample, seed, product_dtype, power_iterations: see ``scale_by_dion``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose matrix branch's state is a
    ``DionState``.

  Raises:
    ValueError: for invalid options (naming the argument), and at ``init`` for routing
      trees that don't match the params, complex matrices or rank fractions out of range
      (naming the leaf).

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> params = {"embed": jnp.zeros((100, 16)), "w": jnp.zeros((16, 16)),
    ...           "b": jnp.zeros(16)}
    >>> tx = optax_muon.dion(0.02, rank_fraction=0.25, adam_learning_rate=3e-3)
    >>> state = tx.init(params)
    >>> state.inner_states["muon"].inner_state[0].q["w"].shape  # Q: 16 × r, r = 4
    (16, 4)

  References:
    Ahn et al., `Dion: Distributed Orthonormalized Updates
    <https://arxiv.org/abs/2504.05295>`_, 2025.
  """
  check_number("beta", beta, 0.0, 1.0)
  check_number("oversample", oversample, 1.0)
  check_alias_arguments(learning_rate=learning_rate, adam_learning_rate=adam_learning_rate,
                        adam_b1=adam_b1, adam_b2=adam_b2, weight_decay=weight_decay,
                        adam_weight_decay=adam_weight_decay, scale=scale,
                        consistent_rms=consistent_rms)
  options = MuonOptions(
      0, weight_dimension_numbers=tree_utils.freeze_prefix(
          muon_weight_dimension_numbers, is_value=is_dimension_numbers,
          what="muon_weight_dimension_numbers"),
      param_shardings=param_shardings,
      routing=check_option("routing", routing, Routing, Routing()), scale=scale,
      consistent_rms=static_or_injected(consistent_rms),
      cautious_weight_decay=cautious_weight_decay,
      qk_clip=check_option("qk_clip", qk_clip, QKClip))
  direction = dion_direction(_settings(options, rank_fraction, oversample, product_dtype,
                                       power_iterations), beta, seed)
  return matrices_and_adam(
      direction, options, learning_rate=learning_rate, consistent_rms=consistent_rms,
      weight_decay=weight_decay, weight_decay_mask=weight_decay_mask,
      adam=AdamBranch(adam_learning_rate, adam_b1, adam_b2, eps, adam_eps_root,
                      adam_weight_decay, adam_weight_decay_mask, mu_dtype, nesterov),
      keep=DionState)
