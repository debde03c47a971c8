"""Which heads each Ulysses rank computes: pure integer code (no tensors, no collectives).

:func:`head_plan` gives each Ulysses rank a contiguous range of query heads, as even as
possible (ranks beyond ``H`` get none).  Only the distinct KV heads a rank's query heads use
travel; when the range cuts a GQA group (e.g. ``H=6, Hkv=3, U=2``), the rank repeats the
received KV heads locally (one per query head) instead of receiving copies, and sums their
gradients back before sending them home.  ``Hkv % U == 0`` is never needed.
:func:`split_plan` splits every rank's heads into groups (pipelined or low-memory stages).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class HeadPlan:
    """Which global heads each Ulysses rank computes.

    ``q[u]``: the contiguous query-head range ``(start, stop)`` of rank ``u``.  ``kv[u]``:
    the contiguous range of distinct global KV heads its query heads use (what travels).
    ``kv_expand[u]``: ``None`` when the kernel can run GQA locally (every received KV head
    serves the same number of local query heads), else, per local query head, the index of
    its KV head in ``kv[u]`` (the rank repeats KV heads locally).
    """

    num_heads: int
    num_kv_heads: int
    q: Tuple[Tuple[int, int], ...]
    kv: Tuple[Tuple[int, int], ...]
    kv_expand: Tuple[Optional[Tuple[int, ...]], ...]

    @property
    def size(self) -> int:
        return len(self.q)

    def local_heads(self, u: int) -> Tuple[int, int]:
        """(query heads, KV heads) the kernel sees on Ulysses rank ``u``."""
        a, b = self.q[u]
        exp = self.kv_expand[u]
        return b - a, (len(exp) if exp is not None else self.kv[u][1] - self.kv[u][0])

    @property
    def kv_shared(self) -> bool:
        """Some KV head is received by more than one rank (its gradients must be summed)."""
        seen: set = set()
        for a, b in self.kv:
            if any(h in seen for h in range(a, b)):
                return True
            seen.update(range(a, b))
        return False

    def wire_kv_heads(self) -> int:
        """KV heads sent in total (summed over ranks): what the all-to-all moves for k and v."""
        return sum(b - a for a, b in self.kv)


def head_plan(num_heads: int, num_kv_heads: int, ulysses: int) -> HeadPlan:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"heads={num_heads} must be a positive multiple of kv_heads={num_kv_heads}")
    g = num_heads // num_kv_heads
    base, extra = divmod(num_heads, ulysses)
    q, kv, expand, start = [], [], [], 0
    for u in range(ulysses):
        n = base + (1 if u < extra else 0)
        a, b = start, start + n
        start = b
        q.append((a, b))
        r, e = _kv_for(a, b, g)
        kv.append(r)
        expand.append(e)
    return HeadPlan(num_heads, num_kv_heads, tuple(q), tuple(kv), tuple(expand))


def _kv_for(a: int, b: int, g: int):
    """KV range and local expansion for the query heads [a, b) (see :class:`HeadPlan`)."""
    if b <= a:
        return (0, 0), None
    ga, gb = a // g, (b - 1) // g + 1
    counts = [min(b, (x + 1) * g) - max(a, x * g) for x in range(ga, gb)]
    return (ga, gb), (None if len(set(counts)) == 1 else tuple(h // g - ga for h in range(a, b)))


def _split_units(plan: HeadPlan, u: int) -> Tuple[int, int]:
    """``(units, heads per unit)`` rank ``u``'s heads split into: whole KV groups where it runs
    GQA locally on two or more KV heads, else single query heads."""
    a, b = plan.q[u]
    ka, kb = plan.kv[u]
    if plan.kv_expand[u] is None and kb - ka >= 2:
        return kb - ka, (b - a) // (kb - ka)
    return b - a, 1


def most_groups(plan: HeadPlan) -> int:
    """The most head groups :func:`split_plan` makes without an empty group on every rank."""
    return max([1] + [_split_units(plan, u)[0] for u in range(plan.size)])


def split_plan(plan: HeadPlan, chunks: int) -> List[HeadPlan]:
    """Split every rank's heads into ``chunks`` consecutive groups (for pipelining the
    all-to-all of one group with the kernel of another).  Where a rank runs GQA locally the
    split follows whole KV groups, so no KV head travels twice; with fewer than two local KV
    heads the query heads are split evenly and a KV head may travel with several groups.
    Groups may be empty on some ranks (never on all)."""
    g = plan.num_heads // plan.num_kv_heads
    rows = []   # per rank: the chunks' query ranges
    for u in range(plan.size):
        a = plan.q[u][0]
        units, step = _split_units(plan, u)
        base, extra = divmod(units, chunks)
        cur, mine = a, []
        for c in range(chunks):
            n = (base + (1 if c < extra else 0)) * step
            mine.append((cur, cur + n))
            cur += n
        rows.append(mine)
    out = []
    for c in range(chunks):
        if all(rows[u][c][0] == rows[u][c][1] for u in range(plan.size)):
            continue   # empty on every rank
        q, kv, exp = [], [], []
        for u in range(plan.size):
            a, b = rows[u][c]
            r, e = _kv_for(a, b, g)
            q.append((a, b))
            kv.append(r)
            exp.append(e)
        out.append(HeadPlan(plan.num_heads, plan.num_kv_heads, tuple(q), tuple(kv), tuple(exp)))
    return out
