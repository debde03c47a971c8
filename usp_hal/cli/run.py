"""``usp-hal run``: one USP attention configuration on N ranks, checked and timed.

Spawns N ranks on this machine (or, under ``torchrun``, runs as one of its ranks), builds
random global inputs from a fixed seed identically on every rank, shards them with
:func:`usp_hal.shard` in the chosen layout, runs :class:`usp_hal.LongContextAttention`,
checks the output (and, with ``--bwd``, the gradients) against single-device attention of
the same global inputs, and reports the time per iteration, a per-rank breakdown (kernel,
communication, the rest), the bytes each rank sends against the minimum for the split,
and the peak memory growth per rank.

Reference (``--check``):
    ``fp64``  usp_hal.dispatch.reference.reference_attention in float64;
    ``sdpa``  torch scaled_dot_product_attention in float32 (float64 for fp64 inputs);
    ``auto``  fp64 while B*H*S^2 <= 2^25 (S <= 2048 at B=1, H=8), else sdpa.
Both run on blocks of query rows against the full keys (bounded memory); the row blocks
are divided among the ranks, the partial key/value gradients are summed over them, and
the distributed results are gathered with :func:`usp_hal.unshard` before comparing.

The case itself (configuration, inputs, the functions that run in the ranks, the check)
is :mod:`usp_hal.harness.cases`; this module parses the arguments and prints the report.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..harness import pool
from ..harness.cases import CHECKS, DTYPES, FP8_CHOICES, PROJ_CHOICES, RunConfig, execute, resolve_split, validate
from ..harness.meter import fmt_bytes, fmt_ms
from ..harness.verify import FP8_RMS_BUDGET
from ..parallel.rotation import rotation_names
from ..sequence.positions import layout_names

REFERENCE_TEXT = {
    "fp64": "float64 usp_hal.dispatch.reference.reference_attention",
    "sdpa": "torch scaled_dot_product_attention in float32 (float64 for fp64 inputs)",
}


def format_report(res: dict, launcher: str) -> str:
    cfg = RunConfig(**res["config"])
    s, chk = res["summary"], res["check"]
    from ..dispatch import platform as _platform
    try:
        dist_backend = _platform.dist_backend_string(cfg.device_type)
    except Exception:
        dist_backend = "?"
    mode = ("forward+backward" if cfg.bwd else "forward") + (", causal" if cfg.causal else ", not causal")
    lines = [
        f"usp-hal run: {cfg.nproc} rank(s) = ulysses {cfg.ulysses} x ring {cfg.ring} on {cfg.device_type} "
        f"({dist_backend}), {cfg.threads_per_rank} thread(s) per rank, {launcher}",
        f"  inputs     B={cfg.batch} S={cfg.seqlen} H={cfg.heads} Hkv={cfg.kv_heads} D={cfg.head_dim} {cfg.dtype}, "
        f"{mode}, seed {cfg.seed}",
        f"  layout     {cfg.ring_impl}, rotation {cfg.rotate}" + "".join(
            f", {k} {v}" for k, v in (("fp8", cfg.fp8), ("ring fp8", cfg.ring_fp8), ("pipeline", cfg.pipeline),
                                      ("low memory", {-1: "most groups"}.get(cfg.low_memory, cfg.low_memory)),
                                      ("projections", cfg.proj)) if v not in ("none", False, 0)),
        f"  backend    {res['backend']} (attn-type {cfg.attn_type})",
    ]
    docs = cfg.documents()
    if docs is not None:
        lens = [b - a for a, b in zip(docs, docs[1:])]
        shown = ",".join(map(str, docs)) if len(docs) <= 12 else ",".join(map(str, docs[:12])) + ",..."
        lines.append(f"  documents  {len(lens)} packed (cu_seqlens {shown}; lengths {min(lens)}..{max(lens)}), "
                     "attention within each document")
    if chk["mode"] == "none":
        lines.append("check: skipped (--check none)")
    else:
        atol, rtol = chk["tolerance"]
        lines.append(f"check against {REFERENCE_TEXT[chk['mode']]} on the same global inputs "
                     f"(query-row blocks split over the ranks)")
        if chk.get("lossy"):
            lines.append(f"  tolerance  fp8 wire format: RMS(err) <= {FP8_RMS_BUDGET:g} * RMS(ref) (lossy; the "
                         "gradient is the straight-through gradient of the quantised forward)")
        else:
            lines.append(f"  tolerance  |err| <= {atol:g} + {rtol:g} * |ref|")
        lines.append("  tensor  max abs error  rms err/rms ref  worst / tolerance  result")
        for name, e in chk["errors"].items():
            mabs = "nan" if e["max_abs"] is None else f"{e['max_abs']:.2e}"
            rms = "-" if e.get("rms_rel") is None else f"{e['rms_rel']:.2e}"
            lines.append(f"  {name:<6}  {mabs:<13}  {rms:<15}  {e['worst']:<17.3g}  "
                         f"{'pass' if e['worst'] <= 1 else 'FAIL'}")
    lines.append(f"time per iteration: {fmt_ms(s['time'])} ms (median over {cfg.iters} iterations of the max "
                 f"over ranks, after {cfg.warmup} warm-up)"
                 + (f"; forward {fmt_ms(s['fwd'])} ms, backward {fmt_ms(s['bwd'])} ms" if cfg.bwd else ""))
    lines.append("per rank (medians per iteration): kernel = inside the backend; comm = in collectives and "
                 "their waits; merge = the ring's own work (merges, block slices); "
                 "layout = Ulysses re-layout around the all-to-all; "
                 "other = the rest (buffers, copies, gradient sums, Python)")
    lines.append("  rank  total ms  kernel fwd  kernel bwd  comm   merge  layout  other  sent       peak memory")
    for r in s["ranks"]:
        lines.append(f"  {r['rank']:<4}  {fmt_ms(r['time']):<8}  {fmt_ms(r['kernel_fwd']):<10}  "
                     f"{fmt_ms(r['kernel_bwd']):<10}  {fmt_ms(r['comm']):<5}  {fmt_ms(r['merge']):<5}  "
                     f"{fmt_ms(r['layout']):<6}  {fmt_ms(r['other']):<5}  {fmt_bytes(r['sent']):<9}  "
                     f"{fmt_bytes(r['mem'])}")
    if s["kernel_balance"]:
        lines.append(f"  balance, max/min over ranks: kernel time {s['kernel_balance']:.3f}, kernel work (query-key "
                     f"pairs scored) {s['work_balance']:.3f}")
    mc = res["min_comm"]["total"]
    ratio = f" (x{s['sent_per_rank'] / mc:.2f})" if mc else ""
    r0 = s["ranks"][0]
    detail = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in r0["bytes"].items() if v)
    lines.append(f"communication per rank and iteration: {fmt_bytes(s['sent_per_rank'])} sent"
                 + (f" (rank 0: {detail})" if detail else "") + f"; minimum for this split {fmt_bytes(mc)}{ratio}; "
                 f"plus {fmt_bytes(r0['metadata_bytes'])} of call metadata")
    lines.append(f"peak memory per rank above its inputs: {fmt_bytes(s['mem_per_rank'])} during one extra, untimed "
                 f"iteration ({res['mem_method']}); the rank's inputs: {fmt_bytes(res['input_bytes_per_rank'])}")
    one = s.get("mem_one_process")
    if one:
        lines.append(f"one process holding the whole sequence (same kernel, measured the same way): {fmt_bytes(one)} "
                     f"above its inputs; per rank here: x{s['mem_per_rank'] / one:.2f} of that")
    if chk["mode"] != "none":
        lines.append("result: " + ("PASS" if chk["ok"] else "FAIL (error above tolerance)"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def add_common_arguments(p, *, sweep: bool = False) -> None:
    """Shape and run options shared with ``usp-hal bench``."""
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads; GQA if fewer)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--attn-type", default="auto", help="backend name or 'auto' (default auto)")
    p.add_argument("--dtype", default="fp32", choices=DTYPES, help="input dtype (default fp32)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random global inputs (default 0)")
    p.add_argument("--device", default=None,
                   help="device type (default: the accelerator if present, else cpu; USP_HAL_DEVICE also works)")



def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="run one USP attention configuration on N ranks: check it and time it",
        description=__doc__.split("\n\n")[0] + " Exit status: 0 pass, 1 check failed or a rank failed, "
                    "2 bad arguments.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default: ulysses x ring, else 2)")
    p.add_argument("--ulysses", type=int, default=None, help="Ulysses degree (default: nproc / ring, else 1)")
    p.add_argument("--ring", type=int, default=None, help="ring degree (default: nproc / ulysses)")
    p.add_argument("--seqlen", type=int, default=1024, help="global sequence length S (default 1024)")
    add_common_arguments(p)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask (default on)")
    p.add_argument("--bwd", action=argparse.BooleanOptionalAction, default=True,
                   help="also run and check the backward (default on)")
    p.add_argument("--ring-impl", default="zigzag", choices=layout_names(), help="sequence layout (default zigzag)")
    p.add_argument("--rotate", default="p2p", choices=rotation_names(), help="ring rotation (default p2p)")
    p.add_argument("--fp8", default="none", choices=FP8_CHOICES,
                   help="Ulysses wire format: none, qvo (q, v and the output in fp8), qkvo (k too)")
    p.add_argument("--ring-fp8", action="store_true", help="the ring's V blocks (K too with --fp8 qkvo) in fp8")
    p.add_argument("--pipeline", type=int, default=0, metavar="N",
                   help="AsyncLongContextAttention with N head groups (0: the synchronous module)")
    p.add_argument("--low-memory", type=int, nargs="?", const=-1, default=0, metavar="N",
                   help="LongContextAttention(low_memory=...): head groups one after another, the backward "
                        "re-exchanging each group from the sequence layout (N groups; without N as many as the "
                        "heads allow)")
    p.add_argument("--proj", default="none", choices=PROJ_CHOICES,
                   help="also project q/k/v from hidden states in the timed call: sync, or overlap (each projection "
                        "overlapped with the previous all-to-all); only the output is checked")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--cu-seqlens", default="", metavar="0,L1,...,S",
                      help="packed documents: the global document boundaries (attention stays inside each)")
    docs.add_argument("--docs", type=int, default=None, metavar="N",
                      help="packed documents: N documents of equal length (shortcut for --cu-seqlens)")
    p.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up iterations (default 1)")
    p.add_argument("--check", default="auto", choices=CHECKS,
                   help="reference for the check: auto (fp64 for small S, else sdpa), fp64, sdpa, none")
    p.add_argument("--timeout", type=float, default=900.0, help="limit for the whole run in seconds (default 900)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON ('-' = stdout)")
    p.add_argument("--quiet", action="store_true", help="no header and progress lines on stderr")
    p.set_defaults(func=run)


def device_type_from(args) -> str:
    from ..dispatch import platform as _platform
    if args.device:
        if args.device not in _platform.DEVICE_TYPES:
            raise ValueError(f"--device {args.device!r}; valid: {', '.join(_platform.DEVICE_TYPES)}")
        return args.device
    return _platform.default_device_type()


def check_common_arguments(args) -> None:
    """Numbers that a default would otherwise hide (``--kv-heads 0`` read as "no GQA") or that
    leave nothing to run (``--timeout 0``): refused with the flag named (ValueError)."""
    if args.kv_heads is not None and args.kv_heads < 1:
        raise ValueError(f"--kv-heads must be >= 1, got {args.kv_heads} (leave it out for --heads: no GQA)")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {timeout:g}")


def check_output_path(path, flag: str = "--json") -> None:
    """Refuse an output path that cannot be written before anything runs (ValueError); '-' and
    None pass.  Nothing is created here."""
    import os
    if path in (None, "-"):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder; give a file path (or '-' for stdout)")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it or give another path")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable; give another path (or '-' for stdout)")


def config_from_args(args) -> RunConfig:
    check_common_arguments(args)
    check_output_path(args.json)
    nproc, U, R = resolve_split(args.nproc, args.ulysses, args.ring)
    if pool.in_torchrun():
        world = int(__import__("os").environ["WORLD_SIZE"])
        if args.nproc is None and args.ulysses is None and args.ring is None:
            nproc, U, R = resolve_split(world, None, None)
        elif nproc != world:
            raise ValueError(f"under torchrun the world size is {world} (torchrun --nproc_per_node x --nnodes), but "
                             f"the options ask for {nproc} ranks; drop --nproc, make --ulysses x --ring = {world}, or "
                             f"start torchrun with --nproc_per_node={nproc}")
    cfg = RunConfig(nproc=nproc, ulysses=U, ring=R, seqlen=args.seqlen, batch=args.batch, heads=args.heads,
                    kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim, causal=args.causal,
                    bwd=args.bwd, attn_type=args.attn_type, ring_impl=args.ring_impl, rotate=args.rotate,
                    dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                    threads_per_rank=args.threads_per_rank, seed=args.seed, check=args.check,
                    device_type=device_type_from(args), fp8=args.fp8, ring_fp8=args.ring_fp8,
                    pipeline=args.pipeline, low_memory=args.low_memory, proj=args.proj,
                    cu_seqlens=_cu_seqlens_arg(args))
    validate(cfg)
    return cfg


def _cu_seqlens_arg(args) -> str:
    """--cu-seqlens as given, or the boundaries of --docs N equal documents ("" = one sequence)."""
    if getattr(args, "docs", None) is not None:
        if args.docs < 1:
            raise ValueError(f"--docs must be >= 1, got {args.docs}")
        from ..sequence.positions import equal_documents
        return ",".join(map(str, equal_documents(args.seqlen, args.docs)))
    return (getattr(args, "cu_seqlens", "") or "").replace(" ", "")


class Heartbeat:
    """A header on stderr when the run starts, then one progress line every ``every`` seconds
    until it ends (the report comes on stdout), so that a long run never looks hung."""

    def __init__(self, cfg: RunConfig, timeout: float, enabled: bool = True, every: float = 5.0):
        import threading
        import time
        self.enabled, self.every, self.t0 = enabled, every, time.monotonic()
        self.done = threading.Event()
        if not enabled:
            return
        mode = ("forward+backward" if cfg.bwd else "forward") + (", causal" if cfg.causal else ", not causal")
        print(f"usp-hal run: {cfg.nproc} rank(s) = ulysses {cfg.ulysses} x ring {cfg.ring}, B={cfg.batch} "
              f"S={cfg.seqlen} H={cfg.heads} D={cfg.head_dim} {cfg.dtype}, {mode}, {cfg.ring_impl}; "
              f"{cfg.warmup} warm-up + {cfg.iters} timed iterations, then the check ({cfg.check}); "
              f"limit {timeout:g} s", file=sys.stderr, flush=True)
        self.thread = threading.Thread(target=self._loop, name="usp-hal-run-progress", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import time
        while not self.done.wait(self.every):
            print(f"usp-hal run: running, {time.monotonic() - self.t0:.0f} s elapsed", file=sys.stderr, flush=True)

    def stop(self) -> None:
        import time
        self.done.set()
        if self.enabled:
            self.thread.join(timeout=1.0)
            print(f"usp-hal run: finished in {time.monotonic() - self.t0:.1f} s", file=sys.stderr, flush=True)


def run(args) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"usp-hal run: {exc}", file=sys.stderr)
        return 2
    torchrun = pool.in_torchrun()
    executor: Any = None
    finished = False
    chatty = not args.quiet and (not torchrun or __import__("os").environ.get("RANK", "0") == "0")
    beat = Heartbeat(cfg, args.timeout, enabled=chatty)
    try:
        if torchrun:
            executor = pool.TorchrunExecutor(cfg.threads_per_rank, cfg.device_type)
            launcher = f"torchrun rank {executor.rank} of {executor.world}"
        else:
            executor = pool.RankPool(cfg.nproc, threads=cfg.threads_per_rank, device_type=cfg.device_type,
                                        start_timeout=min(args.timeout, 300.0))
            launcher = "spawned on 127.0.0.1"
        res = execute(cfg, executor, args.timeout)
        finished = True
    except pool.LaunchError as exc:
        print(f"usp-hal run: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not torchrun:
            raise
        # under torchrun a failing rank exits; torchrun then stops the others
        rank = executor.rank if executor is not None else __import__("os").environ.get("RANK")
        print(f"usp-hal run (rank {rank}): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        beat.stop()
        if executor is not None:
            if torchrun:   # every rank finished: wait for all, then tear the groups down together
                executor.close(ok=finished)
            else:
                executor.close()
    rc = 0 if res["check"].get("ok", True) else 1
    if torchrun and executor.rank != 0:
        return _leave(rc)
    print(format_report(res, launcher))
    if args.json:
        text = json.dumps(res, indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            try:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
            except OSError as exc:
                print(f"usp-hal run: --json {args.json}: {exc.strerror or exc} (the run itself finished; its "
                      "report is above)", file=sys.stderr)
                return _leave(1) if torchrun else 1
    return _leave(rc) if torchrun else rc


def _leave(rc: int) -> int:
    """A torchrun rank whose groups are torn down: end the process here, output flushed.  The
    interpreter's own teardown would destroy what is left of the communication library's
    threads in no set order, and now and then that aborts the process ("terminate called
    without an active exception", exit -6) after the run has passed.  Outside a real torchrun
    launch (no ``TORCHELASTIC_RUN_ID``: e.g. a test calling this in-process) it just returns."""
    import os
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return rc
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
