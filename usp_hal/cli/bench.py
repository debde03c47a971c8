"""``usp-hal bench``: a sweep of USP configurations, each measured side by side with
single-process attention on the same machine in the same run.

For every group (sequence length x forward / forward+backward x causal) the sweep runs,
in interleaved rounds (the order rotates each round, so a burst of load elsewhere hits
every entry alike):

* each distributed configuration (split ulysses x ring, ring layout, rotation) on the
  ranks - time per iteration = the max over ranks, then the median over rounds;
* the same backend called directly on the whole sequence in one process, with one
  thread, with ``--threads-per-rank`` threads when that differs, and with all the
  threads the ranks use together.  The per-rank compute floor is the single-process time
  at ``--threads-per-rank`` threads divided by the number of ranks;
* with ``--peers``, yunchang's LongContextAttention on the same split when it is
  importable (absent peers are skipped with a note).

Each configuration is also checked against the reference (as in ``usp-hal run``), and
reports a per-rank breakdown (time inside the backend's kernels, in communication, the
rest), the bytes each rank sends against the minimum for its split (formulas in
``usp_hal.harness.cases.min_comm_bytes`` and docs/performance.md), and the peak memory growth
per rank next to the single process's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform as _pyplatform
import sys
import time
from dataclasses import asdict, replace
from statistics import median

from ..harness import LaunchError, RankPool, fmt_bytes, fmt_ms, in_torchrun
from ..harness.cases import (CHECKS, FP8_CHOICES, LAYOUTS, PROJ_CHOICES, ROTATIONS, RunConfig, merge_checks,
                             min_comm_bytes, peer_available, rank_check, rank_clear, rank_peer_prepare,
                             rank_peer_steps, rank_prepare, rank_release, rank_steps, single_prepare, single_steps,
                             summarize, validate)
from .run import add_common_arguments, device_type_from

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


# ----------------------------------------------------------------------------- progress
class Progress:
    """A tqdm bar on a terminal when tqdm is installed, else one plain line per step on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if sys.stderr.isatty():      # a log file gets plain lines instead of carriage returns
            self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)

    def step(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description_str(text[:60])
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------- the sweep
def _thread_counts(cfg: RunConfig) -> list:
    return sorted({1, cfg.threads_per_rank, cfg.nproc * cfg.threads_per_rank})


def run_sweep(args, groups: list, device_type: str) -> dict:
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
                 (len([x for x in c if not x.bwd]) if peers else 0) for _, b, c in groups]
    progress = Progress(sum(n * (rounds + 1) for n in per_group), enabled=not args.quiet)
    results, baselines, peer_rows = [], [], []
    pool = single = None
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
            peer_prep = {}
            if peers and not base.bwd:
                for i, c in enumerate(cfgs):
                    got = pool.run(rank_peer_prepare, timeout=args.timeout, cfg=asdict(c), case=f"p{i}")
                    failed = [g["failed"] for g in got if g.get("failed")]
                    if failed:
                        peer_rows.append({"group": label, **_group_fields(base), "config": config_label(c),
                                          "peer": "yunchang", "status": "failed", "note": failed[0]})
                        continue
                    peer_prep[i] = got
                    entries.append(("peer", i))
            elif peers and base.bwd:
                notes.append(f"{label}: peers timed forward only (yunchang has no backward on cpu)"
                             if device_type == "cpu" else f"{label}: peers timed forward only")
            recs = {e: [] for e in entries}
            for rnd in range(rounds):
                shift = rnd % len(entries)
                for kind, key in entries[shift:] + entries[:shift]:
                    if kind == "dist":
                        out = pool.run(rank_steps, timeout=args.timeout, case=f"c{key}", n=1)
                        text = config_label(cfgs[key])
                    elif kind == "single":
                        out = single.run(single_steps, timeout=args.timeout, case="single", n=1, threads=key)[0]
                        text = f"single process {key} thread(s)"
                    else:
                        out = pool.run(rank_peer_steps, timeout=args.timeout, case=f"p{key}", n=1)
                        text = f"yunchang {config_label(cfgs[key])}"
                    if rnd >= args.warmup:
                        recs[(kind, key)].append(out)
                    progress.step(f"{label} {text}")
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
                progress.step(f"{label} memory")
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
                rs = [[per[0] for per in rnd] for rnd in recs[("peer", i)]]     # round -> rank records
                it_max = [max(r["time"] for r in per) for per in rs]
                row = {"group": label, **_group_fields(base), "config": config_label(cfgs[i]), "peer": "yunchang",
                       "status": "ok", "version": peer_prep[i][0]["version"],
                       "attn_type": peer_prep[i][0]["attn_type"], "time": median(it_max),
                       "mem_per_rank": max(r[0]["mem"] for r in mems[("peer", i)])}
                errs = [p["error"] for p in peer_prep[i] if p["error"] is not None]
                if errs:
                    row["error_max_abs"] = max(e["max_abs"] for e in errs)
                    row["error_worst"] = max(e["worst"] for e in errs)
                    row["correct"] = row["error_worst"] <= 1.0
                ours = next((r for r in results if r["group"] == label and r["config"] == row["config"]), None)
                if ours:
                    row["usp_hal_time"] = ours["time"]
                    row["ratio_peer_vs_usp_hal"] = row["time"] / ours["time"]
                if base_row:
                    row["ratio_vs_floor"] = row["time"] / (base_row[f"t{base.threads_per_rank}"]["time"] / base.nproc)
                peer_rows.append(row)
    finally:
        progress.close()
        for p in (pool, single):
            if p is not None:
                p.close()
    return {"results": results, "baselines": baselines, "peers": peer_rows, "notes": notes}


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


# ----------------------------------------------------------------------------- output
def _table(headers: list, rows: list) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    out = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths)).rstrip(),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(out)


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_results(rep: dict) -> str:
    meta = rep["meta"]
    lines = [f"usp-hal bench: {meta['nproc']} ranks x {meta['threads_per_rank']} thread(s) on {meta['device_type']}, "
             f"B={meta['batch']} H={meta['heads']} Hkv={meta['kv_heads']} D={meta['head_dim']} {meta['dtype']}, "
             f"median of {meta['iters']} interleaved rounds after {meta['warmup']} warm-up",
             "time = max over ranks per iteration; floor = single process at threads-per-rank threads / ranks; "
             "single = single process with all the ranks' threads",
             "balance = max/min over ranks of the time inside the backend; work bal = the same for the query-key "
             "pairs the kernels scored; comm = share of the iteration in communication calls and waits "
             "(slowest rank)",
             "mem = peak of live tensor memory above the inputs during one iteration; x single+in = (mem + the "
             "rank's inputs) / (single-process mem + its inputs)", ""]
    headers = ["S", "mode", "mask", "config", "ms", "floor ms", "x floor", "single ms", "x single", "balance",
               "work bal", "comm", "sent/rank", "x min", "mem/rank", "single mem", "x single+in", "check"]
    rows = []
    for r in rep["results"]:
        rows.append([r["seqlen"], r["mode"], "causal" if r["causal"] else "full", r["config"], fmt_ms(r["time"]),
                     fmt_ms(r.get("floor")), _x(r.get("ratio_vs_floor")), fmt_ms(r.get("single_same_threads")),
                     _x(r.get("ratio_vs_single_same_threads")), _x(r["kernel_balance"]), _x(r["work_balance"]),
                     "-" if r["comm_fraction"] is None else f"{100 * r['comm_fraction']:.0f}%",
                     fmt_bytes(r["sent_per_rank"]), _x(r["sent_vs_min"]), fmt_bytes(r["mem_per_rank"]),
                     fmt_bytes(r.get("single_mem")), _x(r.get("mem_with_inputs_vs_single")),
                     "-" if r["check"]["mode"] == "none" else ("pass" if r["check"]["ok"] else "FAIL")])
    lines.append(_table(headers, rows))
    if rep["baselines"]:
        lines += ["", "single process (same backend, whole sequence)"]
        bh = ["S", "mode", "mask"] + [f"{k[1:]} thread(s) ms" for k in rep["baselines"][0] if k.startswith("t")] + \
            ["peak mem"]
        brows = []
        for b in rep["baselines"]:
            ts = [k for k in b if k.startswith("t")]
            brows.append([b["seqlen"], b["mode"], "causal" if b["causal"] else "full"] +
                         [fmt_ms(b[k]["time"]) for k in ts] + [fmt_bytes(b["mem"])])
        lines.append(_table(bh, brows))
    lines += ["", "per-rank breakdown (ms per iteration: total / kernel fwd / kernel bwd / comm / merge / layout / "
                  "other)"]
    for r in rep["results"]:
        parts = "  ".join(f"r{p['rank']} {fmt_ms(p['time'])}/{fmt_ms(p['kernel_fwd'])}/{fmt_ms(p['kernel_bwd'])}/"
                          f"{fmt_ms(p['comm'])}/{fmt_ms(p['merge'])}/{fmt_ms(p['layout'])}/{fmt_ms(p['other'])}"
                          for p in r["per_rank"])
        lines.append(f"  S={r['seqlen']} {r['mode']} {'causal' if r['causal'] else 'full'} {r['config']}: {parts}")
    if rep["peers"]:
        lines += ["", "peers (forward; error = worst |err| / tolerance against the same reference, <= 1 passes)"]
        ph = ["S", "mask", "config", "peer", "kernel", "ms", "x usp-hal", "x floor", "mem/rank", "error", "status"]
        prow = []
        for p in rep["peers"]:
            if p["status"] != "ok":
                prow.append(["-", "-", p["config"], p["peer"], "-", "-", "-", "-", "-", "-", p["note"][:60]])
                continue
            err = p.get("error_worst")
            prow.append([p["seqlen"], "causal" if p["causal"] else "full", p["config"], f"{p['peer']} {p['version']}",
                         p["attn_type"], fmt_ms(p["time"]), _x(p.get("ratio_peer_vs_usp_hal")),
                         _x(p.get("ratio_vs_floor")), fmt_bytes(p["mem_per_rank"]),
                         "-" if err is None else f"{err:.3g}",
                         "ok" if p.get("correct", True) else "WRONG RESULT"])
        lines.append(_table(ph, prow))
    for n in rep["notes"]:
        lines.append(f"note: {n}")
    failed = [r for r in rep["results"] if not r["check"]["ok"]]
    checked = [r for r in rep["results"] if r["check"]["mode"] != "none"]
    lines.append("")
    lines.append("checks: " + ("skipped (--check none)" if not checked else "all passed" if not failed else
                               f"{len(failed)} FAILED: " + ", ".join(f"S={r['seqlen']} {r['config']}" for r in failed)))
    return "\n".join(lines)


def write_plot(rep: dict, path: str) -> str:
    """Time vs S and per-rank memory vs S, one row per (mode, mask).  Returns a note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    keys = []
    for r in rep["results"]:
        k = (r["mode"], r["causal"])
        if k not in keys:
            keys.append(k)
    fig, axes = plt.subplots(len(keys), 2, figsize=(12, 4.2 * len(keys)), squeeze=False)
    for row, (mode, causal) in enumerate(keys):
        mask = "causal" if causal else "full"
        sub = [r for r in rep["results"] if r["mode"] == mode and r["causal"] == causal]
        axt, axm = axes[row]
        for cfg in dict.fromkeys(r["config"] for r in sub):
            pts = sorted((r["seqlen"], r["time"], r["mem_per_rank"] + r["input_bytes_per_rank"])
                         for r in sub if r["config"] == cfg)
            xs = [p[0] for p in pts]
            axt.plot(xs, [p[1] * 1e3 for p in pts], marker="o", label=cfg)
            axm.plot(xs, [p[2] / 2 ** 20 for p in pts], marker="o", label=cfg)
        base = sorted((r["seqlen"], r.get("floor"), r.get("single_same_threads"),
                       (r.get("single_mem") or 0) + (r.get("single_input_bytes") or 0))
                      for r in sub if r.get("floor"))
        base = list({b[0]: b for b in base}.values())
        if base:
            xs = [b[0] for b in base]
            axt.plot(xs, [b[1] * 1e3 for b in base], "k--", label="floor: single process / ranks")
            axt.plot(xs, [b[2] * 1e3 for b in base], "k:", label="single process, all threads")
            axm.plot(xs, [b[3] / 2 ** 20 for b in base], "k:", label="single process")
        for ax, what in ((axt, "time per iteration (ms)"),
                         (axm, "inputs + peak tensor memory, per rank (MiB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length S")
            ax.set_ylabel(what)
            ax.set_title(f"{mode}, {mask}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    meta = rep["meta"]
    fig.suptitle(f"usp-hal bench: {meta['nproc']} ranks x {meta['threads_per_rank']} thread(s), {meta['device_type']}, "
                 f"B={meta['batch']} H={meta['heads']} D={meta['head_dim']} {meta['dtype']}")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


# ----------------------------------------------------------------------------- CLI
def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="sweep splits, layouts, rotations and lengths against single-process attention",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--splits", default=None,
                   help="comma-separated ULYSSESxRING, e.g. 2x1,1x2 (default: every split of --nproc)")
    p.add_argument("--ring-impls", default="basic,zigzag,stripe", help="layouts for ring splits (default all three)")
    p.add_argument("--rotations", default="p2p", help="ring rotations: p2p, allgather or both (default p2p)")
    p.add_argument("--seqlens", default="1024,2048,4096", help="sequence lengths (default 1024,2048,4096)")
    p.add_argument("--modes", default="fwd,fwdbwd", help="fwd, fwdbwd or both (default both)")
    p.add_argument("--causal", default="on", choices=tuple(CAUSAL_CHOICES),
                   help="causal mask: on, off, both (default on)")
    p.add_argument("--fp8", default="none",
                   help="Ulysses wire formats to sweep: none, qvo, qkvo, comma-separated (default none)")
    p.add_argument("--ring-fp8", action="store_true", help="with --fp8 other than none: the ring's blocks in fp8 too")
    p.add_argument("--pipelines", default="0",
                   help="head groups of AsyncLongContextAttention to sweep, e.g. 0,2 (0: synchronous; default 0)")
    p.add_argument("--proj", default="none",
                   help="q/k/v projections in the timed call: none, sync, overlap, comma-separated (default none)")
    add_common_arguments(p)
    p.add_argument("--iters", type=int, default=3, help="measured rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds (default 1)")
    p.add_argument("--check", default="auto", choices=CHECKS, help="reference for the checks (as in run; default auto)")
    p.add_argument("--no-baseline", action="store_true", help="skip the single-process baselines")
    p.add_argument("--peers", action="store_true", help="also time yunchang on the same splits when importable")
    p.add_argument("--json", metavar="PATH", default=None, help="write all results as JSON")
    p.add_argument("--plot", metavar="PATH", default=None, help="write time and memory vs S to an image (matplotlib)")
    p.add_argument("--timeout", type=float, default=900.0, help="limit per step in seconds (default 900)")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)


def run(args) -> int:
    if in_torchrun():
        print("usp-hal bench: spawns its own ranks and single-process baselines; run it without torchrun "
              "(use `usp-hal run` under torchrun)", file=sys.stderr)
        return 2
    try:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
        device_type = device_type_from(args)
        groups = build_groups(args, device_type)
    except ValueError as exc:
        print(f"usp-hal bench: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        out = run_sweep(args, groups, device_type)
    except LaunchError as exc:
        print(f"usp-hal bench: {exc}", file=sys.stderr)
        return 1
    import torch

    from .. import __version__
    rep = {"meta": {"usp_hal": __version__, "torch": torch.__version__, "device_type": device_type,
                    "machine": f"{_pyplatform.machine()} {os.cpu_count()} logical cpus",
                    "nproc": args.nproc, "threads_per_rank": args.threads_per_rank, "batch": args.batch,
                    "heads": args.heads, "kv_heads": args.kv_heads or args.heads, "head_dim": args.head_dim,
                    "dtype": args.dtype, "iters": args.iters, "warmup": args.warmup,
                    "command": "usp-hal " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else None,
                    "wall_s": round(time.monotonic() - t0, 1),
                    "memory_method": "peak of live tensor allocations above the start of one extra, untimed "
                                     "iteration (torch profiler memory events)" if device_type == "cpu"
                    else "peak allocated bytes above the start of one extra, untimed iteration"},
           **out}
    print(format_results(rep))
    if args.plot:
        print(write_plot(rep, args.plot))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
            f.write("\n")
        print(f"results written to {args.json}")
    return 0 if all(r["check"]["ok"] for r in rep["results"]) else 1
