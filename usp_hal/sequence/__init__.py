"""Pure position code: no process group, no kernel, no tensor beyond index tensors.

``positions`` (segments, layouts, document boundaries), ``blocks`` (the block plan of every
ring rank against every source block, and its per-rank work), ``masks`` (mask descriptions
and their block-sparse plans).  It imports nothing else of the package.
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
