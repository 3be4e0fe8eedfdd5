"""``scale_by_muon``: momentum → Newton–Schulz → (NorMuon) → (⟨n, O⟩);
``muon``'s Muon branch chains it with ``scale_by_shape`` (``core.scaling``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_muon._src.core.dtypes import moment_dtype
from optax_muon._src.core.options import check_number, check_option
from optax_muon._src.core.reporting import report
from optax_muon._src.core.scaling import dual_norm_scale
from optax_muon._src.core.sharding import placement_of, zeros
from optax_muon._src.core.spec import branch_options
from optax_muon._src.core.tree_utils import check_same_shapes
from optax_muon._src.core.user_warnings import OncePerTransformation
from optax_muon._src.muon.coefficients import (
    CoefficientsLike,
    NSCoefficients,
    resolve_coefficients,
)
from optax_muon._src.muon.executor import orthogonalize
from optax_muon._src.muon.momentum import momentum_step
from optax_muon._src.muon.newton_schulz import (
    PRECONDITIONINGS,
    orthogonalize_block,
)
from optax_muon._src.muon.normuon import init_moment, normalize_neurons
from optax_muon._src.muon.options import (
    MOMENTUM_KINDS,
    MuonOptions,
    NorMuon,
    NSOptions,
)
from optax_muon._src.core.options import ShardingOptions
from optax_muon._src.muon.report import MuonReport
from optax_muon._src.muon.spec import muon_tree_spec


class MuonState(NamedTuple):
  """State of ``scale_by_muon``: ``optax.contrib.MuonState``'s fields, shapes
  and dtypes, so that a checkpoint of either restores into the other."""

  count: jax.Array  # shape=(), dtype=int32; steps taken.
  # The momentum: the params' tree and shapes; dtype mu_dtype if given, else the
  # params' (float32 for 16-bit params).
  mu: optax.Updates
  # The NS coefficients as given: shape=(3,) for an (a, b, c) triple or a
  # one-triple preset ("jordan", "standard"), else shape=(steps, 3), the rows
  # run; the default float dtype. Kept as optax.contrib keeps it; NS runs with
  # the schedule fixed when the transformation is built.
  ns_coeffs: jax.Array


class NorMuonState(NamedTuple):
  """State of ``scale_by_muon`` with ``normalization=NorMuon()``:
  ``MuonState``'s fields, then NorMuon's second moments."""

  count: jax.Array  # shape=(), dtype=int32; steps taken.
  mu: optax.Updates  # as ``MuonState.mu``.
  ns_coeffs: jax.Array  # as ``MuonState.ns_coeffs``.
  # Per-neuron second moments: the params' tree, each leaf's shape with its
  # input axes 1, float32 (float64 for float64 leaves).
  nu: optax.Updates


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class MuonHyperparams:
  """The values of Muon's direction that the spec does not read (``MuonOptions``
  holds those). Only ``beta`` may be an array (``optax.inject_hyperparams``
  passes its hyperparameters as arrays); the rest are Python values, fixed when
  the transformation is built.

  Attributes:
    coefficients: the resolved NS schedule.
    stored_coefficients: what the state's ``ns_coeffs`` holds (see
      ``MuonState``), as nested tuples of floats.
    preconditioning: the scaling before the first NS step.
    beta: the momentum decay.
    momentum: ``"ema"``, ``"ema_uncorrected"`` or ``"sum"``.
    nesterov: the Nesterov look-ahead.
    mu_dtype: the momentum's dtype, or None.
    adaptive: multiply by ⟨n, NS(n)⟩.
  """

  coefficients: NSCoefficients
  stored_coefficients: tuple
  preconditioning: str = "frobenius"
  beta: Any = 0.95
  momentum: str = "ema"
  nesterov: bool = True
  mu_dtype: Any = None
  adaptive: bool = False


def muon_direction(
    options: MuonOptions,
    hyper: MuonHyperparams,
    warnings: OncePerTransformation | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Muon's direction for every leaf it receives: momentum, NS, NorMuon, ⟨n, O⟩,
  in order.

  ``options.routing`` is not applied here (``muon`` routes with
  ``optax.partition``); ``init`` reports ``options`` whole, so that
  ``summarize`` can show the routing, and issues the spec's warnings through
  ``warnings`` (``muon`` issues its own).
  """
  received = branch_options(options)
  ns = functools.partial(
      orthogonalize_block,
      table=hyper.coefficients,
      preconditioning=hyper.preconditioning,
      method=options.ns.method,
      gram_restart=options.ns.gram_restart,
  )

  def init_fn(params):
    report(MuonReport(options))
    spec = muon_tree_spec(
        params, received
    )  # validates every leaf now, not at the first update
    if warnings is not None:
      warnings.warn(spec.notices)
    leaves, muon = spec.take(params), spec.muon_leaves
    placements = [
        placement_of(x, leaf.sharding) for x, leaf in zip(leaves, muon)
    ]
    mu = [
        zeros(x.shape, moment_dtype(x.dtype, hyper.mu_dtype), where, x)
        for x, where in zip(leaves, placements)
    ]
    count = jnp.zeros([], jnp.int32)
    mu = spec.put(params, mu)
    ns_coeffs = jnp.asarray(hyper.stored_coefficients)
    if options.normalization is None:
      return MuonState(count, mu, ns_coeffs)
    return NorMuonState(
        count,
        mu,
        ns_coeffs,
        spec.put(
            params,
            [
                init_moment(
                    x.shape,
                    leaf.layout.reduction_axes,
                    moment_dtype(jnp.finfo(x.dtype).dtype),
                    where,
                    x,
                )
                for x, leaf, where in zip(leaves, muon, placements)
            ],
        ),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    check_same_shapes(
        updates, state.mu, "the optimizer state (made from the params)"
    )
    spec = muon_tree_spec(updates, received)
    muon, grads = spec.muon_leaves, spec.take(updates)
    count = optax.safe_increment(state.count)
    # 1. Momentum, and the NS input n = n_scale·n'.
    mu, n, n_scale = momentum_step(
        grads,
        spec.take(state.mu),
        count,
        hyper.beta,
        hyper.momentum,
        hyper.nesterov,
    )
    # 2. Orthogonalize: O = NS(n'), each whole matrix on one device.
    o = orthogonalize(
        n, spec, functools.partial(ns, compute_dtype=spec.ns.compute_dtype)
    )
    state = state._replace(count=count, mu=spec.put(state.mu, mu))
    # 3. Normalize (NorMuon): per output neuron.
    if options.normalization is not None:
      pairs = [
          normalize_neurons(
              x, v, options.normalization.beta, leaf.layout, leaf.sharding
          )
          for x, v, leaf in zip(o, spec.take(state.nu), muon)
      ]
      o = [x for x, _ in pairs]
      state = state._replace(nu=spec.put(state.nu, [v for _, v in pairs]))
    # 4. Scale by ⟨n, O⟩ with ``adaptive`` (the shape factor is
    # ``scale_by_shape``'s).
    if hyper.adaptive:
      o = [
          n_scale * dual_norm_scale(x, y, leaf.sharding) * x
          for x, y, leaf in zip(o, n, muon)
      ]
    out = [x.astype(g.dtype) for x, g in zip(o, grads)]
    return spec.put(updates, out), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def muon_hyperparams(
    ns_coeffs: CoefficientsLike,
    ns_steps: int | None,
    beta: Any,
    eps: Any,
    mu_dtype: Any,
    *,
    nesterov: bool,
    adaptive: bool,
    preconditioning: str,
    momentum: str,
) -> MuonHyperparams:
  """Checks the arguments ``scale_by_muon`` and ``muon`` share; returns them
  resolved (the NS schedule, and what the state stores of it).

  Raises:
    ValueError: naming the argument.
  """
  for name, value in (("ns_steps", ns_steps), ("eps", eps)):
    if isinstance(value, jax.core.Tracer):
      raise ValueError(
          f"{name} is traced, but it fixes the Newton–Schulz schedule when the"
          " optimizer is built. optax.inject_hyperparams turns numbers into"
          " arrays: name it static, optax.inject_hyperparams(optax_muon.muon,"
          " static_args=('ns_steps', 'eps'))(...)."
      )
  check_number("beta", beta, 0.0, 1.0)
  check_number("eps", eps, 0.0)
  if momentum not in MOMENTUM_KINDS:
    raise ValueError(
        f"momentum must be one of {MOMENTUM_KINDS}, got {momentum!r}."
    )
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(
        f"preconditioning must be one of {PRECONDITIONINGS}, got "
        f"{preconditioning!r}."
    )
  coefficients = resolve_coefficients(ns_coeffs, ns_steps, eps)
  return MuonHyperparams(
      coefficients=coefficients,
      stored_coefficients=(
          coefficients.rows[0]
          if _is_one_triple(ns_coeffs)
          else coefficients.rows
      ),
      preconditioning=preconditioning,
      beta=beta,
      momentum=momentum,
      nesterov=nesterov,
      mu_dtype=mu_dtype,
      adaptive=adaptive,
  )


def _is_one_triple(ns_coeffs: CoefficientsLike) -> bool:
  """Whether ``ns_coeffs`` names one (a, b, c) triple (repeated every step):
  a triple, or a preset whose table is one triple."""
  if isinstance(ns_coeffs, NSCoefficients):
    return False
  if isinstance(ns_coeffs, str):
    return len(set(resolve_coefficients(ns_coeffs).rows)) == 1
  if (
      isinstance(ns_coeffs, tuple)
      and ns_coeffs
      and isinstance(ns_coeffs[0], str)
  ):  # ("polar_express", steps, lower_bound)
    return False
  return np.shape(ns_coeffs) == (3,)


def scale_by_muon(
    ns_coeffs: CoefficientsLike = "jordan",
    ns_steps: int | None = None,
    beta: jax.typing.ArrayLike = 0.95,
    eps: float | None = None,
    mu_dtype: jax.typing.DTypeLike | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers: Any = None,
    momentum: str = "ema",
    ns_options: NSOptions | None = None,
    normalization: NorMuon | None = None,
    param_shardings: Any = None,
    sharding: ShardingOptions | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Muon's direction: orthogonalized momentum.

  Takes every argument of ``optax.contrib.scale_by_muon``, in its order and with
  its meaning (no shape factor: chain ``scale_by_shape`` for it, as ``muon``
  does); the options after ``weight_dimension_numbers`` are this package's.
  Every array leaf it receives is orthogonalized (use ``muon`` or
  ``optax.partition`` to route other leaves elsewhere). Per leaf, with g the
  gradient::

    m ← β·m + (1−β)·g;  n = (1−β)·g + β·m   (Nesterov; n = m without)
    O = NS(n)                               (each whole matrix on one device)
    O ← NorMuon(O)                          (with ``normalization=NorMuon()``)
    update = O  (· ⟨n, O⟩ with ``adaptive``)

  Args:
    ns_coeffs: NS coefficients: a preset name (``"jordan"`` = optax's
      ``"standard"``, ``"polar_express"``, ``"deepseek_v4"``, ``"dion"``,
      ``"modded_nanogpt"``), an ``(a, b, c)`` triple, a table of triples (see
      ``resolve_coefficients``).
    ns_steps: NS steps; ``None`` takes the preset's own count.
    beta: momentum decay, in [0, 1).
    eps: overrides the preset's normalization epsilon.
    mu_dtype: dtype of the stored momentum; ``None`` keeps the params' dtype,
      except float32 for 16-bit params.
    nesterov: use the Nesterov look-ahead.
    adaptive: multiply each leaf's update by ⟨n, NS(n)⟩ = Σ conj(n)·NS(n) (the
      dual-norm scaling of Bernstein & Newhouse; per leaf, as
      ``optax.contrib``).
    preconditioning: the scaling before the first NS step: ``"frobenius"``,
      ``"spectral"``, ``"aol"`` or ``"schatten"`` (see ``newton_schulz``).
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf: a tree, prefix
      tree, single value or callable ``updates -> tree``; ``None`` entries mean
      a plain 2-D ``x @ W`` matrix.
    momentum: ``"ema"`` (optax.contrib: bias-corrected), ``"ema_uncorrected"``
      (KellerJordan/Muon's reference) or ``"sum"`` (Moonlight, DeepSeek-V4); see
      ``optax_muon._src.muon.momentum``.
    ns_options: how NS runs (``NSOptions``: compute dtype, method, Gram
      restarts).
    normalization: ``NorMuon(beta)`` for NorMuon, or None. The state is then
      a ``NorMuonState``: ``MuonState``'s fields, and NorMuon's second moments
      ``nu``.
    param_shardings: for Auto meshes and ``shard_map`` train steps, the params'
      shardings: a tree or prefix tree of ``NamedSharding`` or ``PartitionSpec``
      (resolved against the mesh set with ``jax.set_mesh``), as a pure dict, an
      ``nnx.State``, the output of ``nnx.get_named_sharding`` or of linen's
      ``nn.get_sharding`` / ``nn.logical_to_mesh_sharding``. On Explicit meshes
      the leaves' types carry their shardings and this may stay ``None``.
      Sharded leaves are orthogonalized by the plan: each matrix on one device,
      or on a team of devices where the cost model says it pays.
    sharding: how sharded matrices are exchanged (``ShardingOptions``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a ``MuonState``
    (``optax.contrib.scale_by_muon``'s fields, shapes and dtypes), or a
    ``NorMuonState`` with ``normalization``.

  Raises:
    ValueError: for unknown or out-of-range options (naming the argument), and
      (at init/update) for leaves Muon cannot take (naming the leaf).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_muon
    >>> params = {"w": jnp.zeros((16, 64))}
    >>> tx = optax.chain(
    ...     optax_muon.scale_by_muon(ns_coeffs="polar_express", ns_steps=8),
    ...     optax_muon.scale_by_shape(),
    ...     optax.scale_by_learning_rate(0.02))
    >>> state = tx.init(params)
    >>> grads = {"w": jax.random.normal(jax.random.PRNGKey(0), (16, 64))}
    >>> updates, state = tx.update(grads, state, params)
    >>> # all 0.02·sqrt(64/16)
    >>> s = jnp.linalg.svd(updates["w"], compute_uv=False)
    >>> bool(jnp.allclose(s, 0.04, rtol=1e-3))
    True

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.

    Bernstein & Newhouse, `Old Optimizer, New Norm: An Anthology
    <https://arxiv.org/abs/2409.20325>`_, 2024.

    Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their
    Application to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_,
    2025.
  """
  hyper = muon_hyperparams(
      ns_coeffs,
      ns_steps,
      beta,
      eps,
      mu_dtype,
      nesterov=nesterov,
      adaptive=adaptive,
      preconditioning=preconditioning,
      momentum=momentum,
  )
  options = MuonOptions(
      ns_steps=hyper.coefficients.steps,
      ns=check_option("ns_options", ns_options, NSOptions, NSOptions()),
      weight_dimension_numbers=weight_dimension_numbers,
      param_shardings=param_shardings,
      sharding=check_option(
          "sharding", sharding, ShardingOptions, ShardingOptions()
      ),
      normalization=check_option("normalization", normalization, NorMuon),
  )
  return muon_direction(options, hyper, OncePerTransformation())
