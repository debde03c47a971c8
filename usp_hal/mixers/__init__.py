"""Sequence mixers other than attention, on sequence-sharded tensors.

``head_parallel`` (any per-head operator over the whole sequence, by the head-parallel
all-to-all, and the halo exchange of a causal convolution) and ``state_passing`` (linear
recurrences carried from rank to rank).  They import :mod:`usp_hal.sequence` and
:mod:`usp_hal.parallel` only.
"""
from ..lazy import submodules

__getattr__ = submodules(__name__)   # usp_hal.<layer>.<module> after a plain import usp_hal
