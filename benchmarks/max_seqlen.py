"""The longest sequence whose forward+backward fits a per-rank memory budget, on 1, 2 and 4 ranks.

    python -m benchmarks.max_seqlen                          # attention alone, budget 32 MiB a rank
    python -m benchmarks.max_seqlen --what llama --budget-mib 96
    python -m benchmarks.max_seqlen --worlds 1,4 --modes default

For each world size W and module mode (``default``, ``low_memory``) every rank runs one
forward+backward at a global length S and measures its peak with
:class:`usp_hal.harness.meter.MemoryMeter` (what ``usp-hal run`` reports), plus what was live
when the measurement started: its inputs for attention (q, k, v and the output gradient), the
parameters and the input ids for the model.  A length fits when the worst rank's total is at
most the budget.  S doubles until it no longer fits, then bisection narrows it to a multiple of
``--step`` tokens.  W=1 is one process holding the whole sequence, with no usp-hal module: the
sdpa kernel under autograd for attention, the plain model (``attn_implementation="sdpa"``) for
the Llama.  The number users care about is S(W) / S(1).  ``--modes ...,tiled_loss`` (the Llama
only) also runs the default module with the loss in tiles of 256 tokens
(:func:`usp_hal.integrations.training.tiled_loss.enable_tiled_loss`), on one process too.

Attention: B=1, H=8, Hkv=8, D=64, fp32, causal, zigzag (Ulysses x Ring splits are given by
``--split``; by default Ulysses for W=2 and Ulysses-2 x Ring-2 for W=4).  The Llama: 2 layers,
hidden 256, 8 heads / 2 KV heads, vocabulary 2048, labels = inputs, the loss's backward.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks._ranks import run_on_ranks

H, D = 8, 64
TILE = 256          # tokens per tile of the loss in the ``tiled_loss`` mode


def _attention_peak(mesh, mode: str, S: int, fresh: dict) -> int:
    """Bytes at the peak of one forward+backward on this rank (inputs included)."""
    import usp_hal
    from usp_hal.harness import meter

    g = torch.Generator().manual_seed(S)
    if mesh is None:
        q, k, v, dout = (torch.randn(1, S, H, D, generator=g) for _ in range(4))
    else:
        q, k, v, dout = (usp_hal.shard(torch.randn(1, S, H, D, generator=g), layout="zigzag", mesh=mesh).contiguous()
                         for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    live = sum(t.numel() * t.element_size() for t in (q, k, v, dout))
    if mesh is None:
        fn = _one_process_attention
    else:
        key = mode
        if key not in fresh:
            fresh[key] = usp_hal.LongContextAttention(ring_impl_type="zigzag", attn_type="sdpa", mesh=mesh,
                                                      low_memory=(mode == "low_memory"))
        mod = fresh[key]

        def fn(q, k, v):
            return mod(q, k, v, causal=True)
    fn(q, k, v).backward(dout)                       # warm: plans and caches are not the call's memory
    for t in (q, k, v):
        t.grad = None
    mm = meter.MemoryMeter("cpu")
    mm.start()
    fn(q, k, v).backward(dout)
    return live + mm.stop()


def _one_process_attention(q, k, v):
    from usp_hal import KernelCall
    from usp_hal.dispatch.registry import REGISTRY
    backend = REGISTRY.get("sdpa")()
    scale = q.shape[-1] ** -0.5

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = backend.forward(q, k, v, KernelCall(scale=scale, causal=True))
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v, out, lse = ctx.saved_tensors
            return backend.backward(g.contiguous(), q, k, v, out, lse, KernelCall(scale=scale, causal=True))

    return F.apply(q, k, v)


def _llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      intermediate_size=512, vocab_size=2048, max_position_embeddings=1 << 20)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model


def _llama_peak(mesh, mode: str, S: int, fresh: dict) -> int:
    from usp_hal.harness import meter

    if "model" not in fresh:
        fresh["model"] = _llama()
        if mode == "tiled_loss":
            from usp_hal.integrations.training.tiled_loss import enable_tiled_loss
            enable_tiled_loss(fresh["model"], TILE)
        if mesh is not None:
            from usp_hal.integrations import transformers as usp
            kw = {"low_memory": True} if mode == "low_memory" else {}
            fresh["name"] = usp.register(f"usp_hal_maxlen_{mode}", mesh=mesh, layout="zigzag", attn_type="sdpa",
                                         enable=True, **kw)
            fresh["model"].set_attn_implementation(fresh["name"])
    model = fresh["model"]
    ids = torch.randint(0, 2048, (1, S), generator=torch.Generator().manual_seed(S))
    if mesh is None:
        batch = {"input_ids": ids, "labels": ids}
    else:
        from usp_hal.integrations import transformers as usp
        batch = usp.shard_batch({"input_ids": ids, "labels": ids}, mesh, "zigzag")
    live = sum(p.numel() * p.element_size() for p in model.parameters())
    live += sum(t.numel() * t.element_size() for t in batch.values() if torch.is_tensor(t))

    def step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
    step()
    model.zero_grad(set_to_none=True)
    mm = meter.MemoryMeter("cpu")
    mm.start()
    model(**batch).loss.backward()
    peak = mm.stop()
    model.zero_grad(set_to_none=True)
    return live + peak


def search(U=1, R=1, what="attention", mode="default", budget=32 << 20, step=256, start=1024, limit=1 << 20):
    """On every rank: the largest S (a multiple of ``step``) whose worst-rank peak fits ``budget``,
    with every (S, peak) measured on the way."""
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = None
    if world > 1:
        import usp_hal
        mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
    measure = _attention_peak if what == "attention" else _llama_peak
    fresh: dict = {}
    seen = []

    def peak(S):
        p = torch.tensor([measure(mesh, mode, S, fresh)], dtype=torch.int64)
        if world > 1:
            dist.all_reduce(p, op=dist.ReduceOp.MAX)
        seen.append((S, int(p)))
        return int(p)

    lo, hi = 0, start
    while hi <= limit and peak(hi) <= budget:     # doubling until a length does not fit
        lo, hi = hi, hi * 2
    while hi - lo > step:                         # then bisect between the last fit and the first miss
        mid = (lo + hi) // 2 // step * step
        if mid in (lo, hi):
            break
        if peak(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return {"max_seqlen": lo, "measured": seen}


def _one_process(**kw):
    torch.set_num_threads(1)
    return search(**kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("attention", "llama"), default="attention")
    ap.add_argument("--budget-mib", type=float, default=32.0)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--modes", default="default,low_memory")
    ap.add_argument("--step", type=int, default=256, help="granularity of the answer in tokens")
    ap.add_argument("--split", action="append", default=[], metavar="W=UxR",
                    help="the split for W ranks, e.g. 4=1x4 (default: 2=2x1, 4=2x2)")
    args = ap.parse_args(argv)
    splits = {2: (2, 1), 4: (2, 2)}
    for s in args.split:
        w, ur = s.split("=")
        u, r = ur.split("x")
        splits[int(w)] = (int(u), int(r))
    budget = int(args.budget_mib * 2**20)
    modes = args.modes.split(",")
    rows = []
    for w in map(int, args.worlds.split(",")):
        if w == 1:
            res = _one_process(what=args.what, mode="default", budget=budget, step=args.step)
            rows.append(("one process", 1, res))
            if "tiled_loss" in modes and args.what == "llama":
                res = _one_process(what=args.what, mode="tiled_loss", budget=budget, step=args.step)
                rows.append(("one process tiled_loss", 1, res))
            continue
        U, R = splits[w]
        for mode in modes:
            if mode == "tiled_loss" and args.what != "llama":
                continue
            res = run_on_ranks(search, world=w, U=U, R=R, what=args.what, mode=mode, budget=budget, step=args.step)[0]
            rows.append((f"U{U}xR{R} {mode}", w, res))
    base = next((r[2]["max_seqlen"] for r in rows if r[1] == 1), None)
    print(f"{args.what}: largest S whose forward+backward fits {args.budget_mib:g} MiB per rank "
          f"(peak of live tensors + inputs, worst rank; multiples of {args.step})")
    print(f"  {'ranks':>5}  {'module':26s} {'max S':>8}  {'x one process':>13}")
    for label, w, res in rows:
        ratio = f"{res['max_seqlen'] / base:.2f}" if base else "-"
        print(f"  {w:5d}  {label:26s} {res['max_seqlen']:8d}  {ratio:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
