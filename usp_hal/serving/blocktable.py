"""Where the tokens of a sharded KV cache live: the block table of one layer, as plain
integers (no tensors, no communication), the same on every rank of the sequence-parallel
group.  :class:`usp_hal.serving.ShardedKVCache` keeps one per layer beside its storage.

New tokens of a sequence go to ring ranks in blocks of ``block_size`` consecutive
positions: a new block goes to the ring rank holding the fewest tokens of that sequence
(ties: the lowest ring rank), so every ring rank holds ``S_b / R`` tokens of each sequence
``b`` plus at most one block.  Every rank knows every ring rank's counts; this rank also
knows which positions it holds, as runs ``[start position, count]`` in storage order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

from ..parallel.comm import digest_ints

#: ``(ring rank, first index among the new tokens, count)``: one piece of an append
Piece = Tuple[int, int, int]


@dataclass
class BlockTable:
    """The placement state of one layer for ``batch`` sequences on ``ring`` ring ranks."""

    batch: int
    ring: int
    local: List[int] = field(default_factory=list)             # per row: tokens held here
    runs: List[List[List[int]]] = field(default_factory=list)  # per row: [start position, count] in storage order
    counts: List[List[int]] = field(default_factory=list)      # per row, per ring rank (every rank knows all)
    total: List[int] = field(default_factory=list)             # per row: global length
    owner: List[int] = field(default_factory=list)             # per row: ring rank of the open block
    left: List[int] = field(default_factory=list)              # per row: room left in the open block

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        b, r = self.batch, self.ring
        self.local = [0] * b
        self.runs = [[] for _ in range(b)]
        self.counts = [[0] * r for _ in range(b)]
        self.total = [0] * b
        self.owner = [0] * b
        self.left = [0] * b

    @property
    def filled(self) -> bool:
        return any(self.total)

    def copy(self) -> "BlockTable":
        """An independent copy of the placement (work on it, then :meth:`adopt` it)."""
        return BlockTable(self.batch, self.ring)._set(self)

    def adopt(self, other: "BlockTable") -> None:
        """Take ``other``'s placement (a copy this table was advanced on)."""
        self._set(other)

    def _set(self, src: "BlockTable") -> "BlockTable":
        self.local, self.total, self.owner, self.left = list(src.local), list(src.total), list(src.owner), \
            list(src.left)
        self.runs = [[list(r) for r in row] for row in src.runs]
        self.counts = [list(c) for c in src.counts]
        return self

    def digest(self) -> int:
        """What every rank must agree on: every row's length, open block and per-ring-rank counts."""
        flat: List[int] = []
        for b in range(self.batch):
            flat += [self.total[b], self.owner[b], self.left[b], *self.counts[b]]
        return digest_ints(flat)

    def held_by(self, ring_rank: int) -> List[int]:
        """Per row: how many tokens the table says ``ring_rank`` holds."""
        return [self.counts[b][ring_rank] for b in range(self.batch)]

    def positions(self, row: int) -> List[int]:
        """Global positions of the tokens of ``row`` held here, in storage order."""
        out: List[int] = []
        for start, count in self.runs[row]:
            out += range(start, start + count)
        return out

    # ------------------------------------------------------------------ appends
    def place(self, row: int, n: int, block_size: int) -> List[Piece]:
        """Assign the next ``n`` positions of ``row`` to ring ranks (every rank does the same);
        returns ``(ring rank, first index among the n, count)`` pieces in order."""
        pieces: List[Piece] = []
        j = 0
        while j < n:
            if self.left[row] == 0:
                counts = self.counts[row]
                self.owner[row] = min(range(len(counts)), key=lambda r: (counts[r], r))
                self.left[row] = block_size
            take = min(self.left[row], n - j)
            r = self.owner[row]
            pieces.append((r, j, take))
            self.counts[row][r] += take
            self.left[row] -= take
            self.total[row] += take
            j += take
        return pieces

    def hold(self, row: int, start: int, count: int) -> int:
        """This rank stores ``count`` tokens of ``row`` from global position ``start`` next in
        its storage; returns the storage index they go to."""
        at = self.local[row]
        if count > 0:
            add_run(self.runs[row], start, count)
            self.local[row] = at + count
        return at


def add_run(runs: List[List[int]], start: int, count: int) -> None:
    """Append positions ``start .. start+count`` to ``runs``, extending the last run when they follow it."""
    if count <= 0:
        return
    if runs and runs[-1][0] + runs[-1][1] == start:
        runs[-1][1] += count
    else:
        runs.append([start, count])


__all__ = ["BlockTable", "Piece", "add_run"]
