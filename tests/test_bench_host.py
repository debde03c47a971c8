"""The no-communication host-time benchmark (benchmarks/per_call_overhead.py, part 3): usp-hal
runs as rank 0 of torch's fake process group (the metadata on the CPU, the exchanges through
it) for Ulysses-2 and Ring-2, and every variant it times is there.  Timings are not asserted:
that is the benchmark's job."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("U,R", [(2, 1), (1, 2)])
def test_fake_group_host_benchmark_runs(U, R):
    code = ("import json, benchmarks.per_call_overhead as b; "
            f"print('RESULT', json.dumps(b._fake_host({U}, {R}, 3, 1)))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.split("RESULT", 1)[1])
    for name in ("usp-hal", "usp-hal static_shapes", "floor: kernel + bare collectives"):
        best, median = got[name]
        assert 0 < best <= median, (name, got)
