"""``usp-hal plan``: rank every Ulysses x Ring split, layout, rotation and wire format by the
predicted time per attention call on a described (or measured) machine.

The machine comes from a profile (``--profile``: a built-in name or a JSON path), explicit
link numbers (``--intra-bw``/``--inter-bw``/``--latency`` on top of a profile's kernel
numbers), or ``--calibrate``: spawn ranks here (like ``usp-hal run``), measure the kernel
and the collectives in well under a minute, write the profile (``--save``) and plan with it.
The model is described in usp_hal/planning/planner.py and docs/planning.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from ..harness import memprobe
from ..harness.calibrate import calibrate
from ..harness.pool import LaunchError, in_torchrun
from ..planning import planner
from ..planning.schedule import ScheduleError

DTYPES = tuple(planner.DTYPE_BYTES)


# ----------------------------------------------------------------------------- CLI
def _with_unit(text: str, units, hint: str) -> float:
    """A number, optionally followed by one of ``units`` ((suffix, multiplier), longest first)."""
    t = text.strip().replace(" ", "")
    m = 1.0
    for suf, mul in units:
        if t.endswith(suf):
            t, m = t[:-len(suf)], mul
            break
    try:
        return float(t) * m
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give {hint}") from None


def _bytes_per_s(text: str) -> float:
    """'25e9' or '25GB/s' (bytes) or '200Gb/s' (bits) -> bytes per second."""
    return _with_unit(text, (("GB/s", 1e9), ("MB/s", 1e6), ("Gb/s", 1e9 / 8), ("Mb/s", 1e6 / 8)),
                      "bytes/s (450e9), or 450GB/s, or 400Gb/s")


def _bytes(text: str) -> float:
    """'24GiB', '512MiB', '80GB' or a number of bytes -> bytes."""
    return _with_unit(text, (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)),
                      "bytes (24e9), or 24GiB, 512MiB, 80GB")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="rank Ulysses x Ring splits, layouts, rotations and wire formats by predicted time",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs) in the sequence-parallel group")
    p.add_argument("--heads", type=int, required=True, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads; GQA if fewer)")
    p.add_argument("--seqlen", type=int, required=True, help="global sequence length S (all tokens)")
    p.add_argument("--head-dim", type=int, required=True, help="head dim D")
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="input dtype (default bf16)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--bwd", action="store_true", help="predict forward + backward (default forward only)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="ranks per node (default: the profile's)")
    p.add_argument("--profile", default=None,
                   help=f"machine profile: {', '.join(planner.list_profiles())} or a JSON path (default cpu)")
    p.add_argument("--intra-bw", type=_bytes_per_s, default=None,
                   help="link rate per rank and direction inside a node (e.g. 450e9, 450GB/s); the profile's "
                        "collective efficiencies still apply; replaces its measured collectives")
    p.add_argument("--inter-bw", type=_bytes_per_s, default=None, help="bytes/s per rank and direction across nodes")
    p.add_argument("--latency", type=float, default=None, help="seconds per collective (both scopes)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure this machine first (spawns --nproc CPU ranks; under a minute)")
    p.add_argument("--nproc", type=int, default=2, help="ranks to calibrate with (default 2)")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per calibration rank (default 1)")
    p.add_argument("--save", metavar="PATH", default=None, help="with --calibrate: write the measured profile here")
    p.add_argument("--fp8", action="store_true",
                   help="also consider the fp8 Ulysses wire (ulysses_float8; lossy, bf16/fp16 only)")
    p.add_argument("--async", dest="pipeline", action="store_true",
                   help="also consider AsyncLongContextAttention (2 head groups; all-to-alls overlapped)")
    p.add_argument("--memory-budget", type=_bytes, default=None, metavar="SIZE",
                   help="memory per rank (24GiB, 512MiB, bytes): meter every candidate's memory, add low_memory "
                        "ones, and pick the fastest that fits")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--cu-seqlens", default="", metavar="0,L1,...,S",
                      help="packed documents: the global document boundaries (adds the varlen_zigzag layout)")
    docs.add_argument("--docs", type=int, default=None, metavar="N",
                      help="packed documents: N documents of equal length (shortcut for --cu-seqlens)")
    dyn = p.add_mutually_exclusive_group()
    dyn.add_argument("--length-dist", default=None, metavar="SPEC",
                     help="also schedule a Ulysses x Ring split per global batch (usp_hal.planning.dynamic) for "
                          "sequence lengths drawn from SPEC (lognormal:MEDIAN:MAX[:SIGMA] or llama3-sft), --seqlen "
                          "tokens per global batch, and print its predicted gain over the best static split")
    dyn.add_argument("--lengths", default=None, metavar="FILE",
                     help="the same for the sequence lengths in FILE (integers; one global batch per line)")
    p.add_argument("--budget-tokens", type=int, default=None, metavar="N",
                   help="with --length-dist/--lengths: the most tokens one rank holds in one job "
                        "(default: --seqlen / --world, what a static split over every rank holds)")
    model = p.add_argument_group("the model's token-proportional layers (with --length-dist/--lengths: the jobs are "
                                 "priced as whole training steps)")
    model.add_argument("--hidden", type=int, default=0, help="hidden size (0: price attention alone)")
    model.add_argument("--intermediate", type=int, default=0, help="MLP (intermediate) size")
    model.add_argument("--layers", type=int, default=1, help="decoder layers")
    model.add_argument("--vocab", type=int, default=0, help="vocabulary size")
    model.add_argument("--model-config", default=None, metavar="PATH",
                       help="a transformers config.json (or a directory holding one) to read the above and the "
                            "heads from")
    p.set_defaults(func=run)


def _documents(args):
    """The boundaries of --cu-seqlens or --docs N (None: one sequence)."""
    if args.docs is not None:
        if args.docs < 1:
            raise planner.PlanError(f"--docs must be >= 1, got {args.docs}")
        from ..sequence.positions import equal_documents
        return equal_documents(args.seqlen, args.docs)
    text = (args.cu_seqlens or "").replace(" ", "")
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise planner.PlanError(f"--cu-seqlens {text!r}: write the boundaries as integers, e.g. 0,300,1024") from None


def run(args) -> int:
    try:
        if args.calibrate:
            if args.profile or args.intra_bw or args.inter_bw or args.latency is not None:
                raise planner.PlanError("--calibrate measures the machine: drop --profile/--intra-bw/--inter-bw/"
                                        "--latency, or drop --calibrate to use them")
            if in_torchrun():
                raise planner.PlanError("--calibrate spawns its own ranks; run it without torchrun")
            prof = calibrate(args.nproc, dtype=args.dtype, head_dim=args.head_dim, threads=args.threads_per_rank)
            if args.save:
                planner.save_profile(prof, args.save)
                print(f"profile written to {args.save}", file=sys.stderr)
        else:
            prof = planner.load_profile(args.profile or "cpu")
        res = planner.plan(args.world, args.heads, args.seqlen, args.head_dim, kv_heads=args.kv_heads,
                           dtype=args.dtype, causal=args.causal, bwd=args.bwd, batch=args.batch, profile=prof,
                           gpus_per_node=args.gpus_per_node, intra_bw=args.intra_bw, inter_bw=args.inter_bw,
                           latency=args.latency, fp8=args.fp8, pipelines=(0, 2) if args.pipeline else (0,),
                           cu_seqlens=_documents(args), memory_budget=args.memory_budget,
                           meter=memprobe.probe if args.memory_budget is not None else None)
    except planner.PlanError as exc:
        print(f"usp-hal plan: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"usp-hal plan: {exc}", file=sys.stderr)
        return 1
    try:
        dynamic = _dynamic_degree(args, prof)
    except (planner.PlanError, ScheduleError, OSError) as exc:
        print(f"usp-hal plan: {exc}", file=sys.stderr)
        return 2
    res["assumptions"] = assumptions(args)
    if dynamic is not None:
        res["dynamic_degree"] = dynamic
    res["integrations"] = integration_lines(res)
    if args.json:
        json.dump(res, sys.stdout, indent=2, default=str)
        print()
    else:
        print("\n".join(format_assumptions(res["assumptions"])))
        print(planner.format_plan(res))
        head = "in transformers / diffusers (import usp_hal.integrations.transformers or .diffusers as usp):"
        print("\n".join(["", head] + ["  " + ln for ln in res["integrations"]]))
        if dynamic is not None:
            print("\n".join([""] + format_dynamic(dynamic)))
    return 0


def _model_shape(args):
    """The model as the schedule prices it: --model-config, or the heads and --hidden etc."""
    from ..planning.schedule import AttentionShape
    if args.model_config:
        import os
        path = os.path.join(args.model_config, "config.json") if os.path.isdir(args.model_config) else \
            args.model_config
        with open(path, encoding="utf-8") as f:
            try:
                cfg = json.load(f)
            except ValueError:
                raise planner.PlanError(f"--model-config {path}: not a JSON config") from None
        from types import SimpleNamespace
        try:
            return AttentionShape.from_config(SimpleNamespace(**cfg), dtype=args.dtype, causal=bool(args.causal),
                                              bwd=bool(args.bwd))
        except (AttributeError, TypeError, ValueError) as exc:
            raise planner.PlanError(f"--model-config {path}: {exc} (a transformers decoder config: "
                                    "num_attention_heads, hidden_size, num_hidden_layers, ...)") from None
    for name in ("hidden", "intermediate", "vocab"):
        if getattr(args, name) < 0:
            raise planner.PlanError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.layers < 1:
        raise planner.PlanError(f"--layers must be >= 1, got {args.layers}")
    return AttentionShape(args.heads, args.head_dim, args.kv_heads, args.dtype, bool(args.causal), bool(args.bwd),
                          hidden=args.hidden, intermediate=args.intermediate, layers=args.layers, vocab=args.vocab)


def _dynamic_degree(args, prof) -> Optional[dict]:
    """--length-dist / --lengths: the schedule per global batch against static+ (every fixed
    split, placed with the same care), priced as whole steps when the model's layers are given."""
    if args.length_dist is None and args.lengths is None:
        if args.budget_tokens is not None:
            raise planner.PlanError("--budget-tokens goes with --length-dist or --lengths")
        return None
    from ..planning.schedule import compare_with_static, draw_batches
    budget = args.budget_tokens if args.budget_tokens is not None else -(-args.seqlen // args.world)
    if budget < 1:
        raise planner.PlanError(f"--budget-tokens must be >= 1, got {budget}")
    if args.lengths is not None:
        with open(args.lengths, encoding="utf-8") as f:
            try:
                batches = [[int(x) for x in line.replace(",", " ").split()] for line in f if line.strip()]
            except ValueError:
                raise planner.PlanError(f"--lengths {args.lengths}: write integers, one batch per line") from None
        source = f"the {len(batches)} batches of {args.lengths}"
    else:
        batches = draw_batches(args.length_dist, 16, args.seqlen, seed=0)
        source = f"16 batches of {args.length_dist} (seed 0), >= {args.seqlen} tokens each"
    shape = _model_shape(args)
    cmp = compare_with_static(batches, args.world, shape, budget_tokens=budget, profile=prof)
    cmp.pop("schedules", None)
    profile = args.profile or ("the calibration" if args.calibrate else "cpu")
    return {"source": source, "budget_tokens": budget, "shape": shape.describe(), "steps": len(batches),
            "profile": profile, "world": args.world, **cmp}


def format_dynamic(d: dict) -> list:
    n = d["steps"]
    lines = [f"split per global batch (usp_hal.planning.dynamic) on {d['source']}, at most {d['budget_tokens']} tokens "
             f"per rank in one job; model {d['shape']}; predicted whole step of the slowest rank (ms, mean over the "
             "batches):"]
    if not d["static"]:
        lines.append("  no fixed split holds every batch within the budget")
    rows = [("dynamic", d["dynamic"])] + [(f"static+ {k}" + (" (best)" if k == d["best"] else ""), v)
                                          for k, v in sorted(d["static"].items(), key=lambda kv: kv[1]["predicted"])]
    for name, t in rows:
        lines.append(f"  {name:26s} {t['predicted'] / n * 1e3:10.2f} ms   attention {t['attention'] / n * 1e3:9.2f}  "
                     f"tokens {t['tokens'] / n * 1e3:9.2f}  comm {t['communication'] / n * 1e3:8.2f}  "
                     f"overhead {t['overhead'] / n * 1e3:7.2f}")
    if d["best"] is not None:
        gain = 1 - d["ratio"]
        lines.append(f"  predicted gain over static+ ({d['best']}): {100 * gain:.1f}% (dynamic / static+ "
                     f"{d['ratio']:.3f}); slowest rank / mean {d['balance']:.3f}; {d['fallbacks']} of {n} batches "
                     "gain under 3% over their own best fixed split and run it")
    prof = d["profile"]
    lines += ["  turn it on:",
              f"    USPTrainer: USPTrainingArguments(..., usp_dynamic_degree=True, usp_budget_tokens="
              f"{d['budget_tokens']}, usp_profile={prof!r})",
              f"    custom loop: dd = usp.dynamic_degree(model, budget_tokens={d['budget_tokens']}, profile={prof!r}) "
              "(usp_hal.integrations.transformers; then dd.schedule(lengths) per step, docs/dynamic-degree.md)",
              "    keep it only where measured faster than a fixed split: usp_dynamic_trial_steps=3 (USPTrainer) or "
              "trial_steps=3 (custom loop)",
              "    keep the price fitted to the run's own last 32 steps: usp_dynamic_refit_steps=32 (USPTrainer) or "
              "refit_steps=32 (custom loop)"]
    return lines


def assumptions(args) -> dict:
    """What the plan assumed, and whether each came from a flag or a default."""
    if args.calibrate:
        profile = {"value": "measured here (--calibrate)", "default": False}
    else:
        profile = {"value": args.profile or "cpu", "default": args.profile is None}
    return {"profile": profile,
            "pass": {"value": "forward+backward" if args.bwd else "forward only", "default": not args.bwd},
            "mask": {"value": "causal" if args.causal else "not causal (full attention)", "default": not args.causal}}


_HINTS = {"profile": "--profile NAME|PATH or --calibrate for the machine you will run on",
          "pass": "--bwd when training", "mask": "--causal for causal language models"}


def format_assumptions(a: dict) -> list:
    lines = ["assumptions (each changes the answer):"]
    for key, label in (("profile", "profile"), ("pass", "pass   "), ("mask", "mask   ")):
        item = a[key]
        lines.append(f"  {label}  {item['value']}" + (f"  [default; {_HINTS[key]}]" if item["default"] else ""))
    return lines + [""]


def integration_lines(res: dict) -> list:
    """The winner as the transformers and diffusers integrations take it."""
    c = res["rows"][0]["candidate"]
    init = f"mesh = usp.init_distributed(ulysses_degree={c['ulysses']}, ring_degree={c['ring']})"
    rot = f", rotation={c['rotation']!r}" if c.get("rotation") not in (None, "p2p") else ""
    low = ", low_memory=True" if c.get("low_memory") else ""
    lines = [f"transformers:  {init}; usp.register(layout={c['layout']!r}{rot}{low}, enable=True); then "
             f"usp.shard_batch(batch, mesh, layout={c['layout']!r})"]
    if low:
        lines.append("               (USPTrainer: USPTrainingArguments(..., usp_low_memory=True))")
    lines.append(f"diffusers:     {init}; usp.parallelize(pipe.transformer, mesh{rot})   # non-causal, basic layout")
    if c.get("fp8", "none") != "none" or c.get("pipeline"):
        lines.append("note: the integrations run the synchronous module without an fp8 wire; the planned "
                     f"{res['winner']!r} applies to direct LongContextAttention use")
    return lines
