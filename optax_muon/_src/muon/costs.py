"""Cost accounting: what Newton–Schulz and the plan's collectives cost, and how
long it takes.

The planner, ``summarize`` and the tests that check the compiled update against
the plan all read it.

* NS FLOPs of one matrix, whole or per team member (``ns_flops``; ``uses_gram``
  picks the iteration by them; ``matrix_flops`` and ``team_cost`` under an
  ``NSOptions``), and the collectives a team member runs (``team_collectives``,
  ``TeamCost``).
* Modelled time, an alpha–beta model of one device (``CostModel``, from
  ``core.profiles``): time = FLOPs
  / flops_per_second + Σ over collectives (collective_latency + bytes received /
  bytes_per_second). A matrix of c FLOPs of Newton–Schulz takes c / rate on one
  device; on a team of k devices about c / (k·rate) on each, plus per step the
  all-reduce of the m × m Gram matrix (a reduce-scatter and an all-gather) and
  the all-gather of the polynomial's rows, each receiving (k − 1)/k·m² elements.
  Splitting pays when the compute it saves exceeds the collectives it adds; the
  plan decides that for the whole tree (``optax_muon._src.muon.plan``).
* The pipelined time of an exchange in stages (``pipelined_seconds``).

A plan's figures per device (NS FLOPs, received bytes, modelled seconds, the
busiest device's and the lower bound) are the plan's own methods
(``plan.model.Plan``): the plan holds ``TeamCost`` and ``CostModel`` values, so
it sits above this module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_muon._src.core.matrices import ns_orientation
from optax_muon._src.core.profiles import CostModel

METHODS = ("standard", "gram", "auto")
#: Steps between Gram restarts; see ``newton_schulz``.
GRAM_RESTART = 3


# NS FLOPs and team collectives of one matrix.


def _gram_chunk_flops(m: int, n: int, steps: int, rows: int) -> int:
  """G and the final Q·X (4·m²·n); P_0 (2·r·m²); if more steps: A_1 (4·r·m²),
  8·r·m² per middle step (A², Q·P, P·A·P) and 4·r·m² for the last (A², Q·P); r
  the rows of the m × m products a device computes (m on one device)."""
  if steps == 1:
    return 4 * m * m * n + 2 * rows * m * m
  return 4 * m * m * n + (10 + 8 * (steps - 2)) * rows * m * m


def _gram_chunks(steps: int, gram_restart: int) -> list[int]:
  """The steps of each run between Gram restarts."""
  return [min(gram_restart, steps - s) for s in range(0, steps, gram_restart)]


def ns_flops(
    m: int,
    n: int,
    steps: int,
    gram: bool = False,
    gram_restart: int = GRAM_RESTART,
    team: int = 1,
) -> int:
  """FLOPs of ``steps`` NS steps on one m × n matrix (counted on the short side
  m ≤ n), on each member of a team of ``team`` devices (n divisible by it).

  Standard: 4·m²·n/k + 2·⌈m/k⌉·m² per step (the rows of the m × m polynomial
  split too). Gram: see ``newton_schulz``'s Gram iteration; in a team every m ×
  m product is split by rows as well (⌈m/k⌉ of them on each member).

  Examples:
    >>> from optax_muon._src.muon.costs import ns_flops
    >>> ns_flops(256, 1024, 5)  # 5·(4·256²·1024 + 2·256³)
    1509949440
    >>> ns_flops(256, 1024, 5, team=4)  # a quarter on each of 4 devices
    377487360
  """
  (m, n), _ = ns_orientation(m, n)
  n //= team
  rows = -(-m // team)
  if not gram:
    return steps * (4 * m * m * n + 2 * rows * m * m)
  return sum(
      _gram_chunk_flops(m, n, k, rows)
      for k in _gram_chunks(steps, gram_restart)
  )


def team_collectives(
    m: int,
    n: int,
    steps: int,
    team: int,
    gram: bool = False,
    gram_restart: int = GRAM_RESTART,
) -> tuple[tuple[int, bool], ...]:
  """The collectives one member of a team of ``team`` runs in NS of one m × n
  matrix with the Frobenius preconditioning: per collective, (elements it
  receives, whether it sits in the NS loop). A batch of matrices runs the same
  collectives, each carrying all of them.

  Standard: max and sum of the norm (k − 1 each), then per step the Gram
  matrix's reduce-scatter and all-gather and the polynomial's all-gather ((k −
  1)·⌈m/k⌉·m each), in the loop. Gram, per run of s steps between restarts: G's
  reduce-scatter and all-gather, the all-gathers of P_0 and (if s > 1) A_1, two
  per middle step (P and A; in the loop if there are several) and two for the
  last (P and the final Q): 2·s + 2 (3 for s = 1).
  """
  (m, _), _ = ns_orientation(m, n)
  if team == 1:
    return ()
  block = (team - 1) * -(-m // team) * m
  out = [(team - 1, False), (team - 1, False)]
  if not gram:
    return tuple(out + [(block, True)] * (3 * steps))
  for s in _gram_chunks(steps, gram_restart):
    middle = max(s - 2, 0)  # a scan of one step compiles to no loop
    out += [(block, False)] * (3 if s == 1 else 4) + [(block, middle > 1)] * (
        2 * middle
    )
    out += [(block, False)] * (2 if s > 1 else 0)
  return tuple(out)


def uses_gram(
    method: str,
    m: int,
    n: int,
    steps: int,
    gram_restart: int = GRAM_RESTART,
    compute_dtype=jnp.float32,
    team: int = 1,
) -> bool:
  """Whether ``method`` runs the Gram iteration on an m × n matrix (on a team of
  ``team``).

  ``"auto"`` chooses it where it needs fewer FLOPs per device and the products
  run in float32 or wider (in bf16 the Gram matrix's rounding error is squared
  into the result: measured 3e-2 vs 1e-2 for the standard iteration).

  Raises:
    ValueError: for an unknown method or a non-positive restart interval.
  """
  if method not in METHODS:
    raise ValueError(
        f"Unknown Newton–Schulz method {method!r}; expected one of {METHODS}."
    )
  if (
      isinstance(gram_restart, bool)
      or not isinstance(gram_restart, int)
      or gram_restart < 1
  ):
    raise ValueError(
        f"gram_restart must be a positive integer, got {gram_restart!r}."
    )
  if method != "auto":
    return method == "gram"
  return jnp.finfo(
      compute_dtype
  ).bits >= 32 and ns_flops(  # complex64's parts are 32-bit
      m, n, steps, True, gram_restart, team
  ) < ns_flops(
      m, n, steps, team=team
  )


def matrix_flops(
    ns: Any, m: int, n: int, dtype: Any, steps: int, team: int = 1
) -> int:
  """NS FLOPs of ``steps`` steps on one m × n matrix of ``dtype``, on each
  member of a team of ``team`` devices.

  Args:
    ns: the ``NSOptions`` (method, Gram restarts, compute dtype; ``"auto"`` is
      settled for the default backend).
    m, n: the matrix's shape (either orientation).
    dtype: its dtype (NS computes in it unless ``ns.compute_dtype`` says
      otherwise).
    steps: NS steps.
    team: k, the devices sharing the matrix.

  Returns:
    The FLOPs.
  """
  ns = ns.resolved(jax.default_backend())
  (m, n), _ = ns_orientation(m, n)
  gram = uses_gram(
      ns.method,
      m,
      n,
      steps,
      ns.gram_restart,
      ns.compute_dtype or jnp.dtype(dtype),
      team,
  )
  return ns_flops(m, n, steps, gram, ns.gram_restart, team)


def team_cost(
    ns: Any, m: int, n: int, dtype: Any, team: int, steps: int
) -> TeamCost:
  """What one member of a team of ``team`` devices spends on one m × n matrix.

  Args:
    ns: the ``NSOptions``.
    m, n: the matrix's shape (either orientation).
    dtype: its dtype.
    team: k.
    steps: NS steps.

  Returns:
    The member's ``TeamCost``.
  """
  ns = ns.resolved(jax.default_backend())
  (m, n), _ = ns_orientation(m, n)
  compute = jnp.dtype(ns.compute_dtype or dtype)
  gram = uses_gram(ns.method, m, n, steps, ns.gram_restart, compute, team)
  collectives = team_collectives(m, n, steps, team, gram, ns.gram_restart)
  return TeamCost(
      ns_flops(m, n, steps, gram, ns.gram_restart, team),
      tuple(e * compute.itemsize for e, _ in collectives),
      sum(in_loop for _, in_loop in collectives) // steps,
      gram,
  )


@dataclasses.dataclass(frozen=True)
class TeamCost:
  """One team member's share of NS of one matrix.

  Attributes:
    flops: its NS FLOPs.
    collective_bytes: per collective it runs, the bytes it receives.
    loop_collectives: how many of those run in each step of the NS loop.
    gram: whether it runs the Gram iteration (else the standard one).
  """

  flops: int
  collective_bytes: tuple[int, ...]
  loop_collectives: int
  gram: bool = False

  def collective_seconds(self, model: CostModel, matrices: int = 1) -> float:
    """Modelled time of its collectives for ``matrices`` matrices run as one
    batch (each collective carries all of them)."""
    return sum(
        model.collective_seconds(matrices * b) for b in self.collective_bytes
    )

  def seconds(self, model: CostModel, matrices: int = 1) -> float:
    """Modelled time of ``matrices`` matrices run as one batch: FLOPs and
    collectives."""
    return model.compute_seconds(
        matrices * self.flops
    ) + self.collective_seconds(model, matrices)


# Modelled time of an exchange in stages.


def pipelined_seconds(
    ns: list, out: list, back: list, looped: bool = True
) -> np.ndarray | float:
  """Modelled time of an exchange in stages, each worker running its own NS
  between the collectives that all of them join: stage 0 moves out first; then
  each worker orthogonalizes its matrices of stage s while one all-to-all
  carries stage s + 1 out and stage s − 1 back (started when the last worker
  starts stage s, done that long after); a worker starts stage s + 1 when its
  stage s is done and that all-to-all has arrived; the last stage comes back
  at the end. A worker with little in stage s thus runs ahead into stage
  s + 1 while others are still busy. In the executor's loop (``looped``) the
  first iteration's way back and the last one's way out move a stage's chunk
  that nothing needs; in line they move nothing. One stage: out, NS, back in
  turn.

  Args:
    ns: per stage, each worker's NS time (the workers on the last axis; a
      scalar: every worker alike; leading axes: several pipelines at once).
    out: per stage, the all-to-all to the owners (scalars, or arrays of the
      pipelines' shape).
    back: per stage, the all-to-all back (and the replicas' all-gather).
    looped: whether the stages run as the executor's loop.

  Returns:
    The time until the last stage is back (one per pipeline).
  """
  busiest = lambda t: np.max(t, axis=-1)
  ns = [
      np.asarray(t, np.float64)[..., None] if np.ndim(t) == 0 else t for t in ns
  ]
  if len(ns) == 1:
    return out[0] + busiest(ns[0]) + back[0]
  last = len(ns) - 1
  begin = np.asarray(out[0], np.float64)[..., None] + np.zeros_like(ns[0])
  for s, compute in enumerate(ns):
    if looped:
      moving = out[min(s + 1, last)] + back[max(s - 1, 0)]
    else:
      moving = (out[s + 1] if s < last else 0.0) + (back[s - 1] if s else 0.0)
    arrived = busiest(begin) + moving
    begin = np.maximum(begin + compute, np.asarray(arrived)[..., None])
  return busiest(begin) + back[-1]
