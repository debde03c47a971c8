"""Rank-side functions for tests/test_meter.py: the harness's step hook on every path."""
from __future__ import annotations

import torch

import usp_hal
from tests.dist_cases import get_mesh
from usp_hal.harness import meter
from usp_hal.pipeline import run as pipeline_run


def hook_case(U=2, R=1, path="plain"):
    """One forward and backward through ``path`` (plain, async, compiled) with the harness's
    step hook installed: the steps the loops reported and the times they were charged."""
    mesh = get_mesh(U, R)
    kw = dict(attn_type="sdpa", ring_impl_type="zigzag", mesh=mesh)
    attn = usp_hal.AsyncLongContextAttention(head_chunks=2, **kw) if path == "async" else \
        usp_hal.LongContextAttention(**kw)
    g = torch.Generator().manual_seed(3)
    q, k, v = (usp_hal.shard(torch.randn(1, 32, 4, 8, generator=g), layout="zigzag", mesh=mesh).requires_grad_()
               for _ in range(3))

    def call(q, k, v):
        return attn(q, k, v, causal=True)
    fn = torch.compile(call, fullgraph=True, backend="eager") if path == "compiled" else call
    if path == "compiled":
        torch._dynamo.reset()
    seen: list = []
    times = meter.KernelTimes()
    comm = meter.CommMeter()
    meter.instrument_core()
    pipeline_run.HOOKS.append(seen.append)
    meter.ACTIVE["times"] = times
    try:
        with comm:
            out = fn(q, k, v)
            out.sum().backward()
    finally:
        meter.ACTIVE["times"] = None
        pipeline_run.HOOKS.remove(seen.append)
        meter.uninstrument_core()
    return {"steps": seen, "layout": times.layout_s, "merge": times.merge_s, "hooks": len(pipeline_run.HOOKS),
            "open": times._step}


def collective_buffers_freed(reps=4):
    """The memory meter's peak over eight 4 MiB all-to-alls in a row, each one's send and
    receive buffers dropped as soon as it returns: the true peak is one pair (8 MiB).  gloo's
    worker threads often drop the last reference to such a buffer, a free the profiler
    never records on its own thread; the meter's pause after each collective is what keeps
    those buffers from reading as live to the end of the region (16-32 MiB without it)."""
    import torch.distributed as dist
    peaks = []
    for _ in range(reps):
        m = meter.MemoryMeter("cpu")
        m.start()
        for _ in range(8):
            send = torch.randn(1 << 20)          # 4 MiB of float32
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send)
            del send, recv
        peaks.append(m.stop() / 2 ** 20)
    return {"peaks_mib": peaks, "method": m.method}
