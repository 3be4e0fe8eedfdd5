"""``scale_by_dion``: Dion's direction (low-rank power iteration with error
feedback).

Dion replaces Newton–Schulz by one warm-started step of subspace iteration at
rank r per matrix (see ``dion.step``): it never needs a whole matrix on one
device, and its collectives carry O((m + n)·r) values per matrix; with
``replica_axes`` data-parallel replicas sync those factors instead of their
gradients. The leaves' routing, layouts and shardings come from the same spec as
Muon's (``core.spec.tree_spec``); no plan is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.core.dtypes import moment_dtype
from optax_muon._src.core.options import check_number
from optax_muon._src.core.replicas import (
    check_replica_count,
    without_replica_axis,
)
from optax_muon._src.core.reporting import report
from optax_muon._src.core.sharding import manual_axes
from optax_muon._src.core.spec import TreeOptions, branch_options, tree_spec
from optax_muon._src.core.tree_utils import check_same_shapes
from optax_muon._src.core.user_warnings import OncePerTransformation
from optax_muon._src.dion.report import DionReport
from optax_muon._src.dion.settings import DionSettings, make_settings
from optax_muon._src.dion.step import initial_momentum, initial_q, run_step


class DionState(NamedTuple):
  """State of ``scale_by_dion``."""

  count: jax.Array  # shape=(), dtype=int32; steps taken.
  # The buffer B: the params' tree and shapes, float32 (float64 for float64
  # params).
  momentum: optax.Updates
  # The right factors Q: the params' tree; per leaf (batch…, n…, r) with n the
  # long side's axes (the NS orientation's columns), in the buffer's dtype.
  q: optax.Updates


class DionReplicaState(NamedTuple):
  """State of ``scale_by_dion`` with ``replica_axes``: a buffer per replica for
  the matrices whose replicas sync only rank-r factors.

  ``average_replicas`` turns it into the ``DionState`` of Dion on averaged
  gradients (a checkpoint that restores onto any replica count).
  """

  count: jax.Array  # shape=(), dtype=int32; steps taken.
  # The buffer B of each matrix whose gradient is averaged over the replicas
  # (the same on every replica), shaped like its param; ``optax.MaskedNode``
  # for the others.
  momentum: optax.Updates
  # The buffers Bᵢ of the other matrices, one per replica: (replicas, *param
  # shape), split over the replica axes; ``optax.MaskedNode`` elsewhere.
  replica_momentum: optax.Updates
  # The right factors Q, as in ``DionState`` (the same on every replica).
  q: optax.Updates


def _buffers(state: Any, spec: Any, matrices: list) -> list[Any]:
  """Each matrix leaf's buffer, in spec order."""
  if not isinstance(state, DionReplicaState):
    return spec.take(state.momentum)
  shared, own = spec.take(state.momentum), spec.take(state.replica_momentum)
  return [
      b if not mx.compressed else r for mx, b, r in zip(matrices, shared, own)
  ]


def _state(state_type, count, tree, spec, matrices, buffers, qs):
  """The new state, each buffer in its field."""
  if state_type is DionState:
    return DionState(count, spec.put(tree, buffers), spec.put(tree, qs))
  masked = optax.MaskedNode()
  shared = [masked if mx.compressed else b for mx, b in zip(matrices, buffers)]
  own = [b if mx.compressed else masked for mx, b in zip(matrices, buffers)]
  return DionReplicaState(
      count, spec.put(tree, shared), spec.put(tree, own), spec.put(tree, qs)
  )


def dion_direction(
    settings: DionSettings,
    beta: Any,
    seed: int,
    warnings: OncePerTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Dion's direction P·Qᵀ for every Muon leaf it receives.

  Args:
    settings: the static options (``settings.options.routing`` is applied by
      ``dion``'s partition, not here) and Dion's own; ``init`` reports them for
      ``summarize``.
    beta: μ; may be traced.
    seed: seeds Q's initial values.
    warnings: where ``init`` issues the spec's warnings (``dion`` issues its
      own).
  """
  received = branch_options(settings.options)
  base = jax.random.key(seed)
  replica_axes = settings.replica_axes
  state_type = DionReplicaState if replica_axes else DionState

  def init_fn(params):
    report(DionReport(settings))
    spec = tree_spec(params, received)
    if warnings is not None:
      warnings.warn(spec.notices)
    manual = manual_axes()
    matrices = settings.matrices(spec, params)
    momentum, q = [], []
    for k, (x, matrix) in enumerate(zip(spec.take(params), matrices)):
      dtype = moment_dtype(x.dtype)
      momentum.append(initial_momentum(matrix, x.shape, dtype, manual))
      q.append(initial_q(matrix, jax.random.fold_in(base, k), dtype, manual))
    return _state(
        state_type,
        jnp.zeros([], jnp.int32),
        params,
        spec,
        matrices,
        momentum,
        q,
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if not isinstance(state, state_type):
      raise ValueError(
          f"scale_by_dion{' with replica_axes' if replica_axes else ''} takes"
          f" a {state_type.__name__}, got a {type(state).__name__}"
          + (
              ": lay an averaged checkpoint out for the replicas with"
              " optax_muon.average_replicas(restored, like=tx.init(params))."
              if replica_axes
              else "."
          )
      )
    view = without_replica_axis(updates, replica_axes)
    spec = tree_spec(view, received)
    matrices = settings.matrices(spec, view)
    buffers = _buffers(state, spec, matrices)
    check_same_shapes(
        view,
        spec.put(
            view,
            [
                jax.ShapeDtypeStruct(b.shape[mx.compressed :], b.dtype)
                for mx, b in zip(matrices, buffers)
            ],
        ),
        "the optimizer state (made from the params)",
    )
    check_replica_count(updates, replica_axes, spec.mesh)
    count = optax.safe_increment(state.count)
    live = [k for k, mx in enumerate(matrices) if mx.rank]
    pick = lambda xs: [xs[k] for k in live]
    grads, qs = spec.take(updates), spec.take(state.q)
    directions, momenta, new_qs = run_step(
        pick(matrices),
        pick(grads),
        pick(buffers),
        pick(qs),
        beta,
        manual_axes(),
    )
    out = list(grads) if not replica_axes else [None] * len(grads)
    for j, k in enumerate(live):
      out[k] = directions[j].astype(grads[k].dtype)
      buffers[k], qs[k] = momenta[j], new_qs[j]
    for k in range(len(out)):  # empty leaves: nothing to orthogonalize
      if out[k] is None:
        out[k] = jnp.zeros(spec.muon_leaves[k].shape, grads[k].dtype)
    return spec.put(view, out), _state(
        state_type, count, view, spec, matrices, buffers, qs
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_dion(
    rank_fraction: Any = 1.0,
    beta: jax.typing.ArrayLike = 0.95,
    *,
    weight_dimension_numbers: Any = None,
    param_shardings: Any = None,
    seed: int = 0,
    product_dtype: jax.typing.DTypeLike | str | None = "auto",
    power_iterations: int = 1,
    replica_axes: str | Sequence[str] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Dion's direction: a rank-r orthonormal update by warm-started power
  iteration.

  Every array leaf it receives is a matrix (or a batch of them, under its
  dimension numbers). Per matrix, with G the gradient, B the buffer, Q the n × r
  right factor kept from the last step, and m × n the matrix in Newton–Schulz
  orientation (m ≤ n)::

    M = B + G;  P = orthonormalize(M·Q);  R = Mᵀ·P
    B ← M − (1 − μ)·P·Rᵀ;  Q ← R with unit columns;  update = P·Qᵀ

  ``orthonormalize`` is a shifted Cholesky-QR in three passes (the first
  shifted so that it succeeds on any P, the next two plain), stable on
  ill-conditioned P: it gives P's Gram–Schmidt basis. At rank ``min(m, n)`` and
  a fixed gradient the update converges to Muon's U·Vᵀ. On sharded leaves every
  product runs on the local blocks, and what crosses devices is P's and R's
  partial sums, P's rows (an all-to-all gives each device whole P's of its
  share of the matrices to orthonormalize, and back; or, at low rank on few row
  shards, the r × r Gram matrices are summed instead), column norms, and Q,
  which lies split over the param's row and column axes (n·r / (row shards ·
  column shards) values per device), all-gathered over the row axes.

  With ``replica_axes`` (data parallelism: the mesh axes along which the params
  are replicated) the update takes each replica's own gradient and keeps a
  buffer per replica (``DionReplicaState``); for matrices where (m + n)·r < m·n
  only P's and R's sums cross the replica axes (averaged, so the update equals
  Dion's on the replicas' mean gradient), for the others the gradient is
  averaged. Under ``jax.jit`` each gradient leaf is ``(replicas, *param_shape)``
  (``optax_muon.per_replica`` makes them); inside a ``shard_map`` over the
  replica axes a device passes its replica's own gradient.

  Args:
    rank_fraction: r as a fraction of min(m, n), in (0, 1] (rounded up, at least
      1): one number, a tree or prefix tree of numbers (None entries: 1), or a
      callable ``params -> such a tree``.
    beta: μ, the momentum decay, in [0, 1).
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf, as
      ``scale_by_muon``'s; batch axes (stacked layers, experts) are independent
      matrices.
    param_shardings: the params' shardings on Auto meshes, as
      ``scale_by_muon``'s; on Explicit meshes the leaves' types carry them.
    seed: seeds Q's initial values (per leaf).
    product_dtype: the operands' dtype of the four m × n × r products (M·Q,
      Mᵀ·P, P·Rᵀ, P·Qᵀ), accumulated in the state's dtype: ``"bfloat16"`` runs
      them at the device's bfloat16 rate; None: the state's dtype at full
      precision; ``"auto"`` (default): bfloat16 on TPUs and GPUs, None
      elsewhere (as Muon's ``NSOptions.compute_dtype``). The orthonormalization
      runs in the state's dtype: at full precision, or on TPUs with 16-bit
      products at ``Precision.HIGH`` (three bfloat16 passes, about 1e-5).
    power_iterations: subspace-iteration steps per optimizer step (P =
      orth(M·R), R = Mᵀ·P, from R = Q), at least 1; Dion takes 1, more bring the
      update closer to the rank-r polar factor at twice the products and
      collectives per extra step.
    replica_axes: the data-parallel mesh axis name(s) whose replicas sync only
      rank-r factors (see above); None: the gradients arrive averaged.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a ``DionState``
    (a ``DionReplicaState`` with ``replica_axes``).

  Raises:
    ValueError: for options out of range (naming the argument), and at
      init/update for complex leaves, leaves that are not matrices, rank
      fractions out of range, or gradients without their replica axis (naming
      the leaf).

  Examples:
    >>> import jax, jax.numpy as jnp, optax_muon
    >>> tx = optax_muon.scale_by_dion(rank_fraction=1.0)
    >>> params = {"w": jnp.zeros((16, 32))}
    >>> state = tx.init(params)
    >>> # σ = 1, 1/2, 1/4…
    >>> g = {"w": jnp.eye(16, 32) * 0.5 ** jnp.arange(16)[:, None]}
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
  options = TreeOptions(
      weight_dimension_numbers=weight_dimension_numbers,
      param_shardings=param_shardings,
  )
  return dion_direction(
      make_settings(
          options,
          rank_fraction,
          product_dtype,
          power_iterations,
          replica_axes,
      ),
      beta,
      seed,
      OncePerTransformation(),
  )
