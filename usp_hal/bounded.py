"""The one bounded cache of the core: a dict that empties itself when it grows past its limit.

Caches keyed by call signatures, shapes or tensor versions see few distinct keys in steady
state; a program that keeps changing them (new lengths every call) must not grow them
without bound.  Emptying the whole cache at the limit costs one rebuild per key afterwards
and no bookkeeping per hit (a hit is one dict lookup), which is what the steady path wants.
"""
from __future__ import annotations

from typing import Callable, Dict, Hashable, Optional, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCache(Dict[K, V]):
    """A dict whose :meth:`put` empties it first when it holds more than ``limit`` entries.
    ``also``: called whenever it empties itself (a cache whose entries hang off this one's)."""

    def __init__(self, limit: int, also: Optional[Callable[[], None]] = None):
        super().__init__()
        self.limit = limit
        self.also = also

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` (emptying the cache first when it is over its limit); returns it."""
        if len(self) > self.limit and self.also is not None:
            self.also()
        return put(self, key, value, self.limit)

    def get_or(self, key: K, make: Callable[[], V]) -> V:
        """The value under ``key``, made by ``make()`` and stored on a miss."""
        got = self.get(key)
        if got is None:
            got = self.put(key, make())
        return got

    def add(self, key: K) -> None:
        """Use as a bounded set: remember ``key`` (``key in cache`` asks)."""
        self.put(key, True)  # type: ignore[arg-type]


def put(cache: dict, key, value, limit: int):
    """``cache[key] = value``, emptying ``cache`` first when it holds more than ``limit``
    entries (a caller's plain dict bounded as :class:`BoundedCache` is); returns ``value``."""
    if len(cache) > limit:
        cache.clear()
    cache[key] = value
    return value
