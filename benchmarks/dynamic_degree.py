"""The per-batch Ulysses x Ring degree against the best fixed split, as whole training steps.

    python -m benchmarks.dynamic_degree                      # lognormal: predicted, then measured here
    python -m benchmarks.dynamic_degree --dist llama3-sft    # the second length distribution
    python -m benchmarks.dynamic_degree --no-time            # the predictions only
    python -m benchmarks.dynamic_degree --host-time          # also the scheduling's host time, 64 ranks
    python -m benchmarks.dynamic_degree --calls-spread 3     # only calibrate_calls, 3 times: its spread
    python -m benchmarks.dynamic_degree --packs              # only one batch's packed jobs against their price
    python -m benchmarks.dynamic_degree --replay DUMP        # a --dump's steps priced with and without split shifts

**Predicted** (the planner's whole-step model, usp_hal.planning.stepcost): a Llama-3-8B-shaped model (32
layers, hidden 4,096, MLP 14,336, 32 heads of 128, 8 KV heads, vocabulary 128,256, bf16) on 4 GPUs
of one node, 16 global batches of about 32K tokens per rank, at most 16,384 tokens per rank in
one job.  Each profile on its own line: the dynamic schedule (usp_hal.planning.schedule.Scheduler) against
``static+``, every fixed split that holds every batch, each placed with the same care
(Scheduler.static: balanced by predicted time, packed first-fit decreasing, varlen_zigzag for
packed ring jobs), the best being the one split with the lowest predicted total; the fixed splits
as earlier versions placed them (static_rule) beside it; a lower bound per batch
(Scheduler.bound: every sequence at its cheapest rank-seconds over the world, and no less than
its fastest job); the slowest rank's step in parts.

**Measured** (this CPU, 4 gloo ranks, one thread each): the machine is calibrated first
(usp_hal.harness.calibrate, 4 ranks at once) unless --profile names a profile, then the model
path's own cost on each split (usp.calibrate_calls: parts per call, per token and per packed
document, and one factor on the priced attention), then whole steps of 2 batches of their own
after a warm-up (DynamicDegree.calibrate_steps: the price scaled by one factor for the step and
one for the per-call overhead, and shifted per split), and during the run those refitted after every measured
step to the last REFIT steps (StepRefit, as DynamicDegree(refit_steps=REFIT) does: each batch's
schedules priced before it runs, from the steps before it; the same schedules priced by the
calibration's factors alone are printed beside them); a Llama built from a transformers config
with every size divided by 16 (2 layers, hidden 256, MLP 896, 8 heads of 32, 2 KV heads, vocabulary 2,048,
fp32), lengths divided by 16, 2,048 tokens per rank, at most 1,024 tokens per rank in one job,
so that the linear layers' compute dominates a step (about a second per step here, per-call
costs a few percent).  Per seed, 11 batches (after one warm-up),
each run under every schedule in turn (the order rotating), a whole step each: every job's
forward and backward through the transformers integration, the gradients summed over the world,
an AdamW step; then again in the reverse order (REPEAT passes; --repeat).  Schedules that
place a batch alike (the same jobs on the same ranks in the same order: the per-batch schedule
where it falls back to a fixed split, say) are one step, counted for each of them.  The slowest
rank's step time (barrier to barrier), the least of its passes (the Spearman of the first pass
alone is printed beside); per schedule the predicted
time (the calibrated profile) against it: the plan's error and the Spearman rank correlation of
the schedules' totals.  One of the schedules is the per-batch schedule under the measured trial
(usp_hal.planning.trial, as ``DynamicDegree(trial_steps=2)`` runs it): it sees only its own
steps' times, the warm-up batch included, and its trial steps count in its total.

The last line: ``dynamic/static+ predicted=<the NVLink profile's ratio> measured=<this CPU,
every seed's total> slowest/mean=<the NVLink dynamic schedule's worst batch> schedule/bound=<its
total over the bound> plan-error=<the largest |predicted / measured - 1| over the measured
schedules, each its batches' mean step (the line before gives the per-batch errors)> spearman=<the
lowest over the seeds>``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Dict, List, Optional

from usp_hal.planning.schedule import (
    AttentionShape,
    Schedule,
    ScheduleError,
    Scheduler,
    compare_with_static,
    draw_batches,
    scheduler,
    split_label,
    static_rule,
)
from usp_hal.planning.stepcost import SCALED, StepRefit, fitted_seconds, split_key
from usp_hal.planning.trial import MeasuredTrial

WORLD = 4
PROFILES = ("h100-nvlink", "l40-pcie")
DISTS = {"lognormal": "lognormal:1024:32768:1.5", "llama3-sft": "llama3-sft"}
#: the model the predictions price: Llama-3-8B's shape
GPU_MODEL = AttentionShape(32, 128, 8, "bf16", True, True, hidden=4096, intermediate=14336, layers=32, vocab=128256)
#: the model measured here: every size of GPU_MODEL over 16 (layers and vocabulary fewer), fp32
CPU_LAYER = {"hidden": 256, "heads": 8, "kv_heads": 2, "head_dim": 32, "intermediate": 896, "vocab": 2048}
CPU_LAYERS = 2
SCALE = 16
#: the measured trial's timed steps per arm (after one warm-up step of each)
TRIAL = 2
TRIALED = "dynamic, measured trial"
#: the whole-step factors refitted to the last this many measured steps (StepRefit, as
#: DynamicDegree(refit_steps=REFIT) does): about 3 batches of every schedule here
REFIT = 32
#: passes over each measured batch's schedules, every other one in the reverse order; a
#: schedule's step on a batch is the least of its passes (the work is the same each pass: what
#: differs is what the machine adds, 4 ranks sharing its cores)
REPEAT = 2
#: whole-step calibration: batches of their own (seeded apart from the measured ones)
CAL_BATCHES = 2
CAL_SEED = 1000


def cpu_shape() -> AttentionShape:
    c = CPU_LAYER
    return AttentionShape(c["heads"], c["head_dim"], c["kv_heads"], "fp32", True, True, hidden=c["hidden"],
                          intermediate=c["intermediate"], layers=CPU_LAYERS, vocab=c["vocab"])


def spearman(xs: List[float], ys: List[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    a, b = ranks(xs), ranks(ys)
    ma, mb = statistics.mean(a), statistics.mean(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return num / den if den else 1.0


# ------------------------------------------------------------------------- predicted (GPU scale)
def predicted(dist: str, steps: int, tokens_per_rank: int, budget: int, seed: int) -> Dict[str, dict]:
    bs = draw_batches(DISTS[dist], steps, WORLD * tokens_per_rank, seed=seed)
    n_seq = sum(len(b) for b in bs)
    print(f"{dist} ({DISTS[dist]}): {steps} global batches on {WORLD} ranks, {n_seq / steps:.0f} sequences and "
          f"{sum(map(sum, bs)) / steps / WORLD:.0f} tokens per rank per step, longest {max(map(max, bs))}; budget "
          f"{budget} tokens per rank; model: {GPU_MODEL.describe()}, causal, forward+backward")
    out = {}
    for prof in PROFILES:
        cmp = compare_with_static(bs, WORLD, GPU_MODEL, budget_tokens=budget, profile=prof)
        static: Dict[str, Dict[str, float]] = cmp["static"]     # type: ignore[assignment]
        best = cmp["best"]
        dyn: Dict[str, float] = cmp["dynamic"]                   # type: ignore[assignment]
        print(f"\n{prof}: predicted whole step (ms, mean over the steps), the slowest rank's")
        print(f"  {'schedule':24s} {'step':>9s} {'attention':>10s} {'tokens':>9s} {'comm':>8s} {'overhead':>9s} "
              f"{'idle':>7s} {'constant':>9s}")
        rows = [("dynamic", dyn)] + [(f"static+ {k}" + (" (best)" if k == best else ""), v)
                                     for k, v in sorted(static.items(), key=lambda kv: kv[1]["predicted"])]
        for name, t in rows:
            print(f"  {name:24s} {t['predicted'] / steps * 1e3:9.1f} {t['attention'] / steps * 1e3:10.1f} "
                  f"{t['tokens'] / steps * 1e3:9.1f} {t['communication'] / steps * 1e3:8.1f} "
                  f"{t['overhead'] / steps * 1e3:9.1f} {t['idle'] / steps * 1e3:7.1f} "
                  f"{t['constant'] / steps * 1e3:9.1f}")
        sch = scheduler(WORLD, GPU_MODEL, budget_tokens=budget, profile=prof)
        for u, r in sch.static_splits(max(map(max, bs))):
            try:
                tot = sum(static_rule(b, WORLD, GPU_MODEL, ulysses=u, ring=r, budget_tokens=budget,
                                      profile=prof).predicted for b in bs)
            except ScheduleError:
                continue
            print(f"  {'rule ' + split_label(WORLD, u, r):24s} {tot / steps * 1e3:9.1f}   (earlier versions' "
                  f"placement: replicas by tokens, index-order packing, zigzag)")
        bound = float(cmp["bound"])           # type: ignore[arg-type]
        ratio = float(cmp["ratio"]) if cmp["ratio"] is not None else float("nan")    # type: ignore[arg-type]
        print(f"  lower bound {bound / steps * 1e3:.1f} ms per step: every sequence at its cheapest rank-seconds "
              "beyond a job's fixed cost (as if packed, on a group of any size) over the ranks, and no less than its "
              "fastest job, plus the step's constant part (gradient all-reduce, optimizer)")
        line = (f"{prof}: dynamic/static+ predicted={ratio:.3f} (static+ = {best}) slowest/mean={cmp['balance']:.3f} "
                f"token-balance={cmp['token_balance']:.3f} schedule/bound={dyn['predicted'] / bound:.3f} "
                f"fixed-split steps={cmp['fallbacks']}/{steps}")
        print(line)
        out[prof] = {"ratio": ratio, "balance": cmp["balance"], "bound": dyn["predicted"] / bound,
                     "token_balance": cmp["token_balance"], "best": best}
    return out


# ------------------------------------------------------------------------- measured (this CPU)
def _ids(seed: int, step: int, i: int, n: int, vocab: int):
    import torch
    g = torch.Generator().manual_seed(hash((seed, step, i)) % (1 << 31))
    return torch.randint(0, vocab, (1, n), generator=g)


def measured_ranks(dist: str, seeds: List[int], steps: int, tokens_per_rank: int, budget: int, profile,
                   repeat: int = 1) -> dict:
    """On each of 4 ranks: per seed, ``steps`` + 1 batches, each run under every schedule in
    turn (rotating), a whole training step each, ``repeat`` times (every other pass in the
    reverse order); returns per seed, batch and schedule the seconds (the slowest rank's,
    barrier to barrier: the least over the passes, and the first pass's alone) and the
    predicted seconds."""
    import torch
    import torch.distributed as dist_

    from usp_hal.integrations import transformers as usp
    c = CPU_LAYER
    model, dd = _cpu_model(budget, profile)
    shape = dd.shape
    extra = usp.calibrate_calls(model, dd)          # the model path against its price, per call and split
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rank = dist_.get_rank()
    # whole steps on batches of their own (not among the measured ones), the price fitted to them
    cal = draw_batches(DISTS[dist], CAL_BATCHES, WORLD * tokens_per_rank, seed=CAL_SEED + seeds[0], scale=SCALE)
    scale = dd.calibrate_steps(cal, lambda lens, sched: _step(model, opt, dd, sched, rank, CAL_SEED, cal.index(lens),
                                                              sum(n - 1 for n in lens), c["vocab"]))
    model_ = dd.scheduler.model
    # the calibration's factors and split shifts, for the column priced by them alone
    cal_scale = {**model_.part_scale, **{split_key(*k): v for k, v in model_.split_shift.items()}}
    refit = StepRefit(model_, REFIT * repeat, dd.calibration_samples)
    variants = {"dynamic": dd.scheduler,
                "dynamic rings only": Scheduler(WORLD, shape, budget_tokens=budget, profile=dd.scheduler.model.profile,
                                                ulysses_degrees=(1,), model=dd.scheduler.model),
                "dynamic unpacked": Scheduler(WORLD, shape, budget_tokens=budget, profile=dd.scheduler.model.profile,
                                              pack=False, model=dd.scheduler.model)}
    out: Dict[int, dict] = {}
    for seed in seeds:
        bs = draw_batches(DISTS[dist], steps + 1, WORLD * tokens_per_rank, seed=seed, scale=SCALE)
        # the per-batch schedule under a measured trial (DynamicDegree(trial_steps=TRIAL)): it
        # sees only its own steps' times, the slowest rank's, as DynamicDegree gives them
        trial = MeasuredTrial(Scheduler(WORLD, shape, budget_tokens=budget, profile=model_.profile, model=model_),
                              TRIAL)
        trial_labels: List[str] = []
        base = dd.scheduler
        totals = {}
        for u, r in base.static_splits(max(map(max, bs))):
            try:
                totals[(u, r)] = sum(base.static(b, u, r).predicted for b in bs[1:])
            except ScheduleError:
                continue
        best = min(totals, key=lambda k: totals[k])
        names = list(variants) + [TRIALED] + [("static+ " if k == best else "static ") + split_label(WORLD, *k)
                                              for k in totals]
        runs: Dict[str, List[float]] = {n: [] for n in names}
        firsts: Dict[str, List[float]] = {n: [] for n in names}
        common: List[float] = []
        steps_ran: List[dict] = []                    # every step in the order it ran (for --dump)
        preds: Dict[str, List[float]] = {n: [] for n in names}
        preds_cal: Dict[str, List[float]] = {n: [] for n in names}
        for step, b in enumerate(bs):
            scheds: Dict[str, Schedule] = {n: s.schedule(b) for n, s in variants.items()}
            serial, scheds[TRIALED] = trial.choose(b, at=step)
            trial_labels.append(scheds[TRIALED].label)
            for k in totals:
                scheds[("static+ " if k == best else "static ") + split_label(WORLD, *k)] = base.static(b, *k)
            items = sum(n - 1 for n in b)
            shift = step % len(names)
            order = names[shift:] + names[:shift]
            took_at: Dict[str, List[float]] = {n: [] for n in names}
            priced = {n: scheds[n].predicted for n in names}    # before the batch ran, by the refitted factors
            # schedules that place the batch alike (the same jobs on the same ranks, in the same
            # order) are the same work: one step runs them, and counts for each of them
            alike: Dict[tuple, List[str]] = {}
            for n in order:
                alike.setdefault(_placement(scheds[n]), []).append(n)
            groups = list(alike.values())
            for rep in range(repeat):
                for group in (groups if rep % 2 == 0 else groups[::-1]):
                    lead = group[0]
                    dist_.barrier()
                    t0 = time.perf_counter()
                    _step(model, opt, dd, scheds[lead], rank, seed, step, items, c["vocab"])
                    dist_.barrier()
                    slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist_.all_reduce(slowest, op=dist_.ReduceOp.MAX)
                    for n in group:
                        took_at[n].append(float(slowest))
                    if TRIALED in group and rep == 0:      # the trial sees one step per batch, as a run gives it
                        trial.record(serial, float(slowest), at=step + 1)
                    raw = scheds[lead].parts(unscaled=True)
                    common.append(refit.record(raw, float(slowest))["tokens"])   # for the batches after this one
                    steps_ran.append({"batch": step, "schedule": lead, "alike": group[1:], "parts": raw,
                                      "seconds": float(slowest), "predicted": priced[lead], "repeat": rep})
            if step:                           # the first batch warms every path up
                for n in names:
                    raw = scheds[n].parts(unscaled=True)
                    runs[n].append(min(took_at[n]))
                    firsts[n].append(took_at[n][0])
                    preds[n].append(priced[n])
                    preds_cal[n].append(fitted_seconds(raw, cal_scale))
        out[seed] = {"runs": runs, "firsts": firsts, "preds": preds, "preds_cal": preds_cal, "common": common,
                     "steps": steps_ran, "calibration": dd.calibration_samples, "cal_scale": cal_scale,
                     "best": split_label(WORLD, *best),
                     "trial": {"kept": trial.decided, "ratio": trial.ratio,
                               "split": split_label(WORLD, *trial.split) if trial.split else None,
                               "labels": trial_labels}}
    out["call_extra"] = extra
    out["part_scale"] = scale
    return out


def _cpu_model(budget: int, profile):
    """The measured model (CPU_LAYER, CPU_LAYERS; the transformers integration) and its
    DynamicDegree."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from usp_hal.integrations import transformers as usp
    from usp_hal.planning.dynamic import DynamicDegree
    c = CPU_LAYER
    cfg = LlamaConfig(hidden_size=c["hidden"], intermediate_size=c["intermediate"], num_hidden_layers=CPU_LAYERS,
                      num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"], head_dim=c["head_dim"],
                      vocab_size=c["vocab"], max_position_embeddings=1 << 16)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    name = usp.register("usp_hal_bench_dynamic", mesh=None, layout="varlen_zigzag", attn_type="sdpa", enable=True)
    model.set_attn_implementation(name)
    shape = AttentionShape.from_config(cfg, dtype="fp32")
    assert shape == cpu_shape(), (shape, cpu_shape())
    return model, DynamicDegree(shape, budget_tokens=budget, profile=profile)


def _calls_ranks(rounds: int, budget: int, profile) -> list:
    from usp_hal.integrations import transformers as usp
    model, dd = _cpu_model(budget, profile)
    return [usp.calibrate_calls(model, dd) for _ in range(rounds)]


def calls_spread(rounds: int) -> None:
    """usp.calibrate_calls ``rounds`` times on one calibration of this machine: how far its
    parts move between runs minutes apart (what the measured steps' price rests on)."""
    from benchmarks._ranks import run_on_ranks
    from usp_hal.harness.calibrate import calibrate
    prof = calibrate(WORLD, dtype="fp32", head_dim=CPU_LAYER["head_dim"], heads=CPU_LAYER["heads"], layer=CPU_LAYER,
                     timeout=600)
    runs = run_on_ranks(_calls_ranks, world=WORLD, timeout=3600, rounds=rounds, budget=16384 // SCALE,
                        profile=prof)[0]
    att = [r["attention"] for r in runs]
    print(f"\nusp.calibrate_calls {rounds} times on one calibration ({cpu_shape().describe()}, budget "
          f"{16384 // SCALE}): attention factor {min(att):.3f}-{max(att):.3f}")
    print("  split   per call (ms)        per token (us)       per document (ms)")
    for k in [k for k in runs[0] if k != "attention"]:
        cols = [[r[k][i] * f for r in runs] for i, f in enumerate((1e3, 1e6, 1e3))]
        print(f"  {k:7s} " + "  ".join(f"{min(v):+8.1f} to {max(v):+8.1f}" for v in cols) +
              f"   (per token: {max(cols[1]) - min(cols[1]):.0f} apart)")


def _packs_ranks(jobs: list, reps: int, budget: int, profile) -> dict:
    import statistics as st

    import torch
    import torch.distributed as dist_

    from usp_hal.integrations import transformers as usp
    from usp_hal.planning.schedule import Job
    model, dd = _cpu_model(budget, profile)
    extra = usp.calibrate_calls(model, dd)
    sch = dd.scheduler

    def timed(run) -> float:
        ts = []
        for rep in range(reps + 1):          # the first warms up
            dist_.barrier()
            t0 = time.perf_counter()
            run()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist_.all_reduce(took, op=dist_.ReduceOp.MAX)
            if rep:
                ts.append(float(took))
        return st.median(ts)

    def call(job, ids):
        with dd.on(job) as mesh:
            cu = list(job.cu_seqlens) if job.cu_seqlens else None
            batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, job.cost.layout, cu_seqlens=cu)
            model(**batch).loss.backward()

    out = []
    for (u, r), packs in jobs:
        g = u * r
        built = []
        for lengths in packs:
            cost = sch.model.job(tuple(lengths), g, u, sch.layout(g, u, len(lengths) > 1))
            ids = torch.randint(0, CPU_LAYER["vocab"], (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
            built.append((Job(tuple(range(len(lengths))), tuple(lengths), 0, g, cost), ids))
        alone = [(timed(lambda j=j, x=x: call(j, x)), j.cost.time) for j, x in built]
        real = built[::2]                       # the step's own jobs (not their equal twins)
        step = timed(lambda real=real: [call(j, x) for j, x in real])    # back to back, as a step runs them
        out.append({"alone": alone, "step": step})
    model.zero_grad(set_to_none=True)
    return {"extra": extra, "splits": out}


def packs(dist: str, seed: int, reps: int = 3) -> None:
    """The packed jobs that whole steps run, against their price, on every 4-rank fixed split:
    rank 0's jobs of one measured batch as Scheduler.static places them, each timed alone (the
    slowest rank's median of ``reps``, after a warm-up) beside a pack of the same tokens in
    documents of equal length, and the split's jobs run back to back as a step runs them (no
    barrier between them) against the sum of the same jobs alone: whether the price of a job
    misses, and whether a step adds to its jobs."""
    from benchmarks._ranks import run_on_ranks
    from usp_hal.harness.calibrate import calibrate
    budget = 16384 // SCALE
    prof = calibrate(WORLD, dtype="fp32", head_dim=CPU_LAYER["head_dim"], heads=CPU_LAYER["heads"], layer=CPU_LAYER,
                     timeout=600)
    batch = draw_batches(DISTS[dist], 2, WORLD * 32768 // SCALE, seed=seed, scale=SCALE)[1]
    base = Scheduler(WORLD, cpu_shape(), budget_tokens=budget, profile=prof)
    jobs = []
    for (u, r), placed in base.statics(batch).items():
        if u * r != WORLD:
            continue
        lists = []
        for job in placed.jobs_of(0):
            total, n = sum(job.lengths), len(job.lengths)
            lists.append(list(job.lengths))      # each job, then its twin of equal documents
            lists.append([total // n] * (n - 1) + [total - (total // n) * (n - 1)])
        jobs.append(((u, r), lists))
    res = run_on_ranks(_packs_ranks, world=WORLD, timeout=3600, jobs=jobs, reps=reps, budget=budget,
                       profile=prof)[0]
    print(f"\npacked jobs against their price ({dist}, seed {seed}, batch 1; {cpu_shape().describe()}; the model "
          "path's parts from usp.calibrate_calls just before): rank 0's jobs of each 4-rank fixed split, each beside "
          "the same tokens in equal documents, timed alone; then the split's jobs back to back")
    print("  split    documents  longest  alone (ms)  priced (ms)  alone/priced   equal documents: alone/priced")
    for ((u, r), lists), got in zip(jobs, res["splits"]):
        for k in range(0, len(lists), 2):
            (took, price), (took_eq, price_eq) = got["alone"][k], got["alone"][k + 1]
            print(f"  {split_label(WORLD, u, r):8s} {len(lists[k]):9d} {max(lists[k]):8d} {took * 1e3:11.0f} "
                  f"{price * 1e3:12.0f} {took / price:13.2f} {took_eq / price_eq:31.2f}")
        alone = sum(t for t, _ in got["alone"][::2])
        print(f"  {split_label(WORLD, u, r):8s} back to back {got['step'] * 1e3:.0f} ms against {alone * 1e3:.0f} ms "
              f"alone ({got['step'] / alone:.3f}); priced {sum(p for _, p in got['alone'][::2]) * 1e3:.0f} ms")


def _placement(sched: Schedule) -> tuple:
    """What a step runs under a schedule: each job's sequences, ranks and split, in order."""
    return tuple((j.seqs, j.first, j.size, j.cost.ulysses, j.cost.ring, j.cost.layout) for j in sched.jobs)


def _step(model, opt, dd, sched: Schedule, rank: int, seed: int, step: int, items: int, vocab: int) -> None:
    import torch

    from usp_hal.integrations import transformers as usp
    mine = torch.zeros(())
    for job in sched.jobs_of(rank):
        ids = torch.cat([_ids(seed, step, i, n, vocab) for i, n in zip(job.seqs, job.lengths)], 1)
        with dd.on(job) as mesh:
            cu = list(job.cu_seqlens) if job.cu_seqlens else None
            batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, job.cost.layout, cu_seqlens=cu)
            batch["num_items_in_batch"] = items
            out = model(**batch)
        out.loss.backward()
        mine = mine + out.loss.detach()
    dd.sync_gradients(model, mine)
    opt.step()
    opt.zero_grad(set_to_none=False)


def measured(dist: str, seeds: List[int], steps: int, profile: Optional[str], dump: Optional[str] = None,
             repeat: int = REPEAT) -> dict:
    from benchmarks._ranks import run_on_ranks
    from usp_hal.planning.planner import load_profile
    tokens, budget = 32768 // SCALE, 16384 // SCALE
    print(f"\nmeasured on this CPU: 4 gloo ranks x 1 thread, {cpu_shape().describe()}, lengths / {SCALE}, about "
          f"{tokens} tokens per rank per step, budget {budget}; {steps} batches per seed after a warm-up; per seed, "
          "the machine calibrated just before (usp_hal.harness.calibrate, 4 ranks at once) unless --profile names "
          "one, then the model path's own cost per call and per token on each split against that price "
          "(usp.calibrate_calls: three job sizes and a packed one, with one factor on the priced attention), then "
          "whole steps (DynamicDegree.calibrate_steps)")
    worst_err, worst_spear, batch_errs = 0.0, 1.0, []
    worst_cal, worst_spear_cal, worst_spear_first = 0.0, 1.0, 1.0
    ratios, dyn_all, st_all = [], 0.0, 0.0
    fastest_ratios, dumped = [], {}
    trial_ratios, trial_all = [], 0.0
    for seed in seeds:      # each seed priced by a calibration made just before it (the machine's speed drifts)
        t0 = time.monotonic()
        if profile is None:
            from usp_hal.harness.calibrate import calibrate
            prof = calibrate(WORLD, dtype="fp32", head_dim=CPU_LAYER["head_dim"], heads=CPU_LAYER["heads"],
                             layer=CPU_LAYER, timeout=600)
            how = f"calibrated ({time.monotonic() - t0:.0f} s)"
        else:
            prof = load_profile(profile)
            how = f"profile {profile}"
        res = run_on_ranks(measured_ranks, world=WORLD, timeout=5400, dist=dist, seeds=[seed], steps=steps,
                           tokens_per_rank=tokens, budget=budget, profile=prof, repeat=repeat)
        extra = f"attention x{res[0]['call_extra']['attention']:.2f}; " + ", ".join(
            f"{k}: {v[0] * 1e3:+.1f} ms {v[1] * 1e6:+.1f} us/token {v[2] * 1e3:+.2f} ms/doc"
            for k, v in res[0]["call_extra"].items() if k != "attention")
        print(f"  seed {seed}: {how}; the model path against its price (g,u,r): {extra}")
        print(f"  seed {seed}: whole steps against their price ({CAL_BATCHES} batches of their own, each under the "
              "per-batch schedule, unpacked, and every fixed split: DynamicDegree.calibrate_steps), the price scaled "
              "by: " + ", ".join(f"{k} {v:.2f}" for k, v in res[0]["part_scale"].items()))
        runs = res[0][seed]["runs"]               # the slowest rank's, the least over the passes
        firsts = res[0][seed]["firsts"]           # the same, the first pass alone (one step each)
        preds, preds_cal = res[0][seed]["preds"], res[0][seed]["preds_cal"]
        names = list(runs)
        best = next(n for n in names if n.startswith("static+ "))
        com = res[0][seed]["common"]
        print(f"  seed {seed}: the factors refitted after every measured step to the last {REFIT} (StepRefit): the "
              f"common factor {min(com):.2f}-{max(com):.2f}; each batch's schedules priced before it ran")
        print(f"  seed {seed}: schedule                 predicted (ms/step)  measured (ms/step)  error    "
              "(the calibration's factors alone: predicted, error)")
        for n in names:
            p, m, pc = sum(preds[n]) / steps, sum(runs[n]) / steps, sum(preds_cal[n]) / steps
            errs = [abs(a / b - 1) for a, b in zip(preds[n], runs[n])]
            worst_err = max(worst_err, abs(p / m - 1))
            worst_cal = max(worst_cal, abs(pc / m - 1))
            batch_errs += errs
            print(f"    {n:32s} {p * 1e3:12.1f} {m * 1e3:18.1f} {100 * (p / m - 1):+8.1f}%  (worst batch "
                  f"{100 * max(errs):.1f}%)  {pc * 1e3:8.1f} {100 * (pc / m - 1):+7.1f}%")
        sp = spearman([sum(preds[n]) for n in names], [sum(runs[n]) for n in names])
        sp_cal = spearman([sum(preds_cal[n]) for n in names], [sum(runs[n]) for n in names])
        sp_first = spearman([sum(preds[n]) for n in names], [sum(firsts[n]) for n in names])
        worst_spear_first = min(worst_spear_first, sp_first)
        worst_spear = min(worst_spear, sp)
        worst_spear_cal = min(worst_spear_cal, sp_cal)
        r = sum(runs["dynamic"]) / sum(runs[best])
        ratios.append(r)
        dyn_all += sum(runs["dynamic"])
        st_all += sum(runs[best])
        fixed = [n for n in names if n.startswith("static")]
        fastest = min(fixed, key=lambda n: sum(runs[n]))
        fastest_ratios.append(sum(runs["dynamic"]) / sum(runs[fastest]))
        dumped[seed] = {k: res[0][seed][k] for k in ("steps", "calibration", "cal_scale")}
        print(f"    seed {seed}: measured dynamic/static+ ({best[8:]}) {r:.3f} (against the fixed split measured "
              f"fastest, {fastest.split(' ', 1)[1]}: {fastest_ratios[-1]:.3f}), predicted "
              f"{sum(preds['dynamic']) / sum(preds[best]):.3f}; spearman {sp:.3f} over {len(names)} schedules (the "
              f"calibration's factors alone: {sp_cal:.3f}; the first pass's steps alone: {sp_first:.3f})")
        tr = res[0][seed]["trial"]
        trial_ratios.append(sum(runs[TRIALED]) / sum(runs[best]))
        trial_all += sum(runs[TRIALED])
        verdict = (f"measured the per-batch schedule at {tr['ratio']:.3f}x the fixed split and kept {tr['kept']}"
                   if tr["ratio"] is not None else "had not ended")
        print(f"    seed {seed}: the measured trial (fixed split {tr['split']}, {TRIAL} timed steps of each after a "
              f"warm-up) {verdict}; steps: {', '.join(tr['labels'])}; measured {TRIALED}/static+ "
              f"{trial_ratios[-1]:.3f} (the trial's steps included)")
    within = sum(e <= 0.25 for e in batch_errs)
    print(f"  the plan's error per schedule (its batches' mean step): at most {100 * worst_err:.1f}%; per batch: "
          f"{within} of {len(batch_errs)} within 25%, the worst {100 * max(batch_errs):.1f}%; priced by the "
          f"calibration's factors alone (no refit): at most {100 * worst_cal:.1f}%, spearman at least "
          f"{worst_spear_cal:.3f}; the first of the {repeat} passes alone: spearman at least {worst_spear_first:.3f}")
    print(f"  {TRIALED} / static+: {trial_all / st_all:.3f} over the seeds; per seed "
          + ", ".join(f"{x:.3f}" for x in trial_ratios))
    print("  dynamic / the fixed split measured fastest in each seed (known only after running them all): "
          + ", ".join(f"{x:.3f}" for x in fastest_ratios))
    if dump:
        import json
        with open(dump, "w") as f:
            json.dump({"dist": dist, "window": REFIT * repeat, "repeat": repeat, "seeds": dumped}, f)
    return {"ratio": dyn_all / st_all, "seeds": ratios, "plan_error": worst_err, "spearman": worst_spear,
            "trial": trial_all / st_all, "trial_seeds": trial_ratios}


def replay(path: str) -> None:
    """A ``--dump`` replayed: each measured batch's schedules priced by the refit as it stood
    before the batch (StepRefit over the calibration's steps, then every step that ran, in
    order), once with the per-split shifts (the run's own price: it reproduces the run's
    predictions) and once without (the parts' factors alone, as before the shifts), against
    the same measured steps (each the least of its passes): the Spearman and the plan's error
    per seed, each way.  No step is run: both prices face the same measurements."""
    import json

    from usp_hal.planning.stepcost import fit_part_scale

    class _Held:                      # what StepRefit sets factors on, without a model to price
        def __init__(self):
            self.held: Dict[str, float] = {}

        def set_part_scale(self, scale):
            self.held = dict(scale)

        def factors(self):
            return dict(self.held)

    def plain(parts):
        return {k: v for k, v in parts.items() if k in SCALED or k == "idle"}

    with open(path) as f:
        dump = json.load(f)
    lacks = [k for k in ("dist", "window", "repeat", "seeds") if k not in dump] if isinstance(dump, dict) else ["all"]
    if lacks:
        raise ValueError(f"--replay {path}: not a --dump of this benchmark (it lacks {', '.join(lacks)})")
    print(f"{path}: {dump['dist']}, refit window {dump['window']} steps, {dump['repeat']} passes")
    for shifts in (True, False):
        keep = (lambda p: p) if shifts else plain
        line = []
        for seed, got in dump["seeds"].items():
            held = _Held()
            cal = [(keep(p), t) for p, t in got["calibration"]]
            held.set_part_scale(fit_part_scale(cal))
            refit = StepRefit(held, dump["window"], cal)     # type: ignore[arg-type]
            preds: Dict[str, float] = {}
            meas: Dict[str, float] = {}
            for b in sorted({s["batch"] for s in got["steps"]}):
                scale = held.factors()
                mine = [s for s in got["steps"] if s["batch"] == b]
                took: Dict[str, List[float]] = {}
                for s in mine:
                    for n in [s["schedule"]] + s["alike"]:
                        took.setdefault(n, []).append(s["seconds"])
                        if b and s["repeat"] == 0:         # the first batch warms up, as in the run
                            preds[n] = preds.get(n, 0.0) + fitted_seconds(keep(s["parts"]), scale)
                for n, ts in took.items():
                    if b:
                        meas[n] = meas.get(n, 0.0) + min(ts)
                for s in mine:
                    refit.record(keep(s["parts"]), s["seconds"])
            names = list(preds)
            sp = spearman([preds[n] for n in names], [meas[n] for n in names])
            err = max(abs(preds[n] / meas[n] - 1) for n in names)
            line.append(f"seed {seed}: spearman {sp:.3f}, plan error {100 * err:.1f}%")
        print(f"  {'with the split shifts' if shifts else 'without them':22s} " + "; ".join(line))


def host_time(n_seq: int = 1000, world: int = 64, reps: int = 20) -> float:
    """Seconds of host time to schedule one global batch of ``n_seq`` sequences on ``world``
    ranks (the median after the tables are built), H100 profile, Llama-3-8B shape."""
    sch = Scheduler(world, GPU_MODEL, budget_tokens=16384, profile="h100-nvlink")
    bs = [b[:n_seq] for b in draw_batches(DISTS["lognormal"], reps + 2, world * 32768, seed=1)]
    for b in bs[:2]:
        sch.schedule(b)
    ts = []
    for b in bs[2:]:
        t0 = time.perf_counter()
        sch.schedule(b)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default="lognormal", choices=tuple(DISTS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--tokens-per-rank", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=16384, help="most tokens one rank holds in one job")
    ap.add_argument("--seed", type=int, default=0, help="the predicted batches' seed")
    ap.add_argument("--time", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure whole steps on 4 gloo ranks here")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="the measured runs' seeds")
    ap.add_argument("--time-steps", type=int, default=11, help="measured batches per seed")
    ap.add_argument("--repeat", type=int, default=REPEAT,
                    help="passes over each batch's schedules (every other one in the reverse order); a schedule's "
                         "step on a batch is the least of its passes")
    ap.add_argument("--profile", default=None, help="price the measured runs with this profile (default: calibrate)")
    ap.add_argument("--host-time", action="store_true", help="also time the scheduling of 1,000 sequences on 64 ranks")
    ap.add_argument("--dump", default=None, metavar="PATH",
                    help="write every measured step (its schedule, unscaled parts and seconds) as JSON here")
    ap.add_argument("--calls-spread", type=int, default=0, metavar="N",
                    help="only run usp.calibrate_calls N times on one calibration here and print its spread")
    ap.add_argument("--packs", action="store_true",
                    help="only time one batch's packed jobs of the 4-rank fixed splits against their price")
    ap.add_argument("--replay", default=None, metavar="PATH",
                    help="only replay a --dump: its steps priced with and without the per-split shifts")
    args = ap.parse_args(argv)
    if args.replay:
        replay(args.replay)
        return 0
    if args.packs:
        packs(args.dist, args.seeds[0])
        return 0
    if args.calls_spread:
        calls_spread(args.calls_spread)
        return 0
    pred = predicted(args.dist, args.steps, args.tokens_per_rank, args.budget, args.seed)
    meas = {"ratio": float("nan"), "plan_error": float("nan"), "spearman": float("nan")}
    if args.time:
        meas = measured(args.dist, args.seeds, args.time_steps, args.profile, args.dump, args.repeat)
    if args.host_time:
        print(f"\nscheduling one batch of 1,000 sequences on 64 ranks: {host_time() * 1e3:.2f} ms of host time "
              "(median, the price tables built)")
    nv = pred["h100-nvlink"]
    print(f"\ndynamic/static+ predicted={nv['ratio']:.3f} measured={meas['ratio']:.3f} "
          f"slowest/mean={nv['balance']:.3f} "
          f"schedule/bound={nv['bound']:.3f} plan-error={100 * meas['plan_error']:.1f}% "
          f"spearman={meas['spearman']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
