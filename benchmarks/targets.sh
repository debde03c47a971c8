#!/usr/bin/env bash
# The measurements behind docs/performance.md's "small calls", "long calls", "fp8 wire format"
# and "async Ulysses" sections (2 ranks x 1 thread; about 15 minutes on an idle 2-core machine).
# Every ratio is measured side by side in one run; run on an otherwise idle machine.
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"

# small calls: forward vs yunchang 0.6.4 (pip install yunchang==0.6.4 --no-deps), fwd+bwd vs the floor
usp-hal bench --seqlens 512,1024 --splits 2x1,1x2 --ring-impls zigzag --modes fwd,fwdbwd --causal on \
    --peers --iters 21 --warmup 3 --json "$out/small.json" > "$out/small.log"

# long calls: S=8192 against the floor
usp-hal bench --seqlens 8192 --splits 2x1,1x2 --ring-impls zigzag --modes fwd,fwdbwd --causal on \
    --iters 5 --warmup 1 --json "$out/long.json" > "$out/long.log"

# fp8 wire format: bytes and time (bf16 inputs), Ulysses and ring
usp-hal bench --seqlens 4096 --splits 2x1,1x2 --ring-impls zigzag --modes fwd --causal on --dtype bf16 \
    --fp8 none,qvo,qkvo --ring-fp8 --iters 5 --warmup 1 --json "$out/fp8.json" > "$out/fp8.log" \
    || echo "fp8: some configuration missed its error budget (see $out/fp8.log)"
python benchmarks/fp8_report.py > "$out/fp8_accuracy.txt"

# async Ulysses: head-group pipelining and projection overlap against the synchronous module
usp-hal bench --seqlens 4096 --splits 2x1 --modes fwd,fwdbwd --causal on --pipelines 0,2 \
    --proj none,sync,overlap --iters 7 --warmup 1 --json "$out/async.json" > "$out/async.log"

# bytes copied around the kernels per call
python benchmarks/copies_per_call.py > "$out/copies.txt"
