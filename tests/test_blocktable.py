"""The sharded KV cache's block table (usp_hal.serving.blocktable): pure placement bookkeeping, no
process group."""
from usp_hal.serving.blocktable import BlockTable, add_run


def test_blocks_go_to_the_ring_rank_holding_fewest_tokens_lowest_first():
    t = BlockTable(batch=1, ring=3)
    pieces = t.place(0, 10, block_size=4)
    assert pieces == [(0, 0, 4), (1, 4, 4), (2, 8, 2)]
    assert t.counts[0] == [4, 4, 2] and t.total == [10] and t.owner == [2] and t.left == [2]
    # the open block fills first, then the emptiest rank (ties: the lowest) gets the next one
    assert t.place(0, 3, block_size=4) == [(2, 0, 2), (0, 2, 1)]
    assert t.counts[0] == [5, 4, 4] and t.total == [13]


def test_a_sequence_on_one_rank_is_evened_out():
    t = BlockTable(batch=1, ring=4)
    t.counts, t.total = [[10, 0, 0, 0]], [10]
    owners = [r for _ in range(12) for r, _, _ in t.place(0, 4, block_size=4)]
    assert owners[:3] == [1, 2, 3], owners
    assert max(t.counts[0]) - min(t.counts[0]) <= 4, t.counts


def test_rows_are_placed_independently():
    t = BlockTable(batch=2, ring=2)
    t.place(0, 5, block_size=2)
    assert t.counts == [[3, 2], [0, 0]] and t.total == [5, 0]


def test_hold_records_runs_and_merges_contiguous_positions():
    t = BlockTable(batch=1, ring=2)
    assert t.hold(0, 0, 3) == 0 and t.hold(0, 3, 2) == 3 and t.hold(0, 9, 1) == 5
    assert t.hold(0, 10, 0) == 6            # nothing held: no run
    assert t.runs[0] == [[0, 5], [9, 1]] and t.local == [6]
    assert t.positions(0) == [0, 1, 2, 3, 4, 9]
    runs: list = []
    add_run(runs, 4, 2)
    add_run(runs, 6, 1)
    add_run(runs, 8, -1)
    assert runs == [[4, 3]]


def test_a_copy_is_independent_until_adopted_and_the_digest_follows_the_placement():
    t = BlockTable(batch=2, ring=2)
    t.place(0, 3, block_size=2)
    t.hold(0, 0, 2)
    before = t.digest()
    trial = t.copy()
    trial.place(0, 2, block_size=2)
    trial.hold(0, 3, 1)
    assert t.digest() == before and t.counts == [[2, 1], [0, 0]] and t.runs == [[[0, 2]], []]
    assert trial.digest() != before
    t.adopt(trial)
    assert t.digest() == trial.digest() and t.runs == trial.runs and t.local == trial.local
    trial.runs[0].append([9, 9])             # adopted by value: later edits of the copy do not leak
    assert t.runs[0] == [[0, 2], [3, 1]]


def test_held_by_and_reset():
    t = BlockTable(batch=2, ring=3)
    t.place(0, 7, block_size=3)
    t.place(1, 2, block_size=3)
    assert t.held_by(0) == [3, 2] and t.held_by(2) == [1, 0] and t.filled
    t.reset()
    assert not t.filled and t.counts == [[0, 0, 0], [0, 0, 0]] and t.runs == [[], []]
