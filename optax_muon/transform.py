"""``scale_by_muon``: momentum → Newton–Schulz → shape-dependent scale, for ``optax.chain``."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon import tree_utils
from optax_muon.coefficients import CoefficientsLike, resolve_coefficients
from optax_muon.distributed import orthogonalize
from optax_muon.layout import (SCALE_KINDS, MatrixLayout, make_layout,
                               resolve_dimension_numbers, scale_factor)
from optax_muon.newton_schulz import GRAM_RESTART
from optax_muon.orthogonalize import NSOptions
from optax_muon.plan import Plan, build_plan, validate_options
from optax_muon.sharding import (LeafSharding, dim_axes_of, leaf_shardings,
                                 resolve_param_shardings)

MOMENTUM_KINDS = ("ema", "sum")


class MuonState(NamedTuple):
  """State of ``scale_by_muon``."""

  count: jax.Array  # shape=(), dtype=int32; steps taken.
  mu: optax.Updates  # the momentum; the params' tree and shapes, dtype mu_dtype or theirs.


@dataclasses.dataclass(frozen=True)
class MuonConfig:
  """Everything ``scale_by_muon`` was configured with; the update, ``summarize`` and
  ``diagnostics`` all read it.

  Attributes:
    ns: the Newton–Schulz options.
    scale: the update-scale kind (see ``layout.scale_factor``).
    rms_scale: the ``"rms"`` constant.
    deepseek_gamma: the ``"deepseek"`` γ.
    weight_dimension_numbers: as passed to ``scale_by_muon``.
    param_shardings: as passed to ``scale_by_muon``.
    replica_policy: ``"split"`` or ``"redundant"`` (see ``plan``).
    wire_dtype: dtype of the all-to-all buffers; ``None`` keeps the leaves'.
    exchange: ``"group"`` or ``"bucket"`` (see ``plan.Plan``).
  """

  ns: NSOptions
  scale: str | None
  rms_scale: Any
  deepseek_gamma: Any
  weight_dimension_numbers: Any
  param_shardings: Any = None
  replica_policy: str = "split"
  wire_dtype: Any = None
  exchange: str = "group"

  def layouts(self, tree: Any, selected: list[bool] | None = None
              ) -> list[MatrixLayout | None]:
    """The layout of every array leaf of ``tree``.

    Args:
      tree: params or updates.
      selected: per position, whether the leaf is a Muon leaf; ``None`` selects every
        array leaf.

    Returns:
      A list aligned with ``tree_utils.flatten_positions(tree)``; None where not selected
      or at placeholders.
    """
    positions, _ = tree_utils.flatten_positions(tree)
    dims = resolve_dimension_numbers(self.weight_dimension_numbers, tree,
                                     "weight_dimension_numbers")
    if selected is None:
      selected = [tree_utils.is_array_leaf(leaf) for _, leaf in positions]
    return [make_layout(tree_utils.path_str(path), leaf, d) if keep else None
            for (path, leaf), d, keep in zip(positions, dims, selected)]

  def factor(self, layout: MatrixLayout):
    return scale_factor(layout.n_in, layout.n_out, self.scale, rms_scale=self.rms_scale,
                        deepseek_gamma=self.deepseek_gamma)

  def plan(self, layouts: list[MatrixLayout], typed: list[Any], given: list[Any] | None
           ) -> Plan:
    """The plan of the Muon leaves ``layouts`` (unsharded ones get the trivial plan).

    Args:
      layouts: Muon leaves' global layouts.
      typed: their typed shardings (``jax.typeof(x).sharding``) or None.
      given: their ``param_shardings`` entries, or None.

    Returns:
      The ``Plan``, with ``plan.leaves`` in the order of ``layouts``.
    """
    shardings = leaf_shardings([l.shape for l in layouts], typed, [l.path for l in layouts],
                               given)
    return build_plan(layouts, shardings, self.ns, self.replica_policy, self.exchange,
                      self.wire_dtype)

  def orthogonalize(self, xs: list[jax.Array], layouts: list[MatrixLayout],
                    given: list[Any] | None, manual: bool) -> list[jax.Array]:
    """NS of every Muon leaf, by the plan.

    Args:
      xs: the NS inputs (global arrays, or local blocks when ``manual``).
      layouts: their global layouts.
      given: their ``param_shardings`` entries, or None.
      manual: inside a ``shard_map`` (``xs`` are local blocks).
    """
    typed = [None if manual else getattr(jax.typeof(x), "sharding", None) for x in xs]
    return orthogonalize(xs, self.plan(layouts, typed, given), manual)


class MuonTransformation(optax.GradientTransformationExtraArgs):
  """An optax transformation that also carries how it treats each leaf.

  Attributes:
    muon_config: the ``MuonConfig`` of its Muon part.
    muon_router: ``params -> list[Route]`` for ``muon``; ``None`` for ``scale_by_muon``,
      which orthogonalizes every leaf it is given.
  """

  muon_config: MuonConfig
  muon_router: Any


def with_config(tx: optax.GradientTransformation, config: MuonConfig,
                router: Any = None) -> MuonTransformation:
  out = MuonTransformation(tx.init, tx.update)
  out.muon_config = config
  out.muon_router = router
  return out


def _inside_shard_map() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and bool(mesh.manual_axes)


def _global_shapes(tree: Any, given: list[Any] | None) -> Any:
  """Inside ``shard_map`` the leaves are local blocks: their global shapes, as structs."""
  if given is None:
    raise ValueError("optax_muon: inside shard_map the leaves are local blocks; pass "
                     "param_shardings so that Muon knows each leaf's global shape and mesh.")
  positions, treedef = tree_utils.flatten_positions(tree)
  out = []
  for (path, leaf), sharding in zip(positions, given):
    if not tree_utils.is_array_leaf(leaf) or sharding is None:
      out.append(leaf)
      continue
    local = LeafSharding(sharding.mesh, dim_axes_of(sharding.spec, leaf.ndim))
    out.append(jax.ShapeDtypeStruct(local.global_shape(leaf.shape), leaf.dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def _zeros_like(x, dtype):
  if isinstance(x, jax.ShapeDtypeStruct):
    return jnp.zeros(x.shape, dtype or x.dtype, device=x.sharding)
  return jnp.zeros_like(x, dtype=dtype or x.dtype)


def scale_by_muon(
    beta: jax.typing.ArrayLike = 0.95,
    *,
    momentum: str = "ema",
    nesterov: bool = True,
    bias_correction: bool = True,
    mu_dtype: jax.typing.DTypeLike | None = None,
    coeffs: CoefficientsLike = "jordan",
    steps: int | None = None,
    compute_dtype: jax.typing.DTypeLike | None = None,
    eps: float | None = None,
    method: str = "auto",
    gram_restart: int | None = None,
    scale: str | None = "jordan",
    rms_scale: jax.typing.ArrayLike = 0.2,
    deepseek_gamma: jax.typing.ArrayLike = 0.2,
    weight_dimension_numbers: Any = None,
    bucket: bool = True,
    param_shardings: Any = None,
    replica_policy: str = "split",
    wire_dtype: jax.typing.DTypeLike | None = None,
    exchange: str = "group",
) -> MuonTransformation:
  """Muon's direction: orthogonalized momentum, scaled by the matrix shape.

  Every array leaf it receives is orthogonalized (use ``muon`` or ``optax.partition`` to
  route other leaves elsewhere). Per leaf, with g the gradient::

    ema:  m ← β·m + (1−β)·g;  n = (1−β)·g + β·m   (Nesterov; n = m without)
    sum:  m ← β·m + g;        n = g + β·m         (Nesterov; n = m without)
    update = factor(n_in, n_out) · NS(n)

  Args:
    beta: momentum decay.
    momentum: ``"ema"`` (KellerJordan, optax.contrib) or ``"sum"`` (Moonlight, DeepSeek-V4).
    nesterov: use the Nesterov look-ahead.
    bias_correction: ``"ema"`` only: divide m and g by (1 − βᵗ) as ``optax.contrib`` does.
    mu_dtype: dtype of the stored momentum; ``None`` keeps the params'.
    coeffs: NS coefficients (see ``newton_schulz``).
    steps: NS steps; ``None`` takes the preset's own count.
    compute_dtype: dtype of the NS matrix products (e.g. ``jnp.bfloat16``).
    eps: overrides the preset's normalization epsilon.
    method: ``"standard"``, ``"gram"`` or ``"auto"`` (Gram-space NS where it saves FLOPs;
      see ``newton_schulz``).
    gram_restart: steps between Gram restarts; ``None`` is ``GRAM_RESTART`` (3). (None,
      not 3, so that ``optax.inject_hyperparams`` leaves it a Python int.)
    scale: ``"jordan"``, ``"spectral"``, ``"rms"``, ``"deepseek"`` or ``None``.
    rms_scale: the ``"rms"`` constant (0.2 matches AdamW's update RMS).
    deepseek_gamma: the ``"deepseek"`` γ.
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf: a tree, prefix tree,
      single value or callable ``updates -> tree``; ``None`` entries mean a plain 2-D
      ``x @ W`` matrix.
    bucket: stack same-shape matrices into one batched NS call.
    param_shardings: a tree (or prefix tree) of ``NamedSharding`` mirroring the params, for
      Auto meshes and ``shard_map`` train steps. On Explicit meshes the leaves' types carry
      their shardings and this may stay ``None``. Sharded leaves are orthogonalized by the
      plan (``optax_muon.plan``): each whole matrix on exactly one device.
    replica_policy: for leaves replicated over some mesh axes: ``"split"`` the NS work
      among the replicas and all-gather, or compute it ``"redundant"``ly on each.
    wire_dtype: dtype of the all-to-all buffers (``jnp.bfloat16`` halves the bytes).
    exchange: ``"group"`` (default: one all-to-all each way per group of leaves, owners
      balanced over all shapes at once; one for the whole tree on FSDP/TP meshes) or
      ``"bucket"`` (one each way per same-shape bucket, each spread evenly: only one
      bucket's buffers live at a time, less balance).

  Returns:
    A ``MuonTransformation`` (an ``optax.GradientTransformationExtraArgs``).

  Raises:
    ValueError: for unknown options, and (at init/update) for leaves Muon cannot take.
  """
  if momentum not in MOMENTUM_KINDS:
    raise ValueError(f"momentum must be one of {MOMENTUM_KINDS}, got {momentum!r}.")
  if scale not in SCALE_KINDS:
    raise ValueError(f"scale must be one of {SCALE_KINDS}, got {scale!r}.")
  validate_options(replica_policy, exchange)
  config = MuonConfig(
      ns=NSOptions(resolve_coefficients(coeffs, steps, eps),
                   None if compute_dtype is None else jnp.dtype(compute_dtype), method,
                   GRAM_RESTART if gram_restart is None else gram_restart, bucket),
      scale=scale, rms_scale=rms_scale, deepseek_gamma=deepseek_gamma,
      weight_dimension_numbers=weight_dimension_numbers, param_shardings=param_shardings,
      replica_policy=replica_policy,
      wire_dtype=None if wire_dtype is None else jnp.dtype(wire_dtype), exchange=exchange)

  def init_fn(params):
    config.layouts(params)  # Validates every leaf now rather than at the first update.
    mu = jax.tree.map(lambda x: _zeros_like(x, mu_dtype), params)
    return MuonState(count=jnp.zeros([], jnp.int32), mu=mu)

  def directions(grads, mu, count):
    """New momentum and the matrix NS sees, per leaf."""
    if momentum == "ema":
      new_mu = [beta * m + (1 - beta) * g for g, m in zip(grads, mu)]
      if not nesterov:
        corrected = (optax.tree.bias_correction(new_mu, beta, count) if bias_correction
                     else new_mu)
        return new_mu, corrected
      if bias_correction:
        return new_mu, [beta * m + (1 - beta) * g for m, g in zip(
            optax.tree.bias_correction(new_mu, beta, optax.safe_increment(count)),
            optax.tree.bias_correction(grads, beta, count))]
      return new_mu, [beta * m + (1 - beta) * g for m, g in zip(new_mu, grads)]
    new_mu = [beta * m + g for g, m in zip(grads, mu)]
    return new_mu, [beta * m + g for m, g in zip(new_mu, grads)] if nesterov else new_mu

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    positions, treedef = tree_utils.flatten_positions(updates)
    mu_positions, _ = tree_utils.flatten_positions(state.mu)
    given = resolve_param_shardings(param_shardings, updates)
    manual = _inside_shard_map()
    layouts = config.layouts(_global_shapes(updates, given) if manual else updates)
    index = [i for i, layout in enumerate(layouts) if layout is not None]
    grads = [positions[i][1] for i in index]
    count = optax.safe_increment(state.count)
    new_mu, ns_inputs = directions(grads, [mu_positions[i][1] for i in index], count)
    orthogonal = config.orthogonalize(ns_inputs, [layouts[i] for i in index],
                                      None if given is None else [given[i] for i in index],
                                      manual)

    out_updates = [leaf for _, leaf in positions]
    out_mu = [leaf for _, leaf in mu_positions]
    for k, i in enumerate(index):
      out_updates[i] = (config.factor(layouts[i]) * orthogonal[k]).astype(grads[k].dtype)
      out_mu[i] = new_mu[k].astype(mu_dtype or mu_positions[i][1].dtype)
    return (jax.tree_util.tree_unflatten(treedef, out_updates),
            MuonState(count=count, mu=jax.tree_util.tree_unflatten(treedef, out_mu)))

  return with_config(optax.GradientTransformationExtraArgs(init_fn, update_fn), config)
