"""Sequence mixers other than attention, on sequence-sharded tensors.

``head_parallel`` (any per-head operator over the whole sequence, by the head-parallel
all-to-all, and the halo exchange of a causal convolution) and ``state_passing`` (linear
recurrences carried from rank to rank).  They import :mod:`usp_hal.sequence` and
:mod:`usp_hal.parallel` only.
"""


def __getattr__(name: str):
    """``usp_hal.<layer>.<module>`` after a plain ``import usp_hal``: the module, imported on first use."""
    import importlib
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
