"""Which leaves go to Muon and which to AdamW, why (the reason is data, not
text), and how a Muon leaf is seen as matrices."""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.core import tree_utils
from optax_muon._src.core.matrices import (
    MuonDimensionNumbers,
    is_dimension_numbers,
    portable_dimension_numbers,
)
from optax_muon._src.core.layout_rules import (
    LayerStack,
    UnknownAxisNames,
    check_axis_roles,
    from_logical_names,
)
from optax_muon._src.core.options import Routing
from optax_muon._src.core.user_warnings import warn_at_caller

MUON, ADAM = "muon", "adam"

# A leaf named like a bias: bias, *_bias, bias_*; and b beside a kernel (Haiku's
# w and b).
_BIAS_NAME = re.compile(r"(?i)^(bias|\w+_bias|bias_\w+)$")
_SHORT_BIAS_NAME = re.compile(r"(?i)^b$")
# The kernel of a layer, beside its bias.
_KERNEL_NAME = re.compile(r"(?i)^(kernel|w|weight|weights)$")


class Reason(enum.Enum):
  """Why a leaf went where it went; ``Route.describe`` gives the words
  ``summarize`` shows."""

  LABELS = "labels"
  DIMENSION_NUMBERS = "dimension numbers"
  NO_DIMENSION_NUMBERS = "dimension numbers are None"
  FEWER_THAN_2_D = "{ndim}-D"
  BIAS = "bias{detail}"
  PATTERN = "path matches adam_pattern"
  LAYOUT = "{detail}"
  LOGICAL_NAMES = "logical axis names {detail}"
  MATRIX = "2-D"
  LAYER_MATRICES = "a matrix per layer ({detail})"
  LAYER_VECTORS = "a vector per layer ({detail})"
  UNDESCRIBED = "{ndim}-D without dimension numbers"
  GIVEN_TO_SCALE_BY_MUON = "scale_by_muon"


@dataclasses.dataclass(frozen=True)
class Route:
  """Where one leaf goes.

  Attributes:
    path: the leaf's path.
    optimizer: ``"muon"`` or ``"adam"``.
    reason: why (a ``Reason``).
    dimension_numbers: for a Muon leaf, which axes form its matrices (None: the
      plain 2-D ``x @ W`` matrix, or as the transformation's
      ``weight_dimension_numbers`` say).
    detail: the layout rule, logical names or kernel the reason refers to.
    ndim: the leaf's rank.
  """

  path: str
  optimizer: str
  reason: Reason
  dimension_numbers: MuonDimensionNumbers | None = None
  detail: str = ""
  ndim: int = 2

  def describe(self) -> str:
    """The reason in words."""
    return self.reason.value.format(ndim=self.ndim, detail=self.detail)


@dataclasses.dataclass(frozen=True)
class Routed:
  """The routes of a tree and what a user should hear about them.

  Attributes:
    routes: one ``Route`` per position of ``tree_utils.flatten_positions`` (None
      at placeholders).
    notices: warnings for the user, each naming the leaves and the fix.
  """

  routes: tuple[Route | None, ...]
  notices: tuple[str, ...] = ()


def _shape_of(leaf: Any) -> str:
  return "×".join(map(str, leaf.shape)) or "()"


def _listing(items: list[tuple[str, Any]]) -> str:
  return tree_utils.listing(
      [f"{path} ({_shape_of(leaf)})" for path, leaf in items]
  )


def _check_floating(path: str, leaf: Any) -> None:
  if not jnp.issubdtype(leaf.dtype, jnp.inexact):
    raise ValueError(
        f"optax_muon: leaf '{path}' has dtype {np.dtype(leaf.dtype)} (shape"
        f" {leaf.shape}); optimizers update floating-point (or complex) leaves"
        " only. Leave it out of the tree you optimize (with Equinox:"
        " eqx.filter(model, eqx.is_inexact_array)), or keep it fixed with"
        " optax.masked / optax.set_to_zero around this optimizer."
    )


def _biases(paths: list[tuple], leaves: list[Any]) -> dict[int, str]:
  """Positions of biases: named like one (``b`` only beside a kernel), or beside
  a kernel whose shape ends with theirs (Flax's attention biases are (heads,
  head_dim) beside a (d, heads, head_dim) kernel). Values: the detail
  ``summarize`` shows."""
  kernels: dict[tuple, list[Any]] = {}
  for path, leaf in zip(paths, leaves):
    if path and leaf is not None and _KERNEL_NAME.match(str(path[-1])):
      kernels.setdefault(path[:-1], []).append((path[-1], leaf))
  found = {}
  for i, (path, leaf) in enumerate(zip(paths, leaves)):
    if not path or leaf is None or _KERNEL_NAME.match(str(path[-1])):
      continue
    name = str(path[-1])
    if _BIAS_NAME.match(name) or (
        _SHORT_BIAS_NAME.match(name) and path[:-1] in kernels
    ):
      found[i] = ""
      continue
    for name, kernel in kernels.get(path[:-1], ()):
      if kernel.ndim > leaf.ndim and tuple(kernel.shape[-leaf.ndim :]) == tuple(
          leaf.shape
      ):
        found[i] = f" of {name}"
  return found


def _logical_names_of(leaf: Any) -> tuple | None:
  """The logical axis names a Flax box (linen ``Partitioned``) or
  ``nnx.Variable`` carries, or None."""
  names = getattr(
      leaf, "names", None
  )  # linen's Partitioned and LogicallyPartitioned
  if isinstance(names, tuple):
    return names
  metadata = getattr(leaf, "get_metadata", None)  # nnx.Variable
  if callable(metadata):
    meta = metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
      names = meta.get(key)
      if isinstance(names, (tuple, list)) and all(
          n is None or isinstance(n, str) for n in names
      ):
        return tuple(names)
  return None


def _is_box(x: Any) -> bool:
  return _logical_names_of(x) is not None or tree_utils.is_flax_variable(x)


def _unbox(x: Any) -> Any:
  """The array in a Flax box or ``nnx.Variable``; other leaves as they are."""
  if tree_utils.is_flax_variable(
      x
  ):  # get_value from Flax 0.12.1; .value before
    return x.get_value() if hasattr(type(x), "get_value") else x.value
  return x.value if _logical_names_of(x) is not None else x


def route(
    params: Any,
    routing: Routing | None = None,
    weight_dimension_numbers: Any = None,
) -> list[Route | None]:
  """Decides Muon or AdamW for every leaf.

  Rules, first that applies:
    1. ``routing.labels`` (``"muon"``/``"adam"`` per leaf) decides.
    2. ``weight_dimension_numbers`` given (tree, prefix tree or callable, as in
       ``optax.contrib.muon``): leaves with ``MuonDimensionNumbers`` go to Muon
       (unless they are biases or match ``routing.adam_pattern``: a warning says
       so), leaves with ``None`` to AdamW (a warning names those the default
       rule would put on Muon).
    3. Default, for floating-point leaves: 0-D and 1-D leaves and biases go to
       AdamW, and leaves whose path matches ``routing.adam_pattern``
       (embeddings, output heads); under a ``routing.layer_stacks`` scope
       (scanned layers) the layer axes are batch axes and the rest reads as
       one layer (a layout rule, else a matrix or a vector per layer); a leaf
       a ``routing.layouts`` rule describes goes where the rule says; other
       2-D leaves go to Muon; other leaves of rank ≥ 3 go to AdamW, with a
       warning that says how to describe them.

  Args:
    params: the params tree (arrays or ``jax.ShapeDtypeStruct`` objects).
    routing: the ``Routing`` options; ``None`` is ``Routing()``.
    weight_dimension_numbers: see rule 2.

  Returns:
    One ``Route`` per position of ``tree_utils.flatten_positions(params)`` (None
    for placeholders).

  Raises:
    ValueError: if the labels or dimension numbers don't match the params, a
      label is not ``"muon"``/``"adam"``, or a leaf is not floating point.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> params = {"lm_head": jnp.zeros((64, 256)), "w": jnp.zeros((64, 64)),
    ...           "b": jnp.zeros(64)}
    >>> [(r.path, r.optimizer, r.reason.name) for r in optax_muon.route(params)]
    [('b', 'adam', 'FEWER_THAN_2_D'), ('lm_head', 'adam', 'PATTERN'), ('w',
    'muon', 'MATRIX')]
  """
  dims = None
  if weight_dimension_numbers is not None:
    dims = tree_utils.resolve_prefix(
        tree_utils.freeze_prefix(
            weight_dimension_numbers,
            is_value=is_dimension_numbers,
            what="muon_weight_dimension_numbers",
        ),
        params,
        is_value=is_dimension_numbers,
        what="muon_weight_dimension_numbers",
    )
  routed = decide(params, routing or Routing(), dims)
  for notice in routed.notices:
    warn_at_caller(notice)
  return list(routed.routes)


def decide(
    params: Any,
    routing: Routing,
    dims: list[Any] | None,
    logical_names: list[tuple | None] | None = None,
    axis_roles: Mapping[str, str] | None = None,
) -> Routed:
  """``route`` with the dimension numbers already resolved (one entry per
  position, or None when none were given), and the warnings returned rather than
  issued.

  ``logical_names`` (one tuple of names or None per position) describe leaves by
  their logical axis names, ahead of ``routing.layouts``
  (``infer_dimension_numbers``).
  """
  positions, _ = tree_utils.flatten_positions(params)
  keys = [tree_utils.canonical_path(p) for p, _ in positions]
  paths = [tree_utils.path_str(p) for p, _ in positions]
  leaves = [
      leaf if tree_utils.is_array_leaf(leaf) else None for _, leaf in positions
  ]
  if routing.labels is not None:
    labels = tree_utils.resolve_prefix(
        routing.labels,
        params,
        is_value=lambda x: isinstance(x, str),
        what="labels",
    )
    routes = []
    for path, label, leaf in zip(paths, labels, leaves):
      if leaf is None:
        routes.append(None)
        continue
      if label not in (MUON, ADAM):
        raise ValueError(
            f"labels: leaf '{path}' has label {label!r}; expected '{MUON}' or "
            f"'{ADAM}'."
        )
      if label == MUON:
        _check_floating(path, leaf)
      routes.append(Route(path, label, Reason.LABELS, ndim=leaf.ndim))
    return Routed(tuple(routes))
  for path, leaf in zip(paths, leaves):
    if leaf is not None:
      _check_floating(path, leaf)
  pattern = re.compile(routing.adam_pattern) if routing.adam_pattern else None
  biases = _biases(keys, leaves) if routing.biases else {}
  owners = (
      tree_utils.owner_classes(params)
      if any(rule.owner is not None for rule in routing.layouts)
      else [()] * len(positions)
  )
  roles = check_axis_roles(axis_roles) if logical_names is not None else None
  stacks, notices = _layer_stacks(paths, leaves, routing.layer_stacks)
  default, unreadable = [], []
  for i, (path, leaf) in enumerate(zip(paths, leaves)):
    if leaf is None:
      default.append(None)
      continue
    names = None if logical_names is None else logical_names[i]
    layout = _layout_route(path, leaf, routing, owners[i], stacks[i])
    try:
      r = _default_route(
          path, leaf, pattern, routing, biases.get(i), names, roles, layout
      )
    except UnknownAxisNames as e:
      unreadable.append(e)
      r = None
    default.append(r)
  if unreadable:
    raise ValueError(_unreadable_message(unreadable))
  if dims is None:
    undescribed = [
        (r.path, leaf)
        for r, leaf in zip(default, leaves)
        if r is not None and r.reason == Reason.UNDESCRIBED
    ]
    if undescribed:
      notices.append(_undescribed_notice(undescribed))
    return Routed(tuple(default), tuple(notices))
  routed = _with_dimension_numbers(default, dims, leaves)
  return Routed(routed.routes, tuple(notices) + routed.notices)


def _layer_stacks(
    paths: list[str], leaves: list[Any], stacks: tuple[LayerStack, ...]
) -> tuple[list[LayerStack | None], list[str]]:
  """The ``LayerStack`` each leaf lies under (None: not stacked), and a warning
  for the scopes whose leaves differ in size along the layer axes (read as
  unstacked). A scope without a matrix per layer is not a stack."""
  found: list[LayerStack | None] = [None] * len(paths)
  scopes: dict[tuple[LayerStack, str], list[int]] = {}
  for i, (path, leaf) in enumerate(zip(paths, leaves)):
    if leaf is None or leaf.ndim < 2:
      continue
    for stack in stacks:
      scope = stack.scope(path, leaf.ndim)
      if scope is not None:
        found[i] = stack
        scopes.setdefault((stack, scope), []).append(i)
        break
  uneven = []
  for (stack, scope), members in scopes.items():
    if all(len(stack.per_layer_shape(leaves[i].shape)) < 2 for i in members):
      # Nothing in the scope would be a matrix per layer: not a stack.
      for i in members:
        found[i] = None
      continue
    sizes = {stack.layer_sizes(leaves[i].shape) for i in members}
    if len(sizes) > 1:
      for i in members:
        found[i] = None
      listed = ", ".join("×".join(map(str, n)) for n in sorted(sizes))
      uneven.append(f"'{scope}' ({stack.name}: sizes {listed})")
  notices = []
  if uneven:
    notices.append(
        "optax_muon: the leaves under "
        f"{tree_utils.listing(uneven)} match a Routing.layer_stacks rule but"
        " differ in size along its layer axis, so they are read as unstacked."
        " Give Routing(layer_stacks=...) a LayerStack that fits your tree, or"
        " layer_stacks=() to read no leaf as stacked."
    )
  return found, notices


def _layout_route(
    path: str,
    leaf: Any,
    routing: Routing,
    owner: tuple[str, ...],
    stack: LayerStack | None,
) -> Route | None:
  """The route a layout gives the leaf: under a layer stack, a
  ``routing.layouts`` rule for one layer's shape, else a matrix or a vector
  per layer; elsewhere a rule for the leaf's shape. None when neither
  describes it."""
  shape, ndim = tuple(leaf.shape), leaf.ndim
  per_layer = shape if stack is None else stack.per_layer_shape(shape)
  for rule in routing.layouts:
    if rule.matches(path, per_layer, owner):
      dims = rule.dimension_numbers(per_layer, routing.heads)
      name = rule.name
      if stack is not None:
        dims = None if dims is None else stack.lift(dims, ndim)
        name = f"{rule.name}, per layer ({stack.name})"
      optimizer = ADAM if dims is None else MUON
      return Route(path, optimizer, Reason.LAYOUT, dims, name, ndim)
  if stack is None:
    return None
  if len(per_layer) < 2:
    return Route(path, ADAM, Reason.LAYER_VECTORS, detail=stack.name, ndim=ndim)
  if len(per_layer) == 2:
    return Route(
        path,
        MUON,
        Reason.LAYER_MATRICES,
        stack.lift(MuonDimensionNumbers(0, 1), ndim),
        stack.name,
        ndim,
    )
  return None


def _matrix_of(route: Route) -> MuonDimensionNumbers | None:
  """The dimension numbers a route gives its leaf (None: AdamW)."""
  if route.optimizer == ADAM:
    return None
  return route.dimension_numbers or MuonDimensionNumbers(0, 1)


def _axes_key(dims: Any, ndim: int) -> tuple | None:
  """Dimension numbers as sorted non-negative axes, for comparison."""
  if dims is None:
    return None
  sides = []
  for axes in (dims.reduction_axis, dims.output_axis):
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    sides.append(tuple(sorted(a % ndim for a in axes)))
  return tuple(sides)


def _unreadable_message(errors: list[UnknownAxisNames]) -> str:
  unknown = sorted({n for e in errors for n in e.unknown})
  leaves = tree_utils.listing(
      [f"{e.path} ({', '.join(map(str, e.names))})" for e in errors]
  )
  return (
      f"optax_muon: logical axis names {unknown} have no role, on the leaves"
      f" {leaves}. Give them one with axis_roles={{name: role}}, role one of"
      " 'model', 'heads', 'head_dim', 'hidden', 'batch', 'vocab' (see"
      " LOGICAL_AXIS_ROLES), or describe the leaves with a Routing(layouts=...)"
      " rule."
  )


def _default_route(
    path: str,
    leaf: Any,
    pattern: re.Pattern | None,
    routing: Routing,
    bias: str | None,
    names: tuple | None,
    roles: Mapping[str, str] | None,
    layout: Route | None,
) -> Route:
  """Rule 3 of ``route``. A layout (``_layout_route``) wins over logical names:
  names can say where an axis is sharded rather than what it is (MaxText's
  ``shard_exp_on_fsdp`` names the experts of a kernel ``embed_moe``), and the
  route then says that its names read otherwise. Names describe the leaves
  no layout does; names without a role, on a leaf a layout describes, do not
  count."""
  ndim = leaf.ndim
  if ndim < 2:
    return Route(path, ADAM, Reason.FEWER_THAN_2_D, ndim=ndim)
  # A layout rule that names the leaf is more specific than its bias-like name.
  if bias is not None and (layout is None or layout.reason != Reason.LAYOUT):
    return Route(path, ADAM, Reason.BIAS, detail=bias, ndim=ndim)
  if pattern is not None and pattern.search(path):
    return Route(path, ADAM, Reason.PATTERN, ndim=ndim)
  if layout is not None and layout.optimizer == ADAM:
    return layout
  if names is not None:
    try:
      dims = from_logical_names(
          path, names, tuple(leaf.shape), roles, routing.heads
      )
    except UnknownAxisNames:
      if layout is None:
        raise
      return layout
    listed = "(" + ", ".join(map(str, names)) + ")"
    if layout is not None and _axes_key(dims, ndim) != _axes_key(
        _matrix_of(layout), ndim
    ):
      return dataclasses.replace(
          layout,
          detail=f"{layout.detail}; its logical names {listed} read otherwise",
      )
    optimizer = ADAM if dims is None else MUON
    return Route(path, optimizer, Reason.LOGICAL_NAMES, dims, listed, ndim)
  if layout is not None:
    return layout
  if ndim == 2:
    return Route(path, MUON, Reason.MATRIX, ndim=ndim)
  return Route(path, ADAM, Reason.UNDESCRIBED, ndim=ndim)


def _with_dimension_numbers(
    default: list[Route | None], dims: list[Any], leaves: list[Any]
) -> Routed:
  """Rule 2 of ``route``: the user's dimension numbers, with the default rule's
  verdict on biases and embeddings kept, and the differences said."""
  routes, kept_on_adam, none_for_matrix = [], [], []
  for r, d, leaf in zip(default, dims, leaves):
    if r is None:
      routes.append(None)
    elif is_dimension_numbers(d):
      if r.reason in (Reason.BIAS, Reason.PATTERN):
        routes.append(r)
        kept_on_adam.append((r.path, leaf))
      else:
        routes.append(
            Route(r.path, MUON, Reason.DIMENSION_NUMBERS, d, ndim=r.ndim)
        )
    else:
      routes.append(
          Route(r.path, ADAM, Reason.NO_DIMENSION_NUMBERS, ndim=r.ndim)
      )
      if r.optimizer == MUON:
        none_for_matrix.append((r.path, leaf))
  notices = []
  if kept_on_adam:
    notices.append(
        "optax_muon: muon_weight_dimension_numbers describes leaves that are"
        " biases or whose path matches adam_pattern (embeddings, heads,"
        f" norms); they go to AdamW: {_listing(kept_on_adam)}. To put them on"
        " Muon anyway, pass routing=Routing(adam_pattern=None, biases=False)"
        " (or a narrower adam_pattern), or Routing(labels=...)."
    )
  if none_for_matrix:
    notices.append(
        "optax_muon: muon_weight_dimension_numbers is None for leaves that the"
        " default routing puts on Muon; as in optax.contrib.muon they go to"
        f" AdamW: {_listing(none_for_matrix)}. Give them MuonDimensionNumbers()"
        " (2-D) to keep them on Muon —"
        " optax_muon.infer_dimension_numbers(params) describes every leaf — or"
        " state the choice with Routing(labels=...)."
    )
  return Routed(tuple(routes), tuple(notices))


@dataclasses.dataclass(frozen=True)
class RoutedDimensionNumbers:
  """The dimension numbers ``muon``'s routing gives its Muon leaves, as the
  callable ``weight_dimension_numbers`` of the Muon branch of its partition
  (which receives the Muon leaves only, the others masked).

  Attributes:
    routing: ``muon``'s routing.
    dims: the user's ``muon_weight_dimension_numbers``, frozen (or a callable),
      or None.
  """

  routing: Routing
  dims: Any = None

  def __call__(self, tree: Any) -> Any:
    dims = (
        None
        if self.dims is None
        else tree_utils.resolve_prefix(
            self.dims,
            tree,
            is_value=is_dimension_numbers,
            what="muon_weight_dimension_numbers",
        )
    )
    routes = decide(tree, self.routing, dims).routes
    _, treedef = tree_utils.flatten_positions(tree)
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            r.dimension_numbers
            if r is not None and r.optimizer == MUON
            else None
            for r in routes
        ],
    )


def _undescribed_notice(items: list[tuple[str, Any]]) -> str:
  return (
      "optax_muon: leaves of rank ≥ 3 go to AdamW because nothing says which"
      f" of their axes form Muon's matrix: {_listing(items)}. Describe them"
      " with muon_weight_dimension_numbers: stacked layers or experts (L,"
      " n_in, n_out) as MuonDimensionNumbers(1, 2), conv kernels (kh, kw,"
      " c_in, c_out) as MuonDimensionNumbers((0, 1, 2), 3); attention heads or"
      " fused kernels (e.g. (d_model, heads, head_dim)) with a"
      " Routing(layouts=...) rule or from logical axis names with"
      " optax_muon.infer_dimension_numbers (see the layouts page of the docs)."
      " Routing(labels=...) keeps them on AdamW without this warning."
  )


def infer_dimension_numbers(
    params: Any,
    routing: Routing | None = None,
    *,
    logical_names: Any = None,
    axis_roles: Mapping[str, str] | None = None,
) -> Any:
  """Dimension numbers for every leaf, as ``muon``'s default routing sees the
  tree.

  The result works as ``muon_weight_dimension_numbers`` for ``muon`` and for
  ``optax.contrib.muon`` (``MuonDimensionNumbers`` for each Muon leaf, 2-D ones
  included; ``None`` for each AdamW leaf), and shows how each leaf is read.
  Leaves are described by, first that applies: a layout (a
  ``routing.layer_stacks`` scope, a ``routing.layouts`` rule: ``KNOWN_LAYOUTS``
  for Gemma, Flax attention, MaxText, Equinox), their logical axis names
  (carried by linen's ``nn.with_logical_partitioning`` boxes or
  ``nnx.Variable`` sharding metadata in ``params``, or given as
  ``logical_names``), or the plain 2-D rule. Where names and a layout read a
  leaf differently, the layout wins (names can say where an axis is sharded,
  not what it is) and ``summarize`` says so. Biases, vectors and embeddings
  (``routing.adam_pattern``, a ``vocab`` axis) get None.

  Args:
    params: the params: arrays or ``jax.ShapeDtypeStruct`` objects, linen's
      boxed params or an ``nnx.State`` (their names are read).
    routing: ``heads`` (``"whole"`` or ``"per_head"``), ``layouts``,
      ``layer_stacks``, ``adam_pattern`` and ``biases`` as in ``muon``;
      ``None`` is ``Routing()``.
    logical_names: one tuple of logical axis names per leaf (a tree or prefix
      tree of tuples or ``PartitionSpec``s, e.g.
      ``nn.get_partition_spec(boxed_params)``), for params that don't carry
      them.
    axis_roles: roles for names ``LOGICAL_AXIS_ROLES`` does not know (name →
      ``"model"``, ``"heads"``, ``"head_dim"``, ``"hidden"``, ``"batch"`` or
      ``"vocab"``).

  Returns:
    A tree like ``params`` (boxes and Variables replaced by their entry) of
    ``MuonDimensionNumbers`` (optax.contrib's type where the installed optax has
    one) or None.

  Raises:
    ValueError: as ``route``, and for logical names that don't fit the params or
      have no role.

  Examples:
    >>> import jax.numpy as jnp, optax_muon
    >>> params = {"attn": {"q": jnp.zeros((64, 4, 16)),
    ...                    "o": jnp.zeros((4, 16, 64))},
    ...           "mlp": jnp.zeros((64, 256)), "norm": jnp.ones(64)}
    >>> names = {"attn": {"q": ("embed", "heads", "kv"),
    ...                   "o": ("heads", "kv", "embed")},
    ...          "mlp": ("embed", "mlp"), "norm": ("embed",)}
    >>> dims = optax_muon.infer_dimension_numbers(params, logical_names=names)
    >>> tuple(dims["attn"]["q"]), tuple(dims["attn"]["o"]), dims["norm"]
    (((0,), (1, 2)), ((0, 1), (2,)), None)
  """
  routing = routing or Routing()
  boxed = jax.tree.leaves(params, is_leaf=_is_box)
  structure = jax.tree.structure(params, is_leaf=_is_box)
  carried = [_logical_names_of(x) for x in boxed]
  plain = jax.tree.unflatten(structure, [_unbox(x) for x in boxed])
  names = carried
  if logical_names is not None:
    given = tree_utils.resolve_prefix(
        tree_utils.freeze_prefix(
            logical_names, is_value=_is_names, what="logical_names"
        ),
        plain,
        is_value=_is_names,
        what="logical_names",
    )
    names = [tuple(g) if g is not None else c for g, c in zip(given, carried)]
  elif all(n is None for n in carried):
    names = None
  routed = decide(plain, routing, None, names, axis_roles)
  for notice in routed.notices:
    warn_at_caller(notice)
  dims = [
      None
      if r is None or r.optimizer == ADAM
      else portable_dimension_numbers(
          r.dimension_numbers or MuonDimensionNumbers(0, 1)
      )
      for r in routed.routes
  ]
  return jax.tree.unflatten(
      jax.tree.structure(plain, is_leaf=tree_utils.is_placeholder), dims
  )


def _is_names(x: Any) -> bool:
  return isinstance(x, jax.sharding.PartitionSpec) or (
      isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)
  )
