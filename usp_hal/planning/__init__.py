"""Choosing a split: which Ulysses x Ring degrees, layout, rotation and codec a job runs with.

``planner`` (the cost model of one attention call over the layout/rotation/codec tables and
the machine profiles of ``usp_hal/profiles/``: ``usp-hal plan``, :func:`usp_hal.plan`),
``stepcost`` (a job priced as a whole model call), ``schedule`` (the per-batch placement of
sequences on groups of ranks, and ``static+``), ``dynamic`` (:class:`DynamicDegree`: the
groups built once, a schedule per step), ``trial`` (the per-batch schedule kept only where
it is timed faster than one fixed split).  It imports :mod:`usp_hal.sequence`,
:mod:`usp_hal.dispatch` and :mod:`usp_hal.parallel` only.
"""
from ..lazy import submodules

__getattr__ = submodules(__name__)   # usp_hal.<layer>.<module> after a plain import usp_hal
