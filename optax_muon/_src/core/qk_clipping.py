"""``qk_clip``: QK-clip (MuonClip), capping attention logits by rescaling query
and key heads.

The model, once. Head h of an attention layer computes logits q_i·k_j (with the
model's own scaling); S_h, their largest value over the step's batch, comes out
of the model's forward pass. With threshold τ and balance α, γ_h = min(1, τ /
S_h), and the step's new parameters W = params + updates are rescaled per head:

    W_q[h] ← γ_h^α · W_q[h],    W_k[h] ← γ_h^(1−α) · W_k[h]

Logits are bilinear in W_q and W_k, so for the same inputs head h's logits scale
by γ_h: the logits S_h was taken from end at most τ. S_h comes from the forward
pass before the step's update (as in Kimi K2), so the growth that update itself
brings is not seen: measured after the step, the largest logit sits at τ plus
that growth. Heads with S_h ≤ τ are untouched (bit for bit). Under grouped-query
attention (G query heads share one key head) query head h takes γ_h^α and the
shared key takes (min over its group of γ)^(1−α): every head of the group then
scales by at most γ_h, so all stay ≤ τ; the price is that the group's other
heads lose a little more than they would alone.

Which leaves are projections, and where their heads lie, is a ``QKClipHeads``
per leaf (a tree, prefix tree or callable, like dimension numbers). The maxima
arrive as the extra argument ``attn_logit_max`` of ``update``: a tree with one
``(..., heads)`` array per attention layer, which serves every projection at or
below its path (``{"blocks": {0: s}}`` serves ``blocks/0/q/kernel`` and
``blocks/0/k/kernel``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_muon._src.core import tree_utils
from optax_muon._src.core.options import check_number

ROLES = ("query", "key", "qkv")


class QKClipHeads(NamedTuple):
  """Where a query, key or fused QKV projection keeps its heads.

  Along ``axis`` the leaf is a sequence of equal, contiguous head blocks
  (head-major, as ``y.reshape(..., heads, head_dim)`` reads a Flax ``x @ W``
  output); every other axis is scaled as a whole, except ``layer_axes``.

  Attributes:
    role: ``"query"``, ``"key"`` or ``"qkv"`` (a fused projection: along
      ``axis`` the ``num_heads`` query blocks, then ``num_kv_heads`` key blocks,
      then the value blocks, which are left alone).
    axis: the axis holding the heads.
    num_heads: the leaf's heads along ``axis`` (``"qkv"``: its query heads);
      ``None``: the size of ``axis`` (it is the head axis itself, as in a ``(d,
      heads, head_dim)`` kernel).
    num_kv_heads: ``"qkv"`` only: key (and value) heads; ``None``:
      ``num_heads``.
    layer_axes: axes indexing independent attention layers (stacked or scanned
      layers); the maxima carry them as leading axes, in this order.

  Examples: a Flax ``Linear(d, heads·head_dim)`` query kernel is
  ``QKClipHeads("query", num_heads=heads)``; its GQA key kernel ``Linear(d,
  kv_heads·head_dim)`` is ``QKClipHeads("key", num_heads=kv_heads)``; a fused
  ``(d, 3·heads·head_dim)`` kernel is ``QKClipHeads("qkv", num_heads=heads)``; a
  scanned ``(layers, d, heads, head_dim)`` query kernel is
  ``QKClipHeads("query", axis=2, layer_axes=(0,))``.
  """

  role: str
  axis: int = -1
  num_heads: int | None = None
  num_kv_heads: int | None = None
  layer_axes: Sequence[int] = ()


def is_qk_clip_heads(x: Any) -> bool:
  return isinstance(x, QKClipHeads)


def _check_options(threshold: Any, alpha: Any) -> None:
  check_number("threshold", threshold, 0.0, low_open=True)
  check_number("alpha", alpha, 0.0, 1.0, high_closed=True)


@dataclasses.dataclass(frozen=True)
class QKClip:
  """QK-clip's options for ``muon(..., qk_clip=QKClip(...))`` (see ``qk_clip``).

  Attributes:
    threshold: τ, the logit cap (100 in Kimi K2), > 0.
    heads: ``QKClipHeads`` per leaf: a tree or prefix tree (None entries: not a
      query or key projection), a single value, or a callable ``params -> such a
      tree``.
    alpha: α in [0, 1], the query's share of the rescale (0.5: balanced).

  Examples:
    >>> import optax_muon
    >>> clip = optax_muon.QKClip(
    ...     100.0, heads={"q": optax_muon.QKClipHeads("query")})
    >>> clip.alpha
    0.5
  """

  threshold: float
  heads: Any
  alpha: float = 0.5

  def __post_init__(self):
    _check_options(self.threshold, self.alpha)
    if self.heads is None:
      raise ValueError(
          "QKClip.heads is required: declare the query and key projections "
          "with QKClipHeads."
      )
    object.__setattr__(
        self,
        "heads",
        tree_utils.freeze_prefix(
            self.heads, is_value=is_qk_clip_heads, what="heads"
        ),
    )

  def transformation(self) -> optax.GradientTransformationExtraArgs:
    """The ``qk_clip`` transformation these options describe."""
    return qk_clip(self.threshold, self.alpha, heads=self.heads)


@dataclasses.dataclass(frozen=True)
class Projection:
  """One projection leaf, validated: static metadata computed once from its
  shape.

  Attributes:
    path: the leaf's path, for messages and for matching the maxima.
    key_path: the leaf's key path.
    role: as in ``QKClipHeads``.
    shape: the leaf's shape.
    axis: the head axis (non-negative).
    layer_axes: the layer axes (non-negative).
    query_heads: query heads the leaf holds (0 for a key projection).
    key_heads: key heads the leaf holds (0 for a query projection).
    blocks: head blocks along ``axis`` (values included).
  """

  path: str
  key_path: tuple
  role: str
  shape: tuple[int, ...]
  axis: int
  layer_axes: tuple[int, ...]
  query_heads: int
  key_heads: int
  blocks: int

  @property
  def layer_shape(self) -> tuple[int, ...]:
    """The maxima's leading shape."""
    return tuple(self.shape[a] for a in self.layer_axes)

  def describe(self) -> str:
    if self.role == "qkv":
      return f"fused qkv, {self.query_heads} q + {self.key_heads} k heads"
    return f"{self.role}, {self.query_heads or self.key_heads} heads"


def _axis(path: str, value: Any, ndim: int, field: str) -> int:
  if (
      isinstance(value, bool)
      or not isinstance(value, int)
      or not -ndim <= value < ndim
  ):
    raise ValueError(
        f"{path}: QKClipHeads.{field} {value!r} is out of range for a leaf of "
        f"rank {ndim}."
    )
  return value % ndim


def make_projection(
    key_path: tuple, leaf: Any, heads: QKClipHeads
) -> Projection:
  """Validates one declared projection against its leaf.

  Args:
    key_path: the leaf's key path.
    leaf: the array (or ``jax.ShapeDtypeStruct``).
    heads: its declaration.

  Returns:
    The leaf's ``Projection``.

  Raises:
    ValueError: naming the leaf, for an unknown role, axes out of range or
      overlapping, or head counts that don't divide the head axis.
  """
  path = tree_utils.path_str(key_path)
  shape = tuple(leaf.shape)
  if heads.role not in ROLES:
    raise ValueError(
        f"{path}: QKClipHeads.role must be one of {ROLES}, got {heads.role!r}."
    )
  axis = _axis(path, heads.axis, len(shape), "axis")
  layer_axes = tuple(
      _axis(path, a, len(shape), "layer_axes") for a in heads.layer_axes
  )
  if axis in layer_axes or len(set(layer_axes)) != len(layer_axes):
    raise ValueError(
        f"{path}: QKClipHeads axis {heads.axis} and layer_axes "
        f"{tuple(heads.layer_axes)} overlap (shape {shape})."
    )
  if heads.role == "qkv" and heads.num_heads is None:
    raise ValueError(
        f"{path}: a fused qkv projection needs QKClipHeads.num_heads."
    )
  if heads.role != "qkv" and heads.num_kv_heads is not None:
    raise ValueError(
        f"{path}: num_kv_heads is for role 'qkv'; a {heads.role} projection "
        "gives its own heads as num_heads."
    )
  count = shape[axis] if heads.num_heads is None else heads.num_heads
  kv = count if heads.num_kv_heads is None else heads.num_kv_heads
  query, key = {"query": (count, 0), "key": (0, count), "qkv": (count, kv)}[
      heads.role
  ]
  blocks = query + 2 * key if heads.role == "qkv" else count
  if (
      min(count, kv) < 1
      or shape[axis] % blocks
      or (heads.role == "qkv" and query % key)
  ):
    what = (
        f"{query} query and {key} key/value heads"
        if heads.role == "qkv"
        else f"{count} heads"
    )
    raise ValueError(
        f"{path}: {what} do not split axis {axis} of size {shape[axis]} into "
        f"equal head blocks (shape {shape})."
    )
  return Projection(
      path,
      tuple(key_path),
      heads.role,
      shape,
      axis,
      layer_axes,
      query,
      key,
      blocks,
  )


def resolve_projections(heads: Any, params: Any) -> list[Projection | None]:
  """One ``Projection`` (or None) per position of
  ``tree_utils.flatten_positions(params)``.

  Args:
    heads: ``QKClipHeads`` per leaf: a tree or prefix tree (None entries: not a
      projection), a single value, or a callable ``params -> such a tree``.
    params: the params (or updates).

  Raises:
    ValueError: if the tree does not match the params or declares no projection,
      or for a declaration that doesn't fit its leaf (naming the leaf).
  """
  positions, _ = tree_utils.flatten_positions(params)
  specs = tree_utils.resolve_prefix(
      tree_utils.freeze_prefix(heads, is_value=is_qk_clip_heads, what="heads"),
      params,
      is_value=is_qk_clip_heads,
      what="heads",
  )
  out = [
      make_projection(path, leaf, spec)
      if spec is not None and tree_utils.is_array_leaf(leaf)
      else None
      for (path, leaf), spec in zip(positions, specs)
  ]
  if not any(out):
    raise ValueError(
        "qk_clip: heads declares no query or key projection among the params."
    )
  return out


def _match_maxima(
    projections: list[Projection], attn_logit_max: Any
) -> list[jax.Array]:
  """The maxima entry of each projection: the one at the longest prefix of its
  path."""
  if attn_logit_max is None:
    raise ValueError(
        "qk_clip: update needs attn_logit_max= (the per-head maximum logits of"
        " the step's forward pass); none was given for"
        f" '{projections[0].path}'."
    )
  entries, _ = jax.tree_util.tree_flatten_with_path(attn_logit_max)
  by_path = {tree_utils.path_str(path): value for path, value in entries}
  used, out = set(), []
  for p in projections:
    for i in range(len(p.key_path), -1, -1):
      prefix = tree_utils.path_str(p.key_path[:i])
      if prefix in by_path:
        used.add(prefix)
        out.append(_check_maxima(p, prefix, by_path[prefix]))
        break
    else:
      raise ValueError(
          f"qk_clip: no attn_logit_max entry for '{p.path}' or a path above "
          f"it; entries: {sorted(by_path)}."
      )
  unused = sorted(set(by_path) - used)
  if unused:
    raise ValueError(
        f"qk_clip: attn_logit_max entries {unused} serve no query or key "
        "projection declared in heads."
    )
  return out


def _check_maxima(p: Projection, entry: str, value: Any) -> jax.Array:
  shape = tuple(jnp.shape(value))
  heads = shape[-1] if shape else None
  fits = (
      shape[:-1] == p.layer_shape
      and heads is not None
      and (
          heads == p.query_heads if p.query_heads else heads % p.key_heads == 0
      )
  )
  if not fits:
    want = (
        f"{p.query_heads} query heads"
        if p.query_heads
        else f"a multiple of its {p.key_heads} key heads"
    )
    raise ValueError(
        f"qk_clip: '{p.path}' ({p.describe()}) needs maxima of shape "
        f"{p.layer_shape + ('H',)} with H = {want}; attn_logit_max entry "
        f"'{entry}' has shape {shape}."
    )
  return jnp.asarray(value, jnp.float32)


def head_factors(
    p: Projection, gamma: jax.Array, alpha: jax.typing.ArrayLike
) -> jax.Array:
  """The rescale factors of one projection, broadcastable against its leaf.

  Args:
    p: the projection.
    gamma: γ per query head, shape ``p.layer_shape + (H,)``.
    alpha: the query's share α.

  Returns:
    An array of the leaf's rank: the leaf's sizes on ``p.axis`` and
    ``p.layer_axes``, 1 elsewhere. Heads that are not clipped get exactly 1.
  """
  parts = []
  if p.query_heads:
    parts.append(gamma**alpha)
  if p.key_heads:
    group = gamma.shape[-1] // p.key_heads
    shared = jnp.min(gamma.reshape(*p.layer_shape, p.key_heads, group), axis=-1)
    parts.append(shared ** (1 - alpha))
  if p.role == "qkv":  # the value blocks
    parts.append(
        jnp.ones((*p.layer_shape, p.blocks - p.query_heads - p.key_heads))
    )
  per_block = jnp.concatenate(parts, axis=-1)  # layer_shape + (blocks,)
  per_element = jnp.repeat(per_block, p.shape[p.axis] // p.blocks, axis=-1)
  axes = p.layer_axes + (p.axis,)
  per_element = jnp.transpose(
      per_element, sorted(range(len(axes)), key=axes.__getitem__)
  )
  return per_element.reshape(
      [p.shape[a] if a in axes else 1 for a in range(len(p.shape))]
  )


def qk_clip(
    threshold: jax.typing.ArrayLike = 100.0,
    alpha: jax.typing.ArrayLike = 0.5,
    *,
    heads: Any,
) -> optax.GradientTransformationExtraArgs:
  """QK-clip: rescales each attention head's query and key projections so that
  its largest logit in the step's batch stays at most ``threshold``.

  Per head h with S_h (``attn_logit_max``) above τ: γ_h = τ / S_h, and the
  step's new parameters (params + updates) become W_q[h]·γ_h^α and
  W_k[h]·γ_h^(1−α); a key head shared by several query heads (grouped-query
  attention) takes the smallest γ of its group. The returned updates are those
  that land on the rescaled parameters, so this transformation must come
  **last** in a chain (after the learning rate): anything after it would rescale
  the correction too. ``muon(..., qk_clip=QKClip(τ, heads))`` puts it there.

  Args:
    threshold: τ, the logit cap (100 in Kimi K2).
    alpha: α in [0, 1], the query's share of the rescale (0.5: balanced).
    heads: ``QKClipHeads`` per leaf: a tree or prefix tree (None entries: not a
      query or key projection), a single value, or a callable ``params -> such a
      tree``.

  Returns:
    A stateless ``optax.GradientTransformationExtraArgs``, whose ``update``
    takes the maxima as ``attn_logit_max=``: a tree with one ``layer_shape +
    (heads,)`` array per attention layer (query heads), matched to each
    projection by the longest prefix of its path.

  Raises:
    ValueError: for τ ≤ 0 or α outside [0, 1]; at init/update for a ``heads``
      tree that does not fit the params; at update when ``params`` or the maxima
      are missing, or a maxima entry is missing, unused or of the wrong shape
      (naming the leaf).

  Examples:
    >>> import jax.numpy as jnp, optax, optax_muon
    >>> params = {"attn": {"q": jnp.ones((4, 4)), "k": jnp.ones((4, 4))},
    ...           "w": jnp.ones(4)}
    >>> heads = {"attn": {"q": optax_muon.QKClipHeads("query", num_heads=2),
    ...                   "k": optax_muon.QKClipHeads("key", num_heads=2)},
    ...          "w": None}
    >>> tx = optax.chain(optax.sgd(0.0), optax_muon.qk_clip(10.0, heads=heads))
    >>> updates, _ = tx.update(params, tx.init(params), params,
    ...                        attn_logit_max={"attn": jnp.array([40.0, 5.0])})
    >>> # head 0: × (10/40)^0.5 = 0.5 on q and k
    >>> new = optax.apply_updates(params, updates)
    >>> new["attn"]["q"][0].tolist(), new["attn"]["k"][0].tolist()
    ([0.5, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0])

  References:
    Kimi Team, `Kimi K2: Open Agentic Intelligence
    <https://arxiv.org/abs/2507.20534>`_, 2025 (MuonClip).
  """
  _check_options(threshold, alpha)

  def init_fn(params):
    resolve_projections(heads, params)  # Validates the declaration now.
    return optax.EmptyState()

  def update_fn(
      updates, state, params=None, *, attn_logit_max=None, **extra_args
  ):
    del extra_args
    if params is None:
      raise ValueError(
          "qk_clip rescales the new parameters (params + updates): pass params "
          "to update."
      )
    projections = resolve_projections(heads, params)
    index = [i for i, p in enumerate(projections) if p is not None]
    maxima = _match_maxima([projections[i] for i in index], attn_logit_max)
    positions, treedef = tree_utils.flatten_positions(updates)
    param_leaves = [leaf for _, leaf in tree_utils.flatten_positions(params)[0]]
    out = [leaf for _, leaf in positions]
    for i, s in zip(index, maxima):
      p, u, w = projections[i], out[i], param_leaves[i]
      if u.shape != w.shape:
        raise ValueError(
            f"qk_clip: '{p.path}': updates of shape {u.shape} for params of "
            f"shape {w.shape}."
        )
      gamma = jnp.where(s > threshold, threshold / s, 1.0)
      dtype = jnp.promote_types(u.dtype, jnp.float32)
      new = w.astype(dtype) + u.astype(dtype)
      out[i] = u + ((head_factors(p, gamma, alpha) - 1) * new).astype(u.dtype)
    return jax.tree_util.tree_unflatten(treedef, out), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
