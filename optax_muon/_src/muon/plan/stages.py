"""Exchange stages: an exchange split by matrix so that its all-to-alls overlap
Newton–Schulz.

With one all-to-all each way, nothing can run beside them: every owner waits for
all of its matrices, and every device waits for all of its results. Split into S
stages, the all-to-alls of stage s + 1 (out) and s − 1 (back) have no data
dependence on stage s's NS, so a scheduler with asynchronous collectives runs
them beside it.

Stages with a program in common run as one loop (``executor``): each distinct
program is one switch branch, its NS code compiled once whatever S, and each
worker (and team) looks up its branch for the stage; the loop moves every stage
with the longest stage's chunk, and one stage more each way (``_moved`` in
``model``). Stages with no program in common run in line, each with its own
chunk and its own branches (``model.in_line``): the same NS code, and only the
bytes the step needs. Three ways to cut an exchange, all tried:

* equal stages (``split_exchange``): the owners are chosen again in bundles of
  S matrices of a kind (``owners.place_matrices``), and each worker's run of k
  matrices of one kind (and each team's) is cut into S slices of ⌈k/S⌉ in
  program order, a short bundle padded with ``PAD`` slots (zeros in, zeros out;
  their FLOPs and bytes count like a matrix's). Every stage runs one program:
  no more NS code than one stage; a loop.
* by load (``split_by_load``): the owners of one stage, each one's matrices
  spread over the stages so that the busiest worker of each stage stays short;
  a worker's program differs between stages (more branches, no padding).
* by kind (``split_by_kind``): the owners of one stage, each kind of matrix (a
  bucket's whole matrices, or its team runs) in one stage, the assignment the
  model pipelines best; no program in two stages, so in line. It is the cut
  for exchanges whose workers hold one or two large matrices (teams on a pod),
  where a loop's stages would each move the largest.

Each stage is an ``Exchange`` of the same buckets; the executor takes
consecutive ones as one exchange (``Group.stages``).

S and the cut come from the cost model (``costs.pipelined_seconds``): among the
cuts that compile no more NS programs than one stage (``ns_programs``), if one
of them gains and no cut with one program more is 10% faster, else among those
with at most one more, the fewest stages within 2% of the shortest modelled
time (then the shortest, then the fewest bytes moved); one stage where the
model cannot overlap collectives (``CostModel.overlap``; XLA:CPU) or where
padding, the loop's extra transfers, a stage's collective latency or a kind's
stage waiting for another's cost more than overlap hides.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np

from optax_muon._src.core.profiles import CostModel
from optax_muon._src.muon import costs
from optax_muon._src.muon.plan.exchanges import make_exchange
from optax_muon._src.muon.plan.model import (
    PAD,
    Exchange,
    Group,
    Plan,
    Run,
    TeamRun,
    stage_programs,
)
from optax_muon._src.muon.plan.owners import Ownership

#: The most stages an exchange is split into.
MAX_STAGES = 8
#: A split must shorten the modelled time by this share of it.
MIN_GAIN = 0.01
#: The fewest stages whose modelled time is within this share of the shortest.
NEAR_BEST = 0.02
#: Cuts that compile more NS programs than one stage are taken only if they
#: shorten the modelled time by more than this share of the best cut that
#: does not (each program compiles its own NS code) ...
MORE_PROGRAMS_GAIN = 0.10
#: ... and compile at most this many more (on the measured GPU targets one
#: more program costs a tenth of the update's compile time).
EXTRA_PROGRAMS = 1


def _slice(items: tuple[int, ...], stages: int, stage: int) -> tuple[int, ...]:
  """Stage ``stage``'s slice of ``items`` cut into ``stages`` slices of
  ⌈len/stages⌉, padded with ``PAD``."""
  size = -(-len(items) // stages)
  part = items[stage * size : (stage + 1) * size]
  return tuple(part) + (PAD,) * (size - len(part))


def _stage_program(program, stages: int):
  """A whole-matrix program with each run's count cut to ⌈count/stages⌉."""
  return tuple(
      tuple(Run(leaf, -(-count // stages)) for leaf, count in runs)
      for runs in program
  )


def split_exchange(ex: Exchange, stages: int) -> tuple[Exchange, ...]:
  """``ex`` as ``stages`` exchanges of the same buckets and the same programs:
  each run of each worker's program (and of each team's) cut in program order
  into ``stages`` slices of equal length, padded with ``PAD``.

  Args:
    ex: an exchange in one stage.
    stages: how many stages.

  Returns:
    The stages, each an ``Exchange`` whose ``owned`` (and ``teams``) hold that
    stage's matrices.
  """
  out = []
  for s in range(stages):
    owned = []
    for w, mine in enumerate(ex.owned):
      program = ex.programs[ex.program_of[w]]
      per_bucket = []
      for runs, matrices in zip(program, mine):
        cut, start = (), 0
        for _, count in runs:
          cut += _slice(matrices[start : start + count], stages, s)
          start += count
        per_bucket.append(cut)
      owned.append(tuple(per_bucket))
    teams = tuple(
        tuple(
            dataclasses.replace(r, matrices=_slice(r.matrices, stages, s))
            for r in runs
        )
        for runs in ex.teams
    )
    out.append(
        dataclasses.replace(
            ex,
            owned=tuple(owned),
            programs=tuple(_stage_program(p, stages) for p in ex.programs),
            teams=teams,
            team_programs=tuple(
                tuple(k._replace(count=-(-k.count // stages)) for k in p)
                for p in ex.team_programs
            ),
        )
    )
  return tuple(out)


def _place(loads: np.ndarray, profile: np.ndarray, seconds: float) -> int:
  """The stage for an item of ``seconds`` on devices with per-stage ``loads``:
  the one that lengthens the stages' busiest loads (``profile``) least, the
  least loaded of those."""
  growth = np.maximum(loads + seconds - profile, 0.0)
  return int(np.lexsort((np.arange(len(loads)), loads, growth))[0])


def split_by_load(
    ex: Exchange,
    plan: Plan,
    group: Group,
    stages: int,
    model: CostModel,
) -> tuple[Exchange, ...]:
  """``ex`` as ``stages`` exchanges of the same buckets, each worker's (and
  team's) program its own per stage, so that the pipelined time stays short:
  teams, then workers, the busiest first, place their matrices (largest first)
  where they lengthen the stages' busiest loads least, else in their least
  loaded stage. Each stage starts as long as its share of the exchange's
  transfers (NS that short hides them anyway).

  Args:
    ex: an exchange in one stage.
    plan: its plan.
    group: its group.
    stages: how many stages.
    model: the cost model (a team member's collectives count as its time).

  Returns:
    The stages, each an ``Exchange`` whose ``owned`` (and ``teams``) hold that
    stage's matrices.
  """
  k, workers = ex.team_size, group.workers
  _, out, back = group.stage_seconds(ex, plan.wire_itemsize(ex), model)
  # (worker, stage) modelled NS seconds, and per stage its busiest.
  loads = np.zeros((workers, stages))
  profile = np.full(stages, (out + back) / stages)
  team_items = [
      [
          (r.cost.seconds(model), q, j)
          for q, r in enumerate(runs)
          for j in r.matrices
      ]
      for runs in ex.teams
  ]
  whole_items = [
      [
          (model.compute_seconds(ex.buckets[b].flops), b, j)
          for b, mine in enumerate(owned)
          for j in mine
      ]
      for owned in ex.owned
  ]
  picked = [[[] for _ in runs] for runs in ex.teams]
  order = sorted(
      range(len(ex.teams)), key=lambda t: -sum(x[0] for x in team_items[t])
  )
  for t in order:
    members = slice(t * k, (t + 1) * k)
    for seconds, q, j in sorted(team_items[t], reverse=True):
      stage = _place(loads[members].max(axis=0), profile, seconds)
      picked[t][q].append((stage, j))
      loads[members, stage] += seconds
      profile[stage] = max(profile[stage], loads[members, stage].max())
  offsets = np.cumsum([0] + [b.matrices for b in ex.buckets])
  owners = [[-1] * int(offsets[-1]) for _ in range(stages)]
  for w in sorted(
      range(workers),
      key=lambda w: -sum(x[0] for x in whole_items[w]) - loads[w].sum(),
  ):
    for seconds, b, j in sorted(whole_items[w], reverse=True):
      stage = _place(loads[w], profile, seconds)
      owners[stage][offsets[b] + j] = w
      loads[w, stage] += seconds
      profile[stage] = max(profile[stage], loads[w, stage])
  out = []
  for stage, owner in enumerate(owners):
    part = make_exchange(
        ex.buckets, Ownership(owner, []), list(plan.leaves), workers
    )
    if ex.teams:
      teams = [
          [
              dataclasses.replace(
                  r, matrices=tuple(j for s, j in picked[t][q] if s == stage)
              )
              for q, r in enumerate(runs)
              if any(s == stage for s, _ in picked[t][q])
          ]
          for t, runs in enumerate(ex.teams)
      ]
      part = _with_teams(part, k, teams)
    out.append(part)
  return tuple(out)


#: The most assignments of an exchange's kinds to S stages ``split_by_kind``
#: weighs (S^kinds); beyond, that cut is not tried.
MAX_ASSIGNMENTS = 4096


def _kind_loads(
    ex: Exchange, g: int, model: CostModel
) -> tuple[list[tuple[str, int]], np.ndarray, np.ndarray]:
  """The exchange's kinds (its team runs' buckets, then its whole matrices'
  buckets) and, per (worker, kind), the modelled NS time (a team's collectives
  included) and the elements each device sends the worker."""
  kinds = list(
      dict.fromkeys(("team", r.bucket) for runs in ex.teams for r in runs)
  ) + [
      ("whole", b)
      for b in range(len(ex.buckets))
      if any(owned[b] for owned in ex.owned)
  ]
  column = {kind: i for i, kind in enumerate(kinds)}
  seconds = np.zeros((len(ex.owned), len(kinds)))
  elements = np.zeros((len(ex.owned), len(kinds)))
  k = ex.team_size
  for t, runs in enumerate(ex.teams):
    for r in runs:
      members, c = slice(t * k, (t + 1) * k), column["team", r.bucket]
      count = len(r.matrices)
      seconds[members, c] += r.cost.seconds(model, count)
      elements[members, c] += count * r.block
  for w, owned in enumerate(ex.owned):
    for b, mine in enumerate(owned):
      if mine:
        bucket, c = ex.buckets[b], column["whole", b]
        seconds[w, c] += len(mine) * model.compute_seconds(bucket.flops)
        elements[w, c] += len(mine) * bucket.piece_size(g)
  return kinds, seconds, elements


def _kind_stages(
    seconds: np.ndarray,
    elements: np.ndarray,
    stages: int,
    transfer: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
) -> np.ndarray | None:
  """The stage of each kind whose stages, run in line, the model pipelines
  best, or None when there are fewer kinds than stages or too many
  assignments to weigh.

  Args:
    seconds, elements: per (worker, kind), as ``_kind_loads`` gives them.
    stages: how many stages, each with a kind.
    transfer: chunk elements → (out, back) seconds, elementwise.
  """
  count = seconds.shape[1]
  if count < stages or stages**count > MAX_ASSIGNMENTS:
    return None
  # Workers with the same loads pipeline alike.
  rows = np.unique(np.concatenate([seconds, elements], axis=1), axis=0)
  seconds, elements = rows[:, :count], rows[:, count:]
  choices = np.array(list(itertools.product(range(stages), repeat=count)))
  choices = choices[
      (choices[:, :, None] == np.arange(stages)).any(axis=1).all(axis=1)
  ]
  onehot = (choices[:, :, None] == np.arange(stages)).astype(np.float64)
  ns = np.einsum("wk,aks->saw", seconds, onehot)
  chunk = np.einsum("wk,aks->aws", elements, onehot).max(axis=1)
  out, back = transfer(chunk)
  total = costs.pipelined_seconds(
      list(ns), list(out.T), list(back.T), looped=False
  )
  return choices[int(np.argmin(total))]


def _restricted(ex: Exchange, kinds: set[tuple[str, int]]) -> Exchange:
  """``ex`` with only its matrices of ``kinds``: each worker's program and each
  team's runs keep those buckets, in their order."""
  keep = lambda runs, b: runs if ("whole", b) in kinds else ()
  programs = [
      tuple(keep(runs, b) for b, runs in enumerate(p)) for p in ex.programs
  ]
  distinct = list(dict.fromkeys(programs))
  part = dataclasses.replace(
      ex,
      owned=tuple(
          tuple(keep(mine, b) for b, mine in enumerate(owned))
          for owned in ex.owned
      ),
      programs=tuple(distinct),
      program_of=tuple(distinct.index(programs[i]) for i in ex.program_of),
  )
  if not ex.teams:
    return part
  teams = [
      [r for r in runs if ("team", r.bucket) in kinds] for runs in ex.teams
  ]
  return _with_teams(part, ex.team_size, teams)


def split_by_kind(
    ex: Exchange,
    plan: Plan,
    group: Group,
    stages: int,
    model: CostModel,
) -> tuple[Exchange, ...] | None:
  """``ex`` as ``stages`` exchanges, each with the matrices of some of its kinds
  (a bucket's whole matrices, or its team runs): the owners of one stage, no
  program in two stages, so the stages run in line (``model.in_line``), each
  moving its own chunk. The kinds' stages are the assignment the model
  pipelines best.

  Args:
    ex: an exchange in one stage.
    plan: its plan.
    group: its group.
    stages: how many stages.
    model: the cost model.

  Returns:
    The stages, or None when ``ex`` has fewer kinds than ``stages`` (or too
    many to weigh).
  """
  g, itemsize = group.exchange_size, plan.wire_itemsize(ex)
  kinds, seconds, elements = _kind_loads(ex, g, model)

  def transfer(chunks):
    values, where = np.unique(chunks, return_inverse=True)
    out, back = np.array(
        [group.transfer_seconds(itemsize * c, model) for c in values]
    ).T
    return out[where].reshape(chunks.shape), back[where].reshape(chunks.shape)

  chosen = _kind_stages(seconds, elements, stages, transfer)
  if chosen is None:
    return None
  return tuple(
      _restricted(ex, {k for k, s in zip(kinds, chosen) if s == stage})
      for stage in range(stages)
  )


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


def _most(ex: Exchange) -> int:
  """The most matrices (whole, and team shares) one worker of ``ex`` runs."""
  return max(
      sum(map(len, owned)) + team
      for owned, team in zip(ex.owned, ex.per_worker(lambda r: len(r.matrices)))
  )


def _moves(group: Group) -> bool:
  """Whether the group's exchanges move anything: an all-to-all between
  workers."""
  return group.workers > 1 and group.exchange_size > 1


def _splittable(group: Group, ex: Exchange) -> bool:
  """Whether stages can overlap anything: an all-to-all, and a worker with two
  matrices."""
  return _moves(group) and _most(ex) >= 2


def _in_stages(
    plan: Plan, stages: int, cut: str, model: CostModel
) -> Plan | None:
  """``plan`` with every exchange that can be split cut into ``stages`` (at
  most its busiest worker's matrix count): into equal runs of one program
  (``cut="equal"``: ``split_exchange``, owners in bundles), by load
  (``"load"``: ``split_by_load``) or by kind (``"kind"``: ``split_by_kind``;
  None when no exchange has that many kinds)."""
  groups, any_cut = [], False
  for group in plan.groups:
    exchanges = []
    for ex in group.exchanges:
      count = min(stages, _most(ex))
      parts = None
      if not _splittable(group, ex):
        pass
      elif cut == "equal":
        parts = split_exchange(ex, count)
      elif cut == "load":
        parts = split_by_load(ex, plan, group, count, model)
      else:
        parts = split_by_kind(ex, plan, group, stages, model)
      any_cut = any_cut or parts is not None
      exchanges += parts or (ex,)
    groups.append(dataclasses.replace(group, exchanges=tuple(exchanges)))
  if not any_cut:
    return None
  return dataclasses.replace(plan, groups=tuple(groups))


def ns_programs(plan: Plan) -> int:
  """The NS calls the plan compiles: per exchange (its stages share their
  switch branches), each distinct program's buckets with a matrix, and each
  distinct team program's runs."""
  total = 0
  for group in plan.groups:
    for stages in group.stages():
      table = stage_programs(stages, group.exchange_size)
      total += sum(sum(1 for runs in p if runs) for p in table.programs)
      total += sum(len(p) for p in table.team_programs)
  return total


def choose_stages(
    plan: Plan,
    model: CostModel,
    stages: int | None,
    replan: Callable[[int], Plan],
) -> Plan:
  """``plan``, or the plan whose exchanges the model says pipeline best in
  stages.

  For S stages the owners are chosen again in bundles of S matrices of a kind
  (``replan(S)``), so that each worker's matrices cut into S equal stages with
  little padding.

  Args:
    plan: the plan in one stage.
    model: the cost model.
    stages: force this many stages on every exchange that can be split (an
      exchange keeps at most as many as its busiest worker has matrices); None:
      chosen by ``model``.
    replan: the plan with owners placed in bundles of a given size.

  Returns:
    The plan with staged exchanges (``plan`` where nothing is split), its
    ``stage_notes`` saying why exchanges that could overlap keep one stage.
  """
  split = [
      (group, ex)
      for group in plan.groups
      for ex in group.exchanges
      if _splittable(group, ex)
  ]
  notes = [
      f"{_exchange_words(ex)} in one stage: no worker orthogonalizes two of"
      " its matrices, so none can move while another is orthogonalized."
      for group in plan.groups
      for ex in group.exchanges
      if _moves(group) and _most(ex) < 2
  ]
  if stages == 1 or (stages is not None and not split):
    return plan
  if stages is None and not model.overlap:
    return plan
  if not split:
    return dataclasses.replace(plan, stage_notes=tuple(notes))
  # Per (stages, one program or not), the plan.
  options = {(1, "equal"): plan}
  for s in range(2, MAX_STAGES + 1) if stages is None else [stages]:
    options[s, "equal"] = _in_stages(replan(s), s, "equal", model)
    options[s, "load"] = _in_stages(plan, s, "load", model)
    options[s, "kind"] = _in_stages(plan, s, "kind", model)
  options = {k: p for k, p in options.items() if p is not None}
  seconds = {k: p.critical_seconds(model) for k, p in options.items()}
  if stages is not None:
    return options[min((k for k in options if k[0] == stages), key=seconds.get)]
  # Stages that gain; those that compile no more NS programs than one stage
  # first.
  base = seconds[1, "equal"]
  gaining = [
      k for k in options if k[0] == 1 or seconds[k] < base * (1 - MIN_GAIN)
  ]
  programs = ns_programs(plan)
  extra = {k: ns_programs(options[k]) - programs for k in gaining}
  cheap = [k for k in gaining if extra[k] <= 0]
  gaining = [k for k in gaining if k[0] == 1 or extra[k] <= EXTRA_PROGRAMS]
  if len(cheap) > 1 and min(seconds[k] for k in gaining) >= min(
      seconds[k] for k in cheap
  ) * (1 - MORE_PROGRAMS_GAIN):
    gaining = cheap
  best = min(seconds[k] for k in gaining)
  # The fewest stages, then the shortest time, then the fewest bytes moved (a
  # loop and stages in line may model alike where NS hides both).
  chosen = min(
      (k for k in gaining if seconds[k] <= best * (1 + NEAR_BEST)),
      key=lambda k: (
          k[0],
          round(seconds[k], 12),
          options[k].device_received_bytes().max(),
      ),
  )
  if chosen[0] == 1:
    t, s, more = min(
        (t, k[0], ns_programs(options[k]) - programs)
        for k, t in seconds.items()
        if k[0] > 1
    )
    if t < base * (1 - MIN_GAIN):
      return dataclasses.replace(
          plan,
          stage_notes=tuple(notes)
          + (
              f"The exchanges go in one stage: the cost model's shortest"
              f" pipelined time ({s} stages, {t * 1e3:.3g} ms against"
              f" {base * 1e3:.3g} ms in one) compiles {more} more NS programs"
              " than one stage.",
          ),
      )
    notes += [
        f"{_exchange_words(ex)} in one stage: the cost model's pipelined time"
        f" is no shorter in stages ({s} stages {t * 1e3:.3g} ms against"
        f" {base * 1e3:.3g} ms in one: each stage's all-to-all carries"
        " its busiest worker's chunk and pays the collective latency, the"
        " loop moves one stage more, and a worker's short runs pad)."
        for _, ex in split
    ]
    return dataclasses.replace(plan, stage_notes=tuple(notes))
  return dataclasses.replace(options[chosen], stage_notes=tuple(notes))


def _exchange_words(ex: Exchange) -> str:
  """The exchange, named by its buckets' matrix shapes."""
  shapes = [f"{b.shape[0]}×{b.shape[1]}" for b in ex.buckets]
  listed = ", ".join(shapes[:3]) + (", …" if len(shapes) > 3 else "")
  return f"The exchange of the {listed} matrices goes"
