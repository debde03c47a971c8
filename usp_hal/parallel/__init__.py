"""The data path: what moves between ranks, and how.

``comm`` (collectives, agreements, digests), ``mesh`` (the Ulysses x Ring process groups),
``wire``/``codec`` (buffers on the wire and their optional encodings), ``heads`` (which
heads each Ulysses rank holds), ``ulysses`` (the all-to-all exchange), ``rotation`` (how
key/value blocks travel round the ring), ``ring`` (the ring loop over the block plan),
``sharding`` (:func:`usp_hal.shard` and the collective :func:`usp_hal.unshard`).
It imports :mod:`usp_hal.sequence` and :mod:`usp_hal.dispatch` only.
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
