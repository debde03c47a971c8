"""The kernel contract and its selection.

``backend`` (the base class every kernel adapter implements), ``capabilities`` (what a
backend declares), ``registry`` (the backends and the selection among them), ``platform``
(which device and communication library), ``processor`` (diffusers-style processor
names), ``reference`` (the float64 attention every result is checked against).  It imports
only :mod:`usp_hal.sequence`.
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
