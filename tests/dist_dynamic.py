"""The degree per global batch (usp_hal.planning.dynamic) on every rank of a WorkerPool (tests/mp.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import usp_hal
from usp_hal.dispatch.reference import reference_attention
from usp_hal.planning.dynamic import DynamicDegree
from usp_hal.planning.schedule import AttentionShape

SHAPE = AttentionShape(heads=4, head_dim=8, kv_heads=2, dtype="fp32", causal=True, bwd=True)


def _sequence(i: int, n: int):
    """Sequence ``i``'s q, k, v and output gradient, the same on every rank (seeded by ``i``)."""
    g = torch.Generator().manual_seed(1000 + i)
    return [torch.randn(1, n, h, SHAPE.head_dim, generator=g, dtype=torch.float64)
            for h in (SHAPE.heads, SHAPE.kv_heads, SHAPE.kv_heads, SHAPE.heads)]


def _reference(lengths, seqs):
    """float64 output and q/k/v gradients of each sequence alone, concatenated in job order."""
    outs, grads = [], [[], [], []]
    for i, n in zip(seqs, lengths):
        q, k, v, dout = _sequence(i, n)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out, _ = reference_attention(q, k, v, causal=True)
        out.backward(dout)
        outs.append(out.detach())
        for acc, x in zip(grads, (q, k, v)):
            acc.append(x.grad)
    return torch.cat(outs, 1), [torch.cat(g, 1) for g in grads]


def scheduled_attention(local_lengths, budget: int, sizes=None, profile="cpu-4ranks"):
    """Each rank gives its own sequences; every rank schedules the gathered batch, runs its jobs
    (forward and backward, fp32) on the job's mesh, and compares every job's output and q/k/v
    gradients, unsharded, with float64 attention of each sequence alone."""
    rank = dist.get_rank()
    dd = DynamicDegree(SHAPE, budget_tokens=budget, profile=profile, sizes=sizes)
    sched = dd.schedule(local_lengths[rank])
    worst = {"out": 0.0, "grad": 0.0}
    ran = []
    for job in dd.my_jobs(sched):
        with dd.on(job) as mesh:
            attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=job.cost.layout)
            parts = [_sequence(i, n) for i, n in zip(job.seqs, job.lengths)]
            q, k, v, dout = (torch.cat([p[j] for p in parts], 1) for j in range(4))
            cu = job.cu_seqlens
            lay = job.cost.layout
            ql, kl, vl = (usp_hal.shard(x.float(), layout=lay, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
            out = attn(ql, kl, vl, causal=True, cu_seqlens=cu) if cu else attn(ql, kl, vl, causal=True)
            out.backward(usp_hal.shard(dout.float(), layout=lay, cu_seqlens=cu))
            full = usp_hal.unshard(out.detach(), layout=lay, cu_seqlens=cu)
            grads = [usp_hal.unshard(x.grad, layout=lay, cu_seqlens=cu) for x in (ql, kl, vl)]
            assert mesh.sp_ranks == tuple(job.ranks)
        ref, ref_grads = _reference(job.lengths, job.seqs)
        worst["out"] = max(worst["out"], (full.double() - ref).abs().max().item())
        worst["grad"] = max(worst["grad"], max((g.double() - r).abs().max().item() for g, r in zip(grads, ref_grads)))
        ran.append((job.seqs, job.size, job.cost.ulysses, job.cost.ring))
    return {"worst": worst, "ran": ran, "jobs": [(j.seqs, j.first, j.size, j.cost.ulysses, j.cost.ring)
                                                for j in sched.jobs], "meshes": len(dd.meshes)}


def schedule_error(local_lengths=None, global_lengths=None, budget: int = 64):
    """What every rank raises scheduling these lengths (None when it schedules)."""
    rank = dist.get_rank()
    dd = DynamicDegree(SHAPE, budget_tokens=budget, profile="cpu-4ranks")
    try:
        if global_lengths is not None:
            dd.schedule(global_lengths[rank], global_batch=True)
        else:
            dd.schedule(local_lengths[rank])
    except Exception as exc:     # noqa: BLE001 - the point is what comes out
        return f"{type(exc).__name__}: {exc}"
    return None


def _ids(i: int, n: int, vocab: int):
    g = torch.Generator().manual_seed(5000 + i)
    return torch.randint(0, vocab, (1, n), generator=g)


def scheduled_training(local_lengths, budget: int, steps: int = 3, lr: float = 2e-3, seed: int = 0,
                       wrapper: str = "plain", model_type: str = "llama", ulysses_degrees=None, pack: bool = True):
    """A custom loop: every step schedules the global batch (ranks give different sequences),
    runs each of this rank's jobs through a tiny model (a Llama, or a hybrid of
    tests/hybrid_cases.py with recurrence="auto"; transformers integration, the job's mesh
    as the default one), each rank's loss its tokens' share of the global batch's mean, then
    sums the gradients over the world and takes an AdamW step.  ``wrapper="fsdp"``: FSDP2 over
    the whole world (each layer and the root), the jobs run in the schedule's rounds
    (``Schedule.slots``), a rank without a job in a round calling the model on a two-token
    stand-in whose loss is multiplied by zero.  Rank 0 also trains the same model in one process
    on every sequence and returns the differences."""
    import copy

    from tests.dist_dp_sp import _full
    from tests.integration_cases import _max_diff, tiny_llama
    from usp_hal.integrations import transformers as usp
    rank = dist.get_rank()
    name = usp.register(f"usp_hal_test_dynamic_{model_type}", mesh=None, layout=usp.DYNAMIC_LAYOUT, attn_type="sdpa",
                        enable=True)
    if model_type == "llama":
        ref = tiny_llama(seed, num_hidden_layers=2)
    else:
        from tests.hybrid_cases import tiny_hybrid
        ref = tiny_hybrid(model_type, seed)
    VOCAB = ref.config.vocab_size
    model = copy.deepcopy(ref)
    model.set_attn_implementation(name)
    if wrapper == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("all",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=world)
        fully_shard(model, mesh=world)
    shape = AttentionShape(heads=8, head_dim=16, kv_heads=2, dtype="fp32", causal=True, bwd=True)
    dd = DynamicDegree(shape, budget_tokens=budget, profile="cpu-4ranks", ulysses_degrees=ulysses_degrees, pack=pack)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    from usp_hal.integrations import sequence_mixers as hybrid
    losses, grads, sizes, standins, modes = [], [], set(), 0, set()
    for _ in range(steps):
        sched = dd.schedule(local_lengths[rank])
        lengths = [n for row in local_lengths for n in row]
        items = sum(n - 1 for n in lengths)             # the global batch's labels
        mine = torch.zeros(())
        rounds = [row[rank] for row in sched.slots()] if wrapper == "fsdp" else dd.my_jobs(sched)
        for job in rounds:
            if job is None:                             # a round without a job here: a stand-in call
                two = torch.zeros(1, 2, dtype=torch.long)
                with dd.on(None):
                    out = model(input_ids=two, labels=two, num_items_in_batch=items)
                (out.loss * 0).backward()
                standins += 1
                continue
            sizes.add((job.size, job.cost.ulysses, job.cost.ring))
            ids = torch.cat([_ids(i, n, VOCAB) for i, n in zip(job.seqs, job.lengths)], 1)
            with dd.on(job) as mesh:
                cu = list(job.cu_seqlens) if job.cu_seqlens else None
                batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, job.cost.layout, cu_seqlens=cu)
                batch["num_items_in_batch"] = items
                out = model(**batch)
            out.loss.backward()
            mine = mine + out.loss.detach()
            modes |= {(job.cost.ring, m.__dict__[hybrid._WIRED][2]) for m in model.modules()
                      if hybrid._WIRED in m.__dict__}
        losses.append(float(dd.sync_gradients(model, mine)))
        if not grads:
            grads = [_full(p.grad).detach().clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    params = [_full(p).detach() for p in model.parameters()]   # collective under FSDP2: every rank
    res = {"losses": losses, "sizes": sorted(sizes), "standins": standins, "modes": sorted(modes)}
    if rank != 0:
        return res
    ropt = torch.optim.AdamW(ref.parameters(), lr=lr)
    ref_losses, ref_grads = [], []
    lengths = [n for row in local_lengths for n in row]
    items = sum(n - 1 for n in lengths)
    for _ in range(steps):
        total = 0.0
        for i, n in enumerate(lengths):
            ids = _ids(i, n, VOCAB)
            out = ref(input_ids=ids, labels=ids, num_items_in_batch=items)
            out.loss.backward()
            total += float(out.loss)
        ref_losses.append(total)
        if not ref_grads:
            ref_grads = [p.grad.detach().clone() for p in ref.parameters()]
        ropt.step()
        ropt.zero_grad()
    res.update(ref_losses=ref_losses, loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
               grad_diff=max(_max_diff(g, r) for g, r in zip(grads, ref_grads)),
               grad_scale=max(float(r.abs().max()) for r in ref_grads),
               param_diff=max(_max_diff(p, q) for p, q in zip(params, ref.parameters())))
    return res


def short_sequence(U: int, R: int, S: int, layout: str = "zigzag"):
    """A tiny Llama through shard_batch on a sequence of ``S`` tokens: the logits' largest
    difference to one process, or the error this rank raised."""
    import usp_hal
    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp
    mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    name = usp.register("usp_hal_test_short", mesh=mesh, layout=layout, attn_type="sdpa", enable=True)
    ref = tiny_llama(0, num_hidden_layers=1)
    model = tiny_llama(0, num_hidden_layers=1)
    model.set_attn_implementation(name)
    ids = torch.randint(0, 100, (1, S), generator=torch.Generator().manual_seed(0))
    try:
        out = model(**usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, layout))
    except ValueError as exc:
        return {"error": str(exc)}
    full = usp_hal.unshard(out.logits.detach(), layout=layout, mesh=mesh)
    return {"diff": float((full - ref(input_ids=ids).logits).abs().max())}


def _error(fn):
    try:
        fn()
    except Exception as exc:     # noqa: BLE001 - the point is what comes out
        return f"{type(exc).__name__}: {exc}"
    return None


def settings_error(**per_rank):
    """What every rank raises building a DynamicDegree whose settings are this rank's entry of
    each list in ``per_rank`` (budget_tokens, profile, pack, sizes, ulysses_degrees; the rest
    the same everywhere), or None when it builds."""
    rank = dist.get_rank()
    kw = dict(budget_tokens=64, profile="cpu-4ranks")
    kw.update({k: v[rank] for k, v in per_rank.items()})
    return _error(lambda: DynamicDegree(SHAPE, **kw))


def mixed_global_batch():
    """Rank 0 schedules with ``global_batch=True``, the others gather their own lengths: every
    rank's error (None where it scheduled)."""
    dd = DynamicDegree(SHAPE, budget_tokens=64, profile="cpu-4ranks")
    rank = dist.get_rank()
    return _error(lambda: dd.schedule([10, 20, 30], global_batch=rank == 0))


def bad_lengths(bad, rank_with_bad: int = 1, global_batch: bool = False):
    """One rank passes ``bad`` among its lengths: every rank's error."""
    dd = DynamicDegree(SHAPE, budget_tokens=64, profile="cpu-4ranks")
    mine = [10, bad] if dist.get_rank() == rank_with_bad else [10, 20]
    return _error(lambda: dd.schedule(mine, global_batch=global_batch))


def many_lengths(counts, budget: int = 64):
    """Each rank gives ``counts[rank]`` lengths (more than the gather's first message holds on
    some): the gathered lengths and their ranks, and the schedule's jobs."""
    rank = dist.get_rank()
    mine = [1 + (rank * 1000 + i) % 50 for i in range(counts[rank])]
    dd = DynamicDegree(SHAPE, budget_tokens=budget, profile="cpu-4ranks")
    got, owner = dd.gather_lengths(mine)
    sched = dd.plan(got)
    return {"lengths": got, "owner": owner, "jobs": [(j.seqs, j.first, j.size) for j in sched.jobs]}


def same_schedules(batches, budget: int, world_sizes=(1, 2, 4, 8)):
    """Every batch scheduled for several worlds on this rank (a digest of each schedule)."""
    import hashlib

    from usp_hal.planning.schedule import ScheduleError, schedule_batch
    out = []
    for w in world_sizes:
        for b in batches:
            try:
                s = schedule_batch(b, w, SHAPE, budget_tokens=budget, profile="cpu-4ranks")
                out.append(hashlib.sha256(repr([(j.seqs, j.first, j.size, j.cost) for j in s.jobs]).encode())
                           .hexdigest())
            except ScheduleError as exc:
                out.append(str(exc))
    return out


def hybrid_packing(pack=None):
    """``usp.dynamic_degree`` for a qwen3_next (gated DeltaNet, whose one-rank torch kernel cannot keep
    packed documents apart): the ``pack`` it chose, or every rank's error."""
    from tests.hybrid_cases import tiny_hybrid
    from usp_hal.integrations import transformers as usp
    model = tiny_hybrid("qwen3_next", 0)
    try:
        dd = usp.dynamic_degree(model, budget_tokens=16, profile="cpu-4ranks", pack=pack)
    except Exception as exc:     # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return {"pack": dd.pack, "packed_jobs": sum(1 for j in dd.plan([7, 4, 12, 11, 9, 5]).jobs if len(j.seqs) > 1)}


def ahead(local_lengths, budget: int = 64):
    """schedule_ahead's schedule (the gather now, the scheduling in a thread) against schedule()'s."""
    dd = DynamicDegree(SHAPE, budget_tokens=budget, profile="cpu-4ranks")
    mine = local_lengths[dist.get_rank()]
    fut = dd.schedule_ahead(mine)
    now = dd.schedule(mine)
    return fut.result(timeout=60) == now


def measured_trial(slow: str, steps: int = 12, trial: int = 2, ahead: bool = False, delay: float = 0.15):
    """``steps`` steps of a DynamicDegree with ``trial_steps=trial`` (margin 0: the per-batch
    schedule is never replaced on the model's word), each rank entering its jobs; a step of the
    arm named by ``slow`` ("dynamic": the per-batch schedule, or "fixed": a fixed split) sleeps
    ``delay`` seconds in each job, as a schedule the model prices wrong would.  Returns each
    step's schedule label, the trial's decision and its measured ratio.  With ``ahead`` the next
    step's schedule is computed in the background while the step runs (schedule_ahead)."""
    import time
    rank = dist.get_rank()
    dd = DynamicDegree(SHAPE, budget_tokens=64, profile="cpu-4ranks", margin=0.0, trial_steps=trial)

    def lengths(step):     # one 200-token sequence needs the whole world; the rest fit one rank
        return [200 + step] if rank == 0 else [9 + step % 3, 12, 7 + rank]

    labels = []
    sched = dd.schedule(lengths(0))
    for step in range(steps):
        nxt = dd.schedule_ahead(lengths(step + 1)) if ahead and step + 1 < steps else None
        for job in dd.my_jobs(sched):
            with dd.on(job):
                if (sched.label == "dynamic") == (slow == "dynamic"):
                    time.sleep(delay)
        labels.append(sched.label)
        if step + 1 < steps:
            sched = nxt.result(timeout=60) if nxt is not None else dd.schedule(lengths(step + 1))
    t = dd.trial
    return {"labels": labels, "decided": t.decided, "ratio": t.ratio, "split": t.split, "samples": t.samples}


def refitted(steps: int = 8, window: int = 4, ahead: bool = False, delay: float = 0.05, calibrate: bool = False):
    """``steps`` steps of a DynamicDegree with ``refit_steps=window``, each job sleeping
    ``delay`` seconds (a machine far slower than the cpu profile prices); with ``calibrate``,
    calibrate_steps on one batch first.  Returns what every rank must hold alike: the factors
    after each step's schedule, each schedule's jobs, and the refit's window."""
    import time
    rank = dist.get_rank()
    dd = DynamicDegree(SHAPE, budget_tokens=64, profile="cpu-4ranks", margin=0.0, refit_steps=window)

    def lengths(step):
        return [200 + step] if rank == 0 else [9 + step % 3, 12, 7 + rank]

    def run(sched):
        for job in dd.my_jobs(sched):
            with dd.on(job):
                time.sleep(delay)
    first = None
    if calibrate:
        batch = [n for r in range(dist.get_world_size()) for n in ([200] if r == 0 else [9, 12, 7 + r])]
        first = dict(dd.calibrate_steps([batch], lambda lens, sched: run(sched), warmup=False))
    model = dd.scheduler.model
    factors, jobs = [], []
    sched = dd.schedule(lengths(0))
    for step in range(steps):
        nxt = dd.schedule_ahead(lengths(step + 1)) if ahead and step + 1 < steps else None
        run(sched)
        if step + 1 < steps:
            sched = nxt.result(timeout=60) if nxt is not None else dd.schedule(lengths(step + 1))
        factors.append(model.factors())
        jobs.append([(j.seqs, j.first, j.size, j.cost.ulysses) for j in sched.jobs])
    return {"factors": factors, "jobs": jobs, "window": [(p, t) for p, t in dd.refit.samples], "first": first,
            "calibration": len(dd.calibration_samples)}


def calibrated_steps_error(batches, warmup=(True, True, True, True)):
    """calibrate_steps given this rank's entry of ``batches`` and of ``warmup``: every rank's
    error."""
    dd = DynamicDegree(SHAPE, budget_tokens=64, profile="cpu-4ranks")
    rank = dist.get_rank()
    return _error(lambda: dd.calibrate_steps(batches[rank], lambda lens, sched: None, warmup=warmup[rank]))


def calibrated_steps(batches, budget: int = 64):
    """DynamicDegree.calibrate_steps over ``batches``, each step every job of this rank's
    attention forward and backward (fp32): the factors, the schedules each step ran, and the
    factors the price model then holds."""
    dd = DynamicDegree(SHAPE, budget_tokens=budget, profile="cpu-4ranks")
    ran = []

    def run(lens, sched):
        ran.append((list(lens), sched.label, len(sched.jobs)))
        for job in dd.my_jobs(sched):
            with dd.on(job):
                attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=job.cost.layout)
                parts = [_sequence(i, n) for i, n in zip(job.seqs, job.lengths)]
                q, k, v, dout = (torch.cat([p[j] for p in parts], 1) for j in range(4))
                cu, lay = job.cu_seqlens, job.cost.layout
                ql, kl, vl = (usp_hal.shard(x.float(), layout=lay, cu_seqlens=cu).requires_grad_() for x in (q, k, v))
                out = attn(ql, kl, vl, causal=True, cu_seqlens=cu) if cu else attn(ql, kl, vl, causal=True)
                out.backward(usp_hal.shard(dout.float(), layout=lay, cu_seqlens=cu))

    scale = dd.calibrate_steps(batches, run)
    return {"scale": scale, "ran": ran, "held": dd.scheduler.model.factors()}


def calibrated_calls(tokens=(8, 24, 64), budget: int = 64, error: bool = False, rank_tokens=None):
    """usp.calibrate_calls on a tiny Llama (transformers integration, every split of 4 ranks):
    what it returns, what the price model then holds, and whether it left gradients
    (``error``: only what it raised, or None; ``rank_tokens``: {rank: its own tokens})."""
    from tests.integration_cases import tiny_llama
    from usp_hal.integrations import transformers as usp
    model = tiny_llama(0, num_hidden_layers=1)
    name = usp.register("usp_hal_test_calls", mesh=None, layout=usp.DYNAMIC_LAYOUT, attn_type="sdpa", enable=True)
    model.set_attn_implementation(name)
    dd = usp.dynamic_degree(model, budget_tokens=budget, profile="cpu-4ranks")
    tokens = (rank_tokens or {}).get(dist.get_rank(), tokens)
    if error:
        return _error(lambda: usp.calibrate_calls(model, dd, reps=1, tokens=tokens, doc=8))
    out = usp.calibrate_calls(model, dd, reps=1, tokens=tokens, doc=8)
    m = dd.scheduler.model
    # the optimizer step after it: its backward passes left no gradient and no pending mark
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    return {"out": out, "splits": sorted("{},{},{}".format(*k) for k in dd.meshes),
            "held": {"attention": m.call_attention, **{f"{g},{u},{g // u}": list(v) for (g, u), v in
                                                       m.call_extra.items()}},
            "grads": sum(p.grad is not None for p in model.parameters())}
