"""The harness times the core through the call loops' step hook (usp_hal.pipeline.run.HOOKS),
so every path - plain, async (pipelined start_* all-to-alls), compiled - reports its
Ulysses re-layout and ring time; with no hook installed nothing is called."""
import pytest

from tests import dist_meter
from usp_hal.harness import meter
from usp_hal.pipeline import run as pipeline_run


def test_step_times_charge_each_step_its_own_time(monkeypatch):
    clock = [0.0]

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]

    class Comm:
        seconds = 0.0
    monkeypatch.setattr(meter, "time", FakeTime)
    kt, comm = meter.KernelTimes(), Comm()
    kt.step("exchange", comm)
    clock[0], comm.seconds = 5.0, 3.0      # 3 s of the exchange step were the collective
    kt.step("ring", comm)
    clock[0], comm.seconds, kt.fwd_s = 12.0, 4.0, 4.0   # ring: 7 s, 1 s comm, 4 s kernels
    kt.step("exchange", comm)
    clock[0] = 13.0
    kt.step(None, comm)
    clock[0] = 20.0                        # between calls: charged to nothing
    kt.step(None, comm)
    assert (kt.layout_s, kt.merge_s) == (3.0, 2.0)
    kt.reset()
    assert kt._step is None and kt.layout_s == kt.merge_s == 0.0


def test_instrument_core_installs_one_hook_and_is_idempotent():
    before = list(pipeline_run.HOOKS)
    try:
        meter.instrument_core()
        meter.instrument_core()
        assert pipeline_run.HOOKS.count(meter.step_hook) == 1
        meter.step_hook("ring")          # nothing is being timed: a no-op
    finally:
        meter.uninstrument_core()
    assert pipeline_run.HOOKS == before


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["plain", "async", "compiled"])
def test_every_path_reports_its_exchange_and_ring_steps(pools, path):
    for r in pools(2).run(dist_meter.hook_case, timeout=240, U=2, R=1, path=path):
        steps = r["steps"]
        assert steps.count(None) == 2, steps            # one forward loop, one backward loop
        assert "exchange" in steps and "ring" in steps, steps
        assert steps.count("ring") == (4 if path == "async" else 2), steps   # one per stage and pass
        assert r["layout"] > 0 and r["merge"] > 0, r
        assert r["hooks"] == 0 and r["open"] is None, r


def test_memory_meter_sees_collective_buffers_freed(pools):
    """A collective's buffers count as live until the caller frees them, not to the end of the
    region: over eight 4 MiB all-to-alls the peak is one send + receive pair, 8 MiB."""
    for r in pools(2).run(dist_meter.collective_buffers_freed, timeout=120):
        assert "profiler" in r["method"], r
        assert all(7.9 <= p <= 9.0 for p in r["peaks_mib"]), r
