"""``usp-hal calibrate``: measure this machine and write a profile for ``usp-hal plan``,
:class:`usp_hal.planning.dynamic.DynamicDegree` and ``USPTrainingArguments(usp_profile=)``.

It spawns ``--nproc`` CPU ranks (gloo), all measuring at once (on a machine with fewer cores than
ranks each rank's rates are what it gets while the others run, as in a run), and measures: the
attention kernel (forward, backward, causal share, per-call overhead), the merge and copies, the
collectives (all-to-all, p2p, all-gather, all-reduce), one USP call's fixed cost on the group and
on one rank, the token-proportional layers (a linear layer's GEMMs, elementwise ops) and the fixed
cost of a Llama-shaped decoder layer and of the rest of a model call (embedding, norm, head,
loss) and of AdamW's step.  The layer is the model's shape (``--hidden`` ...), scaled to what
this machine can time in a minute or two.
"""
from __future__ import annotations

import argparse
import sys

from ..harness.calibrate import LAYER, calibrate
from ..harness.pool import LaunchError, in_torchrun
from ..planning import planner


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure this machine and write a profile (kernel, linear layers, "
                                                "collectives, per-call overheads)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks, all measuring at once (default 2): the ranks of "
                                                        "the run the profile will price")
    p.add_argument("--threads-per-rank", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--dtype", default="fp32", choices=tuple(planner.DTYPE_BYTES), help="dtype (default fp32)")
    p.add_argument("--hidden", type=int, default=LAYER["hidden"], help=f"layer hidden size (default {LAYER['hidden']})")
    p.add_argument("--heads", type=int, default=LAYER["heads"], help=f"query heads (default {LAYER['heads']})")
    p.add_argument("--kv-heads", type=int, default=LAYER["kv_heads"], help=f"KV heads (default {LAYER['kv_heads']})")
    p.add_argument("--head-dim", type=int, default=LAYER["head_dim"], help=f"head dim (default {LAYER['head_dim']})")
    p.add_argument("--intermediate", type=int, default=LAYER["intermediate"],
                   help=f"MLP size (default {LAYER['intermediate']})")
    p.add_argument("--vocab", type=int, default=LAYER["vocab"], help=f"vocabulary (default {LAYER['vocab']})")
    p.add_argument("--out", default="usp-hal-profile.json", metavar="PATH",
                   help="where to write the profile (default usp-hal-profile.json)")
    p.set_defaults(func=run)


def run(args) -> int:
    if in_torchrun():
        print("usp-hal calibrate: it spawns its own ranks; run it without torchrun", file=sys.stderr)
        return 2
    for name in ("nproc", "threads_per_rank", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
        if getattr(args, name) < 1:
            print(f"usp-hal calibrate: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    if args.heads % args.kv_heads:
        print(f"usp-hal calibrate: --heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}",
              file=sys.stderr)
        return 2
    layer = {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
             "intermediate": args.intermediate, "vocab": args.vocab}
    try:
        prof = calibrate(args.nproc, dtype=args.dtype, head_dim=args.head_dim, heads=args.heads,
                         threads=args.threads_per_rank, layer=layer, timeout=600)
    except LaunchError as exc:
        print(f"usp-hal calibrate: {exc}", file=sys.stderr)
        return 1
    planner.save_profile(prof, args.out)
    k, lin = prof["kernel"][args.dtype], prof["linear"][args.dtype]
    print(f"attention kernel {k['fwd_flops'] / 1e9:.1f} / {k['bwd_flops'] / 1e9:.1f} GFLOP/s (forward / backward, "
          f"{k['backend']}); linear layers {lin['flops'] / 1e9:.1f} GFLOP/s; elementwise "
          f"{prof['elementwise_bandwidth'] / 1e9:.2f} GB/s")
    print(f"per call: attention {prof['call_overhead'] * 1e3:.2f} ms on {args.nproc} ranks, "
          f"{prof['call_overhead_local'] * 1e3:.2f} ms on one; decoder layer {prof['layer_overhead'] * 1e3:.2f} ms, "
          f"rest of a model call {prof['model_overhead'] * 1e3:.2f} ms, "
          f"AdamW {prof['optimizer_overhead'] * 1e3:.2f} ms")
    print(f"profile written to {args.out} ({prof['calibration']['wall_s']:.0f} s); use it as --profile {args.out}, "
          f"DynamicDegree(..., profile={args.out!r}) or USPTrainingArguments(usp_profile={args.out!r})")
    return 0
