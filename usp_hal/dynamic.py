"""The Ulysses x Ring degree per global batch, at run time: the groups built once, a schedule
per step (see :mod:`usp_hal.schedule` for how sequences are placed).

    dd = DynamicDegree(AttentionShape(heads=32, head_dim=128, kv_heads=8), budget_tokens=16384)
    sched = dd.schedule(my_lengths)          # one all-gather; the same schedule on every rank
    for job in dd.my_jobs(sched):            # this rank's jobs, in the order every rank runs them
        with dd.on(job):                     # modules built with mesh=None use the job's mesh
            ...                              # shard the job's sequences, call the model

Set-up (:class:`DynamicDegree`) builds one mesh per (group size, Ulysses degree) of
:func:`usp_hal.schedule.group_sizes`, on every rank in the same order, contiguous ranks first to
Ulysses (the intra-node rule) and the rest to the ring: for a world of W ranks, at most
``sum over sizes g of d(g)`` meshes (d: the number of divisors), each with ``W / g`` sequence-
parallel groups; 6 meshes on 4 ranks, 10 on 8.  A step creates no group: it only selects among
them.  Jobs of one rank make no collective, those of a group make theirs on that group's own
process groups, and every rank runs its jobs in the schedule's one order, so no two groups can
wait on each other.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from .parallel.comm import agree, digest_ints
from .parallel.mesh import SequenceParallelMesh, default_mesh_set_to, init_sequence_parallel
from .schedule import AttentionShape, Job, Schedule, ScheduleError, group_sizes, schedule_batch, ulysses_degrees_of

#: the most sequences one rank may contribute to a step (the gather's fixed width)
MAX_LOCAL_SEQUENCES = 1024


class DynamicDegree:
    """The meshes a schedule may use, built once; one schedule per global batch.

    ``shape``: the attention call apart from its length (heads, head dim, kv heads, dtype,
    causal, backward); ``budget_tokens``: the most tokens one rank may hold in one job;
    ``profile``: the planner profile that prices the jobs (use the one of the machine the run is
    on); ``sizes``: group sizes (default :func:`usp_hal.schedule.group_sizes` of the world);
    ``ulysses_degrees``: the Ulysses degrees a group may use besides 1 (``(1,)``: rings only);
    ``pack=False``: each sequence a job of its own (see :func:`usp_hal.schedule.schedule_batch`);
    ``timeout``: given to every group (as :func:`usp_hal.init_sequence_parallel`)."""

    def __init__(self, shape: AttentionShape, *, budget_tokens: int, profile="h100-nvlink",
                 sizes: Optional[Sequence[int]] = None, ulysses_degrees: Optional[Sequence[int]] = None,
                 pack: bool = True, timeout=None):
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.shape = shape
        self.budget_tokens = int(budget_tokens)
        self.profile = profile
        self.sizes = tuple(sorted(set(sizes))) if sizes is not None else group_sizes(self.world)
        if any(g < 1 or self.world % g for g in self.sizes):
            raise ScheduleError(f"group sizes {self.sizes} must divide the world ({self.world})")
        self.ulysses_degrees = None if ulysses_degrees is None else tuple(sorted(set(ulysses_degrees)))
        self.pack = bool(pack)
        self.meshes: Dict[Tuple[int, int, int], SequenceParallelMesh] = {}
        for g in self.sizes:                               # the same order on every rank
            for u in ulysses_degrees_of(g, self.ulysses_degrees):
                self.meshes[(g, u, g // u)] = init_sequence_parallel(u, g // u, set_default=False, timeout=timeout)
        if (1, 1, 1) not in self.meshes:                   # each rank alone: a round without a job of its own
            self.meshes[(1, 1, 1)] = init_sequence_parallel(1, 1, set_default=False, timeout=timeout)

    # ------------------------------------------------------------------ per step
    def gather_lengths(self, lengths: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Every rank's sequence lengths, in rank order, and the rank that gave each one (one
        all-gather of :data:`MAX_LOCAL_SEQUENCES` + 1 integers; a rank whose lengths are not
        positive integers, or too many, makes every rank raise)."""
        vals = list(lengths)
        problem = None
        if len(vals) > MAX_LOCAL_SEQUENCES:
            problem = f"{len(vals)} sequences, over the {MAX_LOCAL_SEQUENCES} one rank may give"
        elif not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in vals):
            problem = f"lengths must be positive integers, got {vals[:8]}{' ...' if len(vals) > 8 else ''}"
        send = [] if problem else [len(vals), *vals]
        rows = agree(problem, None, what="DynamicDegree.schedule: the sequence lengths", where="default process group",
                     values=send, width=MAX_LOCAL_SEQUENCES + 1)
        out, owner = [], []
        for r, row in enumerate(rows):
            out += row[1:1 + row[0]]
            owner += [r] * row[0]
        return out, owner

    def schedule(self, lengths: Sequence[int], *, global_batch: bool = False) -> Schedule:
        """This step's schedule.  ``lengths``: this rank's sequences (the schedule's indices run
        over every rank's, in rank order); with ``global_batch=True`` every rank passes the whole
        batch's lengths and the gather checks they are the same everywhere (ranks given different
        batches all raise, naming them, instead of computing different schedules).  An
        unplaceable batch raises :class:`ScheduleError` on every rank; no data has moved."""
        if global_batch:
            rows = agree(None, None, what="DynamicDegree.schedule: the global batch's lengths",
                         where="default process group", values=[len(lengths), digest_ints([int(n) for n in lengths])],
                         same=("sequences", "lengths digest"))
            del rows
            gathered = [int(n) for n in lengths]
        else:
            gathered, _ = self.gather_lengths([int(n) for n in lengths])
        return self.plan(gathered)

    def plan(self, lengths: Sequence[int]) -> Schedule:
        """The schedule of lengths every rank already holds alike (no collective)."""
        return schedule_batch([int(n) for n in lengths], self.world, self.shape, budget_tokens=self.budget_tokens,
                              profile=self.profile, sizes=self.sizes, ulysses_degrees=self.ulysses_degrees,
                              pack=self.pack)

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
        partial-gradient mark of every mesh (:func:`usp_hal.integrations.grads.mark_synced`)."""
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
        from .integrations.training.grads import mark_synced
        for mesh in self.meshes.values():
            mark_synced(mesh)
        return total

    def on(self, job: Optional[Job]):
        """Within the block, modules and integrations built with ``mesh=None`` run on the job's
        mesh; ``None`` (a round of :meth:`Schedule.slots` without a job here): this rank alone."""
        if job is None:
            return default_mesh_set_to(self.meshes[(1, 1, 1)])
        mesh = self.mesh(job)
        if self.rank not in job.ranks or mesh.sp_ranks != tuple(job.ranks):
            raise ValueError(f"rank {self.rank} is not in this job's group (ranks {list(job.ranks)})")
        return default_mesh_set_to(mesh)
