"""The program re-deal: fewer distinct per-worker programs where that costs
nothing.

A pattern is how many matrices of each bucket a worker owns; each distinct
pattern is a ``lax.switch`` branch with its own NS code, so fewer patterns
compile faster. The owner choice often ends with four or five patterns where two
reach the same busiest device: u workers take pattern p, v workers pattern q and
the rest nothing, with u·p_b + v·q_b = K_b for every bucket b. A deal is taken
only if it has fewer patterns and neither the busiest device's load nor the
largest owned size (the all-to-all chunk) grows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from optax_muon._src.muon.plan.owners import ExchangeMatrices

#: Beyond this many workers ``fewer_programs`` is not tried (its search would
#: take seconds).
DEAL_WORKERS = 1024


class Deal(NamedTuple):
  """Two patterns and the idle one.

  Attributes:
    key: (distinct patterns, the busiest device's load, the largest owned size):
      less is better.
    u: workers [0, u) take pattern p.
    v: workers [u, u + v) take pattern q; the others own nothing.
    counts: per bucket, (p_b, q_b).
  """

  key: tuple
  u: int
  v: int
  counts: list[tuple[int, int]]


def _pattern_counts(
    totals: list[int], u: int, v: int, bundle: int = 1
) -> list[list[tuple[int, int]]] | None:
  """Per bucket, every (p_b, q_b), multiples of ``bundle``, with u·p_b + v·q_b =
  K_b; None if a bucket has none."""
  options = []
  for t in totals:
    if v == 0:
      opts = [(t // u, 0)] if t % u == 0 else []
    else:
      opts = [
          (p, (t - u * p) // v)
          for p in range(t // u + 1)
          if (t - u * p) % v == 0
      ]
    opts = [(p, q) for p, q in opts if p % bundle == 0 and q % bundle == 0]
    if not opts:
      return None
    options.append(opts)
  return options


def _best_counts(
    options: list[list[tuple[int, int]]],
    cost: list[int],
    size: list[int],
    load_cap: float,
    size_cap: float,
) -> tuple[tuple, list] | None:
  """The per-bucket (p_b, q_b) with the least (busiest load, largest size)
  within the caps, the first found on ties; None if none fits."""
  best = None

  def search(b, p_load, q_load, p_size, q_size, chosen):
    nonlocal best
    if max(p_load, q_load) > load_cap or max(p_size, q_size) > size_cap:
      return
    if b == len(options):
      key = (max(p_load, q_load), max(p_size, q_size))
      if best is None or key < best[0]:
        best = (key, list(chosen))
      return
    for p, q in options[b]:
      search(
          b + 1,
          p_load + p * cost[b],
          q_load + q * cost[b],
          p_size + p * size[b],
          q_size + q * size[b],
          chosen + [(p, q)],
      )

  search(0, 0.0, 0.0, 0.0, 0.0, [])
  return best


def _best_deal(
    m: ExchangeMatrices, patterns: int, load_cap: float, bundle: int
) -> Deal | None:
  """The deal with the fewest patterns (fewer than ``patterns``), then the least
  load and size, within the caps, each count a multiple of ``bundle``; None if
  there is none."""
  workers, buckets = m.counts.shape
  totals = [int(t) for t in m.counts.sum(axis=0)]
  cost = [
      next((c for c, k in zip(m.costs, m.bucket_of) if k == b), 0)
      for b in range(buckets)
  ]
  size = [
      next((e for e, k in zip(m.elements, m.bucket_of) if k == b), 0)
      for b in range(buckets)
  ]
  size_cap = float(m.owned_elements.max())
  best = None
  for u in range(1, workers + 1):
    for v in range(0, workers - u + 1):
      count = (
          1 + (v > 0) + (u + v < workers)
      )  # distinct patterns, the idle one included
      if count >= patterns:
        continue
      options = _pattern_counts(totals, u, v, bundle)
      found = (
          None
          if options is None
          else _best_counts(options, cost, size, load_cap, size_cap)
      )
      if found is not None and (best is None or (count, *found[0]) < best.key):
        best = Deal((count, *found[0]), u, v, found[1])
  return best


def _owner_loads(m: ExchangeMatrices) -> np.ndarray:
  """Per worker, the NS FLOPs of the matrices it owns."""
  mine = np.zeros(len(m.owned_elements))
  np.add.at(mine, m.owner, m.costs)
  return mine


def fewer_programs(
    m: ExchangeMatrices, loads: np.ndarray, bundle: int = 1
) -> None:
  """Re-deals one exchange's matrices as two patterns (and idle workers), if
  free.

  Applies when the devices' loads from other exchanges are equal across workers
  (otherwise a pattern's cost would depend on the worker), and up to
  ``DEAL_WORKERS`` workers (the search is quadratic in them).

  Args:
    m: the exchange's matrices and their owners; updated.
    loads: every device's load (flattened mesh); updated.
    bundle: the owners' bundle size (``owners.place_matrices``): each pattern's
      counts stay multiples of it; the matrices of a bucket are dealt in their
      order, a kind's consecutive.
  """
  workers = len(m.owned_elements)
  patterns = len({tuple(row) for row in m.counts})
  if workers < 3 or patterns <= 2 or workers > DEAL_WORKERS:
    return
  mine = _owner_loads(m)
  base = np.full(workers, -np.inf)
  np.maximum.at(base, m.worker, loads - mine[m.worker])
  if not np.allclose(base, base[0]):
    return
  deal = _best_deal(m, patterns, float(loads.max()) - base[0], bundle)
  if deal is None:
    return
  loads -= mine[m.worker]
  m.counts[:] = 0
  m.owned_elements[:] = 0
  for b, (p, q) in enumerate(deal.counts):
    quota = [w for w in range(deal.u) for _ in range(p)] + [
        deal.u + w for w in range(deal.v) for _ in range(q)
    ]
    for w, j in zip(
        quota, [j for j, k in enumerate(m.bucket_of) if k == b], strict=True
    ):
      m.owner[j] = w
      m.owned_elements[w] += m.elements[j]
      m.counts[w, b] += 1
  loads += _owner_loads(m)[m.worker]
