"""The data path: what moves between ranks, and how.

``comm`` (collectives, agreements, digests), ``mesh`` (the Ulysses x Ring process groups),
``wire``/``codec`` (buffers on the wire and their optional encodings), ``heads`` (which
heads each Ulysses rank holds), ``ulysses`` (the all-to-all exchange), ``rotation`` (how
key/value blocks travel round the ring), ``ring`` (the ring loop over the block plan).
It imports :mod:`usp_hal.sequence` and :mod:`usp_hal.dispatch` only.
"""
