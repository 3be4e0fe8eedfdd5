"""Exchange stages: an exchange split by matrix so that its all-to-alls overlap
Newton–Schulz.

With one all-to-all each way, nothing can run beside them: every owner waits for
all of its matrices, and every device waits for all of its results. Split into S
stages (each worker's matrices in program order, cut into S runs of about equal
FLOPs), the all-to-alls of stage s + 1 (out) and s − 1 (back) have no data
dependence on stage s's NS, so a scheduler with asynchronous collectives runs
them beside it. Each stage is an ``Exchange`` of the same buckets; the executor
takes consecutive ones as one exchange (``Group.stages``).

S comes from the cost model (``costs.pipelined_seconds``): the fewest stages
within 2% of the shortest modelled time (each stage compiles its own NS code), 1
where the model cannot overlap collectives (``CostModel. overlap``; XLA:CPU) or
where a stage's collective latency costs more than it hides. An exchange with
teams is cut the same way, each team's matrices in its runs' order.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from optax_muon._src.core.profiles import CostModel
from optax_muon._src.muon.plan.exchanges import make_exchange
from optax_muon._src.muon.plan.model import Exchange, Group, Plan, TeamRun
from optax_muon._src.muon.plan.owners import Ownership

#: The most stages an exchange is split into.
MAX_STAGES = 8
#: A split must shorten the modelled time by this share of it.
MIN_GAIN = 0.01
#: The fewest stages whose modelled time is within this share of the shortest:
#: each stage compiles its own NS code (on the 7B-like tree, compile time grows
#: about linearly with the stage count), for gains that shrink as 1/S.
NEAR_BEST = 0.02


def _cut(flops: list[int], stages: int) -> list[int]:
  """Per item, its stage: consecutive items, each stage about 1/``stages`` of
  the FLOPs (an item goes to the stage its FLOP midpoint falls in)."""
  total = sum(flops) or 1
  before = np.cumsum([0] + flops[:-1])
  middle = (before + np.asarray(flops) / 2) / total
  return [min(stages - 1, int(m * stages)) for m in middle]


def split_exchange(
    ex: Exchange, plan: Plan, workers: int, stages: int
) -> tuple[Exchange, ...]:
  """``ex`` as ``stages`` exchanges of the same buckets: each worker's whole
  matrices, and each team's matrices, cut in program order into runs of about
  equal FLOPs (stages a worker or team has no matrix for are empty for it).
  Beside a team, a worker's whole matrices fill its least loaded stages.

  Args:
    ex: an exchange.
    plan: its plan.
    workers: its group's workers.
    stages: how many stages.

  Returns:
    The stages, each an ``Exchange`` whose ``owned`` (and ``teams``) hold that
    stage's matrices.
  """
  # Per stage, per team, its runs restricted to the stage's matrices; and per
  # team, its members' FLOPs in each stage.
  teams = [[[] for _ in ex.teams] for _ in range(stages)]
  team_load = np.zeros((len(ex.teams), stages))
  for t, runs in enumerate(ex.teams):
    items = [(q, j) for q, r in enumerate(runs) for j in r.matrices]
    picked = [[[] for _ in runs] for _ in range(stages)]
    for (q, j), c in zip(
        items, _cut([runs[q].cost.flops for q, _ in items], stages)
    ):
      picked[c][q].append(j)
      team_load[t, c] += runs[q].cost.flops
    for s in range(stages):
      teams[s][t] = [
          dataclasses.replace(r, matrices=tuple(js))
          for r, js in zip(runs, picked[s])
          if js
      ]
  offsets = np.cumsum([0] + [b.matrices for b in ex.buckets])
  owners = [[-1] * int(offsets[-1]) for _ in range(stages)]
  for w, owned in enumerate(ex.owned):
    items = [(k, j) for k, mine in enumerate(owned) for j in mine]
    flops = [ex.buckets[k].flops for k, _ in items]
    if ex.teams:
      # Around the worker's team share: each matrix to its least loaded stage.
      load = team_load[w // ex.team_size].copy()
      cut = []
      for f in flops:
        cut.append(int(np.argmin(load)))
        load[cut[-1]] += f
    else:
      cut = _cut(flops, stages)
    for (k, j), s in zip(items, cut):
      owners[s][offsets[k] + j] = w
  out = []
  for s, owner in enumerate(owners):
    stage = make_exchange(
        ex.buckets, Ownership(owner, []), list(plan.leaves), workers
    )
    if ex.teams:
      stage = _with_teams(stage, ex.team_size, teams[s])
    out.append(stage)
  return tuple(out)


def _with_teams(
    ex: Exchange, team_size: int, teams: list[list[TeamRun]]
) -> Exchange:
  """``ex`` with these teams' runs (and their distinct programs)."""
  keys = [tuple(r.key for r in runs) for runs in teams]
  programs = list(dict.fromkeys(keys))
  return dataclasses.replace(
      ex,
      team_size=team_size,
      teams=tuple(tuple(runs) for runs in teams),
      team_programs=tuple(programs),
      team_program_of=tuple(programs.index(k) for k in keys),
  )


def _staged_seconds(
    plan: Plan, group: Group, stages: tuple[Exchange, ...], model: CostModel
) -> float:
  part = dataclasses.replace(
      plan, groups=(dataclasses.replace(group, exchanges=stages),)
  )
  return part.critical_seconds(model)


def choose_stages(
    plan: Plan, model: CostModel, stages: int | None = None
) -> Plan:
  """``plan`` with each exchange split into the stages that the model says
  pipeline best.

  Args:
    plan: a plan, one stage per exchange.
    model: the cost model.
    stages: force this many stages on every exchange that can be split (an
      exchange keeps at most as many as its busiest worker has matrices); None:
      chosen by ``model``.

  Returns:
    The plan with staged exchanges (itself where nothing is split).
  """
  groups, notes = [], []
  for group in plan.groups:
    exchanges = []
    for ex in group.exchanges:
      what = _exchange_words(ex)
      most = max(
          sum(map(len, owned)) + team
          for owned, team in zip(
              ex.owned, ex.per_worker(lambda r: len(r.matrices))
          )
      )
      if (
          group.workers == 1
          or group.exchange_size == 1
          or most < 2
          or (stages is None and not model.overlap)
      ):
        if most < 2 and model.overlap and group.exchange_size > 1:
          notes.append(
              f"{what} in one stage: no worker orthogonalizes two of its"
              " matrices, so none can move while another is orthogonalized."
          )
        exchanges.append(ex)
        continue
      if stages is not None:
        exchanges += split_exchange(ex, plan, group.workers, min(stages, most))
        continue
      options = {1: (ex,)}
      for s in range(2, min(MAX_STAGES, most) + 1):
        options[s] = split_exchange(ex, plan, group.workers, s)
      seconds = {
          s: _staged_seconds(plan, group, x, model) for s, x in options.items()
      }
      best = min(seconds.values())
      chosen = min(
          s
          for s, t in seconds.items()
          if t <= best * (1 + NEAR_BEST)
          and (s == 1 or t < seconds[1] * (1 - MIN_GAIN))
      )
      if chosen == 1:
        alternative = min((t, s) for s, t in seconds.items() if s > 1)
        notes.append(
            f"{what} in one stage: the cost model's pipelined time is no"
            f" shorter in stages ({alternative[1]} stages"
            f" {alternative[0] * 1e3:.3g} ms against {seconds[1] * 1e3:.3g} ms"
            " in one: each stage's all-to-all carries its busiest worker's"
            " chunk and pays the collective latency)."
        )
      exchanges += options[chosen]
    groups.append(dataclasses.replace(group, exchanges=tuple(exchanges)))
  return dataclasses.replace(
      plan, groups=tuple(groups), stage_notes=tuple(notes)
  )


def _exchange_words(ex: Exchange) -> str:
  """The exchange, named by its buckets' matrix shapes."""
  shapes = [f"{b.shape[0]}×{b.shape[1]}" for b in ex.buckets]
  listed = ", ".join(shapes[:3]) + (", …" if len(shapes) > 3 else "")
  return f"The exchange of the {listed} matrices goes"
