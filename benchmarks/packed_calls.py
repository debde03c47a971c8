"""Packed documents on one rank: one call against a call per document, side by side.

    python -m benchmarks.packed_calls

On this CPU (SDPA, no varlen entry: a packed call runs one kernel call per document inside one
usp-hal call), one rank, fp32, 8 heads of 32 (2 KV heads), causal, forward and backward: the
attention call (usp_hal.LongContextAttention on a one-rank mesh) for 1,024 tokens as 8, 32 and
128 documents, packed in one call against one call per document.  Each line: milliseconds of
each (medians of 7), their ratio, and the ratio usp_hal.planning.stepcost prices (the `cpu` profile).
The schedule packs what a rank holds alone; this says whether that pays here and whether the
price says so.  (A whole model call adds its own per-call and per-document costs, which
usp_hal.integrations.transformers.calibrate_calls measures.)
"""
from __future__ import annotations

import statistics
import time


def _median(fn, rounds: int) -> float:
    fn()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    import torch
    import torch.distributed as dist

    import usp_hal
    from usp_hal.planning.stepcost import AttentionShape, StepModel
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29571", rank=0, world_size=1)
    mesh = usp_hal.init_sequence_parallel(1, 1, set_default=False)
    attn = usp_hal.LongContextAttention(attn_type="sdpa", mesh=mesh)
    model = StepModel(AttentionShape(8, 32, 2, "fp32", True, True), "cpu")
    n = 1024
    print(f"one rank, {n} tokens, H=8 Hkv=2 D=32 fp32 causal, forward+backward; ms (median of 7)")
    print("  documents   packed   separate   packed/separate   priced packed/separate")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, h, 32, generator=g).requires_grad_() for h in (8, 2, 2))
    for docs in (8, 32, 128):
        size = n // docs
        cu = [i * size for i in range(docs + 1)]

        def packed(cu=cu):
            attn(q, k, v, causal=True, cu_seqlens=cu).sum().backward()

        def separate(docs=docs, size=size):
            for a in range(docs):
                s = slice(a * size, (a + 1) * size)
                attn(q[:, s], k[:, s], v[:, s], causal=True).sum().backward()
        tp, ts = _median(packed, 7), _median(separate, 7)
        priced_p = model.job(tuple([size] * docs), 1, 1, "basic").time
        priced_s = docs * model.job((size,), 1, 1, "basic").time
        print(f"  {docs:9d} {tp * 1e3:8.1f} {ts * 1e3:10.1f} {tp / ts:17.2f} {priced_p / priced_s:24.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
