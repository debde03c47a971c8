"""The harness behind ``usp-hal run``, ``bench``, ``probe`` and ``matrix``, the benchmarks and
the tests: rank processes (:mod:`.pool`) and measurement inside a rank (:mod:`.meter`).
"""
from __future__ import annotations

from .meter import (CommMeter, KernelTimes, MemoryMeter, fmt_bytes, fmt_ms, instrument_core, proc_status_kib,
                    reset_peak_rss, time_backend, trim_freed_memory)
from .pool import LaunchError, RankPool, TorchrunExecutor, gather_objects, in_torchrun

__all__ = [
    "CommMeter", "KernelTimes", "LaunchError", "MemoryMeter", "RankPool", "TorchrunExecutor", "fmt_bytes", "fmt_ms",
    "gather_objects", "in_torchrun", "instrument_core", "proc_status_kib", "reset_peak_rss", "time_backend",
    "trim_freed_memory",
]
