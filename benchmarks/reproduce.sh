#!/usr/bin/env bash
# The measurements behind docs/performance.md (2 ranks x 1 thread, fp32, B=1, H=8, D=64).
# Results go to bench-results/ (ignored by git); the committed plot is copied to docs/.
# Run on an otherwise idle machine: every number is a ratio measured side by side in one
# run, but the spread between runs still grows with background load.
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"

# 1. time, balance, communication and memory vs S (about 12 minutes on 2 cores)
usp-hal bench --seqlens 2048,4096,8192 --causal both --modes fwd,fwdbwd \
    --ring-impls basic,zigzag,stripe --rotations p2p --iters 5 --warmup 1 \
    --json "$out/main.json" --plot "$out/main.png" > "$out/main.log"

# 2. memory at S=32768: Ulysses-2, Ring-2 with p2p and all-gather rotation, vs one process
usp-hal bench --seqlens 32768 --splits 2x1,1x2 --ring-impls zigzag --rotations p2p,allgather \
    --modes fwd,fwdbwd --causal on --iters 1 --warmup 0 --check none \
    --json "$out/mem32k.json" > "$out/mem32k.log"

# 3. memory vs ring degree at S=16384 (R=4 puts 4 ranks on 2 cores: its times mean nothing)
usp-hal bench --nproc 1 --seqlens 16384 --modes fwd,fwdbwd --causal on --iters 1 --warmup 0 \
    --check none --json "$out/memR1.json" > "$out/memR1.log"
for R in 2 4; do
    usp-hal bench --nproc $R --splits 1x$R --seqlens 16384 --ring-impls zigzag --rotations p2p,allgather \
        --modes fwd,fwdbwd --causal on --iters 1 --warmup 0 --check none --no-baseline \
        --json "$out/memR$R.json" > "$out/memR$R.log"
done

# 4. where one call's memory goes (per-phase timeline)
python benchmarks/memory_phases.py --ulysses 1 --ring 2 --seqlen 8192 > "$out/phases-r2.txt"
python benchmarks/memory_phases.py --ulysses 2 --ring 1 --seqlen 8192 > "$out/phases-u2.txt"
python benchmarks/memory_phases.py --ulysses 1 --ring 2 --seqlen 8192 --causal --bwd > "$out/phases-r2-bwd.txt"

# 5. peers on the same kernel, forward only (needs `pip install yunchang==0.6.4 --no-deps`;
#    skipped with a note otherwise; yunchang's zigzag ring cannot take the kernel, so basic)
usp-hal bench --seqlens 512,1024,4096,8192 --splits 2x1,1x2 --ring-impls basic --modes fwd \
    --causal off --peers --no-baseline --check fp64 --iters 15 --warmup 2 \
    --json "$out/peers.json" > "$out/peers.log"

# 6. the lean call: launches, host time (with and without communication), the per-call check
python benchmarks/launches_per_call.py --ops > "$out/launches.txt"
python -m benchmarks.per_call_overhead --fake > "$out/host-time.txt"
python -m benchmarks.agreement_cost > "$out/agreement.txt"
python -m benchmarks.message_cost > "$out/message-cost.txt"
python -m benchmarks.peer_steady > "$out/peer-steady-r2.txt"             # needs yunchang, as step 5
python -m benchmarks.peer_steady --ulysses > "$out/peer-steady-u2.txt"
python -m benchmarks.low_memory > "$out/low-memory.txt"
