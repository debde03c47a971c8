"""Peak memory per rank of one attention call (forward+backward, or forward), metered without a group of ranks.

The planner's ``memory_budget`` needs what a rank of each split would allocate.  Rather than
a formula that drifts from the code, this runs the real :class:`usp_hal.LongContextAttention`
once per rank of the split in this process, on a *fake* process group (torch's ``"fake"``
backend: collectives return at once, their outputs keep what they were allocated with), and
meters the peak of live tensor allocations above the inputs with
:class:`usp_hal.harness.meter.MemoryMeter` (the meter ``usp-hal run`` reports).  Every buffer
the core allocates is allocated here as on real ranks; what a communication library holds on
its own is not seen (on 2 and 4 gloo ranks the real meter read 0.93x-1.12x of this).

Memory grows linearly with the sequence (the kernels are flash-style; the ring's and the
all-to-alls' buffers are per shard), so each split is metered at two short lengths and
extrapolated.  The kernel is the CPU one: a GPU kernel's own workspace (e.g. FA2's float32
``dq`` accumulator) is not included.

The fake group is this process's default group while it runs, so :func:`peak_bytes` runs in
a fresh interpreter (:func:`probe`) unless ``torch.distributed`` is not initialized here.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import List, Sequence

#: tokens per rank of the two metered lengths (the extrapolation's points)
POINTS = (256, 512)
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}


def _one_rank(spec: dict, seqlen: int, rank: int) -> int:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import usp_hal
    from usp_hal.harness import meter
    U, R = int(spec["ulysses"]), int(spec["ring"])
    dist.init_process_group("fake", rank=rank, world_size=U * R, store=FakeStore())
    try:
        mesh = usp_hal.init_sequence_parallel(U, R, set_default=False)
        dtype = getattr(torch, _DTYPES[spec["dtype"]])
        B, H, Hkv, D = int(spec.get("batch", 1)), int(spec["heads"]), int(spec["kv_heads"]), int(spec["head_dim"])
        layout = spec.get("layout", "basic") if R > 1 else "basic"
        shapes = ((B, seqlen, H, D), (B, seqlen, Hkv, D), (B, seqlen, Hkv, D), (B, seqlen, H, D))
        q, k, v, dout = (usp_hal.shard(torch.zeros(s, dtype=dtype), layout=layout, mesh=mesh).contiguous()
                         for s in shapes)
        bwd = bool(spec.get("bwd", True))
        for t in (q, k, v):
            t.requires_grad_(bwd)
        attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type=layout, mesh=mesh,
                                            rotation=spec.get("rotation", "p2p"),
                                            low_memory=bool(spec.get("low_memory", False)), check_ranks="off")
        causal = bool(spec.get("causal", False))

        def call():
            out = attn(q, k, v, causal=causal)
            if bwd:
                out.backward(dout)
            for t in (q, k, v):
                t.grad = None

        call()                                   # the caches of the first call are not the call's
        mm = meter.MemoryMeter("cpu")
        mm.start()
        call()
        return int(mm.stop())
    finally:
        dist.destroy_process_group()


def peak_bytes(spec: dict, seqlen: int) -> int:
    """The worst rank's peak above its inputs for ``spec`` (ulysses, ring, heads, kv_heads,
    head_dim, dtype, causal, layout, rotation, low_memory, batch, bwd: forward+backward, the
    default, or forward only) at ``seqlen`` tokens,
    extrapolated from :data:`POINTS` (this process must not have a process group)."""
    world = int(spec["ulysses"]) * int(spec["ring"])
    points = []
    for per_rank in POINTS:
        n = per_rank * world
        points.append((n, max(_one_rank(spec, n, r) for r in range(world))))
    (s1, m1), (s2, m2) = points
    slope = max(0.0, (m2 - m1) / (s2 - s1))
    return int(round(max(m1, m2, m1 + slope * (seqlen - s1)) if seqlen >= s1 else m1))


def probe(specs: Sequence[dict], seqlen: int, timeout: float = 600.0) -> List[int]:
    """:func:`peak_bytes` of every spec, in a fresh interpreter."""
    done = subprocess.run([sys.executable, "-m", "usp_hal.harness.memprobe"],
                          input=json.dumps({"specs": list(specs), "seqlen": int(seqlen)}),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the memory probe failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return [int(x) for x in json.loads(done.stdout.strip().splitlines()[-1])]


def main() -> int:
    import torch
    torch.set_num_threads(1)
    job = json.loads(sys.stdin.read())
    print(json.dumps([peak_bytes(s, job["seqlen"]) for s in job["specs"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
