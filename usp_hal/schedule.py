"""A Ulysses x Ring split per global batch, chosen from its sequence lengths.

One split for a whole run cuts every sequence over the whole sequence-parallel group, a short
one as much as a long one.  :func:`schedule_batch` instead places each sequence of a global
batch on a *group* of ranks sized for it, with that group's best Ulysses x Ring split:

- the groups are contiguous, aligned blocks of ranks whose size is a power of two dividing the
  world, or the whole world (:func:`group_sizes`): at most ``sum(world / g)`` groups per split,
  built once at set-up;
- a sequence goes to the smallest group whose ranks hold it within ``budget_tokens`` per rank
  and on which it takes no longer than the batch's balanced share per rank (a sequence that fits
  on one rank and is not the slowest rank's alone runs there with no sequence parallelism);
- the placement is longest-first onto the block of its size whose ranks are free earliest, priced
  by the planner's cost model (:func:`usp_hal.planner.predict`) on one device profile, a job
  starting when every rank of its block is free;
- the sequences a rank holds alone are packed into as few jobs as the budget allows.

Every input is a number, every step deterministic: ranks that compute the schedule from the same
gathered lengths get the same schedule.  A batch that cannot be placed (one sequence over the
budget on every group) raises :class:`ScheduleError` naming the sequence and the budget.

The counts of each job (query-key pairs scored per rank, bytes each rank sends, collectives) come
from the same block plans the attention runs; :func:`static_schedule` prices a fixed split (dp x sp
replicas, each packing its sequences) on the same terms, for comparison.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Sequence, Tuple

from .parallel.heads import head_plan
from .planner import Candidate, Problem, call_pairs, load_profile, predict, ring_work


class ScheduleError(ValueError):
    """A batch that no schedule can place within the budget (raised before any data moves)."""


@dataclass(frozen=True)
class AttentionShape:
    """Everything about one attention call but its length."""
    heads: int
    head_dim: int
    kv_heads: Optional[int] = None
    dtype: str = "bf16"
    causal: bool = True
    bwd: bool = True


@dataclass(frozen=True)
class Cost:
    """One job's price on its group: the best split and what each rank of the group pays."""
    ulysses: int
    ring: int
    layout: str
    time: float          # predicted seconds (the profile's), forward (and backward with bwd)
    pairs: int           # query-key pairs x query heads the busiest rank of the group scores (forward)
    bytes: float         # bytes the busiest rank sends
    collectives: int


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
    finish: Tuple[float, ...] = field(default=())   # predicted time each rank ends the step

    def jobs_of(self, rank: int) -> List[Job]:
        return [j for j in self.jobs if rank in j.ranks]

    def per_rank(self, what: str) -> List[float]:
        """Sum over each rank's jobs of ``pairs``, ``bytes`` or ``collectives``."""
        out = [0.0] * self.world
        for j in self.jobs:
            for r in j.ranks:
                out[r] += getattr(j.cost, what)
        return out

    def slowest(self) -> Dict[str, float]:
        """The slowest rank's attention work, bytes sent, collectives and predicted time."""
        return {"pairs": max(self.per_rank("pairs")), "bytes": max(self.per_rank("bytes")),
                "collectives": max(self.per_rank("collectives")), "predicted": max(self.finish)}

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


def fitting_static_splits(batches: Sequence[Sequence[int]], world: int, shape: AttentionShape, *,
                          budget_tokens: int, profile="h100-nvlink") -> Dict[Tuple[int, int], List[Schedule]]:
    """``(ulysses, ring)`` -> every batch's schedule, for each static split (``sp`` ranks of the
    group sizes, largest first, ``world / sp`` replicas) that holds every batch within the budget."""
    out: Dict[Tuple[int, int], List[Schedule]] = {}
    for sp in sorted(group_sizes(world), reverse=True):
        for u in ulysses_degrees_of(sp):
            try:
                out[(u, sp // u)] = [static_schedule(b, world, shape, ulysses=u, ring=sp // u,
                                                     budget_tokens=budget_tokens, profile=profile) for b in batches]
            except ScheduleError:
                continue
    return out


class _Pricer:
    """Costs of (lengths, group size), each priced once."""

    def __init__(self, shape: AttentionShape, profile, ulysses_degrees: Optional[Sequence[int]] = None):
        self.shape = shape
        self.ulysses_degrees = None if ulysses_degrees is None else frozenset(ulysses_degrees)
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self._seen: Dict[Tuple[Tuple[int, ...], int], Cost] = {}

    def __call__(self, lengths: Tuple[int, ...], g: int) -> Cost:
        key = (lengths, g)
        cost = self._seen.get(key)
        if cost is None:
            options = (self._price(lengths, g, u, g // u, lay) for u, lay in self._options(lengths, g))
            cost = self._seen[key] = min(options, key=lambda c: (c.time, c.bytes, -c.ulysses))
        return cost

    def _options(self, lengths, g):
        packed = len(lengths) > 1
        for u in self.splits(g):
            if g // u == 1:
                yield u, "basic"
            elif not self.shape.causal:
                yield u, "basic"
            else:
                yield u, "zigzag"
                if packed:
                    yield u, "varlen_zigzag"

    def splits(self, g: int) -> List[int]:
        return ulysses_degrees_of(g, self.ulysses_degrees)

    def _price(self, lengths, g, u, r, layout) -> Cost:
        s = self.shape
        total = sum(lengths)
        cu = None
        if len(lengths) > 1:
            acc = [0]
            for n in lengths:
                acc.append(acc[-1] + n)
            cu = tuple(acc)
        pred = predict(Problem(g, s.heads, total, s.head_dim, s.kv_heads, 1, s.dtype, s.causal, s.bwd, cu),
                       Candidate(u, r, layout), self.profile)
        work, _, _ = ring_work(layout, total, r, s.causal, cu)
        heads = max(b - a for a, b in head_plan(s.heads, s.kv_heads or s.heads, u).q)
        pairs = max(sum(call_pairs(call) for step in rank_steps for call in step) for rank_steps in work) * heads
        return Cost(u, r, layout, pred.time, pairs, pred.comm_bytes, pred.collectives)


def _check_lengths(lengths: Sequence[int]) -> Tuple[int, ...]:
    out = tuple(int(n) for n in lengths)
    if not out:
        raise ScheduleError("an empty batch: give at least one sequence length")
    bad = [(i, n) for i, n in enumerate(out) if n < 1]
    if bad:
        raise ScheduleError(f"sequence {bad[0][0]} has {bad[0][1]} tokens: every length must be >= 1")
    return out


def _smallest_group(i: int, n: int, sizes: Tuple[int, ...], budget: int) -> int:
    for g in sizes:
        if math.ceil(n / g) <= budget:
            return g
    world = sizes[-1]
    raise ScheduleError(f"sequence {i} has {n} tokens: {math.ceil(n / world)} per rank even on all {world} ranks, "
                        f"over the budget of {budget} tokens per rank; raise budget_tokens (low_memory=True lowers "
                        f"what a token costs) or add ranks")


def _finish_times(jobs: Sequence[Job], world: int) -> Tuple[float, ...]:
    """Each rank runs its jobs in order; a job starts when every rank of its group is free."""
    free = [0.0] * world
    for j in jobs:
        end = max(free[r] for r in j.ranks) + j.cost.time
        for r in j.ranks:
            free[r] = end
    return tuple(free)


def _pack(seqs: Sequence[int], lengths: Tuple[int, ...], limit: int) -> List[List[int]]:
    """Consecutive bins of at most ``limit`` tokens, in the given order."""
    bins: List[List[int]] = []
    used = 0
    for i in seqs:
        if not bins or used + lengths[i] > limit:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += lengths[i]
    return bins


def schedule_batch(lengths: Sequence[int], world: int, shape: AttentionShape, *, budget_tokens: int,
                   profile="h100-nvlink", sizes: Optional[Sequence[int]] = None,
                   ulysses_degrees: Optional[Sequence[int]] = None, pack: bool = True) -> Schedule:
    """Place every sequence of a global batch on a group of ranks with its own U x R split.

    ``lengths``: every sequence's token count, in the batch's order (gather them with
    :func:`usp_hal.dynamic.gather_lengths`); ``budget_tokens``: the most tokens one rank may hold
    in one job; ``profile``: the planner profile that prices the jobs (a name, a path or a dict);
    ``sizes``: the group sizes to use (default :func:`group_sizes`); ``ulysses_degrees``: the
    Ulysses degrees a group may use besides 1 (default: any divisor of its size; ``(1,)``: rings
    only, say for layers whose recurrence crosses the shards by state passing); ``pack=False``:
    each sequence a job of its own (for models whose one-rank kernels cannot keep packed
    documents apart)."""
    lens = _check_lengths(lengths)
    if budget_tokens < 1:
        raise ScheduleError(f"budget_tokens must be >= 1, got {budget_tokens}")
    sizes = tuple(sorted(set(sizes))) if sizes is not None else group_sizes(world)
    if any(g < 1 or world % g for g in sizes):
        raise ScheduleError(f"group sizes {sizes} must divide the world ({world})")
    price = _Pricer(shape, profile, ulysses_degrees)
    least = [_smallest_group(i, n, sizes, budget_tokens) for i, n in enumerate(lens)]

    # each sequence's group: the smallest (within the budget) on which it takes no longer than a
    # target time; the balanced share of the batch's rank-seconds is the natural target (a sequence
    # longer than that on one rank is the slowest rank's alone), smaller ones split more and
    # balance better for more exchanges: each is scheduled, the fastest kept
    base = sum(price((n,), 1).time for n in lens) / world
    best: Optional[Schedule] = None
    for frac in TARGETS:
        group = [next((g for g in sizes if g >= least[i] and price((n,), g).time <= frac * base), sizes[-1])
                 for i, n in enumerate(lens)]
        sched = _place(lens, group, world, budget_tokens, price, pack)
        if best is None or max(sched.finish) < max(best.finish):
            best = sched
    # a fixed split is one more candidate: the schedule is never predicted slower than one that fits
    # (a fixed split packs its replica's sequences: not a candidate without packing)
    for g in (sizes if pack else ()):
        for u in price.splits(g):
            try:
                sched = _static(lens, world, budget_tokens, price, u, g // u, None)
            except ScheduleError:
                continue
            if best is None or max(sched.finish) < max(best.finish):
                best = sched
    assert best is not None
    return best


#: fractions of the balanced share tried as the longest time a sequence may take on its group
TARGETS = (1.0, 0.75, 0.5, 0.35, 0.25)


def _place(lens: Tuple[int, ...], group: List[int], world: int, budget: int, price: _Pricer,
           pack: bool = True) -> Schedule:
    """The groups' jobs longest first, each onto the block of its size whose ranks are free
    earliest; then what ranks hold alone, longest first onto the rank free earliest, moved from
    the slowest rank to the fastest while that lowers the slowest; each rank's own sequences
    packed into as few jobs as the budget allows (fewer kernel calls).  They make no collective,
    so they run after the groups' jobs."""
    free = [0.0] * world
    shared: List[Job] = []
    by_time = sorted(range(len(lens)), key=lambda i: (-price((lens[i],), group[i]).time, i))
    for i in (i for i in by_time if group[i] > 1):
        g = group[i]
        b = min(range(world // g), key=lambda b: (max(free[b * g:(b + 1) * g]), b))
        job = Job((i,), (lens[i],), b * g, g, price((lens[i],), g))
        end = max(free[r] for r in job.ranks) + job.cost.time
        for r in job.ranks:
            free[r] = end
        shared.append(job)
    mine: List[List[int]] = [[] for _ in range(world)]
    for i in (i for i in by_time if group[i] == 1):
        r = min(range(world), key=lambda r: (free[r], r))
        mine[r].append(i)
        free[r] += price((lens[i],), 1).time
    for _ in range(len(lens) * world):   # a move from the slowest rank to the fastest that lowers the slowest
        hi = max(range(world), key=lambda r: (free[r], -r))
        lo = min(range(world), key=lambda r: (free[r], r))
        gap = free[hi] - free[lo]
        # t < gap lowers the sum of squared loads by 2t(gap - t): moves that gain a fraction of
        # it only would trade rounding for iterations
        moves = [(abs(gap - 2 * price((lens[i],), 1).time), i) for i in mine[hi]
                 if 0 < price((lens[i],), 1).time < gap * (1 - 1e-6)]
        if not moves:
            break
        _, i = min(moves)
        t = price((lens[i],), 1).time
        mine[hi].remove(i)
        mine[lo].append(i)
        free[hi] -= t
        free[lo] += t
    alone: List[Job] = []
    for r in range(world):      # without packing: each sequence a job (bins of 0 tokens hold one each)
        for bin_ in _pack(sorted(mine[r], key=lambda i: (-lens[i], i)), lens, budget if pack else 0):
            ls = tuple(lens[i] for i in bin_)
            alone.append(Job(tuple(bin_), ls, r, 1, price(ls, 1)))
    jobs = tuple(shared + alone)
    return Schedule(world, budget, jobs, _finish_times(jobs, world))


def static_schedule(lengths: Sequence[int], world: int, shape: AttentionShape, *, ulysses: int, ring: int,
                    budget_tokens: int, profile="h100-nvlink", layout: Optional[str] = None) -> Schedule:
    """One fixed split for the whole batch: ``world / (ulysses * ring)`` data-parallel replicas,
    each a ``ulysses x ring`` group; sequences go to the replica with the fewest tokens
    (longest first), and each replica packs its sequences into jobs of at most
    ``budget_tokens`` per rank.  Raises :class:`ScheduleError` when a sequence does not fit."""
    lens = _check_lengths(lengths)
    if ulysses < 1 or ring < 1 or world % (ulysses * ring):
        raise ScheduleError(f"ulysses x ring = {ulysses * ring} must divide the world ({world})")
    return _static(lens, world, budget_tokens, _Pricer(shape, profile), ulysses, ring, layout)


def _static(lens: Tuple[int, ...], world: int, budget: int, price: _Pricer, ulysses: int, ring: int,
            layout: Optional[str]) -> Schedule:
    sp = ulysses * ring
    for i, n in enumerate(lens):
        if math.ceil(n / sp) > budget:
            raise ScheduleError(f"sequence {i} has {n} tokens: {math.ceil(n / sp)} per rank on {ulysses} x {ring}, "
                                f"over the budget of {budget} tokens per rank")
    if layout is None:
        layout = "basic" if ring == 1 or not price.shape.causal else "zigzag"
    replicas = world // sp
    tokens = [0] * replicas
    held: List[List[int]] = [[] for _ in range(replicas)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        d = min(range(replicas), key=lambda d: (tokens[d], d))
        held[d].append(i)
        tokens[d] += lens[i]
    jobs = []
    for d in range(replicas):
        for bin_ in _pack(sorted(held[d]), lens, budget * sp):
            ls = tuple(lens[i] for i in bin_)
            jobs.append(Job(tuple(bin_), ls, d * sp, sp, price._price(ls, sp, ulysses, ring, layout)))
    jobs_t = tuple(jobs)
    return Schedule(world, budget, jobs_t, _finish_times(jobs_t, world))


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
    import numpy as np
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
                        profile="h100-nvlink") -> Dict[str, object]:
    """The dynamic schedule against every static split (``U x R`` over ``sp`` ranks, ``world /
    sp`` replicas) that holds every batch within the budget, summed over the batches: per
    schedule the slowest rank's ``pairs``, ``bytes``, ``collectives`` and ``predicted`` time;
    ``ratio``: dynamic over the best static split of each metric (None without one that fits)."""
    def total(scheds: List[Schedule]) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for s in scheds:
            for k, v in s.slowest().items():
                out[k] = out.get(k, 0.0) + v
        return out

    dynamic = total([schedule_batch(b, world, shape, budget_tokens=budget_tokens, profile=profile) for b in batches])
    static = {split_label(world, u, r): total(scheds) for (u, r), scheds in
              fitting_static_splits(batches, world, shape, budget_tokens=budget_tokens, profile=profile).items()}
    ratio = {k: (v / min(s[k] for s in static.values()) if static and min(s[k] for s in static.values()) else None)
             for k, v in dynamic.items()}
    return {"dynamic": dynamic, "static": static, "ratio": ratio}
