"""Where one USP attention call's memory goes: a timeline of resident memory per rank.

Runs one forward (and, with --bwd, backward) of LongContextAttention on N spawned CPU ranks
and records, at the entry and exit of the core's phases (the Ulysses re-layout
``UlyssesExchange`` all-to-alls, ``ring_forward``/``ring_backward``, each backend kernel
call, each ``merge_block``), the live resident memory and the peak since the previous
mark, both relative to the start of the call.  malloc's cached free memory is returned
to the system at every mark, so "live" is the memory in use there.

    python benchmarks/memory_phases.py --ulysses 1 --ring 2 --seqlen 8192
    python benchmarks/memory_phases.py --ulysses 2 --ring 1 --seqlen 8192 --bwd
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from usp_hal import harness
from usp_hal.harness.cases import RunConfig, global_inputs

_MARKS: list = []
_STATE = {"base": 0, "depth": 0}


def _mark(name: str) -> None:
    hwm = (harness.proc_status_kib("VmHWM") or 0) * 1024
    harness.trim_freed_memory()          # so the resident size is the live memory
    rss = (harness.proc_status_kib("VmRSS") or 0) * 1024
    _MARKS.append(("  " * _STATE["depth"] + name, rss - _STATE["base"], hwm - _STATE["base"]))
    harness.reset_peak_rss()


def _wrap(mod, name: str, label: str = None):
    fn = getattr(mod, name)

    def wrapped(*args, **kwargs):
        _mark(f"{label or name} >")
        _STATE["depth"] += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE["depth"] -= 1
            _mark(f"{label or name} <")
    setattr(mod, name, wrapped)


def rank_timeline(cfg: dict) -> list:
    import usp_hal
    import usp_hal.parallel.ring as ring
    import usp_hal.pipeline.run as run_step
    from usp_hal.parallel.ulysses import UlyssesExchange
    cfg = RunConfig(**cfg)
    mesh = usp_hal.init_sequence_parallel(cfg.ulysses, cfg.ring, set_default=False)
    q, k, v, dout = global_inputs(cfg)
    sh = [usp_hal.shard(x, layout=cfg.ring_impl, mesh=mesh).contiguous() for x in (q, k, v)]
    for t in sh:
        t.requires_grad_(cfg.bwd)
    dl = usp_hal.shard(dout, layout=cfg.ring_impl, mesh=mesh) if cfg.bwd else None
    attn = usp_hal.LongContextAttention(ring_impl_type=cfg.ring_impl, rotation=cfg.rotate, mesh=mesh)
    out = attn(*sh, causal=cfg.causal)                 # warm call: backend chosen, groups created
    if cfg.bwd:
        out.backward(dl)
    del out
    for t in sh:
        t.grad = None
    backend = attn.last_backend
    for name in ("forward", "backward"):
        fn = getattr(backend, name)

        def timed(*a, _fn=fn, _name=name, **kw):
            _mark(f"kernel {_name} >")
            try:
                return _fn(*a, **kw)
            finally:
                _mark(f"kernel {_name} <")
        setattr(backend, name, timed)
    for name in ("start_qkv", "start_out", "start_dout", "start_grads"):
        _wrap(UlyssesExchange, name)
    for name in ("ring_forward", "ring_backward"):
        _wrap(run_step, name)
    _wrap(ring, "merge_block")
    _MARKS.clear()
    harness.trim_freed_memory()
    _STATE["base"] = (harness.proc_status_kib("VmRSS") or 0) * 1024
    harness.reset_peak_rss()
    _mark("call >")
    out = attn(*sh, causal=cfg.causal)
    _mark("forward returned")
    if cfg.bwd:
        out.backward(dl)
        _mark("backward returned")
    return list(_MARKS)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ulysses", type=int, default=1)
    p.add_argument("--ring", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--rotate", default="p2p")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--bwd", action="store_true")
    p.add_argument("--rank", type=int, default=0, help="which rank's timeline to print")
    args = p.parse_args(argv)
    n = args.ulysses * args.ring
    cfg = RunConfig(nproc=n, ulysses=args.ulysses, ring=args.ring, seqlen=args.seqlen, heads=args.heads,
                    kv_heads=args.heads, head_dim=args.head_dim, causal=args.causal, bwd=args.bwd,
                    ring_impl=args.layout, rotate=args.rotate, check="none")
    # the ranks import this file as a module (its directory is on the path they receive)
    import memory_phases
    with harness.RankPool(n) as pool:
        res = pool.run(memory_phases.rank_timeline, timeout=600, cfg=asdict(cfg))
    local = 4 * cfg.batch * (cfg.seqlen // n) * cfg.heads * cfg.head_dim
    print(f"rank {args.rank} of u{args.ulysses}r{args.ring}, S={args.seqlen}, {'causal' if args.causal else 'full'}"
          f"{', fwd+bwd' if args.bwd else ', fwd'}: one local q/k/v/out tensor = {local / 2**20:.1f} MiB")
    print(f"{'mark':<40} {'live MiB':>9} {'peak since last mark MiB':>25}")
    for name, live, peak in res[args.rank]:
        print(f"{name:<40} {live / 2**20:>9.1f} {peak / 2**20:>25.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
