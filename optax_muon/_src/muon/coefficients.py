"""Newton–Schulz coefficient tables: presets, validation and the Polar Express
generator.

A table is a sequence of odd quintics p(x) = a·x + b·x³ + c·x⁵, one per NS step,
plus the normalization the iteration starts from (X / (‖X‖_F·(1 + safety) +
eps)). Everything here is plain Python/NumPy evaluated at trace time; nothing is
traced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Union

import numpy as np

Triple = tuple[float, float, float]

#: The Polar Express cushion κ (Amsel et al. 2025): keeps p(x)/x bounded away
#: from zero.
POLAR_EXPRESS_CUSHION = 0.02407327424182761

_JORDAN: Triple = (3.4445, -4.7750, 2.0315)
_CONVERGENT: Triple = (2.0, -1.5, 0.5)  # p(1) = 1, p'(1) = 0.
_COLLAPSED_LIMIT: Triple = (15 / 8, -10 / 8, 3 / 8)
_DION: tuple[Triple, ...] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
_MODDED_NANOGPT: tuple[Triple, ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


@dataclasses.dataclass(frozen=True)
class NSCoefficients:
  """A resolved Newton–Schulz schedule: exactly one row per step.

  Attributes:
    rows: one (a, b, c) triple per NS step, in the order they are applied.
    safety: the input is divided by ‖X‖_F·(1 + safety) + eps before the first
      step.
    eps: added to the scaled norm, so that a zero matrix maps to zero.
    name: the preset name, or ``"custom"``.
  """

  rows: tuple[Triple, ...]
  safety: float = 0.0
  eps: float = 1e-7
  name: str = "custom"

  @property
  def steps(self) -> int:
    return len(self.rows)


@dataclasses.dataclass(frozen=True)
class _Preset:
  rows: tuple[
      Triple, ...
  ]  # Its own table; the last row repeats for further steps.
  default_steps: int
  safety: float
  eps: float


_PRESETS: dict[str, _Preset] = {
    "jordan": _Preset((_JORDAN,), 5, 0.0, 1e-7),
    "deepseek_v4": _Preset((_JORDAN,) * 8 + (_CONVERGENT,) * 2, 10, 0.0, 1e-7),
    "dion": _Preset(_DION, 5, 0.0, 1e-7),
    "modded_nanogpt": _Preset(_MODDED_NANOGPT, 5, 0.02, 1e-6),
    # "polar_express" is generated; see _polar_express_preset.
}
_POLAR_EXPRESS_DEFAULT_STEPS = 5
_POLAR_EXPRESS_SAFETY = 0.01
_POLAR_EXPRESS_EPS = 1e-7

#: The coefficient presets ``ns_coeffs`` may name (see
#: ``resolve_coefficients``).
PRESET_NAMES: tuple[str, ...] = (
    "jordan",
    "polar_express",
    "deepseek_v4",
    "dion",
    "modded_nanogpt",
)
#: optax.contrib.muon's preset names that are spelled differently here.
_PRESET_ALIASES = {"standard": "jordan"}

CoefficientsLike = Union[
    str, Sequence[float], Sequence[Sequence[float]], NSCoefficients, tuple
]


def _fit_rows(rows: Sequence[Triple], steps: int) -> tuple[Triple, ...]:
  """First ``steps`` rows of a table, repeating its last row when more are asked
  for."""
  rows = tuple(rows)
  return rows[:steps] + (rows[-1],) * max(0, steps - len(rows))


def _validate_steps(steps, what: str) -> int:
  if (
      isinstance(steps, bool)
      or not hasattr(steps, "__index__")
      or getattr(steps, "ndim", 0) != 0
      or steps < 1
  ):
    raise ValueError(f"{what} must be a positive integer, got {steps!r}.")
  return int(steps)


def _validate_table(coeffs) -> tuple[Triple, ...]:
  """Turns a user's triple or sequence of triples into a tuple of float
  triples."""
  try:
    arr = np.asarray(coeffs, dtype=np.float64)
  except (TypeError, ValueError) as e:
    raise ValueError(
        f"Newton–Schulz coefficients must be a preset name {PRESET_NAMES}, an"
        f" (a, b, c) triple or a sequence of triples; got {coeffs!r}."
    ) from e
  if arr.shape != (3,) and (
      arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] != 3
  ):
    raise ValueError(
        "Newton–Schulz coefficients must be an (a, b, c) triple or a non-empty"
        " sequence of triples (shape (3,) or (steps, 3)); got shape"
        f" {arr.shape} from {coeffs!r}."
    )
  arr = arr.reshape(-1, 3)
  if not np.all(np.isfinite(arr)):
    raise ValueError(
        f"Newton–Schulz coefficients must be finite; got {coeffs!r}."
    )
  return tuple(tuple(float(v) for v in row) for row in arr)


def resolve_coefficients(
    ns_coeffs: CoefficientsLike = "jordan",
    ns_steps: int | None = None,
    eps: float | None = None,
) -> NSCoefficients:
  """Resolves a user's coefficient spec into one row per NS step.

  Args:
    ns_coeffs: a preset name (see ``PRESET_NAMES``; optax.contrib's
      ``"standard"`` is ``"jordan"``); ``("polar_express", steps, lower_bound)``
      for a generated Polar Express table; an ``(a, b, c)`` triple (repeated
      every step); a sequence of triples (one per step); or an
      ``NSCoefficients``.
    ns_steps: number of NS steps. ``None`` takes the preset's own count (5 for a
      single custom triple, the table's length for a custom table). More steps
      than a table has repeat its last row; fewer take its first rows.
    eps: overrides the preset's epsilon in the normalization.

  Returns:
    An ``NSCoefficients`` with exactly ``steps`` rows.

  Raises:
    ValueError: unknown preset, malformed or empty table, non-positive steps.

  Examples:
    >>> from optax_muon._src.muon.coefficients import resolve_coefficients
    >>> table = resolve_coefficients("dion", 3)
    >>> table.steps, table.rows[0]
    (3, (4.0848, -6.8946, 2.927))
    >>> resolve_coefficients((3.4445, -4.775, 2.0315)).steps
    5
  """
  coeffs, steps = ns_coeffs, ns_steps
  if steps is not None:
    steps = _validate_steps(steps, "ns_steps")
  if isinstance(coeffs, NSCoefficients):
    out = (
        coeffs
        if steps is None
        else dataclasses.replace(coeffs, rows=_fit_rows(coeffs.rows, steps))
    )
  elif isinstance(coeffs, str):
    out = _resolve_preset(coeffs, steps)
  elif (
      isinstance(coeffs, tuple)
      and len(coeffs) == 3
      and isinstance(coeffs[0], str)
  ):
    name, table_steps, lower_bound = coeffs
    if name != "polar_express":
      raise ValueError(
          "Only ('polar_express', steps, lower_bound) may be parameterized; "
          f"got {coeffs!r}."
      )
    rows = polar_express_coefficients(table_steps, lower_bound)
    out = NSCoefficients(
        _fit_rows(rows, steps or len(rows)),
        _POLAR_EXPRESS_SAFETY,
        _POLAR_EXPRESS_EPS,
        "polar_express",
    )
  else:
    rows = _validate_table(coeffs)
    default_steps = 5 if len(rows) == 1 else len(rows)
    out = NSCoefficients(_fit_rows(rows, steps or default_steps))
  if eps is not None:
    out = dataclasses.replace(out, eps=float(eps))
  return out


def _resolve_preset(name: str, steps: int | None) -> NSCoefficients:
  if name == "polar_express":
    steps = steps or _POLAR_EXPRESS_DEFAULT_STEPS
    return NSCoefficients(
        polar_express_coefficients(steps),
        _POLAR_EXPRESS_SAFETY,
        _POLAR_EXPRESS_EPS,
        name,
    )
  name = _PRESET_ALIASES.get(name, name)
  if name not in _PRESETS:
    raise ValueError(
        f"Unknown Newton–Schulz preset {name!r}; expected one of "
        f"{PRESET_NAMES + tuple(_PRESET_ALIASES)}."
    )
  preset = _PRESETS[name]
  return NSCoefficients(
      _fit_rows(preset.rows, steps or preset.default_steps),
      preset.safety,
      preset.eps,
      name,
  )


# ----------------------------------------------------------------------------
# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932).


def _odd_quintic(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
  a, b, c = coeffs
  return x * (a + x * x * (b + c * x * x))


def _minimax_odd_quintic(
    lo: float, hi: float, iterations: int = 100
) -> np.ndarray:
  """The odd quintic minimizing max ``|1 − p(x)|`` on [lo, hi], by Remez
  exchange.

  The optimum equioscillates at lo, two interior extrema and hi: p = 1 − E, 1 +
  E, 1 − E, 1 + E there.
  """
  # Start from the Chebyshev extrema of the interval.
  points = lo + (hi - lo) * (1 - np.cos(np.pi * np.arange(4) / 3)) / 2
  signs = np.array([-1.0, 1.0, -1.0, 1.0])
  coeffs = np.zeros(3)
  for _ in range(iterations):
    # Unknowns (a, b, c, E): a·x + b·x³ + c·x⁵ − s·E = 1.
    system = np.stack([points, points**3, points**5, -signs], axis=1)
    solution = np.linalg.solve(system, np.ones(4))
    coeffs = solution[:3]
    a, b, c = coeffs
    # Interior extrema: p'(x) = a + 3b·x² + 5c·x⁴ = 0, a quadratic in x².
    roots = np.roots([5 * c, 3 * b, a])
    squares = np.sort(roots[np.isreal(roots)].real)
    inner = np.sqrt(squares[(squares > lo * lo) & (squares < hi * hi)])
    if inner.size != 2:
      break
    new_points = np.array([lo, inner[0], inner[1], hi])
    if np.max(np.abs(new_points - points)) <= 1e-15 * hi:
      break
    points = new_points
  return coeffs


@functools.lru_cache(maxsize=None)
def _polar_express_raw(
    steps: int, lower_bound: float, cushion: float
) -> tuple[Triple, ...]:
  lo, hi = float(lower_bound), 1.0
  rows = []
  for _ in range(steps):
    if hi - lo < 1e-7:
      # The interval has collapsed onto 1: the optimal step is the limit (15,
      # −10, 3)/8.
      coeffs = np.array(_COLLAPSED_LIMIT)
    else:
      coeffs = _minimax_odd_quintic(max(lo, cushion * hi), hi)
      coeffs = (
          coeffs * 2.0 / (_odd_quintic(coeffs, lo) + _odd_quintic(coeffs, hi))
      )
    rows.append(tuple(float(v) for v in coeffs))
    lo = float(_odd_quintic(coeffs, lo))
    hi = 2.0 - lo
  return tuple(rows)


def polar_express_coefficients(
    steps: int,
    lower_bound: float = 1e-3,
    *,
    safety: float = _POLAR_EXPRESS_SAFETY,
    cushion: float = POLAR_EXPRESS_CUSHION,
) -> tuple[Triple, ...]:
  """Generates a Polar Express coefficient table (Amsel et al. 2025).

  Greedy construction: at each step the odd quintic minimizing max ``|1 −
  p(x)|`` over the cushioned interval [max(ℓ, κ·u), u], rescaled so that p(ℓ) +
  p(u) = 2, after which the interval maps forward (ℓ ← p(ℓ), u ← 2 − ℓ). Once it
  has collapsed onto 1 the step is the limit (15/8, −10/8, 3/8). Each row but
  the last is then replaced by p(x / (1 + safety)) so that bf16 rounding cannot
  push a singular value past the region the next step expects.

  Args:
    steps: number of rows.
    lower_bound: ℓ, the smallest normalized singular value the table must lift
      to ≈ 1.
    safety: the relative margin above; 0 gives the raw published rows.
    cushion: κ.

  Returns:
    A tuple of ``steps`` (a, b, c) triples. Cached per argument tuple.

  Raises:
    ValueError: if steps is not positive or the bounds are not in (0, 1).

  Examples:
    >>> import optax_muon
    >>> rows = optax_muon.polar_express_coefficients(8, safety=0.0)
    >>> [round(v, 4) for v in rows[0]]  # the published first row
    [8.2872, -23.5959, 17.3004]

  References:
    Amsel et al., `The Polar Express: Optimal Matrix Sign Methods and Their
    Application to the Muon Algorithm <https://arxiv.org/abs/2505.16932>`_,
    2025.
  """
  steps = _validate_steps(steps, "polar_express_coefficients: steps")
  if not 0.0 < lower_bound < 1.0:
    raise ValueError(f"lower_bound must lie in (0, 1), got {lower_bound!r}.")
  if not 0.0 <= cushion < 1.0 or safety < 0.0:
    raise ValueError(
        f"Need 0 <= cushion < 1 and safety >= 0; got {cushion=}, {safety=}."
    )
  raw = _polar_express_raw(steps, float(lower_bound), float(cushion))
  f = 1.0 + safety
  return tuple((a / f, b / f**3, c / f**5) for a, b, c in raw[:-1]) + (raw[-1],)


def singular_value_range(
    ns_coeffs: CoefficientsLike,
    lower_bound: float = 1e-3,
    *,
    ns_steps: int | None = None,
    points: int = 20001,
) -> tuple[float, float]:
  """Exact-arithmetic range of NS outputs for normalized singular values in [ℓ,
  1].

  Composes the scalar polynomials on a log-spaced grid in float64 (NS acts on
  each singular value independently, so this is the iteration's worst case up to
  rounding).

  Args:
    ns_coeffs: anything ``resolve_coefficients`` accepts.
    lower_bound: ℓ.
    ns_steps: as in ``resolve_coefficients``.
    points: grid size.

  Returns:
    (min, max) of the composed polynomial over the grid.

  Examples:
    >>> import optax_muon
    >>> lo, hi = optax_muon.singular_value_range("deepseek_v4")
    >>> round(lo, 4), round(hi, 4)
    (1.0, 1.0005)
  """
  table = resolve_coefficients(ns_coeffs, ns_steps)
  x = np.geomspace(lower_bound, 1.0, points) / (1.0 + table.safety)
  for row in table.rows:
    x = _odd_quintic(np.asarray(row), x)
  return float(x.min()), float(x.max())
