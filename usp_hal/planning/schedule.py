"""A Ulysses x Ring split per global batch, chosen from its sequence lengths and priced as a
whole training step.

One split for a whole run cuts every sequence over the whole sequence-parallel group, a short
one as much as a long one.  :class:`Scheduler` instead places each sequence of a global batch on
a *group* of ranks sized for it, with that group's best Ulysses x Ring split, and prices every
job as the model call it is (:mod:`usp_hal.planning.stepcost`: attention, the token-proportional layers,
communication and per-call overheads):

- the groups are contiguous, aligned blocks of ranks whose size is a power of two dividing the
  world, or the whole world (:func:`group_sizes`), built once at set-up;
- each sequence goes to the smallest group on which its job takes no longer than a target time
  (or to its fastest group when none does), and only to groups that give each of their ranks a
  token and hold it within ``budget_tokens`` per rank; targets are tried on a fast estimate of
  the step (the larger of the work per rank and the longest job) and the best one placed;
- placement: group jobs largest group first onto the aligned block that is free earliest; what
  ranks hold alone, longest first onto the rank free earliest, then moved and swapped between the
  slowest and the fastest rank while that lowers the slowest; each rank's own sequences packed
  first-fit decreasing into jobs of at most the budget (one model call each);
- never slower than a fixed split: every step the best fixed split for the batch (``static+``:
  :meth:`Scheduler.static`) is placed with the same care, and when the dynamic schedule's
  predicted gain over it is below ``margin`` the step runs the fixed split (logged once).

Every input is a number, every step a pure function of its inputs: ranks that compute the
schedule from the same gathered lengths get the same schedule.  A batch that cannot be placed (a sequence over the
budget on every group) raises :class:`ScheduleError` naming the sequence and the budget.
"""
from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .stepcost import (  # noqa: F401  (re-exported)
    PARTS,
    SCALED,
    AttentionShape,
    Cost,
    StepModel,
    fits_packed,
    least_tokens,
    shifted_factor,
    split_key,
)

logger = logging.getLogger(__name__)

#: the predicted gain under which a step runs the best fixed split instead (3%)
MARGIN = 0.03
#: the target times tried (geometric, from the fastest job to the longest job on its smallest
#: group), on the fast estimate; the best few estimates are placed
TARGETS = 24
PLACED = 2
#: a batch of few sequences gets more of its estimates placed: about this many sequences placed in all
PLACEMENTS = 1000
#: a fixed split whose estimate is this far above the dynamic schedule's price (beyond the
#: margin) is not placed to compare (the estimate can undercount a packed job by a few percent)
CLEAR = 0.9
#: a sequence is priced on groups up to this many times the smallest that holds it (beyond,
#: its shards get too short to gain; and the price tables of large rings cost the most to build)
REACH = 4


class ScheduleError(ValueError):
    """A batch that no schedule can place within the budget (raised before any data moves)."""


@dataclass(frozen=True)
class Job:
    """Sequences (one, or several packed) on the ranks ``first .. first + size - 1``."""
    seqs: Tuple[int, ...]          # indices into the batch's lengths
    lengths: Tuple[int, ...]
    first: int
    size: int
    cost: Cost

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.size)

    @property
    def cu_seqlens(self) -> Optional[Tuple[int, ...]]:
        """Global document boundaries of a packed job (None for one sequence)."""
        if len(self.lengths) == 1:
            return None
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return tuple(out)


@dataclass(frozen=True)
class Schedule:
    world: int
    budget_tokens: int
    jobs: Tuple[Job, ...]                  # in the order every rank runs its own ones
    finish: Tuple[float, ...] = field(default=())   # predicted time each rank ends its jobs
    label: str = "dynamic"                 # "dynamic", or the fixed split that runs the step
    constant: float = 0.0                  # what every schedule pays alike (gradient all-reduce, optimizer)
    scale: Tuple[float, ...] = ()          # the model's part_scale when it was priced, in SCALED's order
    shift: Tuple[Tuple[Tuple[int, int], float], ...] = ()   # and its split_shift, ((g, u), shift) pairs

    @property
    def predicted(self) -> float:
        """The predicted whole-step time: the slowest rank's jobs and the step's constant part."""
        return max(self.finish, default=0.0) + self.constant

    @property
    def balance(self) -> float:
        """The slowest rank's predicted step time over the mean rank's."""
        if not self.finish:
            return 1.0
        mean = sum(self.finish) / len(self.finish) + self.constant
        return self.predicted / mean if mean else 1.0

    def jobs_of(self, rank: int) -> List[Job]:
        return [j for j in self.jobs if rank in j.ranks]

    def per_rank(self, what: str) -> List[float]:
        """Sum over each rank's jobs of a :class:`Cost` field (``pairs``, ``bytes``, ``tokens`` ...)."""
        out = [0.0] * self.world
        for j in self.jobs:
            for r in j.ranks:
                out[r] += getattr(j.cost, what)
        return out

    def tokens(self) -> List[int]:
        """Tokens each rank holds over its jobs."""
        out = [0] * self.world
        for j in self.jobs:
            share = -(-sum(j.lengths) // j.size)
            for r in j.ranks:
                out[r] += share
        return out

    def slowest(self) -> Dict[str, float]:
        """The slowest rank's attention work, bytes sent, collectives and predicted time."""
        return {"pairs": max(self.per_rank("pairs")), "bytes": max(self.per_rank("bytes")),
                "collectives": max(self.per_rank("collectives")), "predicted": self.predicted}

    def parts(self, unscaled: bool = False) -> Dict[str, float]:
        """The slowest rank's predicted step in parts: attention, tokens (the token-proportional
        layers), communication, overhead (per-call), idle (waiting for a group) and constant.
        ``unscaled``: each part as priced with every whole-step factor 1 and no split's shift
        (each part is its factor, plus its split's shift, times that; what
        :func:`usp_hal.planning.stepcost.fit_part_scale` fits), and beside them, per split
        ``"g,u"`` the slowest rank has jobs on, those jobs' unscaled parts summed (a breakdown
        of the four job parts, not more time)."""
        r = max(range(self.world), key=lambda i: (self.finish[i], -i))
        mine = self.jobs_of(r)
        out = {k: 0.0 for k in ("attention", "tokens", "communication", "overhead")}
        for j in mine:
            for k, v in j.cost.parts().items():
                out[k] += v
        out["idle"] = max(0.0, self.finish[r] - sum(out.values()))
        out["constant"] = self.constant
        if not unscaled:
            return out
        scale = dict(zip(SCALED, self.scale))
        shift = dict(self.shift)
        out.update({k: 0.0 for k in PARTS})
        out["constant"] = self.constant / scale.get("constant", 1.0)
        for j in mine:
            d = shift.get((j.size, j.cost.ulysses), 0.0)
            key = split_key(j.size, j.cost.ulysses)
            out.setdefault(key, 0.0)
            for k, v in j.cost.parts().items():
                raw = v / shifted_factor(scale.get(k, 1.0), d)
                out[k] += raw
                out[key] += raw
        return out

    def slots(self) -> List[List[Optional[Job]]]:
        """The jobs in rounds: per round, per rank, its job or None.  Every job's ranks run it in
        the same round, and each rank runs at most one job a round.  A loop whose model calls
        make collectives over the whole world (FSDP2 or ZeRO-3 gathering parameters) runs one
        model call per rank per round, a call on a one-token stand-in batch where a rank has no
        job (its loss times zero), so every rank makes the same collectives in the same order."""
        nxt = [0] * self.world
        placed: List[Tuple[int, Job]] = []
        for j in self.jobs:
            s = max(nxt[r] for r in j.ranks)
            for r in j.ranks:
                nxt[r] = s + 1
            placed.append((s, j))
        table: List[List[Optional[Job]]] = [[None] * self.world for _ in range(max(nxt, default=0))]
        for s, j in placed:
            for r in j.ranks:
                table[s][r] = j
        return table

    def splits(self) -> Dict[Tuple[int, int, int], int]:
        """(group size, ulysses, ring) -> number of jobs."""
        out: Dict[Tuple[int, int, int], int] = {}
        for j in self.jobs:
            key = (j.size, j.cost.ulysses, j.cost.ring)
            out[key] = out.get(key, 0) + 1
        return out


def group_sizes(world: int) -> Tuple[int, ...]:
    """Group sizes a schedule uses: the powers of two dividing ``world``, and ``world``."""
    if world < 1:
        raise ScheduleError(f"world must be >= 1, got {world}")
    sizes = {g for g in (2 ** i for i in range(world.bit_length())) if world % g == 0}
    return tuple(sorted(sizes | {world}))


def ulysses_degrees_of(g: int, allowed: Optional[Collection[int]] = None) -> List[int]:
    """The Ulysses degrees a group of ``g`` ranks may use, largest first: its divisors, those in
    ``allowed`` (None: all; 1 always, a ring or a single rank)."""
    return [d for d in range(g, 0, -1) if g % d == 0 and (allowed is None or d == 1 or d in allowed)]


def split_label(world: int, ulysses: int, ring: int) -> str:
    """A static split's name: ``U2xR2``, ``dp2 x U1xR2``, ``dp4 x one rank``."""
    sp = ulysses * ring
    name = "one rank" if sp == 1 else f"U{ulysses}xR{ring}"
    return f"dp{world // sp} x {name}" if world > sp else name


def check_lengths(lengths: Sequence) -> Tuple[int, ...]:
    """The lengths as ints, or :class:`ScheduleError` naming the first one that is not a
    positive integer (bools, floats, strings and None refused before any conversion; values up
    to 2**62)."""
    vals = list(lengths)
    if not vals:
        raise ScheduleError("an empty batch: give at least one sequence length")
    if set(map(type, vals)) == {int} and 1 <= min(vals) and max(vals) <= MAX_LENGTH:
        return tuple(vals)         # plain ints in range (the common case, checked in one pass)
    for i, n in enumerate(vals):
        problem = length_problem(n)
        if problem:
            raise ScheduleError(f"sequence {i} {problem}")
    return tuple(int(n) for n in vals)


#: the largest length accepted (lengths travel as int64 and are summed)
MAX_LENGTH = 2 ** 62


def length_problem(n) -> Optional[str]:
    """Why ``n`` is not a sequence length, as the end of "sequence i ..." (None when it is one)."""
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        return f"is {n!r} ({type(n).__name__}): every length must be a positive integer (a token count)"
    if int(n) < 1:
        return f"has {int(n)} tokens: every length must be >= 1"
    if int(n) > MAX_LENGTH:
        return f"has {int(n)} tokens: over the 2**62 a length may be"
    return None


def _finish_times(jobs: Sequence[Job], world: int) -> Tuple[float, ...]:
    """Each rank runs its jobs in order; a job starts when every rank of its group is free."""
    free = [0.0] * world
    for j in jobs:
        end = max(free[r] for r in j.ranks) + j.cost.time
        for r in j.ranks:
            free[r] = end
    return tuple(free)


def _ffd(items: Sequence[int], lens: Sequence[int], cap: int) -> List[List[int]]:
    """First-fit decreasing: ``items`` (indices into ``lens``) into bins of at most ``cap``
    tokens (a longer item gets a bin of its own); bins in the order opened."""
    if sum(lens[i] for i in items) <= cap:      # all in one bin (the usual case of a rank's own sequences)
        return [sorted(items, key=lambda i: (-lens[i], i))] if items else []
    bins: List[List[int]] = []
    room: List[int] = []
    for i in sorted(items, key=lambda i: (-lens[i], i)):
        n = lens[i]
        for b, left in enumerate(room):
            if n <= left:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(cap - n)
    return bins


def _balance(assign: List[List[int]], load: np.ndarray, cost: np.ndarray, rounds: int) -> None:
    """Moves and swaps of items between the most and the least loaded bin while that lowers the
    most loaded one (in place: ``assign[b]`` the items of bin b, ``load[b]`` its load)."""
    for _ in range(rounds):
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = float(load[hi] - load[lo])
        if gap <= 1e-9 * max(float(load[hi]), 1e-30) or not assign[hi]:
            return
        best = 0.0
        move: Optional[Tuple[int, Optional[int]]] = None
        for i in assign[hi]:          # a move of i: the gap shrinks by 2 c_i while c_i < gap
            c = float(cost[i])
            if 0 < c < gap:
                gain = min(c, gap - c)
                if gain > best:
                    best, move = gain, (i, None)
        if assign[lo]:
            lo_items = sorted(assign[lo], key=lambda j: float(cost[j]))
            lo_costs = np.array([float(cost[j]) for j in lo_items])
            for i in assign[hi]:      # a swap of i for j: as a move of c_i - c_j
                c = float(cost[i])
                k = int(np.searchsorted(lo_costs, c - gap / 2))
                for kk in (k - 1, k):
                    if 0 <= kk < len(lo_items):
                        d = c - lo_costs[kk]
                        if 0 < d < gap and min(d, gap - d) > best:
                            best, move = min(d, gap - d), (i, lo_items[kk])
        if move is None or best <= 1e-12 * gap:
            return
        i, j = move
        assign[hi].remove(i)
        assign[lo].append(i)
        delta = float(cost[i])
        if j is not None:
            assign[lo].remove(j)
            assign[hi].append(j)
            delta -= float(cost[j])
        load[hi] -= delta
        load[lo] += delta


class Scheduler:
    """Schedules the global batches of one run: the world, the model's shape, the profile that
    prices the jobs and the budget, fixed at set-up (the price tables are built once).

    ``budget_tokens``: the most tokens one rank holds in one job; ``sizes``: the group sizes to
    use (default :func:`group_sizes`); ``ulysses_degrees``: the Ulysses degrees a group may use
    besides 1 (default any divisor of its size; ``(1,)``: rings only); ``pack=False``: each
    sequence a job of its own (for models whose layers cannot keep packed documents apart);
    ``margin``: the predicted gain under which a step runs the best fixed split (0: never);
    ``rings=False``: groups use Ulysses alone (the group size its degree)."""

    def __init__(self, world: int, shape: AttentionShape, *, budget_tokens: int, profile="h100-nvlink",
                 sizes: Optional[Sequence[int]] = None, ulysses_degrees: Optional[Sequence[int]] = None,
                 pack: bool = True, margin: float = MARGIN, model: Optional[StepModel] = None, rings: bool = True):
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ScheduleError(f"world must be a positive integer, got {world!r}")
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, (int, np.integer)) or budget_tokens < 1:
            raise ScheduleError(f"budget_tokens must be a positive integer, got {budget_tokens!r}")
        self.world, self.budget = world, int(budget_tokens)
        self.sizes = tuple(sorted(set(sizes))) if sizes is not None else group_sizes(world)
        if not self.sizes or any(g < 1 or world % g for g in self.sizes):
            raise ScheduleError(f"group sizes {self.sizes} must divide the world ({world})")
        self.ulysses_degrees = None if ulysses_degrees is None else tuple(sorted(set(ulysses_degrees)))
        self.pack, self.margin, self.rings = bool(pack), float(margin), bool(rings)
        self.shape = shape
        self.model = model if model is not None else StepModel(shape, profile, top=self.budget)
        self._told = False

    @property
    def constant(self) -> float:
        """What every schedule of a step pays alike (:meth:`StepModel.step_constant`)."""
        return self.model.step_constant(self.world)

    # ---------------------------------------------------------------- prices
    def layout(self, g: int, u: int, packed: bool = False) -> str:
        """A job's layout: a ring's causal work balanced per document (``varlen_zigzag``: one
        sequence alone is cut zigzag-like), else the order kept; one layout for every job, so one
        registration of a model integration serves them all."""
        if g // u == 1 or not self.shape.causal:
            return "basic"
        return "varlen_zigzag"

    def splits(self, g: int) -> List[int]:
        """The Ulysses degrees a group of ``g`` may use: the allowed divisors, none above the
        query heads (a Ulysses rank beyond them would hold no head)."""
        return [u for u in ulysses_degrees_of(g, self.ulysses_degrees) if u <= self.shape.heads and
                (self.rings or u == g)]

    def _least_group(self, lens: np.ndarray) -> np.ndarray:
        """Each sequence's smallest group size that holds it (inf where none does)."""
        least = np.full(len(lens), np.inf)
        for g in sorted(self.sizes, reverse=True):
            fits = (lens >= g) & (np.ceil(lens / g) <= self.budget)
            least[fits] = g
        return least

    def _alone(self, lens: np.ndarray) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
        """Per group size: each sequence's job time there with its best Ulysses degree (inf
        where it does not fit: fewer tokens than ranks, over the budget, or a group more than
        :data:`REACH` times the smallest that holds it), and that degree."""
        out = {}
        least = self._least_group(lens)
        for g in self.sizes:
            best = np.full(len(lens), np.inf)
            deg = np.ones(len(lens), dtype=np.int64)
            ok = (lens >= g) & (np.ceil(lens / g) <= self.budget) & (g <= REACH * least)
            if ok.any():
                for u in self.splits(g):
                    t = np.full(len(lens), np.inf)
                    t[ok] = self.model.alone(lens[ok], g, u, self.layout(g, u), ("time",))["time"]
                    better = t < best
                    best[better], deg[better] = t[better], u
            out[g] = (best, deg)
        return out

    def _one_rank_fixed(self) -> float:
        """What a one-rank job costs before its first token (its calls' fixed costs and, with
        a varlen kernel, its one launch per pass): a packed job is this plus each sequence's
        cost beyond it."""
        m = self.model
        tab = m.table(1, 1, "basic")
        launch = tab.launch * (2 if self.shape.bwd else 1) if m.varlen else 0.0
        f = m.part_factors(1, 1)
        return (m.layers * tab.fixed + m.call_overhead() + m.call_extra.get((1, 1), (0.0,))[0]) * f["overhead"] + \
            m.layers * launch * m.call_attention * f["attention"]

    def _jobs(self, specs: Sequence[Tuple[Sequence[int], int, int, int]], lens: Tuple[int, ...]) -> List[Job]:
        """Jobs of (sequences, first rank, group size, Ulysses degree), in order, priced a
        split at a time."""
        groups: Dict[Tuple[int, int, str], List[int]] = {}
        for k, (seqs, _, g, u) in enumerate(specs):
            groups.setdefault((g, u, self.layout(g, u, len(seqs) > 1)), []).append(k)
        costs: List[Optional[Cost]] = [None] * len(specs)
        for (g, u, lay), ks in groups.items():
            for k, c in zip(ks, self.model.costs([tuple(lens[i] for i in specs[k][0]) for k in ks], g, u, lay)):
                costs[k] = c
        return [Job(tuple(seqs), tuple(lens[i] for i in seqs), first, g, c)
                for (seqs, first, g, _), c in zip(specs, costs) if c is not None]

    def _schedule(self, jobs: List[Job], label: str) -> Schedule:
        return Schedule(self.world, self.budget, tuple(jobs), _finish_times(jobs, self.world), label, self.constant,
                        tuple(self.model.part_scale[k] for k in SCALED), tuple(sorted(self.model.split_shift.items())))

    # ---------------------------------------------------------------- the dynamic schedule
    def dynamic(self, lengths: Sequence[int]) -> Schedule:
        """The batch's dynamic schedule (no comparison with a fixed split)."""
        lens = check_lengths(lengths)
        arr = np.array(lens, dtype=np.float64)
        alone = self._alone(arr)
        times = np.stack([alone[g][0] for g in self.sizes])          # [sizes, N]
        if not np.isfinite(times).any(axis=0).all():
            i = int(np.argmin(np.isfinite(times).any(axis=0)))
            raise ScheduleError(self._unplaceable(i, lens[i]))
        one = self.sizes[0] == 1
        fixed1 = self._one_rank_fixed() if one else 0.0
        sizes = np.array(self.sizes, dtype=np.float64)[:, None]
        work = times * sizes
        if one and self.pack:          # alone on a rank: packed, its cost beyond the job's fixed part
            work[0] = times[0] - fixed1
        finite = np.isfinite(times)
        fastest = np.argmin(times, axis=0)
        idx = np.arange(len(lens))
        smallest = np.argmax(finite, axis=0)                      # each sequence's smallest group that fits
        top = float(times[smallest, idx].max())
        low = float(times[fastest, idx].min())
        targets = np.geomspace(max(low, 1e-12), max(top, low, 1e-12), TARGETS)
        # every target at once: each sequence on its smallest group within the target, else its fastest
        within = finite[None] & (times[None] <= targets[:, None, None])          # [targets, sizes, N]
        picks = np.where(within.any(axis=1), np.argmax(within, axis=1), fastest[None])    # [targets, N]
        # and one group size for all (each sequence on it, or on its smallest group when it does not
        # fit there): fixed-split-like choices, which balance best when few sequences share many ranks
        level = np.arange(len(self.sizes))[:, None]
        uniform = np.where(finite[level.ravel(), :], level, np.maximum(smallest[None], np.minimum(level, fastest)))
        uniform = np.where(finite[uniform, idx[None]], uniform, fastest[None])
        picks = np.concatenate([picks, uniform])
        targets = np.concatenate([targets, np.full(len(self.sizes), np.inf)])
        chosen_work, chosen_time = work[picks, idx[None]], times[picks, idx[None]]           # [targets, N]
        est = np.maximum(chosen_work.sum(axis=1) / self.world + (fixed1 if one and self.pack else 0.0),
                         chosen_time.max(axis=1))
        degs = np.stack([alone[g][1] for g in self.sizes])
        best: Optional[Schedule] = None
        seen = set()
        for t in np.lexsort((-targets, est)):     # the best few estimates placed, the fastest placement kept
            pick = picks[t]
            key = pick.tobytes()
            if key in seen:
                continue
            seen.add(key)
            sched = self._place(lens, pick, degs[pick, idx], times, fixed1)
            if best is None or max(sched.finish) < max(best.finish):
                best = sched
            if len(seen) >= max(PLACED, PLACEMENTS // len(lens)):
                break
        assert best is not None
        return best

    def _place(self, lens, pick: np.ndarray, degrees: np.ndarray, times: np.ndarray, fixed1: float) -> Schedule:
        """Place one choice of groups (``pick``: each sequence's index into the sizes)."""
        W = self.world
        free = np.zeros(W)
        specs: List[Tuple[Sequence[int], int, int, int]] = []
        sizes = np.array(self.sizes)
        groups = sizes[pick]
        t_own = times[pick, np.arange(len(lens))]
        shared = np.flatnonzero(groups > 1)
        for i in shared[np.lexsort((shared, -t_own[shared], -groups[shared]))]:   # largest group, longest first
            g = int(groups[i])
            blocks = free.reshape(W // g, g).max(axis=1)
            b = int(np.argmin(blocks))
            free[b * g:(b + 1) * g] = blocks[b] + t_own[i]
            specs.append(((int(i),), b * g, g, int(degrees[i])))
        alone = np.flatnonzero(groups == 1)
        if alone.size:
            cost = times[0] - (fixed1 if self.pack else 0.0)
            assign: List[List[int]] = [[] for _ in range(W)]
            load = free.copy()
            heap = [(float(load[r]), r) for r in range(W)]
            heapq.heapify(heap)
            for i in alone[np.lexsort((alone, -cost[alone]))].tolist():           # longest first
                t, r = heapq.heappop(heap)
                assign[r].append(i)
                heapq.heappush(heap, (t + float(cost[i]), r))
                load[r] += cost[i]
            _balance(assign, load, cost, rounds=4 * len(alone) + W)
            for r in range(W):
                bins = _ffd(assign[r], lens, self.budget) if self.pack else [[i] for i in sorted(assign[r])]
                specs += [(b, r, 1, 1) for b in bins]
        return self._schedule(self._jobs(specs, lens), "dynamic")

    def _unplaceable(self, i: int, n: int) -> str:
        big = max(self.sizes)
        fit = [g for g in self.sizes if math.ceil(n / g) <= self.budget]
        if not fit:
            return (f"sequence {i} has {n} tokens: {math.ceil(n / big)} per rank even on all {big} ranks, over the "
                    f"budget of {self.budget} tokens per rank; raise budget_tokens (low_memory=True lowers what a "
                    "token costs) or add ranks")
        runs = [g for g in self.sizes if g < fit[0] and
                any(n >= least_tokens(g, u, self.layout(g, u)) for u in self.splits(g))]
        return (f"sequence {i} has {n} tokens: the groups that hold it within the budget of {self.budget} tokens per "
                f"rank ({', '.join(map(str, fit))} ranks) would leave a rank without a token of it, and a smaller "
                f"group puts more than {self.budget} on a rank; raise budget_tokens to "
                f"{math.ceil(n / max(runs)) if runs else n}")

    # ---------------------------------------------------------------- fixed splits (static+)
    def static(self, lengths: Sequence[int], ulysses: int, ring: int) -> Schedule:
        """One fixed split for the whole batch, placed with the dynamic schedule's care:
        ``world / (ulysses x ring)`` replicas, sequences longest first onto the replica whose
        predicted time is lowest, then moved and swapped between the slowest and the fastest
        replica, each replica's sequences packed first-fit decreasing into jobs of at most the
        budget per rank (``varlen_zigzag`` on a ring: each document split for balance).
        Raises :class:`ScheduleError` when a sequence does not fit (over the budget, or a job
        that leaves a rank without a token)."""
        lens = check_lengths(lengths)
        u, r = int(ulysses), int(ring)
        sp = u * r
        if u < 1 or r < 1 or self.world % sp:
            raise ScheduleError(f"ulysses x ring = {sp} must divide the world ({self.world})")
        for i, n in enumerate(lens):
            if math.ceil(n / sp) > self.budget:
                raise ScheduleError(f"sequence {i} has {n} tokens: {math.ceil(n / sp)} per rank on {u} x {r}, "
                                    f"over the budget of {self.budget} tokens per rank")
        arr = np.array(lens, dtype=np.float64)
        reps = self.world // sp
        short = arr < sp                         # fewer tokens than ranks: only packed with others
        if short.any() and not self.pack:
            i = int(np.argmax(short))
            raise ScheduleError(f"sequence {i} has {lens[i]} tokens, fewer than the {sp} ranks of {u} x {r}")
        cost = np.zeros(len(lens))
        ok = ~short
        if ok.any():
            cost[ok] = self.model.alone(arr[ok], sp, u, self.layout(sp, u), ("time",))["time"]
        if short.any():                          # a short one's share: its tokens' token-layer time
            cost[short] = self.model.tokens_time(np.ceil(arr[short] / sp))
        assign: List[List[int]] = [[] for _ in range(reps)]
        load = np.zeros(reps)
        heap = [(0.0, d) for d in range(reps)]
        for i in sorted(range(len(lens)), key=lambda i: (-cost[i], i)):
            t, d = heapq.heappop(heap)
            assign[d].append(i)
            load[d] += cost[i]
            heapq.heappush(heap, (float(load[d]), d))
        _balance(assign, load, cost, rounds=4 * len(lens) + reps)
        specs: List[Tuple[Sequence[int], int, int, int]] = []
        for d in range(reps):
            bins = _ffd(assign[d], lens, self.budget * sp) if self.pack else [[i] for i in sorted(assign[d])]
            merged = _merge_short(bins, lens, sp, u, self.budget * sp, self.layout(sp, u, True))
            if merged is None:
                raise ScheduleError(f"{split_label(self.world, u, r)}: a replica's short sequences leave a rank "
                                    f"without a token and fit no other job")
            specs += [(b, d * sp, sp, u) for b in merged]
        return self._schedule(self._jobs(specs, lens), split_label(self.world, u, r))

    def static_splits(self, longest: Optional[int] = None) -> List[Tuple[int, int]]:
        """Every (ulysses, ring) a fixed split may use: each group size and its Ulysses degrees;
        with ``longest`` (a batch's longest sequence), only groups that hold it and are at most
        :data:`REACH` times the smallest that does."""
        sizes = sorted(self.sizes, reverse=True)
        if longest is not None:
            least = float(self._least_group(np.array([float(longest)]))[0])
            sizes = [g for g in sizes if least <= g <= REACH * least]
        return [(u, g // u) for g in sizes for u in self.splits(g)]

    def statics(self, lengths: Sequence[int]) -> Dict[Tuple[int, int], Schedule]:
        """Every fixed split that holds the batch, placed (:meth:`static`), by (ulysses, ring);
        the splits that cannot hold it left out."""
        lens = check_lengths(lengths)
        out: Dict[Tuple[int, int], Schedule] = {}
        for u, r in self.static_splits(max(lens)):
            try:
                out[(u, r)] = self.static(lens, u, r)
            except ScheduleError:
                continue
        return out

    def _static_estimates(self, lens: Tuple[int, ...]) -> List[Tuple[float, int, int, int]]:
        """(estimate, -ulysses, ulysses, ring) of every fixed split that holds the batch, best
        first.  The estimate of a split: the larger of its work per replica (each sequence's job
        beyond the split's fixed cost, one fixed cost per replica, as packed) and its longest
        job, plus the step's constant part."""
        arr = np.array(lens, dtype=np.float64)
        ranked = []
        for u, r in self.static_splits(max(lens)):
            sp = u * r
            if np.ceil(arr.max() / sp) > self.budget or (not self.pack and arr.min() < sp):
                continue
            ok = arr >= sp
            t = np.asarray(self.model.tokens_time(np.ceil(arr / sp)), dtype=np.float64)
            fixed = float(self.model.alone([least_tokens(sp, u, self.layout(sp, u))], sp, u, self.layout(sp, u),
                                           ("time",))["time"][0])
            if ok.any():
                t[ok] = self.model.alone(arr[ok], sp, u, self.layout(sp, u), ("time",))["time"]
            beyond = np.where(ok, np.maximum(t - fixed, 0.0), t) if self.pack else t
            est = max(float(beyond.sum()) * sp / self.world + (fixed if self.pack else 0.0), float(t.max()))
            ranked.append((est + self.constant, -u, u, r))
        return sorted(ranked)

    def best_static(self, lengths: Sequence[int]) -> Optional[Schedule]:
        """The placed fixed split with the lowest price among those of the best estimates
        (:meth:`_static_estimates`): as many placed as the dynamic schedule places choices, about
        :data:`PLACEMENTS` sequences in all and at least one (so a batch of few sequences has
        every split placed: where per-call costs weigh, the estimate can rank the splits otherwise
        than their placed prices; a batch of many has the estimate's first placed, as its host
        time allows); None when no fixed split holds the batch."""
        lens = check_lengths(lengths)
        want = max(1, PLACEMENTS // len(lens))
        best: Optional[Schedule] = None
        placed = 0
        for _, _, u, r in self._static_estimates(lens):
            try:
                got = self.static(lens, u, r)
            except ScheduleError:
                continue
            placed += 1
            if best is None or got.predicted < best.predicted:
                best = got
            if placed >= want:
                break
        return best

    # ---------------------------------------------------------------- the step's schedule
    def schedule(self, lengths: Sequence[int]) -> Schedule:
        """The step's schedule: the dynamic one, or the best fixed split when the dynamic one is
        predicted to gain less than ``margin`` over it."""
        dyn = self.dynamic(lengths)
        if self.margin <= 0:
            return dyn
        lens = check_lengths(lengths)
        est = self._static_estimates(lens)
        if not est or dyn.predicted < (1.0 - self.margin) * CLEAR * est[0][0]:
            return dyn             # no fixed split holds the batch, or none comes near: not placed
        st = self.best_static(lens)
        if st is not None and dyn.predicted > (1.0 - self.margin) * st.predicted:
            if not self._told:
                self._told = True
                logger.info("usp_hal.planning.schedule: a step's dynamic schedule is predicted to gain %.1f%% over "
                            "the fixed split %s, under the %.0f%% margin: such steps run the fixed split (logged once)",
                            100 * (1 - dyn.predicted / st.predicted), st.label, 100 * self.margin)
            return st
        return dyn

    def bound(self, lengths: Sequence[int]) -> float:
        """A lower bound of any schedule's predicted step for the batch: each sequence at its
        cheapest rank-seconds beyond a job's fixed cost (as if packed with others, on a group of
        any size) over the world, and no less than its fastest job (a sequence with fewer tokens
        than some group has ranks, which a pack there may hold for less, counts in neither); plus
        the step's constant part."""
        lens = check_lengths(lengths)
        arr = np.array(lens, dtype=np.float64)
        alone = self._alone(arr)
        times = np.stack([alone[g][0] for g in self.sizes])
        fixed = np.array([self._group_fixed(g) for g in self.sizes])[:, None]
        work = np.maximum(times - fixed, 0.0) * np.array(self.sizes, dtype=np.float64)[:, None]
        # a sequence too short to be alone on a group may still share a pack there, one token
        # on a rank, in a job cheaper than any alone (a split priced cheaper per job than one
        # rank, by a fitted shift, say): it counts as adding nothing, to either term
        short = np.stack([(arr < g) & (np.ceil(arr / g) <= self.budget) for g in self.sizes]) & self.pack
        work = np.where(short, 0.0, work)
        fastest = np.where(short, 0.0, times)
        return max(float(work.min(axis=0).sum()) / self.world, float(fastest.min(axis=0).max())) + self.constant

    def _group_fixed(self, g: int) -> float:
        """At most what a job on ``g`` ranks costs before the tokens of its sequences: a
        one-rank job's fixed part, or a larger group's cheapest job of the fewest tokens that
        give every rank one."""
        if g == 1:
            return self._one_rank_fixed()
        return min((float(self.model.alone([least_tokens(g, u, self.layout(g, u))], g, u, self.layout(g, u),
                                           ("time",))["time"][0]) for u in self.splits(g)), default=0.0)


def _merge_short(bins: List[List[int]], lens, sp: int, u: int, cap: int, layout: str) -> Optional[List[List[int]]]:
    """Bins whose job would leave a rank without a token (only sequences shorter than the group)
    emptied into the other bins with room, a sequence at a time; None when one cannot be."""
    if sp == 1:
        return bins
    out = [list(b) for b in bins]

    def ok(b) -> bool:          # a sequence of at least sp tokens gives every rank one (least_tokens)
        return not b or max(lens[i] for i in b) >= sp or fits_packed([lens[i] for i in b], sp, u, layout)
    for b in out:
        if ok(b):
            continue
        for i in sorted(b, key=lambda i: (-lens[i], i)):
            home = next((o for o in out if o is not b and o and ok(o) and sum(lens[j] for j in o) + lens[i] <= cap),
                        None)
            if home is None:
                break
            home.append(i)
            b.remove(i)
        if ok(b):
            continue
        # no room for them elsewhere: bring the shortest sequence of at least sp tokens that fits here
        # from a job that stays runnable without it
        room = cap - sum(lens[j] for j in b)
        donors = sorted((lens[d], d, o) for o in out if o is not b for d in o
                        if sp <= lens[d] <= room and ok([j for j in o if j != d]))
        if not donors:
            return None
        _, d, o = donors[0]
        o.remove(d)
        b.append(d)
    return [sorted(b, key=lambda i: (-lens[i], i)) for b in out if b]


@lru_cache(maxsize=16)
def _scheduler(world, shape, budget, profile, sizes, ulysses_degrees, pack, margin) -> Scheduler:
    return Scheduler(world, shape, budget_tokens=budget, profile=profile, sizes=sizes, ulysses_degrees=ulysses_degrees,
                     pack=pack, margin=margin)


def scheduler(world: int, shape: AttentionShape, *, budget_tokens: int, profile="h100-nvlink",
              sizes: Optional[Sequence[int]] = None, ulysses_degrees: Optional[Sequence[int]] = None,
              pack: bool = True, margin: float = MARGIN) -> Scheduler:
    """A :class:`Scheduler`, shared between calls with the same arguments (a profile given by
    name; a dict builds a new one)."""
    sz = None if sizes is None else tuple(sorted(set(sizes)))
    ud = None if ulysses_degrees is None else tuple(sorted(set(ulysses_degrees)))
    if not isinstance(profile, str):
        return Scheduler(world, shape, budget_tokens=budget_tokens, profile=profile, sizes=sz, ulysses_degrees=ud,
                         pack=pack, margin=margin)
    return _scheduler(world, shape, budget_tokens, profile, sz, ud, bool(pack), float(margin))


def schedule_batch(lengths: Sequence[int], world: int, shape: AttentionShape, *, budget_tokens: int,
                   profile="h100-nvlink", sizes: Optional[Sequence[int]] = None,
                   ulysses_degrees: Optional[Sequence[int]] = None, pack: bool = True,
                   margin: float = MARGIN) -> Schedule:
    """Place every sequence of a global batch on a group of ranks with its own U x R split
    (:meth:`Scheduler.schedule`; see :class:`Scheduler` for the arguments).  ``lengths``: every
    sequence's token count, in the batch's order (gather them with
    :meth:`usp_hal.planning.dynamic.DynamicDegree.gather_lengths`)."""
    return scheduler(world, shape, budget_tokens=budget_tokens, profile=profile, sizes=sizes,
                     ulysses_degrees=ulysses_degrees, pack=pack, margin=margin).schedule(lengths)


def static_schedule(lengths: Sequence[int], world: int, shape: AttentionShape, *, ulysses: int, ring: int,
                    budget_tokens: int, profile="h100-nvlink", pack: bool = True) -> Schedule:
    """One fixed split for the whole batch (:meth:`Scheduler.static`)."""
    return scheduler(world, shape, budget_tokens=budget_tokens, profile=profile, pack=pack).static(
        lengths, ulysses, ring)


def static_rule(lengths: Sequence[int], world: int, shape: AttentionShape, *, ulysses: int, ring: int,
                budget_tokens: int, profile="h100-nvlink") -> Schedule:
    """The fixed split as earlier versions placed it, for comparison: sequences to the replica
    with the fewest tokens (longest first), each replica's sequences packed in index order into
    consecutive jobs of at most the budget, a ring's packed jobs in the ``zigzag`` layout (priced
    on the packed stream by the planner)."""
    sch = scheduler(world, shape, budget_tokens=budget_tokens, profile=profile)
    lens = check_lengths(lengths)
    sp = ulysses * ring
    if world % sp:
        raise ScheduleError(f"ulysses x ring = {sp} must divide the world ({world})")
    for i, n in enumerate(lens):
        if math.ceil(n / sp) > budget_tokens:
            raise ScheduleError(f"sequence {i} has {n} tokens: over the budget on {ulysses} x {ring}")
    reps = world // sp
    tokens = [0] * reps
    held: List[List[int]] = [[] for _ in range(reps)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        d = min(range(reps), key=lambda d: (tokens[d], d))
        held[d].append(i)
        tokens[d] += lens[i]
    lay = "basic" if ring == 1 or not shape.causal else "zigzag"
    jobs = []
    for d in range(reps):
        bins: List[List[int]] = []
        used = 0
        for i in sorted(held[d]):
            if not bins or used + lens[i] > budget_tokens * sp:
                bins.append([])
                used = 0
            bins[-1].append(i)
            used += lens[i]
        for b in bins:
            ls = tuple(lens[i] for i in b)
            jobs.append(Job(tuple(b), ls, d * sp, sp, sch.model.job_exact(ls, sp, ulysses, lay)))
    return sch._schedule(jobs, f"rule {split_label(world, ulysses, ring)}")


# ------------------------------------------------------------------------- length distributions
#: the named distributions :func:`draw_batches` knows (see docs/dynamic-degree.md)
DISTRIBUTIONS = ("lognormal:MEDIAN:MAX[:SIGMA]", "llama3-sft")


def _parse_dist(spec: str):
    name, *args = spec.split(":")
    if name == "llama3-sft" and not args:
        return name, ()
    if name == "lognormal" and len(args) in (2, 3):
        try:
            median, top = int(args[0]), int(args[1])
            sigma = float(args[2]) if len(args) == 3 else 1.5
        except ValueError:
            raise ScheduleError(f"length distribution {spec!r}: lognormal:MEDIAN:MAX[:SIGMA] takes numbers") from None
        if not (1 <= median <= top and sigma > 0):
            raise ScheduleError(f"length distribution {spec!r}: needs 1 <= MEDIAN <= MAX and SIGMA > 0")
        return name, (median, top, sigma)
    raise ScheduleError(f"length distribution {spec!r}: use one of {', '.join(DISTRIBUTIONS)}")


def draw_batches(spec: str, steps: int, tokens_per_step: int, *, seed: int = 0, scale: int = 1) -> List[List[int]]:
    """``steps`` global batches of at least ``tokens_per_step`` tokens each, lengths drawn from
    ``spec`` with a fixed seed (divided by ``scale``, at least 1):

    - ``lognormal:MEDIAN:MAX[:SIGMA]``: log-normal with that median (sigma 1.5 by default),
      clipped to [16, MAX];
    - ``llama3-sft``: the Llama 3 long-context SFT mix as its paper reports it (quoted by Skrull,
      arXiv 2505.19609): 99.89% short sequences averaging about 1K tokens, 0.11% long ones
      averaging about 37K; the shapes are assumed (log-normal, sigma 1.0 and 0.3), clipped to
      [16, 65,536]."""
    name, args = _parse_dist(spec)
    rng = np.random.default_rng(seed)

    def lognormal_mean(mean: float, sigma: float) -> float:
        return float(rng.lognormal(math.log(mean) - sigma * sigma / 2, sigma))

    def one() -> int:
        if name == "lognormal":
            median, top, sigma = args
            x = float(rng.lognormal(math.log(median), sigma))
            top_ = top
        else:
            x = lognormal_mean(37000, 0.3) if rng.random() < 0.0011 else lognormal_mean(1000, 1.0)
            top_ = 65536
        return max(1, int(min(max(x, 16), top_)) // scale)

    out = []
    for _ in range(steps):
        b: List[int] = []
        while sum(b) < tokens_per_step:
            b.append(one())
        out.append(b)
    return out


def compare_with_static(batches: Sequence[Sequence[int]], world: int, shape: AttentionShape, *, budget_tokens: int,
                        profile="h100-nvlink", ulysses_degrees: Optional[Sequence[int]] = None,
                        sizes: Optional[Sequence[int]] = None, pack: bool = True,
                        model: Optional[StepModel] = None) -> Dict[str, object]:
    """The dynamic schedule against ``static+`` (every fixed split that holds every batch, each
    placed with the same care: :meth:`Scheduler.static`), summed over the batches.

    Returns ``dynamic`` and ``static`` (label -> totals of ``predicted``, ``pairs``, ``bytes``,
    ``collectives``, ``tokens`` (the slowest rank's), and the parts), ``best`` (the one fixed
    split with the lowest predicted total), ``bound`` (the sum of the batches' lower bounds),
    ``balance`` (the dynamic schedules' largest slowest/mean), ``token_balance`` (the slowest
    rank's tokens over the mean, largest over the batches), ``ratio`` (dynamic / best on
    ``predicted``) and ``fallbacks`` (steps that ran the fixed split)."""
    if model is not None:       # price tables shared with other comparisons (other worlds, variants)
        sch = Scheduler(world, shape, budget_tokens=budget_tokens, profile=model.profile, sizes=sizes,
                        ulysses_degrees=ulysses_degrees, pack=pack, model=model)
    else:
        sch = scheduler(world, shape, budget_tokens=budget_tokens, profile=profile, sizes=sizes,
                        ulysses_degrees=ulysses_degrees, pack=pack)

    def totals(scheds: List[Schedule]) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for s in scheds:
            for k, v in {**s.slowest(), **s.parts(), "tokens_slowest": max(s.tokens())}.items():
                out[k] = out.get(k, 0.0) + v
        return out

    dyn = [sch.schedule(b) for b in batches]
    static: Dict[str, Dict[str, float]] = {}
    for u, r in sch.static_splits(max(max(b) for b in batches)):
        try:
            static[split_label(world, u, r)] = totals([sch.static(b, u, r) for b in batches])
        except ScheduleError:
            continue
    best = min(static, key=lambda k: static[k]["predicted"]) if static else None
    d = totals(dyn)
    toks = [s.tokens() for s in dyn]
    return {"dynamic": d, "static": static, "best": best,
            "bound": sum(sch.bound(b) for b in batches),
            "balance": max(s.balance for s in dyn),
            "token_balance": max(max(t) / (sum(t) / len(t)) for t in toks),
            "ratio": d["predicted"] / static[best]["predicted"] if best else None,
            "fallbacks": sum(1 for s in dyn if s.label != "dynamic"), "schedules": dyn}
