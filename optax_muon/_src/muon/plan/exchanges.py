"""Exchange assembly: from the chosen owners and teams to an ``Exchange``, with
each worker's program and each team's runs.

A worker runs its whole matrices bucket by bucket, grouped by how their pieces
fit together (runs of one representative leaf); workers with equal programs
share a ``lax.switch`` branch, and so do teams with equal runs.
"""

from __future__ import annotations

import dataclasses

from optax_muon._src.muon.plan.model import (
    Bucket,
    Exchange,
    LeafPlacement,
    Program,
    Run,
    TeamRun,
)
from optax_muon._src.muon.plan.owners import MatrixRef, Ownership
from optax_muon._src.muon.plan.teams import Kind, TeamSplit


def _owned(
    buckets: tuple[Bucket, ...],
    owner: list[int],
    leaves: list[LeafPlacement],
    leaf_of: list[list[int]],
    workers: int,
) -> list[list[list[int]]]:
  """Per worker, per bucket, the local matrices it orthogonalizes whole, grouped
  by signature (in the order of the bucket's members), then in index order."""
  owned = [[[] for _ in buckets] for _ in range(workers)]
  start = 0
  for k, b in enumerate(buckets):
    signatures = list(dict.fromkeys(leaves[i].signature for i in b.members))
    order = sorted(
        range(b.matrices),
        key=lambda j: (signatures.index(leaves[leaf_of[k][j]].signature), j),
    )
    for j in order:
      if owner[start + j] >= 0:
        owned[owner[start + j]][k].append(j)
    start += b.matrices
  return owned


def _program(
    mine: list[list[int]],
    leaves: list[LeafPlacement],
    leaf_of: list[list[int]],
    representative: list[dict],
) -> Program:
  """A worker's program: per bucket, its matrices as runs of one representative
  leaf."""
  program = []
  for k, matrices in enumerate(mine):
    runs: list[Run] = []
    for j in matrices:
      rep = representative[k][leaves[leaf_of[k][j]].signature]
      if runs and runs[-1].leaf == rep:
        runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
      else:
        runs.append(Run(rep, 1))
    program.append(tuple(runs))
  return tuple(program)


def _team_runs(
    teams: list[list[MatrixRef]],
    split: TeamSplit,
    leaves: list[LeafPlacement],
    leaf_of: list[list[int]],
) -> list[tuple[TeamRun, ...]]:
  """Per team, its runs: its matrices of each split kind, the kinds in the
  split's order (the same on every team: fewer programs)."""
  kinds = list(split.kinds)
  out = []
  for matrices in teams:
    runs: dict[Kind, list[int]] = {}
    for b, j in sorted(matrices):
      runs.setdefault(Kind(b, leaves[leaf_of[b][j]].signature), []).append(j)
    out.append(
        tuple(
            TeamRun(
                bucket=kind.bucket,
                leaf=split.kinds[kind].leaf,
                split_dim=split.kinds[kind].split_dim,
                matrices=tuple(js),
                cost=split.kinds[kind].cost,
                block=split.kinds[kind].block,
            )
            for kind, js in sorted(
                runs.items(), key=lambda kv: kinds.index(kv[0])
            )
        )
    )
  return out


def make_exchange(
    buckets: tuple[Bucket, ...],
    ownership: Ownership,
    leaves: list[LeafPlacement],
    workers: int,
    split: TeamSplit | None = None,
) -> Exchange:
  """The ``Exchange`` of ``buckets``.

  Args:
    buckets: the exchange's buckets.
    ownership: the worker of each local matrix (−1: split over a team) and each
      team's matrices.
    leaves: the plan's leaves.
    workers: the group's workers.
    split: the kinds teams orthogonalize, or None.

  Returns:
    The exchange, with every worker's program and (with ``split``) every team's
    runs.
  """
  # Per bucket, the leaf of each local matrix.
  leaf_of = [
      [i for i in b.members for _ in range(leaves[i].local_batch)]
      for b in buckets
  ]
  owned = _owned(buckets, ownership.owner, leaves, leaf_of, workers)
  # Per bucket, the first leaf of each signature: the one a program names.
  representative = [{} for _ in buckets]
  for k, b in enumerate(buckets):
    for i in b.members:
      representative[k].setdefault(leaves[i].signature, i)
  programs, program_of = [], []
  for mine in owned:
    program = _program(mine, leaves, leaf_of, representative)
    if program not in programs:
      programs.append(program)
    program_of.append(programs.index(program))
  exchange = Exchange(
      buckets=buckets,
      owned=tuple(tuple(tuple(m) for m in mine) for mine in owned),
      programs=tuple(programs),
      program_of=tuple(program_of),
  )
  if split is None:
    return exchange
  team_runs = _team_runs(ownership.teams, split, leaves, leaf_of)
  keys = [tuple(r.key for r in runs) for runs in team_runs]
  team_programs = list(dict.fromkeys(keys))
  return dataclasses.replace(
      exchange,
      team_size=split.size,
      teams=tuple(team_runs),
      team_programs=tuple(team_programs),
      team_program_of=tuple(team_programs.index(p) for p in keys),
  )
