"""The ``usp-hal bench`` sweep: USP configurations, each measured side by side with
single-process attention on the same machine in the same run.

For every group (sequence length x forward / forward+backward x causal) the sweep runs,
in interleaved rounds (the order rotates each round, so a burst of load elsewhere hits
every entry alike):

* each distributed configuration (split ulysses x ring, ring layout, rotation) on the
  ranks - time per iteration = the max over ranks, then the median over rounds;
* the same backend called directly on the whole sequence in one process, with one
  thread, with ``threads_per_rank`` threads when that differs, and with all the threads
  the ranks use together.  The per-rank compute floor is the single-process time at
  ``threads_per_rank`` threads divided by the number of ranks;
* with ``peers``, yunchang's LongContextAttention on the same split when it is importable
  (absent peers are skipped with a note), given the kernel usp-hal runs wherever yunchang
  can take it (:func:`usp_hal.harness.cases.yunchang_kernel`: on CPU its ``attn_processor``
  hook with usp-hal's CPU kernel, on GPUs FA/FA3 or the same aten op), checked against the
  same reference, and timed in the same rounds right after usp-hal's own calls of the
  configuration it mirrors (right before them, every other round: :func:`round_order`).
  That side of the comparison runs with no meter at work
  (:func:`usp_hal.harness.cases.rank_plain_steps`: the breakdown's collective wrappers,
  step hook and kernel timer would cost usp-hal alone), and each side's sample is as
  many calls as make :data:`PEER_SAMPLE_S` (the same count on both sides), made back to
  back after one barrier as a model makes them.  Each peer row names both kernels and
  gives usp-hal/peer as the ratio of the medians and as the median of the per-round
  ratios, with that ratio's quartiles over the rounds.

Every entry runs the tasks of :mod:`usp_hal.harness.cases` on a
:class:`~usp_hal.harness.pool.RankPool`; the options come as an ``argparse`` namespace with
the attributes ``usp-hal bench`` defines.
"""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from statistics import median, quantiles
from typing import Any, Callable, Optional

from .cases import (
    FP8_CHOICES,
    LAYOUTS,
    PROJ_CHOICES,
    ROTATIONS,
    RunConfig,
    merge_checks,
    min_comm_bytes,
    peer_available,
    rank_check,
    rank_clear,
    rank_peer_prepare,
    rank_peer_steps,
    rank_plain_steps,
    rank_prepare,
    rank_release,
    rank_steps,
    single_prepare,
    single_steps,
    summarize,
    validate,
)
from .pool import RankPool

MODES = {"fwd": False, "fwdbwd": True}
CAUSAL_CHOICES = {"on": (True,), "off": (False,), "both": (False, True)}
PEERS = ("yunchang",)


# ----------------------------------------------------------------------------- sweep
def parse_splits(text: str, nproc: int) -> list:
    """"2x1,1x2" -> [(2, 1), (1, 2)]; every split must use all ``nproc`` ranks."""
    out = []
    for item in text.split(","):
        item = item.strip().lower()
        try:
            u, r = (int(x) for x in item.split("x"))
        except ValueError:
            raise ValueError(f"--splits entry {item!r}: write ULYSSESxRING, e.g. 2x1 or 1x2") from None
        if u < 1 or r < 1 or u * r != nproc:
            raise ValueError(f"--splits entry {item!r}: ulysses x ring must equal --nproc {nproc}")
        out.append((u, r))
    return out


def default_splits(nproc: int) -> list:
    """Ulysses-only, ring-only and every USP factorisation of ``nproc``."""
    return [(u, nproc // u) for u in range(nproc, 0, -1) if nproc % u == 0]


def _csv(text: str, valid, what: str) -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in valid]
    if bad or not items:
        raise ValueError(f"{what}: {', '.join(bad) or 'nothing given'} not valid; choose from {', '.join(valid)}")
    return items


def build_groups(args, device_type: str) -> list:
    """[(group label, base config, [configs])] in sweep order."""
    nproc = args.nproc
    splits = parse_splits(args.splits, nproc) if args.splits else default_splits(nproc)
    impls = _csv(args.ring_impls, LAYOUTS, "--ring-impls")
    rots = _csv(args.rotations, ROTATIONS, "--rotations")
    modes = _csv(args.modes, tuple(MODES), "--modes")
    try:
        seqlens = [int(x) for x in args.seqlens.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seqlens {args.seqlens!r}: give comma-separated integers") from None
    groups = []
    for causal in CAUSAL_CHOICES[args.causal]:
        for mode in modes:
            for S in seqlens:
                base = RunConfig(nproc=nproc, ulysses=nproc, ring=1, seqlen=S, batch=args.batch, heads=args.heads,
                                 kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, causal=causal,
                                 bwd=MODES[mode], attn_type=args.attn_type, ring_impl="basic", rotate="p2p",
                                 dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                                 threads_per_rank=args.threads_per_rank, seed=args.seed, check=args.check,
                                 device_type=device_type)
                cfgs = []
                for u, r in splits:
                    if r == 1:   # layout and rotation do not exist without a ring
                        cfgs += _variants(replace(base, ulysses=u, ring=r), args)
                        continue
                    for impl in impls:
                        for rot in rots:
                            cfgs += _variants(replace(base, ulysses=u, ring=r, ring_impl=impl, rotate=rot), args)
                for c in cfgs:
                    validate(c)
                label = f"S={S} {'fwd+bwd' if MODES[mode] else 'fwd'} {'causal' if causal else 'full'}"
                groups.append((label, base, cfgs))
    return groups


def _variants(cfg: RunConfig, args) -> list:
    """The wire-format / pipelining / projection variants of one split to sweep (each only
    where it changes something: fp8 and pipelining need a Ulysses group, ring fp8 a ring)."""
    out = []
    for fp8 in _csv(getattr(args, "fp8", "none"), FP8_CHOICES, "--fp8"):
        for pipe in [int(x) for x in str(getattr(args, "pipelines", "0")).split(",") if x.strip()]:
            for proj in _csv(getattr(args, "proj", "none"), PROJ_CHOICES, "--proj"):
                if cfg.ulysses == 1 and (pipe or (fp8 != "none" and not getattr(args, "ring_fp8", False))
                                         or proj == "overlap"):
                    continue
                if pipe and proj == "overlap":
                    continue
                out.append(replace(cfg, fp8=fp8, ring_fp8=bool(getattr(args, "ring_fp8", False)) and cfg.ring > 1
                                   and fp8 != "none", pipeline=pipe, proj=proj))
    return out or [cfg]


def config_label(cfg: RunConfig) -> str:
    if cfg.ring == 1:
        name = f"ulysses{cfg.ulysses}"
    else:
        name = f"ring{cfg.ring}" if cfg.ulysses == 1 else f"usp{cfg.ulysses}x{cfg.ring}"
        name = f"{name} {cfg.ring_impl} {cfg.rotate}"
    extra = [f"fp8:{cfg.fp8}" if cfg.fp8 != "none" else "", "ringfp8" if cfg.ring_fp8 else "",
             f"pipe{cfg.pipeline}" if cfg.pipeline else "", f"proj:{cfg.proj}" if cfg.proj != "none" else ""]
    return " ".join([name] + [e for e in extra if e])


# ----------------------------------------------------------------------------- the sweep
def _thread_counts(cfg: RunConfig) -> list:
    return sorted({1, cfg.threads_per_rank, cfg.nproc * cfg.threads_per_rank})


def run_sweep(args, groups: list, device_type: str, progress: Optional[Callable] = None) -> dict:
    """Run the sweep (see the module docstring) on a fresh rank pool and single-process
    worker.  ``progress(total)`` returns an object with ``step(text)`` and ``close()``,
    stepped once per measured entry and round.  Returns {"results", "baselines", "peers",
    "notes"}, the rows ``usp-hal bench`` prints and writes as JSON."""
    rounds = args.warmup + args.iters
    peers = []
    notes = []
    if args.peers:
        for name in PEERS:
            ok, note = peer_available(name)
            if ok:
                peers.append(name)
            else:
                notes.append(f"peer {name} skipped: {note}")
    per_group = [len(c) + (0 if args.no_baseline else len(_thread_counts(b))) +
                 (2 * len([x for x in c if not x.bwd]) if peers else 0) for _, b, c in groups]
    bar = (progress or _NoProgress)(sum(n * (rounds + 1) for n in per_group))
    results, baselines, peer_rows = [], [], []
    pool: Any = None
    single: Any = None
    try:
        pool = RankPool(args.nproc, threads=args.threads_per_rank, device_type=device_type,
                        start_timeout=min(args.timeout, 300.0), wait=False)
        if not args.no_baseline:
            single = RankPool(1, threads=1, device_type=device_type, init_dist=False,
                              start_timeout=min(args.timeout, 300.0), wait=False)
            single.wait_ready()
        pool.wait_ready()
        for label, base, cfgs in groups:
            pool.run(rank_clear, timeout=args.timeout)
            prep = {}
            for i, c in enumerate(cfgs):
                prep[i] = pool.run(rank_prepare, timeout=args.timeout, cfg=asdict(c), case=f"c{i}")
            entries = [("dist", i) for i in range(len(cfgs))]
            if single is not None:
                single.run(rank_clear, timeout=args.timeout)
                single_inputs = single.run(single_prepare, timeout=args.timeout, cfg=asdict(base),
                                           case="single")[0]["input_bytes"]
                entries += [("single", th) for th in _thread_counts(base)]
            peer_prep, calls = {}, {}
            if peers and not base.bwd:
                for i, c in enumerate(cfgs):
                    got = pool.run(rank_peer_prepare, timeout=args.timeout, cfg=asdict(c), case=f"p{i}",
                                   usp_backend=prep[i][0]["backend"])
                    for status in ("skipped", "failed"):
                        why = [g[status] for g in got if g.get(status)]
                        if why:
                            peer_rows.append({"group": label, **_group_fields(base), "config": config_label(c),
                                              "peer": "yunchang", "status": status, "note": why[0]})
                            break
                    else:
                        peer_prep[i] = got
                        calls[i] = _calls_per_sample(pool, args.timeout, i)
                # each peer right after usp-hal's bare calls of its configuration, so the two stay
                # neighbours in every round
                order = []
                for i in range(len(cfgs)):
                    order += [("dist", i)] + ([("plain", i), ("peer", i)] if i in peer_prep else [])
                entries = order + [e for e in entries if e[0] == "single"]
            elif peers and base.bwd:
                notes.append(f"{label}: peers timed forward only (yunchang's backward does not take the "
                             f"attn_processor that gives it usp-hal's CPU kernel)"
                             if device_type == "cpu" else f"{label}: peers timed forward only")
            recs: Any = {e: [] for e in entries}
            for rnd in range(rounds):
                for kind, key in round_order(entries, rnd):
                    if kind == "dist":
                        out = pool.run(rank_steps, timeout=args.timeout, case=f"c{key}", n=1)
                        text = config_label(cfgs[key])
                    elif kind == "single":
                        out = single.run(single_steps, timeout=args.timeout, case="single", n=1, threads=key)[0]
                        text = f"single process {key} thread(s)"
                    elif kind == "plain":
                        out = _sample(pool.run(rank_plain_steps, timeout=args.timeout, case=f"c{key}", n=calls[key],
                                                run=True))
                        text = f"{config_label(cfgs[key])} (no meters)"
                    else:
                        out = _sample(pool.run(rank_peer_steps, timeout=args.timeout, case=f"p{key}", n=calls[key],
                                                run=True))
                        text = f"yunchang {config_label(cfgs[key])}"
                    if rnd >= args.warmup:
                        recs[(kind, key)].append(out)
                    bar.step(f"{label} {text}")
            # one untimed iteration per entry for the memory reading (see usp_hal.harness.meter)
            mems = {}
            for kind, key in entries:
                if kind == "dist":
                    mems[(kind, key)] = pool.run(rank_steps, timeout=args.timeout, case=f"c{key}", n=1, memory=True)
                elif kind == "single" and key == 1:
                    mems[(kind, key)] = single.run(single_steps, timeout=args.timeout, case="single", n=1, threads=1,
                                                   memory=True)[0]
                elif kind == "peer":
                    mems[(kind, key)] = pool.run(rank_peer_steps, timeout=args.timeout, case=f"p{key}", n=1,
                                                 memory=True)
                bar.step(f"{label} memory")
            base_row = None
            if single is not None:
                base_row = {"group": label, **_group_fields(base), "input_bytes": single_inputs}
                for th in _thread_counts(base):
                    rs = [r[0] for r in recs[("single", th)]]
                    base_row[f"t{th}"] = {"time": median([r["time"] for r in rs]),
                                          "fwd": median([r["fwd"] for r in rs]),
                                          "bwd": median([r["bwd"] for r in rs])}
                base_row["mem"] = mems[("single", 1)][0]["mem"]
                baselines.append(base_row)
            for i, c in enumerate(cfgs):
                # each round gave [rank][record]; regroup as rank -> its records over the rounds
                per_rank = [[rnd[r][0] for rnd in recs[("dist", i)]] for r in range(c.nproc)]
                summary = summarize(c, per_rank, mems[("dist", i)])
                check = merge_checks(pool.run(rank_check, timeout=args.timeout, case=f"c{i}"))
                pool.run(rank_release, timeout=args.timeout, case=f"c{i}")
                results.append(_result_row(label, c, prep[i], summary, check, base_row))
            for i in peer_prep:
                it_max = recs[("peer", i)]          # per round: seconds per call (see _sample)
                p0 = peer_prep[i][0]
                row = {"group": label, **_group_fields(base), "config": config_label(cfgs[i]), "peer": "yunchang",
                       "status": "ok", "version": p0["version"], "attn_type": p0["kernel"], "kernel": p0["kernel"],
                       "usp_hal_kernel": p0["usp_hal_kernel"], "same_kernel": p0["same_kernel"],
                       "check_mode": p0["check_mode"], "time": median(it_max), "iter_times": it_max,
                       "usp_hal_iter_times": recs[("plain", i)], "calls_per_sample": calls[i],
                       "mem_per_rank": max(r[0]["mem"] for r in mems[("peer", i)])}
                errs = [p["error"] for p in peer_prep[i] if p["error"] is not None]
                if errs:
                    row["error_max_abs"] = max(e["max_abs"] for e in errs)
                    row["error_worst"] = max(e["worst"] for e in errs)
                    row["correct"] = row["error_worst"] <= 1.0
                row.update(peer_ratios(recs[("plain", i)], it_max))
                if base_row:
                    row["ratio_vs_floor"] = row["time"] / (base_row[f"t{base.threads_per_rank}"]["time"] / base.nproc)
                peer_rows.append(row)
    finally:
        bar.close()
        for p in (pool, single):
            if p is not None:
                p.close()
    return {"results": results, "baselines": baselines, "peers": peer_rows, "notes": notes}


def round_order(entries: list, rnd: int) -> list:
    """The entries of round ``rnd``: rotated by ``rnd`` (a burst of load elsewhere hits every
    entry alike), and each usp-hal bare sample and its peer's (``("plain", i)``, ``("peer",
    i)``, neighbours in ``entries``) swapped every other round, so neither side always runs
    right after the metered entry (whose different buffers leave the allocator and the caches
    in another state) and the other always right after a call like its own."""
    shift = rnd % len(entries)
    out = entries[shift:] + entries[:shift]
    if rnd % 2:
        for j in range(len(out) - 1):
            (k0, i0), (k1, i1) = out[j], out[j + 1]
            if k0 == "plain" and k1 == "peer" and i0 == i1:
                out[j], out[j + 1] = out[j + 1], out[j]
    return out


def peer_ratios(ours: list, peer: list) -> dict:
    """usp-hal against the peer from the per-round times of the same interleaved rounds:
    the ratio of the medians, the median of the per-round ratios (``paired``: each round's
    two samples ran next to each other, so the machine's drift cancels) and that median's
    spread over the rounds (quartiles of the per-round ratios; None under 2 rounds)."""
    t_ours, t_peer = median(ours), median(peer)
    paired = [a / b for a, b in zip(ours, peer) if b > 0]
    q1 = q3 = None
    if len(paired) >= 2:
        q1, _, q3 = quantiles(paired, n=4, method="inclusive")
    return {"usp_hal_time": t_ours, "ratio_peer_vs_usp_hal": t_peer / t_ours,
            "ratio_usp_hal_vs_peer": t_ours / t_peer,
            "ratio_usp_hal_vs_peer_paired": median(paired) if paired else None,
            "ratio_paired_q1": q1, "ratio_paired_q3": q3}


# the peer comparison's samples: each is this many seconds of calls at least (the calls of one
# side back to back after one barrier), so one call's noise does not decide a short call's round
PEER_SAMPLE_S = 0.2
PEER_MAX_CALLS = 64


def _calls_per_sample(pool, timeout: float, i: int):
    """Calls per sample for configuration ``i`` and its peer (one bare call of each, untimed
    for the result and a warm-up besides, decides; the same count on both sides)."""
    ours = pool.run(rank_plain_steps, timeout=timeout, case=f"c{i}", n=1, run=True)
    t = max(_sample(ours), _sample(pool.run(rank_peer_steps, timeout=timeout, case=f"p{i}", n=1, run=True)))
    return max(1, min(PEER_MAX_CALLS, math.ceil(PEER_SAMPLE_S / max(t, 1e-9))))


def _sample(per_rank: list) -> float:
    """One sample of a side of the peer comparison from every rank's records (one record of
    the run's mean call each, or one per call): per record the slowest rank's, averaged."""
    per_call = [max(recs[j]["time"] for recs in per_rank) for j in range(len(per_rank[0]))]
    return sum(per_call) / len(per_call)


def _group_fields(cfg: RunConfig) -> dict:
    return {"seqlen": cfg.seqlen, "mode": "fwd+bwd" if cfg.bwd else "fwd", "causal": cfg.causal}


def _result_row(label, cfg: RunConfig, prep, s, check, base_row) -> dict:
    mc = min_comm_bytes(cfg)
    row = {"group": label, **_group_fields(cfg), "config": config_label(cfg), "ulysses": cfg.ulysses,
           "ring": cfg.ring, "ring_impl": cfg.ring_impl if cfg.ring > 1 else None,
           "rotate": cfg.rotate if cfg.ring > 1 else None, "backend": prep[0]["backend"],
           "time": s["time"], "fwd": s["fwd"], "bwd": s["bwd"], "iter_times": s["iter_times"],
           "per_rank": [{k: r[k] for k in ("rank", "time", "kernel_fwd", "kernel_bwd", "comm", "merge", "layout",
                                           "other", "sent", "bytes", "mem", "work")}
                        for r in s["ranks"]],
           "kernel_balance": s["kernel_balance"], "work_balance": s["work_balance"],
           "sent_per_rank": s["sent_per_rank"],
           "min_sent_per_rank": mc["total"], "sent_vs_min": (s["sent_per_rank"] / mc["total"]) if mc["total"] else None,
           "mem_per_rank": s["mem_per_rank"],
           "input_bytes_per_rank": max(p["input_bytes"] for p in prep),
           "check": {"mode": check["mode"], "ok": check.get("ok", True),
                     "worst": max((e["worst"] for e in check["errors"].values()), default=None),
                     "max_abs": {k: e["max_abs"] for k, e in check["errors"].items()}}}
    comm = max(r["comm"] for r in s["ranks"])
    row["comm_fraction"] = comm / s["time"] if s["time"] else None
    if base_row:
        floor = base_row[f"t{cfg.threads_per_rank}"]["time"] / cfg.nproc
        same = base_row[f"t{cfg.nproc * cfg.threads_per_rank}"]["time"]
        row.update(floor=floor, single_same_threads=same, single_1_thread=base_row["t1"]["time"],
                   ratio_vs_floor=s["time"] / floor, ratio_vs_single_same_threads=s["time"] / same,
                   single_mem=base_row["mem"], mem_vs_single=s["mem_per_rank"] / max(base_row["mem"], 1),
                   single_input_bytes=base_row["input_bytes"],
                   mem_with_inputs_vs_single=(s["mem_per_rank"] + row["input_bytes_per_rank"])
                   / max(base_row["mem"] + base_row["input_bytes"], 1))
    return row


class _NoProgress:
    def __init__(self, total: int):
        pass

    def step(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass
