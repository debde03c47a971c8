"""The Ulysses x Ring degree per global batch, at run time: the groups built once, a schedule
per step (see :mod:`usp_hal.planning.schedule` for how sequences are placed and priced).

    shape = AttentionShape.from_config(model.config, dtype="bf16")     # attention and token layers
    dd = DynamicDegree(shape, budget_tokens=16384, profile="h100-nvlink")
    sched = dd.schedule(my_lengths)          # one all-gather; the same schedule on every rank
    # or, computed while the step before runs: ahead = dd.schedule_ahead(next_lengths) ... ahead.result()
    for job in dd.my_jobs(sched):            # this rank's jobs, in the order every rank runs them
        with dd.on(job):                     # modules built with mesh=None use the job's mesh
            ...                              # shard the job's sequences, call the model

Set-up (:class:`DynamicDegree`) agrees its settings over the default group (a rank built with
another budget, profile, shape, group sizes, packing or Ulysses degrees makes every rank raise,
naming the setting), then builds one mesh per (group size, Ulysses degree) of the sizes, on every
rank in the same order, contiguous ranks first to Ulysses (the intra-node rule) and the rest to
the ring: for a world of W ranks, at most ``sum over sizes g of d(g)`` meshes (d: the number of
divisors), each with ``W / g`` sequence-parallel groups; 6 meshes on 4 ranks, 10 on 8 (built
with ``reuse_groups=True``: another DynamicDegree on the same world shares their process groups).
A step creates no group: it only selects among them.  Jobs of one rank make no collective, those of a
group make theirs on that group's own process groups, and every rank runs its jobs in the
schedule's one order, so no two groups can wait on each other.
"""
from __future__ import annotations

import json
import threading
import time
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..parallel.comm import agree, collective, digest_ints, group_meta
from ..parallel.mesh import SequenceParallelMesh, default_mesh_set_to, init_sequence_parallel
from ..parallel.partial_grads import mark_synced
from .planner import PlanError, load_profile
from .schedule import (
    MARGIN,
    AttentionShape,
    Job,
    Schedule,
    ScheduleError,
    Scheduler,
    group_sizes,
    length_problem,
    ulysses_degrees_of,
)
from .stepcost import StepRefit, fit_part_scale, shape_fields
from .trial import MeasuredTrial

#: the most sequences one rank may contribute to a step
MAX_LOCAL_SEQUENCES = 1 << 16
#: lengths that travel in the gather's first (fixed-size) message; more take a second all-gather
_FIRST = 59
#: schedules whose jobs :meth:`DynamicDegree.on` still recognises (for the step timing)
_RECENT = 4

_SETTINGS = ("budget_tokens", "shape", "profile", "sizes", "pack", "ulysses_degrees", "margin", "trial_steps",
             "refit_steps")


def _digest_text(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


class DynamicDegree:
    """The meshes a schedule may use, built once; one schedule per global batch.

    ``shape``: the model as the step's price needs it (:class:`usp_hal.planning.stepcost.AttentionShape`:
    its attention call and, for whole-step pricing, its token-proportional layers, e.g.
    ``AttentionShape.from_config(model.config)``); ``budget_tokens``: the most tokens one rank
    may hold in one job; ``profile``: the planner profile that prices the jobs (use the one of
    the machine the run is on, or one ``usp-hal calibrate`` wrote there); ``sizes``: group sizes
    (default :func:`usp_hal.planning.schedule.group_sizes` of the world); ``ulysses_degrees``: the Ulysses
    degrees a group may use besides 1 (``(1,)``: rings only); ``pack=False``: each sequence a
    job of its own (for models whose layers cannot keep packed documents apart);
    ``margin``: a step whose dynamic schedule is predicted to gain less than this over the best
    fixed split runs that split (0: never); ``trial_steps``: when not 0, the first steps run the
    per-batch schedule and one fixed split in turn, this many timed steps of each, and the run
    keeps whichever was measured faster (:class:`usp_hal.planning.trial.MeasuredTrial`; the
    times travel with the lengths each step gathers anyway: no collective or device sync is
    added); ``refit_steps``: when not 0, the whole-step factors (what :meth:`calibrate_steps`
    fits) are refitted after every measured step to the last this many (its samples first), so
    the price follows the machine's speed through the run (:class:`usp_hal.planning.stepcost.StepRefit`;
    timed as the trial is, from the gathers: no collective or device sync is added; a step's time
    counts for the schedules computed after the gather that brought it, as every rank sees it);
    ``timeout``: given to every group (as :func:`usp_hal.init_sequence_parallel`).

    Every setting is agreed over the default group before any group is built: a rank whose
    settings differ makes every rank raise the same :class:`ValueError` naming the setting."""

    def __init__(self, shape: AttentionShape, *, budget_tokens: int, profile="h100-nvlink",
                 sizes: Optional[Sequence[int]] = None, ulysses_degrees: Optional[Sequence[int]] = None,
                 pack: bool = True, margin: float = MARGIN, trial_steps: int = 0, refit_steps: int = 0,
                 timeout=None):
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        problem: Optional[BaseException] = None
        values = [0] * len(_SETTINGS)
        try:
            if not isinstance(shape, AttentionShape):
                raise TypeError(f"DynamicDegree: shape must be an AttentionShape, got {type(shape).__name__}")
            prof = load_profile(profile) if isinstance(profile, str) else profile
            self.scheduler = Scheduler(self.world, shape, budget_tokens=budget_tokens, profile=prof, sizes=sizes,
                                       ulysses_degrees=ulysses_degrees, pack=pack, margin=margin)
            if isinstance(trial_steps, bool) or not isinstance(trial_steps, int) or trial_steps < 0:
                raise ValueError(f"DynamicDegree: trial_steps must be an int >= 0 (0: no measured trial), got "
                                 f"{trial_steps!r}")
            if isinstance(refit_steps, bool) or not isinstance(refit_steps, int) or refit_steps < 0:
                raise ValueError(f"DynamicDegree: refit_steps must be an int >= 0 (the measured steps the price is "
                                 f"refitted to; 0: the price stays as calibrated), got {refit_steps!r}")
            s = self.scheduler
            values = [s.budget, _digest_text(repr([getattr(shape, f) for f in shape_fields()])),
                      _digest_text(json.dumps(prof, sort_keys=True, default=str)), digest_ints(list(s.sizes)),
                      int(s.pack), digest_ints(list(s.ulysses_degrees or (0,))), int(round(s.margin * 1e9)),
                      int(trial_steps), int(refit_steps)]
        except (ScheduleError, PlanError, TypeError, ValueError) as exc:
            problem = exc
        # one all-gather before any group is built: the same settings everywhere, or every rank raises
        agree(problem, None, what="DynamicDegree: the settings", where="default process group", values=values,
              same=_SETTINGS)
        self.shape = shape
        self.budget_tokens = self.scheduler.budget
        self.profile = profile
        self.sizes = self.scheduler.sizes
        self.ulysses_degrees = self.scheduler.ulysses_degrees
        self.pack = self.scheduler.pack
        self.meshes: Dict[Tuple[int, int, int], SequenceParallelMesh] = {}
        for g in self.sizes:                               # the same order on every rank
            for u in ulysses_degrees_of(g, self.ulysses_degrees):
                self.meshes[(g, u, g // u)] = init_sequence_parallel(u, g // u, set_default=False, timeout=timeout,
                                                                     reuse_groups=True)
        if (1, 1, 1) not in self.meshes:                   # each rank alone: a round without a job of its own
            self.meshes[(1, 1, 1)] = init_sequence_parallel(1, 1, set_default=False, timeout=timeout,
                                                            reuse_groups=True)
        self._lock = threading.Lock()
        self._ahead: Optional[ThreadPoolExecutor] = None
        self.trial = MeasuredTrial(self.scheduler, trial_steps) if trial_steps else None
        self.refit = StepRefit(self.scheduler.model, refit_steps) if refit_steps else None
        #: the steps :meth:`calibrate_steps` measured (parts priced with every factor 1, seconds)
        self.calibration_samples: List[Tuple[Dict[str, float], float]] = []
        self._serial = 0                         # schedules given out (the trial counts its own)
        self._refits: List[Tuple[int, int, float]] = []    # (at, serial, seconds) not yet refitted to
        # step timing: a schedule's serial is the index of the gather it was computed from; the
        # period between two gathers' ends (the gather reads its result on the host, so it ends
        # after every rank's work before it, on any device) is charged to the one schedule whose
        # jobs this rank entered in it, and sent with the next gather
        self._gathers = 0
        self._gather_end: Optional[float] = None
        self._entered = 0
        self._last = (0, 0)                      # (serial, microseconds) of the last period
        self._jobs_serial: Dict[int, int] = {}
        self._recent: deque = deque(maxlen=_RECENT)

    # ------------------------------------------------------------------ per step
    def gather_lengths(self, lengths: Sequence[int], problem: Optional[str] = None) -> Tuple[List[int], List[int]]:
        """Every rank's sequence lengths, in rank order, and the rank that gave each one.  Each
        length is checked before any conversion (positive integers only: no bools, floats,
        strings or None); a rank whose lengths are bad, or too many, or that gives a
        ``problem`` of its own, makes every rank raise.  One all-gather of a fixed-size int64
        message (the count and the first lengths), and a second one only when some rank gives
        more than fit in it."""
        vals = list(lengths)
        if not problem and len(vals) > MAX_LOCAL_SEQUENCES:
            problem = f"{len(vals)} sequences, over the {MAX_LOCAL_SEQUENCES} one rank may give"
        elif not problem:
            for i, n in enumerate(vals):
                why = length_problem(n)
                if why:
                    problem = f"lengths must be positive integers: sequence {i} of this rank {why}"
                    break
        send = [] if problem else [len(vals), *self._last, *(int(n) for n in vals[:_FIRST])]
        rows = agree(problem, None, what="DynamicDegree.schedule: the sequence lengths", where="default process group",
                     values=send, width=_FIRST + 3)
        self._timed([row[1] for row in rows], [row[2] for row in rows])
        counts = [row[0] for row in rows]
        more = max(counts) - _FIRST
        tails: List[List[int]] = [[] for _ in rows]
        if more > 0:           # every rank knows every count, so all take this branch alike
            import torch
            mine = torch.zeros(more, dtype=torch.long)
            extra = [int(n) for n in vals[_FIRST:]]
            mine[:len(extra)] = torch.tensor(extra, dtype=torch.long)
            out = torch.empty(more * self.world, dtype=torch.long)
            from ..parallel.comm import all_gather_single
            collective("DynamicDegree.schedule: the sequence lengths", "default process group", all_gather_single,
                       out, mine)
            flat = out.tolist()
            tails = [flat[r * more:(r + 1) * more] for r in range(self.world)]
        gathered, owner = [], []
        for r, row in enumerate(rows):
            n = row[0]
            mine_ = (row[3:3 + min(n, _FIRST)] + tails[r])[:n]
            gathered += mine_
            owner += [r] * n
        return gathered, owner

    def _timed(self, serials: List[int], micros: List[int]) -> None:
        """After a gather: the period it closes, charged to the schedule whose jobs ran in it
        (sent with the next gather), and the period every rank sent, given to the trial."""
        end = time.perf_counter()
        self._gathers += 1
        ran = {s for s in serials if s > 0}
        if len(ran) == 1 and max(micros) > 0:
            serial = ran.pop()
            with self._lock:                   # the slowest rank's period, the same on every rank
                if self.trial is not None:
                    self.trial.record(serial, max(micros) / 1e6, at=self._gathers)
                if self.refit is not None:
                    self._refits.append((self._gathers, serial, max(micros) / 1e6))
        if self._gather_end is not None:
            self._last = (self._entered, max(1, int((end - self._gather_end) * 1e6)))
        self._entered = 0
        self._gather_end = end

    def schedule_ahead(self, lengths: Sequence[int], *, global_batch: bool = False) -> "Future[Schedule]":
        """The lengths gathered now (the same collective as :meth:`schedule`, checked the same
        way), the schedule computed in a background thread while this rank goes on (the step
        before runs meanwhile, as Megatron's dynamic CP schedules ahead); ``.result()`` gives it.
        Every rank must call it at the same point, as :meth:`schedule`."""
        gathered = self._gathered(lengths, global_batch)
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="usp_hal-schedule")
        return self._ahead.submit(self._plan_at, gathered, self._gathers)

    def schedule(self, lengths: Sequence[int], *, global_batch: bool = False) -> Schedule:
        """This step's schedule.  ``lengths``: this rank's sequences (the schedule's indices run
        over every rank's, in rank order); with ``global_batch=True`` every rank passes the whole
        batch's lengths and the gather checks they are the same everywhere (ranks given different
        batches all raise, naming them, instead of computing different schedules).  Bad lengths
        on any rank, or ranks that disagree on ``global_batch``, make every rank raise; an
        unplaceable batch raises :class:`ScheduleError` on every rank; no data has moved."""
        return self.plan(self._gathered(lengths, global_batch))

    def _gathered(self, lengths: Sequence[int], global_batch: bool) -> List[int]:
        if not global_batch:
            return self.gather_lengths(lengths)[0]
        vals = list(lengths)
        problem = next((f"sequence {i} {why}" for i, n in enumerate(vals) for why in [length_problem(n)] if why), None)
        send = [] if problem else [len(vals), digest_ints([int(n) for n in vals]), *self._last]

        def same_batch(rows: List[List[int]]) -> List[str]:
            return [f"{label}: " + ", ".join(f"rank {r}={row[j]}" for r, row in enumerate(rows))
                    for j, label in enumerate(("sequences", "lengths digest")) if len({row[j] for row in rows}) > 1]
        rows = agree(problem, None, what="DynamicDegree.schedule: the global batch's lengths",
                     where="default process group", values=send, width=4, check=same_batch)
        self._timed([row[2] for row in rows], [row[3] for row in rows])
        return [int(n) for n in vals]

    def plan(self, lengths: Sequence[int]) -> Schedule:
        """The schedule of lengths every rank already holds alike (no collective)."""
        if self._ahead is not None:    # after a schedule ahead of it, not beside it: the same order everywhere
            return self._ahead.submit(self._plan_at, list(lengths), self._gathers).result()
        return self._plan_at(lengths, self._gathers)

    def _plan_at(self, lengths: Sequence[int], at: int) -> Schedule:
        with self._lock:         # the price tables grow as lengths come: one schedule at a time
            if self.trial is None and self.refit is None:
                return self.scheduler.schedule(lengths)
            if self.refit is not None:
                self._refit_to(at)
            if self.trial is not None:
                serial, sched = self.trial.choose(lengths, at=at)
            else:
                self._serial += 1
                serial, sched = self._serial, self.scheduler.schedule(lengths)
            self._recent.append((serial, sched))
            self._jobs_serial = {id(j): k for k, sc in self._recent for j in sc.jobs}
            return sched

    def _refit_to(self, at: int) -> None:
        """The steps timed by gathers up to ``at`` refitted to, in the order they came (what a
        schedule computed ahead of a gather must not see yet: every rank sees the same)."""
        assert self.refit is not None
        keep = []
        for when, serial, seconds in self._refits:
            if when > at:
                keep.append((when, serial, seconds))
                continue
            sched = next((sc for k, sc in self._recent if k == serial), None)
            if sched is not None:
                self.refit.record(sched.parts(unscaled=True), seconds)
        self._refits = keep

    def calibrate_steps(self, batches: Sequence[Sequence[int]], run, *, warmup: bool = True) -> Dict[str, float]:
        """Whole steps measured against their price, and the price fitted to them: each batch
        of ``batches`` (every rank the same lengths) run as a whole step by ``run(lengths,
        schedule)`` (the caller's own step: every job of this rank, the gradient sync, the
        optimizer) under the per-batch schedule, the per-batch schedule with every sequence a
        job of its own (the per-call costs), and every fixed split that holds it; each step the
        slowest rank's time (barrier to barrier, the device synced).  The price is then scaled
        to fit those times (:func:`usp_hal.planning.stepcost.fit_part_scale`: one factor for
        the whole step, one for the per-call overhead, and a shift per split for what a split's
        jobs pay beyond them), the same factors on every rank,
        used by every schedule made after it.  ``warmup``: the first batch runs under each of
        its schedules once more, untimed, before any timed step (a run's first steps pay for
        what later ones reuse: the optimizer's state, memory, each split's first call).  It
        costs ``(len(batches) + warmup) x (2 + fixed splits)`` steps.  Every rank must call it
        with the same batches and ``warmup`` (it runs collectives; they are agreed first).  Returns the factors
        and shifts the price model then holds (:meth:`usp_hal.planning.stepcost.StepModel.factors`)."""
        import torch

        problem = next((f"batch {k}, sequence {i} {why}" for k, b in enumerate(batches) for i, n in enumerate(b)
                        for why in [length_problem(n)] if why), None)
        flat = [] if problem else [x for b in batches for x in (len(b), *map(int, b))]
        agree(problem, None, what="DynamicDegree.calibrate_steps: the batches", where="default process group",
              values=[len(batches), digest_ints(flat), int(bool(warmup))] if not problem else [], width=3,
              same=("batches", "lengths digest", "warmup"))
        model = self.scheduler.model
        model.set_part_scale({})
        unpacked = Scheduler(self.world, self.shape, budget_tokens=self.budget_tokens, sizes=self.sizes,
                             ulysses_degrees=self.ulysses_degrees, pack=False, model=model)
        samples = []
        for k, b in enumerate(([batches[0]] if warmup and batches else []) + list(batches)):
            timed = k > 0 or not warmup
            lens = [int(n) for n in b]
            scheds = [self.scheduler.dynamic(lens)]
            try:
                scheds.append(unpacked.dynamic(lens))
            except ScheduleError:
                pass
            scheds += list(self.scheduler.statics(lens).values())
            for sched in scheds:
                if self.world > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                run(lens, sched)
                if torch.accelerator.is_available():
                    torch.accelerator.synchronize()
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                                    device=group_meta(None)[0] if self.world > 1 else "cpu")
                if self.world > 1:     # the slowest rank's time, the same on every rank
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if timed:
                    samples.append((sched.parts(unscaled=True), float(took.item())))
        self.calibration_samples = samples
        self._gather_end, self._entered, self._last = None, 0, (0, 0)   # the next period starts at a gather
        model.set_part_scale(fit_part_scale(samples))
        if self.refit is not None:             # the window starts from these steps
            with self._lock:
                self.refit = StepRefit(model, self.refit.window, samples)
        return model.factors()

    def mesh(self, job: Job) -> SequenceParallelMesh:
        """The mesh a job runs on (its block is one of that mesh's sequence-parallel groups)."""
        return self.meshes[(job.size, job.cost.ulysses, job.cost.ring)]

    def my_jobs(self, sched: Schedule) -> List[Job]:
        return sched.jobs_of(self.rank)

    def sync_gradients(self, model, loss=None):
        """After every job's backward: each gradient summed over the whole world (one all-reduce
        of all of them, and of ``loss`` with them), so every rank holds the gradient of the
        global batch.  Each rank's losses must be its tokens' share of the global batch's loss
        (``num_items_in_batch`` = the global batch's label count); then the sum is exactly what
        one process computes.  Returns the global loss (detached), or None.  Clears the
        partial-gradient mark of every mesh (:func:`usp_hal.parallel.partial_grads.mark_synced`)."""
        import torch

        params = [p for p in (model.parameters() if hasattr(model, "parameters") else model) if p.requires_grad]
        sharded = [p for p in params if type(p).__name__ == "DTensor"]
        for p in sharded:                      # FSDP2 reduced these over its mesh already, as a mean
            if p.device_mesh.size() != self.world:
                raise ValueError(f"DynamicDegree.sync_gradients: a parameter sharded over {p.device_mesh.size()} "
                                 f"ranks; shard the model over the whole world ({self.world} ranks): every rank's "
                                 "jobs add to every gradient")
        params = [p for p in params if type(p).__name__ != "DTensor"]
        for p in sharded:
            if p.grad is not None:
                p.grad.to_local().mul_(self.world)
        for p in params:
            if p.grad is None:                 # a rank whose jobs did not reach it: it adds nothing
                p.grad = torch.zeros_like(p)
        parts = [p.grad.reshape(-1) for p in params]
        if loss is not None:
            parts.append(loss.detach().reshape(-1).to(parts[0].dtype if parts else loss.dtype))
        if loss is not None and not params:
            parts = [loss.detach().reshape(-1)]
        if parts and self.world > 1:
            flat = torch.cat(parts)
            dist.all_reduce(flat)
            for p, chunk in zip(params, flat.split([t.numel() for t in parts])):
                p.grad.copy_(chunk.view_as(p.grad))
            total = flat[-1:].reshape(()) if loss is not None else None
        else:
            total = loss.detach() if loss is not None else None
        for mesh in self.meshes.values():
            mark_synced(mesh)
        return total

    def on(self, job: Optional[Job]):
        """Within the block, modules and integrations built with ``mesh=None`` run on the job's
        mesh; ``None`` (a round of :meth:`Schedule.slots` without a job here): this rank alone."""
        if job is None:
            return default_mesh_set_to(self.meshes[(1, 1, 1)])
        self._entered = self._jobs_serial.get(id(job), self._entered)
        mesh = self.mesh(job)
        if self.rank not in job.ranks or mesh.sp_ranks != tuple(job.ranks):
            raise ValueError(f"rank {self.rank} is not in this job's group (ranks {list(job.ranks)})")
        return default_mesh_set_to(mesh)


__all__ = ["DynamicDegree", "MAX_LOCAL_SEQUENCES", "group_sizes"]
