"""The harness behind ``usp-hal probe``, ``run``, ``bench`` and ``matrix``, the benchmarks and
the tests: rank processes (:mod:`.pool`), measurement inside a rank (:mod:`.meter`),
verification against the reference with one comparator (:mod:`.verify`), run cases
(:mod:`.cases`), the bench sweep (:mod:`.sweep`) and the CI matrices (:mod:`.matrix`).
"""
from __future__ import annotations

from .cases import RunConfig, execute
from .meter import (
                    CommMeter,
                    KernelTimes,
                    MemoryMeter,
                    fmt_bytes,
                    fmt_ms,
                    instrument_core,
                    proc_status_kib,
                    reset_peak_rss,
                    time_backend,
                    trim_freed_memory,
)
from .pool import LaunchError, RankPool, TorchrunExecutor, gather_objects, in_torchrun
from .verify import FEATURES, compare, supported_features, tolerances_for, verify_backend

__all__ = [
    "FEATURES", "CommMeter", "KernelTimes", "LaunchError", "MemoryMeter", "RankPool", "RunConfig", "TorchrunExecutor",
    "compare", "execute", "fmt_bytes", "fmt_ms", "gather_objects", "in_torchrun", "instrument_core",
    "proc_status_kib", "reset_peak_rss", "supported_features", "time_backend", "tolerances_for", "trim_freed_memory",
    "verify_backend",
]
