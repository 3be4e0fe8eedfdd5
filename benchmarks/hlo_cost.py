"""Per-device figures read off a compiled XLA program: matmul FLOPs,
collectives, memory.

XLA's own ``cost_analysis`` counts a while-loop body once; here every
instruction is weighted by the trip counts of the loops around it
(``known_trip_count``), so an NS loop of 5 steps counts 5 times. A device runs
one branch of a conditional (``lax.switch``): the FLOPs count its most expensive
branch, and each branch's FLOPs are kept so that a caller who knows which device
takes which branch gets every device's figure. Received bytes follow the ring
model of ``shared/notes/muon.md``: all-gather and all-to-all B·(g−1)/g,
reduce-scatter B·(g−1), all-reduce 2·B·(g−1)/g, collective-permute B, with B the
output bytes and g the group size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$"
)
_CALLEE = re.compile(r"\b(?:calls|body|to_apply|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+), "
    r"false_computation=%?([\w.\-]+))"
)
_COLLECTIVES = (
    "all-to-all",
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "collective-permute",
)


def _array_bytes(type_text: str) -> int:
  return sum(
      _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
      for dt, dims in _ARRAY.findall(type_text)
  )


def _result_bytes(type_text: str, started: bool) -> int:
  """The bytes of a collective's result: an asynchronous ``*-start`` has a
  tuple type (operands, result, …) on some backends (the GPU's all-gather and
  reduce-scatter, the TPU's all-to-all, with a context scalar after it): its
  second element."""
  text = type_text.strip()
  if not (started and text.startswith("(")):
    return _array_bytes(text)
  depth, cuts = 0, [0]
  for i, ch in enumerate(text):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 1:
      cuts.append(i)
  if len(cuts) < 2:
    return _array_bytes(text)
  end = cuts[2] if len(cuts) > 2 else len(text) - 1
  return _array_bytes(text[cuts[1] + 1 : end])


def _dims(type_text: str) -> list[int]:
  match = _ARRAY.search(type_text)
  return [int(d) for d in match.group(2).split(",") if d] if match else []


def _convolution_flops(line: str, type_text: str, rhs_dims: list[int]) -> int:
  """2·|out|·(input features)·(window taps that land on input elements): a
  batched matrix product written as a convolution (the TPU compiler's form: the
  batch as a spatial dimension, window size k with lhs_dilate k, so that each
  output sees one input)."""
  labels = re.search(r"dim_labels=\w+_(\w+)->", line).group(1)
  features = rhs_dims[labels.index("i")]
  window = re.search(r"window=\{([^}]*)\}", line)
  taps = 1
  if window:
    fields = dict(f.split("=") for f in window.group(1).split())
    sizes = [int(v) for v in fields.get("size", "1").split("x")]
    dilations = [
        int(v)
        for v in fields.get("lhs_dilate", "x".join("1" * len(sizes))).split("x")
    ]
    taps = math.prod(
        -(-size // dilation) for size, dilation in zip(sizes, dilations)
    )
  return 2 * math.prod(_dims(type_text)) * features * taps


def _group_size(line: str, default: int) -> int:
  groups = _groups(line)
  return (
      len(groups[0])
      if groups and "source_target_pairs" not in line
      else default
  )


def _groups(line: str) -> tuple[tuple[int, ...], ...] | None:
  """The device groups of a collective (``replica_groups`` written out, or in
  XLA's iota form ``[G,S]<=[dims]T(perm)``; a collective-permute's
  source–target pairs), or None where the line gives none (every device)."""
  by_mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if by_mesh:  # devices over named axes, row-major; groups vary the listed
    axes = re.findall(r"'([^']+)'=(\d+)", by_mesh.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    varying = re.findall(r"'([^']+)'", by_mesh.group(2))
    ids = np.arange(math.prod(sizes)).reshape(sizes)
    order = [i for i, a in enumerate(names) if a not in varying] + [
        names.index(a) for a in varying
    ]
    size = math.prod(sizes[names.index(a)] for a in varying)
    return tuple(map(tuple, ids.transpose(order).reshape(-1, size).tolist()))
  iota = re.search(
      r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line
  )
  if iota:
    count, size = int(iota.group(1)), int(iota.group(2))
    ids = np.arange(count * size).reshape(
        [int(d) for d in iota.group(3).split(",")]
    )
    if iota.group(4):
      ids = ids.transpose([int(a) for a in iota.group(4).split(",")])
    return tuple(map(tuple, ids.reshape(count, size).tolist()))
  listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
  if listed and listed.group(1):
    return tuple(
        tuple(int(i) for i in g.split(",") if i)
        for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
    )
  pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
  if pairs:
    return tuple(
        (int(a), int(b))
        for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))
    )
  return None


@dataclasses.dataclass
class Collective:
  """One collective: its kind, output bytes, group size, and whether it sits in
  a loop."""

  kind: str
  output_bytes: int
  group_size: int
  multiplicity: int
  in_loop: bool
  groups: tuple[tuple[int, ...], ...] | None = None

  @property
  def received_bytes(self) -> float:
    b, g = self.output_bytes, self.group_size
    per_call = {
        "all-gather": b * (g - 1) / g,
        "all-to-all": b * (g - 1) / g,
        "reduce-scatter": b * (g - 1),
        "all-reduce": 2 * b * (g - 1) / g,
        "collective-permute": b,
    }[self.kind]
    return per_call * self.multiplicity


@dataclasses.dataclass
class Conditional:
  """One conditional: the dot FLOPs of each branch (in branch order), and how
  often it runs."""

  branch_flops: tuple[int, ...]
  multiplicity: int


@dataclasses.dataclass
class HloCost:
  """Per-device figures of one compiled program.

  Attributes:
    dot_flops: 2·|out|·|contracted| summed over dot instructions (and the
      convolutions a TPU writes them as), times loop trip counts; a conditional
      counts its most expensive branch.
    collectives: every collective instruction.
    temp_bytes: XLA's temp allocation
      (``memory_analysis().temp_size_in_bytes``).
    conditionals: every conditional that holds dots, outermost ones only.
  """

  dot_flops: int
  collectives: list[Collective]
  temp_bytes: int
  conditionals: list[Conditional] = dataclasses.field(default_factory=list)

  def device_dot_flops(self, branches: list) -> int:
    """Dot FLOPs of a device that takes branch ``branches[k]`` of conditional
    k: one branch, or one per run of a conditional in a loop (an exchange's
    stages)."""
    flops = self.dot_flops
    for c, b in zip(self.conditionals, branches, strict=True):
      runs = np.atleast_1d(b)
      for branch in runs:
        flops += (
            (c.branch_flops[branch] - max(c.branch_flops))
            * c.multiplicity
            // len(runs)
        )
    return flops

  @property
  def received_bytes(self) -> float:
    return sum(c.received_bytes for c in self.collectives)

  @property
  def collectives_in_loops(self) -> int:
    return sum(c.in_loop for c in self.collectives)


def _trip_count(line: str, computations: dict[str, list[str]]) -> int:
  """A while loop's trip count: XLA's ``known_trip_count`` where the compiler
  records it (CPU, GPU), else the bound of the condition's ``i < N`` (the TPU
  compiler's loops, counters from 0)."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
  if known:
    return int(known.group(1))
  condition = re.search(r"\bcondition=%?([\w.\-]+)", line).group(1)
  body = "\n".join(computations.get(condition, []))
  bound = re.search(r"constant\((\d+)\)", body)
  return int(bound.group(1)) if bound and "direction=LT" in body else 1


def _walk(text: str, computations: dict[str, list[str]], on_conditional=None):
  """How many times each computation runs per call of the program (the product
  of the trip counts of the loops around it), and whether a loop is around it.

  ``on_conditional(line, times)`` is called for each conditional outside any
  other conditional's branches.

  Returns:
    (multiplicity, in_loop), dicts by computation name.
  """
  entry = next(
      _COMPUTATION.match(l).group(1)
      for l in text.splitlines()
      if l.startswith("ENTRY")
  )
  multiplicity: dict[str, int] = defaultdict(int)
  in_loop: dict[str, bool] = defaultdict(bool)

  def visit(name: str, times: int, looped: bool, top: bool) -> None:
    multiplicity[name] += times
    in_loop[name] = in_loop[name] or looped
    for line in computations.get(name, []):
      inst = _INSTRUCTION.match(line)
      if not inst:
        continue
      if inst.group(3) == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", line).group(1)
        visit(body, times * _trip_count(line, computations), True, top)
        continue
      if inst.group(3) == "conditional":
        if top and on_conditional is not None:
          on_conditional(line, times)
        for b in _branches(line):
          visit(b, times, looped, False)
        continue
      for callee in _CALLEE.findall(line):
        if callee in computations:
          visit(callee, times, looped, top)

  visit(entry, 1, False, True)
  return multiplicity, in_loop


def analyze(compiled, device_count: int) -> HloCost:
  """Reads the figures off ``jax.jit(f).lower(...).compile()``.

  Args:
    compiled: a compiled JAX program.
    device_count: default group size for collectives without explicit groups.

  Returns:
    An ``HloCost``.
  """
  text = compiled.as_text()
  computations = _computations(text)
  entry = next(
      _COMPUTATION.match(l).group(1)
      for l in text.splitlines()
      if l.startswith("ENTRY")
  )
  trip_count = lambda line: _trip_count(line, computations)
  conditionals: list[Conditional] = []

  memo: dict[str, int] = {}

  def dot_flops(name: str) -> int:
    """Dot FLOPs of one run of computation ``name`` (loops, calls, costliest
    branch)."""
    if name in memo:
      return memo[name]
    total, shapes = 0, {}
    for line in computations.get(name, []):
      inst = _INSTRUCTION.match(line)
      if not inst:
        continue
      result, type_text, opcode, rest = inst.groups()
      shapes[result] = type_text
      if opcode == "dot":
        lhs = rest.split(",")[0].split()[-1].lstrip("%")
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        lhs_dims = _dims(shapes.get(lhs, ""))
        contracted = math.prod(
            lhs_dims[int(d)] for d in contracting.group(1).split(",") if d
        )
        total += 2 * math.prod(_dims(type_text)) * contracted
      elif (
          opcode == "convolution"
      ):  # how the TPU compiler writes a (batched) dot
        rhs = rest.split(",")[1].split()[-1].lstrip("%").rstrip(")")
        total += _convolution_flops(line, type_text, _dims(shapes.get(rhs, "")))
      elif opcode == "while":
        body = re.search(r"\bbody=%?([\w.\-]+)", line).group(1)
        total += trip_count(line) * dot_flops(body)
      elif opcode == "conditional":
        total += max(dot_flops(b) for b in _branches(line))
      else:
        total += sum(
            dot_flops(c) for c in _CALLEE.findall(line) if c in computations
        )
    memo[name] = total
    return total

  def conditional(line: str, times: int) -> None:
    flops = tuple(dot_flops(b) for b in _branches(line))
    if any(flops):
      conditionals.append(Conditional(flops, times))

  multiplicity, in_loop = _walk(text, computations, conditional)

  collectives = []
  for name, lines in computations.items():
    times = multiplicity.get(name, 0)
    if not times:
      continue
    for line in lines:
      inst = _INSTRUCTION.match(line)
      if not inst:
        continue
      _, type_text, opcode, _ = inst.groups()
      base = opcode.removesuffix("-start")
      if opcode == "send" and "_xla_megascale_transfer_type" in line:
        collectives.append(
            _across_slices(line, type_text, device_count, times, in_loop[name])
        )
      elif base in _COLLECTIVES and not opcode.endswith("-done"):
        collectives.append(
            Collective(
                base,
                _result_bytes(type_text, opcode.endswith("-start")),
                _group_size(line, device_count),
                times,
                in_loop[name],
                _groups(line),
            )
        )
  memory = compiled.memory_analysis()
  return HloCost(
      dot_flops(entry),
      collectives,
      int(getattr(memory, "temp_size_in_bytes", 0)),
      conditionals,
  )


_MEGASCALE_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
}


def _across_slices(
    line: str, type_text: str, device_count: int, times: int, looped: bool
) -> Collective:
  """A collective across TPU slices (over the data-center network), which the
  TPU compiler writes as a host-transfer ``send`` of the device's buffer to
  the multi-slice runtime: its kind in ``_xla_megascale_transfer_type`` (or
  the rendezvous name), its devices in ``_xla_megascale_target``, either
  ``"{slices}x{devices}"`` (the devices of each position in every slice) or
  explicit groups ``{{id, …}, …}`` with id = slice·100000 + device (slices
  from 1). Devices are numbered slice after slice."""
  named = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
  if named:
    kind = _MEGASCALE_KINDS[named.group(1)]
  else:
    rendezvous = re.search(r'_xla_host_transfer_rendezvous="([a-z\-_]+)', line)
    kind = rendezvous.group(1).rstrip("._").replace("_", "-")
  if kind not in _MEGASCALE_KINDS.values():
    raise ValueError(f"an unknown transfer across slices: {kind}")
  product = re.search(r'_xla_megascale_target="\{([\d,:]+)\}x', line)
  if product:
    slices = sum(
        int(b) - int(a) + 1 if ":" in part else 1
        for part in product.group(1).split(",")
        for a, _, b in [part.partition(":")]
    )
    per_slice = device_count // slices
    groups = tuple(
        tuple(k + j * per_slice for j in range(slices))
        for k in range(per_slice)
    )
  else:
    listed = re.search(r"_xla_megascale_target=\{(\{[\d,{}]*\})\}", line)
    ids = [
        [int(i) for i in g.split(",")]
        for g in re.findall(r"\{([\d,]+)\}", listed.group(1))
    ]
    slices = len({i // 100000 for g in ids for i in g})
    per_slice = device_count // slices
    groups = tuple(
        tuple((i // 100000 - 1) * per_slice + i % 100000 for i in g)
        for g in ids
    )
  size = len(groups[0])
  sent = _array_bytes(_ARRAY.search(type_text).group(0))
  out = {"all-gather": sent * size, "reduce-scatter": sent // size}
  return Collective(kind, out.get(kind, sent), size, times, looped, groups)


def _computations(text: str) -> dict[str, list[str]]:
  """Computation name → its instruction lines, in the order printed (the
  schedule's, in a scheduled module)."""
  computations: dict[str, list[str]] = {}
  current = None
  for line in text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not line.startswith(" "):
      current = header.group(1)
      computations[current] = []
    elif current is not None and line.strip() != "}":
      computations[current].append(line)
  return computations


def overlapped_bytes(compiled, kind: str = "all-to-all") -> tuple[float, float]:
  """(output bytes of the ``kind`` collectives with matrix products scheduled
  between their start and done, output bytes of all ``kind`` collectives), each
  collective weighted by the trip counts of the loops around it (an exchange in
  stages runs as a loop).

  A synchronous collective (no start/done pair, as the TPU compiler emits them
  unless asynchronous collectives are enabled) overlaps nothing.
  """
  text = compiled.as_text()
  computations = _computations(text)
  multiplicity, _ = _walk(text, computations)
  has_product: dict[str, bool] = {}

  def products(name: str) -> bool:
    if name not in has_product:
      has_product[name] = False
      lines = computations.get(name, [])
      has_product[name] = any(_line_has_product(l, products) for l in lines)
    return has_product[name]

  overlapped = total = 0.0
  for name, lines in computations.items():
    times = multiplicity.get(name, 0)
    started: dict[str, tuple[int, float]] = {}
    for position, line in enumerate(lines):
      inst = _INSTRUCTION.match(line)
      if not inst:
        continue
      result, type_text, opcode, rest = inst.groups()
      if opcode == kind:
        total += times * _array_bytes(type_text)
      elif opcode == f"{kind}-start":
        # The start's type is ((operands), result): count the result once.
        size = times * _array_bytes(type_text) / 2
        started[result] = (position, size)
        total += size
      elif opcode == f"{kind}-done":
        start = rest.split(")")[0].split(",")[0].strip().lstrip("%")
        if start in started:
          first, size = started.pop(start)
          if any(
              _line_has_product(l, products)
              for l in lines[first + 1 : position]
          ):
            overlapped += size
  return overlapped, total


def _branches(line: str) -> list[str]:
  """The branch computations of a conditional (none for other lines)."""
  match = _BRANCHES.search(line)
  if not match:
    return []
  if match.group(1) is not None:
    return [b.strip().lstrip("%") for b in match.group(1).split(",")]
  return [match.group(2), match.group(3)]


def _line_has_product(line: str, products) -> bool:
  """Whether the instruction is a matrix product or calls one: in a fusion, a
  loop, or a branch of a conditional (``lax.switch``'s per-worker programs)."""
  inst = _INSTRUCTION.match(line)
  if not inst:
    return False
  if inst.group(3) in ("dot", "convolution"):
    return True
  callees = _CALLEE.findall(line) + _branches(line)
  return any(products(c) for c in callees)


def compiled_device_flops(cost, plan) -> np.ndarray:
  """Each device's compiled NS FLOPs, as an array of the mesh's shape.

  The HLO gives each ``lax.switch`` branch's FLOPs; the plan says which branch
  each device takes. A conditional is matched to the plan's switch with the same
  branch FLOPs.

  Raises:
    ValueError: if the compiled conditionals don't match the plan's switches.
  """
  switches = plan.switches()
  branches = [tuple(c.branch_flops) for c in cost.conditionals]
  if sorted(branches) != sorted(flops for flops, _ in switches):
    raise ValueError(
        f"compiled branches {branches} are not the plan's "
        f"{[flops for flops, _ in switches]}"
    )
  unmatched = list(switches)
  choice = []
  for flops in branches:
    k = next(k for k, s in enumerate(unmatched) if s[0] == flops)
    choice.append(unmatched.pop(k)[1])
  shape = [size for _, size in plan.mesh_shape]
  out = np.zeros(shape, np.int64)
  for index in np.ndindex(*shape):
    out[index] = cost.device_dot_flops([c[index] for c in choice])
  return out


def crossing_bytes(
    collective: Collective, coordinate: list[tuple[int, ...]], device_count: int
) -> float:
  """The bytes a device receives in ``collective`` across the boundary that
  ``coordinate`` draws (device id → its coordinate along some mesh axes, e.g.
  its replica): for an all-reduce, all-gather or reduce-scatter the share
  (c − 1)/(g − 1) of its ring-model bytes, c the distinct coordinates in a
  group of g (what it moves across the boundary when it runs inside each
  coordinate first: the least any schedule moves); for an all-to-all the share
  of its peers on other coordinates; for a collective-permute the share of
  pairs that cross."""
  groups = collective.groups or (tuple(range(device_count)),)
  if collective.kind == "collective-permute":
    crossing = [coordinate[a] != coordinate[b] for a, b in groups]
    return collective.received_bytes * sum(crossing) / max(len(crossing), 1)
  shares = []
  for group in groups:
    g, c = len(group), len({coordinate[i] for i in group})
    if g == 1:
      shares.append(0.0)
    elif collective.kind == "all-to-all":
      shares.append((g - g / c) / (g - 1))
    else:
      shares.append((c - 1) / (g - 1))
  return collective.received_bytes * max(shares)


def mesh_coordinate(mesh_shape: tuple[int, ...], axes: tuple[int, ...]):
  """Device id → its coordinate along the mesh axes ``axes`` (positions in
  ``mesh_shape``), for a program compiled over the mesh's devices in their
  order (an SPMD program's ids are positions in its device assignment)."""
  coordinates = np.indices(mesh_shape).reshape(len(mesh_shape), -1).T
  return [tuple(int(c[a]) for a in axes) for c in coordinates]
