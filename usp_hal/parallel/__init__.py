"""The data path: what moves between ranks, and how.

``comm`` (collectives, agreements, digests), ``mesh`` (the Ulysses x Ring process groups),
``wire``/``codec`` (buffers on the wire and their optional encodings), ``heads`` (which
heads each Ulysses rank holds), ``ulysses`` (the all-to-all exchange), ``rotation`` (how
key/value blocks travel round the ring), ``ring`` (the ring loop over the block plan),
``sharding`` (:func:`usp_hal.shard` and the collective :func:`usp_hal.unshard`).
It imports :mod:`usp_hal.sequence` and :mod:`usp_hal.dispatch` only.
"""
from ..lazy import submodules

__getattr__ = submodules(__name__)   # usp_hal.<layer>.<module> after a plain import usp_hal
