"""``scale_by_muon``: momentum → Newton–Schulz → shape-dependent scale, for ``optax.chain``."""

from __future__ import annotations

import dataclasses
import math
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
from optax_muon.normalization import NORMALIZATIONS, init_moment, normalize_neurons
from optax_muon.orthogonalize import NSOptions
from optax_muon.plan import Plan, build_plan, validate_options
from optax_muon.sharding import (LeafSharding, dim_axes_of, is_explicit_sharding,
                                 leaf_shardings, place_like_params, resolve_param_shardings)

MOMENTUM_KINDS = ("ema", "sum")


class MuonState(NamedTuple):
  """State of ``scale_by_muon``."""

  count: jax.Array  # shape=(), dtype=int32; steps taken.
  mu: optax.Updates  # the momentum; the params' tree and shapes, dtype mu_dtype or theirs.
  # NorMuon's per-neuron second moments (normalization="neuron"): the params' tree, each
  # leaf's shape with its input axes 1, float32 (float64 for float64 leaves); else None.
  nu: optax.Updates | None = None


@dataclasses.dataclass(frozen=True)
class MuonConfig:
  """Everything ``scale_by_muon`` was configured with; the update, ``summarize`` and
  ``diagnostics`` all read it.

  Attributes:
    ns: the Newton–Schulz options.
    scale: the update-scale kind (see ``layout.scale_factor``).
    consistent_rms: the RMS-matching constant, or None (see ``layout.scale_factor``).
    weight_dimension_numbers: as passed to ``scale_by_muon``.
    param_shardings: as passed to ``scale_by_muon``.
    replica_policy: ``"split"`` or ``"redundant"`` (see ``plan``).
    wire_dtype: dtype of the all-to-all buffers; ``None`` keeps the leaves'.
    exchange: ``"group"`` or ``"bucket"`` (see ``plan.Plan``).
    normalization: ``None`` or ``"neuron"`` (NorMuon; see ``normalization``).
    cautious_weight_decay: set by ``muon``: weight decay only where the parameter and the
      update agree in sign (see ``weight_decay``).
  """

  ns: NSOptions
  scale: str | None
  consistent_rms: Any
  weight_dimension_numbers: Any
  param_shardings: Any = None
  replica_policy: str = "split"
  wire_dtype: Any = None
  exchange: str = "group"
  normalization: str | None = None
  cautious_weight_decay: bool = False

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
    return scale_factor(layout.n_in, layout.n_out, self.scale,
                        consistent_rms=self.consistent_rms)

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
    qk_clip: ``muon``'s QK-clip transformation (``qk_clip.QKClipTransformation``), or None.
  """

  muon_config: MuonConfig
  muon_router: Any
  qk_clip: Any


def with_config(tx: optax.GradientTransformation, config: MuonConfig,
                router: Any = None, qk_clip: Any = None) -> MuonTransformation:
  out = MuonTransformation(tx.init, tx.update)
  out.muon_config = config
  out.muon_router = router
  out.qk_clip = qk_clip
  return out


def inside_shard_map() -> bool:
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


def state_dtype(dtype: Any, mu_dtype: Any = None) -> jnp.dtype:
  """The dtype optimizer moments are kept in: ``mu_dtype`` if given, else float32 for
  16-bit floating leaves (their sums and squares lose too much in 16 bits), else the
  leaf's own."""
  if mu_dtype is not None:
    return jnp.dtype(mu_dtype)
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jnp.dtype(jnp.float32)
  return dtype


def _own_sharding(x) -> Any:
  """A leaf's ``NamedSharding``: a concrete array's or struct's own, a traced leaf's typed
  one on an Explicit mesh; else None."""
  if isinstance(x, jax.core.Tracer):
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding if is_explicit_sharding(sharding) else None
  sharding = getattr(x, "sharding", None)
  return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None


def _zeros_like(x, dtype):
  if isinstance(x, jax.ShapeDtypeStruct):
    return jnp.zeros(x.shape, dtype, device=x.sharding)
  return jnp.zeros_like(x, dtype=dtype)


def check_number(name: str, value: Any, low: float, high: float | None = None, *,
                 low_open: bool = False) -> None:
  """Raises ValueError if a Python number lies outside [low, high) ((low, high) if
  ``low_open``); arrays and traced values (``optax.inject_hyperparams``) pass unchecked."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return
  too_low = value <= low if low_open else value < low
  if too_low or (high is not None and value >= high) or value != value:
    interval = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'})"
    raise ValueError(f"{name} must lie in {interval}, got {value!r}.")


def _directions(momentum: str, nesterov: bool, bias_correction: bool, beta, grads, mu, count):
  """New momentum, and the NS input as (n', s) with NS input n = s·n'.

  n' is a convex combination of the momentum and the gradient, so it is finite whenever
  they are (the bias-corrected gradient g/(1−βᵗ) alone is 20·g at the first step with
  β = 0.95, past float32's range for |g| ≳ 1.7e37). NS does not see s (it is
  scale-invariant); ``adaptive`` does.
  """
  t = count.astype(jnp.float32)
  if momentum == "ema":
    new_mu = [beta * m + (1 - beta) * g for g, m in zip(grads, mu)]
    if not nesterov:
      return new_mu, new_mu, 1 / (1 - beta**t) if bias_correction else 1.0
    if bias_correction:
      w_mu, w_g = beta / (1 - beta**(t + 1)), (1 - beta) / (1 - beta**t)
    else:
      w_mu, w_g = beta, 1 - beta
  else:
    new_mu = [beta * m + g for g, m in zip(grads, mu)]
    if not nesterov:
      return new_mu, new_mu, 1.0
    w_mu, w_g = beta, 1.0
  total = w_mu + w_g
  return new_mu, [(w_mu / total) * m + (w_g / total) * g
                  for m, g in zip(new_mu, grads)], total


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
    consistent_rms: jax.typing.ArrayLike | None = None,
    momentum: str = "ema",
    bias_correction: bool = True,
    compute_dtype: jax.typing.DTypeLike | None = None,
    method: str = "auto",
    gram_restart: int | None = None,
    scale: str | None = None,
    bucket: bool = True,
    param_shardings: Any = None,
    replica_policy: str = "split",
    wire_dtype: jax.typing.DTypeLike | None = None,
    exchange: str = "group",
    normalization: str | None = None,
    normalization_beta: jax.typing.ArrayLike = 0.95,
) -> MuonTransformation:
  """Muon's direction: orthogonalized momentum, optionally scaled by the matrix shape.

  Accepts every argument of ``optax.contrib.scale_by_muon``, in its order and with its
  meaning; the options after ``weight_dimension_numbers`` are this package's. Every array
  leaf it receives is orthogonalized (use ``muon`` or ``optax.partition`` to route other
  leaves elsewhere). Per leaf, with g the gradient::

    ema:  m ← β·m + (1−β)·g;  n = (1−β)·g + β·m   (Nesterov; n = m without)
    sum:  m ← β·m + g;        n = g + β·m         (Nesterov; n = m without)
    update = factor(n_in, n_out) · NS(n)          (· ⟨n, NS(n)⟩ with ``adaptive``)

  With ``normalization="neuron"`` (NorMuon), NS(n) is replaced by its neuron-normalized
  Ô before the factor (and ``adaptive``'s inner product): see ``normalize_neurons``.

  Args:
    ns_coeffs: NS coefficients: a preset name (``"jordan"`` = optax's ``"standard"``,
      ``"polar_express"``, ``"deepseek_v4"``, ``"dion"``, ``"modded_nanogpt"``), an
      ``(a, b, c)`` triple, a table of triples (see ``resolve_coefficients``).
    ns_steps: NS steps; ``None`` takes the preset's own count.
    beta: momentum decay, in [0, 1).
    eps: overrides the preset's normalization epsilon.
    mu_dtype: dtype of the stored momentum; ``None`` keeps the params' dtype, except
      float32 for 16-bit params.
    nesterov: use the Nesterov look-ahead.
    adaptive: multiply each leaf's update by ⟨n, NS(n)⟩ = Σ conj(n)·NS(n) (the dual-norm
      scaling of Bernstein & Newhouse; per leaf, as ``optax.contrib``).
    preconditioning: the scaling before the first NS step: ``"frobenius"``,
      ``"spectral"``, ``"aol"`` or ``"schatten"`` (see ``newton_schulz``).
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf: a tree, prefix tree,
      single value or callable ``updates -> tree``; ``None`` entries mean a plain 2-D
      ``x @ W`` matrix.
    consistent_rms: k: scale each update by k·sqrt(max(n_in, n_out)) (RMS ≈ k for every
      shape; 0.2 matches AdamW). Replaces ``scale``.
    momentum: ``"ema"`` (KellerJordan, optax.contrib) or ``"sum"`` (Moonlight, DeepSeek-V4).
    bias_correction: ``"ema"`` only: divide m and g by (1 − βᵗ) as ``optax.contrib`` does.
    compute_dtype: dtype of the NS matrix products (e.g. ``jnp.bfloat16``).
    method: ``"standard"``, ``"gram"`` or ``"auto"`` (Gram-space NS where it saves FLOPs;
      see ``newton_schulz``).
    gram_restart: steps between Gram restarts; ``None`` is ``GRAM_RESTART`` (3). (None,
      not 3, so that ``optax.inject_hyperparams`` leaves it a Python int.)
    scale: ``"jordan"`` sqrt(max(1, n_out/n_in)), ``"spectral"`` sqrt(n_out/n_in) or
      ``None`` (no factor: ``optax.contrib.scale_by_muon``'s behaviour; chain
      ``scale_by_shape`` for its separate scaling step).
    bucket: stack same-shape matrices into one batched NS call.
    param_shardings: for Auto meshes and ``shard_map`` train steps, the params' shardings:
      a tree or prefix tree of ``NamedSharding`` or ``PartitionSpec`` (resolved against
      the mesh set with ``jax.set_mesh``), as a pure dict, an ``nnx.State``, the output of
      ``nnx.get_named_sharding`` or of linen's ``nn.get_sharding`` /
      ``nn.logical_to_mesh_sharding``. On Explicit meshes the leaves' types carry their
      shardings and this may stay ``None``. Sharded leaves are orthogonalized by the plan
      (``optax_muon.plan``): each whole matrix on exactly one device.
    replica_policy: for leaves replicated over some mesh axes: ``"split"`` the NS work
      among the replicas and all-gather, or compute it ``"redundant"``ly on each.
    wire_dtype: dtype of the all-to-all buffers (``jnp.bfloat16`` halves the bytes).
    exchange: ``"group"`` (default: one all-to-all each way per group of leaves, owners
      balanced over all shapes at once; one for the whole tree on FSDP/TP meshes) or
      ``"bucket"`` (one each way per same-shape bucket, each spread evenly: only one
      bucket's buffers live at a time, less balance).
    normalization: ``None``, or ``"neuron"`` for NorMuon: after NS, divide each output
      neuron's update by the root of an EMA of its mean square, then restore the matrix's
      Frobenius norm. Adds the state field ``nu``.
    normalization_beta: β₂ of NorMuon's second-moment EMA, in [0, 1).

  Returns:
    A ``MuonTransformation`` (an ``optax.GradientTransformationExtraArgs``).

  Raises:
    ValueError: for unknown or out-of-range options (naming the argument), and (at
      init/update) for leaves Muon cannot take (naming the leaf).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, optax_muon
    >>> params = {"w": jnp.zeros((16, 64))}
    >>> tx = optax.chain(optax_muon.scale_by_muon(ns_coeffs="polar_express", ns_steps=8),
    ...                  optax_muon.scale_by_shape(),
    ...                  optax.scale_by_learning_rate(0.02))
    >>> state = tx.init(params)
    >>> grads = {"w": jax.random.normal(jax.random.PRNGKey(0), (16, 64))}
    >>> updates, state = tx.update(grads, state, params)
    >>> s = jnp.linalg.svd(updates["w"], compute_uv=False)  # all 0.02·sqrt(64/16)
    >>> bool(jnp.allclose(s, 0.04, rtol=1e-3))
    True

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024.

    Bernstein & Newhouse, `Old Optimizer, New Norm: An Anthology
    <https://arxiv.org/abs/2409.20325>`_, 2024.

    Liu et al., `Muon is Scalable for LLM Training <https://arxiv.org/abs/2502.16982>`_,
    2025.

    Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their Application
    to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_, 2025.

    Li et al., `NorMuon: Making Muon more efficient and scalable
    <https://arxiv.org/abs/2510.05491>`_, 2025.
  """
  if momentum not in MOMENTUM_KINDS:
    raise ValueError(f"momentum must be one of {MOMENTUM_KINDS}, got {momentum!r}.")
  if scale not in SCALE_KINDS:
    raise ValueError(f"scale must be one of {SCALE_KINDS}, got {scale!r}.")
  if consistent_rms is not None and scale == "spectral":
    raise ValueError("consistent_rms replaces the shape scale; pass it or "
                     "scale='spectral', not both.")
  if normalization not in NORMALIZATIONS:
    raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}.")
  check_number("beta", beta, 0.0, 1.0)
  check_number("normalization_beta", normalization_beta, 0.0, 1.0)
  check_number("eps", eps, 0.0)
  check_number("consistent_rms", consistent_rms, 0.0, low_open=True)
  validate_options(replica_policy, exchange)
  config = MuonConfig(
      ns=NSOptions(resolve_coefficients(ns_coeffs, ns_steps, eps),
                   None if compute_dtype is None else jnp.dtype(compute_dtype), method,
                   GRAM_RESTART if gram_restart is None else gram_restart, bucket,
                   preconditioning),
      scale=scale, consistent_rms=consistent_rms,
      weight_dimension_numbers=weight_dimension_numbers, param_shardings=param_shardings,
      replica_policy=replica_policy,
      wire_dtype=None if wire_dtype is None else jnp.dtype(wire_dtype), exchange=exchange,
      normalization=normalization)

  def init_fn(params):
    layouts = config.layouts(params)  # Validates every leaf now, not at the first update.
    mu = jax.tree.map(lambda x: _zeros_like(x, state_dtype(x.dtype, mu_dtype)), params)
    given = resolve_param_shardings(param_shardings, params)
    if not inside_shard_map():  # there the leaves are local blocks, placed by the caller
      mu = place_like_params(mu, params, given)
    nu = None
    if normalization is not None:
      positions, treedef = tree_utils.flatten_positions(params)
      given = given or [None] * len(positions)
      nu = jax.tree_util.tree_unflatten(treedef, [
          leaf if layout is None else init_moment(
              layout, state_dtype(jnp.finfo(leaf.dtype).dtype), s or _own_sharding(leaf),
              traced=isinstance(leaf, jax.core.Tracer))
          for (_, leaf), layout, s in zip(positions, layouts, given)])
    return MuonState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    positions, treedef = tree_utils.flatten_positions(updates)
    mu_positions, _ = tree_utils.flatten_positions(state.mu)
    given = resolve_param_shardings(param_shardings, updates)
    manual = inside_shard_map()
    layouts = config.layouts(_global_shapes(updates, given) if manual else updates)
    index = [i for i, layout in enumerate(layouts) if layout is not None]
    grads = [positions[i][1] for i in index]
    count = optax.safe_increment(state.count)
    new_mu, ns_inputs, input_scale = _directions(
        momentum, nesterov, bias_correction, beta, grads,
        [mu_positions[i][1] for i in index], count)
    ns_inputs = [n.astype(g.dtype) for n, g in zip(ns_inputs, grads)]
    live = [k for k, i in enumerate(index) if math.prod(layouts[i].shape)]  # not zero-size
    orthogonal = [jnp.zeros_like(g) for g in grads]
    for k, y in zip(live, config.orthogonalize(
        [ns_inputs[k] for k in live], [layouts[index[k]] for k in live],
        None if given is None else [given[index[k]] for k in live], manual)):
      orthogonal[k] = y

    out_updates = [leaf for _, leaf in positions]
    out_mu = [leaf for _, leaf in mu_positions]
    out_nu = None if normalization is None else [
        leaf for _, leaf in tree_utils.flatten_positions(state.nu)[0]]
    for k, i in enumerate(index):
      if normalization is not None:
        orthogonal[k], out_nu[i] = normalize_neurons(
            orthogonal[k], out_nu[i], normalization_beta, layouts[i],
            LeafSharding(given[i].mesh, dim_axes_of(given[i].spec, grads[k].ndim))
            if manual and given[i] is not None else None)
      update = config.factor(layouts[i]) * orthogonal[k]
      if adaptive:
        dual = jnp.sum(jnp.conj(ns_inputs[k]).astype(update.dtype) * orthogonal[k])
        if manual and given[i] is not None:
          dual = jax.lax.psum(dual, tuple(sorted(LeafSharding(
              given[i].mesh, dim_axes_of(given[i].spec, update.ndim)).used_axes)))
        update = (input_scale * dual) * update
      out_updates[i] = update.astype(grads[k].dtype)
      out_mu[i] = new_mu[k].astype(mu_positions[i][1].dtype)
    return (jax.tree_util.tree_unflatten(treedef, out_updates),
            MuonState(count=count, mu=jax.tree_util.tree_unflatten(treedef, out_mu),
                      nu=None if out_nu is None else jax.tree_util.tree_unflatten(treedef,
                                                                                  out_nu)))

  return with_config(optax.GradientTransformationExtraArgs(init_fn, update_fn), config)


def scale_by_shape(weight_dimension_numbers: Any = None,
                   consistent_rms: jax.typing.ArrayLike | None = None
                   ) -> optax.GradientTransformation:
  """Scales each update by its matrix shape, as ``optax.contrib.scale_by_shape``.

  Args:
    weight_dimension_numbers: ``MuonDimensionNumbers`` per leaf (tree, prefix tree or
      callable); ``None`` entries mean a plain 2-D matrix.
    consistent_rms: k for the factor k·sqrt(max(n_in, n_out)); ``None`` gives Jordan's
      sqrt(max(1, n_out/n_in)).

  Returns:
    A stateless ``optax.GradientTransformation``.

  Raises:
    ValueError: (at update) for leaves that are not matrices under their dimension
      numbers, naming the leaf.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> tx = optax_muon.scale_by_shape()
    >>> u, _ = tx.update({"w": jnp.ones((16, 64))}, tx.init(None))
    >>> float(u["w"][0, 0])
    2.0
  """
  check_number("consistent_rms", consistent_rms, 0.0, low_open=True)

  def update_fn(updates, state, params=None):
    del params
    positions, treedef = tree_utils.flatten_positions(updates)
    dims = resolve_dimension_numbers(weight_dimension_numbers, updates,
                                     "weight_dimension_numbers")
    out = []
    for (path, leaf), d in zip(positions, dims):
      if tree_utils.is_array_leaf(leaf):
        layout = make_layout(tree_utils.path_str(path), leaf, d)
        leaf = (scale_factor(layout.n_in, layout.n_out, "jordan",
                             consistent_rms=consistent_rms) * leaf).astype(leaf.dtype)
      out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)
