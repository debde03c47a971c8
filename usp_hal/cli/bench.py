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
  importable (absent peers are skipped with a note), running the kernel usp-hal runs
  wherever yunchang can take it (on CPU through its ``attn_processor`` hook, which only its
  basic ring passes on; on GPUs FA/FA3 or the same aten op), checked against the same
  reference and timed in the same rounds; each row names the kernel each side ran.

Each configuration is also checked against the reference (as in ``usp-hal run``), and
reports a per-rank breakdown (time inside the backend's kernels, in communication, the
rest), the bytes each rank sends against the minimum for its split (formulas in
``usp_hal.harness.cases.min_comm_bytes`` and docs/performance.md), and the peak memory growth
per rank next to the single process's.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform as _pyplatform
import sys
import time

from ..harness import LaunchError, fmt_bytes, fmt_ms, in_torchrun
from ..harness.cases import CHECKS
from ..harness.sweep import CAUSAL_CHOICES, build_groups, run_sweep
from .run import add_common_arguments, check_common_arguments, check_output_path, device_type_from


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
        lines += ["", "peers (forward, in the same interleaved rounds, each next to usp-hal's own calls of the "
                      "configuration made with no meter at work; a sample = calls x the mean call; usp/peer = median "
                      "usp-hal time / median peer time, paired = median over rounds of the two samples' ratio, "
                      "q1-q3 = its quartiles over the rounds; error = worst |err| / tolerance against the same "
                      "reference, <= 1 passes)"]
        ph = ["S", "mask", "config", "peer", "peer kernel", "same kernel", "calls", "ms", "usp/peer", "paired",
              "q1-q3", "x floor", "mem/rank", "check", "error", "status"]
        prow = []
        for p in rep["peers"]:
            if p["status"] != "ok":
                prow.append([p.get("seqlen", "-"), "causal" if p.get("causal") else "full", p["config"], p["peer"],
                             "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", "-", f"{p['status']}: {p['note'][:90]}"])
                continue
            err = p.get("error_worst")
            prow.append([p["seqlen"], "causal" if p["causal"] else "full", p["config"], f"{p['peer']} {p['version']}",
                         p["kernel"], "yes" if p.get("same_kernel") else "NO", p.get("calls_per_sample", "-"),
                         fmt_ms(p["time"]), _x(p.get("ratio_usp_hal_vs_peer")),
                         _x(p.get("ratio_usp_hal_vs_peer_paired")),
                         "-" if p.get("ratio_paired_q1") is None else
                         f"{p['ratio_paired_q1']:.2f}-{p['ratio_paired_q3']:.2f}",
                         _x(p.get("ratio_vs_floor")), fmt_bytes(p["mem_per_rank"]), p.get("check_mode") or "-",
                         "-" if err is None else f"{err:.3g}",
                         "ok" if p.get("correct", True) else "WRONG RESULT"])
        lines.append(_table(ph, prow))
        kernels = sorted({f"usp-hal ran {p['usp_hal_kernel']}" for p in rep["peers"] if p.get("usp_hal_kernel")})
        lines += [f"peer kernels: {k}; the peer column says what yunchang ran" for k in kernels]
    for n in rep["notes"]:
        lines.append(f"note: {n}")
    failed = [r for r in rep["results"] if not r["check"]["ok"]]
    checked = [r for r in rep["results"] if r["check"]["mode"] != "none"]
    lines.append("")
    lines.append("checks: " + ("skipped (--check none)" if not checked else "all passed" if not failed else
                               f"{len(failed)} FAILED: " + ", ".join(f"S={r['seqlen']} {r['config']}" for r in failed)))
    wrong = wrong_peers(rep)
    if wrong:
        lines.append(f"peer checks: {len(wrong)} WRONG (the comparison is void for them): " +
                     ", ".join(f"S={p['seqlen']} {p['config']}" for p in wrong))
    return "\n".join(lines)


def wrong_peers(rep: dict) -> list:
    """Peer rows whose output failed the reference check."""
    return [p for p in rep["peers"] if p["status"] == "ok" and not p.get("correct", True)]


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
    p.add_argument("--peers", action="store_true",
                   help="also time yunchang on the same splits (forward) with usp-hal's kernel, when importable")
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
        check_common_arguments(args)
        check_output_path(args.json)
        device_type = device_type_from(args)
        groups = build_groups(args, device_type)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ValueError(f"--plot {args.plot}: matplotlib is not installed (pip install matplotlib, or "
                             "pip install -e '.[bench]'); drop --plot to run without it")
    except ValueError as exc:
        print(f"usp-hal bench: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        out = run_sweep(args, groups, device_type, lambda total: Progress(total, enabled=not args.quiet))
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
    plot_failed = False
    if args.plot:
        note = write_plot(rep, args.plot)
        plot_failed = not note.startswith("plot written")
        print(note, file=sys.stderr if plot_failed else sys.stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
            f.write("\n")
        print(f"results written to {args.json}")
    return 0 if all(r["check"]["ok"] for r in rep["results"]) and not wrong_peers(rep) and not plot_failed else 1
