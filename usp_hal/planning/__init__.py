"""Choosing a split: which Ulysses x Ring degrees, layout, rotation and codec a job runs with.

``planner`` (the cost model of one attention call over the layout/rotation/codec tables and
the machine profiles of ``usp_hal/profiles/``: ``usp-hal plan``, :func:`usp_hal.plan`),
``stepcost`` (a job priced as a whole model call), ``schedule`` (the per-batch placement of
sequences on groups of ranks, and ``static+``), ``dynamic`` (:class:`DynamicDegree`: the
groups built once, a schedule per step).  It imports :mod:`usp_hal.sequence`,
:mod:`usp_hal.dispatch` and :mod:`usp_hal.parallel` only.
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
