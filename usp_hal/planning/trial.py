"""Keep the per-batch schedule only where it is measured faster than one fixed split.

The per-batch schedule and its predicted-gain margin (:meth:`usp_hal.planning.schedule.Scheduler.schedule`)
are both priced by the same step model; where that model is off by more than the margin, the
schedule can lose to the fixed split a user would otherwise run.  :class:`MeasuredTrial` does not
trust the model for this choice: over its first steps it runs the per-batch schedule and the
fixed split in turn, one warm-up step and then ``trial`` timed steps of each (an arm's first
step pays its groups' and kernels' first use), and from then on keeps the one that was faster.

- The fixed split is the one a user would pick for the run: the split with the lowest
  predicted total over the batches seen so far (each batch placed on each split, as static+
  is priced), among those that held every one of them, frozen once chosen.  A later batch it
  cannot hold runs the per-batch schedule.
- Batches differ, so a step's time is compared as its measured time over the fixed split's
  predicted time for the same batch; the arms' medians of that ratio are compared.
- Each decision is a pure function of the lengths and of the recorded times, which every rank
  receives alike (:class:`usp_hal.planning.dynamic.DynamicDegree` sends them with the lengths
  it gathers anyway), so every rank keeps the same schedule.  A time is applied from the
  step index given with it on, so a schedule computed ahead in a thread sees the same
  records on every rank.
"""
from __future__ import annotations

import logging
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from .schedule import Schedule, ScheduleError, Scheduler, check_lengths, split_label

logger = logging.getLogger(__name__)

#: the per-batch schedule ("schedule") and the fixed split ("fixed")
ARMS = ("schedule", "fixed")
#: a trial still open after this many times its steps ends: the per-batch schedule was (nearly
#: always) the fixed split's placement, so there is little to compare, and the price of the
#: fixed split's placement is no longer paid each step
PATIENCE = 10


class MeasuredTrial:
    """A warm-up and ``trial`` timed steps of each arm, then the faster one kept (see the module's text).

    ``choose(lengths, at)`` gives the step's serial and schedule; ``record(serial, seconds,
    at)`` gives a step's measured time (the slowest rank's), applied to choices from step ``at``
    on.  ``decided``: None during the trial, else the kept arm."""

    def __init__(self, scheduler: Scheduler, trial: int):
        if int(trial) < 1:
            raise ValueError(f"MeasuredTrial: trial must be at least 1 step per arm, got {trial}")
        self.scheduler = scheduler
        self.trial = int(trial)
        self.split: Optional[Tuple[int, int]] = None
        self.decided: Optional[str] = None
        self.ratio: Optional[float] = None
        self.samples: Dict[str, List[float]] = {a: [] for a in ARMS}
        self._issued = {a: 0 for a in ARMS}
        self._totals: Optional[Dict[Tuple[int, int], float]] = None
        self._pending: Dict[int, Tuple[str, float]] = {}        # serial -> (arm, fixed split's prediction)
        self._records: List[Tuple[int, int, float]] = []        # (at, serial, seconds), not yet applied
        self._serial = 0

    # ------------------------------------------------------------------ what ranks feed it
    def record(self, serial: int, seconds: float, at: int) -> None:
        """Step ``serial``'s measured time, seen by choices of index ``at`` and later."""
        self._records.append((int(at), int(serial), float(seconds)))

    def _apply(self, at: int) -> None:
        keep = []
        for when, serial, seconds in self._records:
            if when > at:
                keep.append((when, serial, seconds))
                continue
            got = self._pending.pop(serial, None)
            if got is not None and seconds > 0 and got[1] > 0:
                self.samples[got[0]].append(seconds / got[1])
        self._records = keep
        if self.decided is None and all(len(self.samples[a]) > self.trial for a in ARMS):
            self._decide()

    def _decide(self) -> None:             # each arm's first step is its warm-up
        ratio = statistics.median(self.samples["schedule"][1:]) / statistics.median(self.samples["fixed"][1:])
        self.ratio = ratio
        self.decided = "schedule" if ratio < 1.0 else "fixed"
        self._pending.clear()
        label = split_label(self.scheduler.world, *self.split) if self.split else "?"
        logger.info("usp_hal.planning.trial: the per-batch schedule measured %.3fx the time of the fixed split %s "
                    "(%d steps each, each step's time over the fixed split's predicted time for its batch): "
                    "%s from now on (logged once)", ratio, label, self.trial,
                    "the per-batch schedule" if self.decided == "schedule" else f"the fixed split {label}")

    # ------------------------------------------------------------------ the step's schedule
    def choose(self, lengths: Sequence[int], at: Optional[int] = None) -> Tuple[int, Schedule]:
        """This step's serial and schedule (``at``: the step's index, default one more than the last)."""
        self._serial += 1
        serial = self._serial
        self._apply(serial if at is None else int(at))
        if self.decided is None and serial > PATIENCE * 2 * (self.trial + 1):
            self.decided = "schedule"
            logger.info("usp_hal.planning.trial: after %d steps the per-batch schedule has had too few steps that "
                        "differ from the fixed split to compare (%d timed of %d): the per-batch schedule from now "
                        "on (logged once)", serial - 1, len(self.samples["schedule"]), self.trial + 1)
        lens = check_lengths(lengths)
        if self.decided == "schedule":
            return serial, self.scheduler.schedule(lens)
        split, placed = self._split(lens)
        fixed = None
        if split is not None and placed is not None:
            fixed = placed.get(split)
        elif split is not None:
            try:
                fixed = self.scheduler.static(lens, *split)
            except ScheduleError:
                fixed = None
        if self.decided == "fixed" and fixed is not None:
            return serial, fixed
        dyn = self.scheduler.schedule(lens)
        if fixed is None or self.decided:       # the fixed split cannot hold this batch
            return serial, dyn
        if dyn.label == fixed.label and dyn.jobs == fixed.jobs:     # this batch's schedule is the fixed split
            if self._issued["fixed"] > self.trial:
                return serial, dyn
            want = "fixed"
        else:
            open_ = [a for a in ARMS if self._issued[a] <= self.trial]
            if not open_:                        # each arm's steps are out; their times still to come
                return serial, dyn
            want = min(open_, key=lambda a: (self._issued[a], a != "schedule"))
        self._issued[want] += 1
        self._pending[serial] = (want, fixed.predicted)
        return serial, fixed if want == "fixed" else dyn

    def _split(self, lens: Tuple[int, ...]) -> Tuple[Optional[Tuple[int, int]],
                                                    Optional[Dict[Tuple[int, int], Schedule]]]:
        """The run's fixed split: the lowest predicted total over the batches seen, among the
        splits that held each of them; frozen when the trial's first fixed step is issued.  With
        it, this batch placed on every split (None once frozen: nothing was placed)."""
        if self.split is not None and (self._issued["fixed"] or self.decided):
            return self.split, None
        # each split placed, as static+ is priced: the quick estimate (Scheduler._static_estimates)
        # can rank the splits otherwise where per-call costs are large (a CPU profile)
        placed = self.scheduler.statics(lens)
        est = {k: sc.predicted for k, sc in placed.items()}
        if self._totals is None:
            self._totals = dict(est)
        else:
            self._totals = {k: v + est[k] for k, v in self._totals.items() if k in est}
        self.split = min(self._totals, key=lambda k: (self._totals[k], -k[0])) if self._totals else None   # type: ignore[index]
        return self.split, placed


__all__ = ["ARMS", "MeasuredTrial"]
