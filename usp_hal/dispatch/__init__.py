"""The kernel contract and its selection.

``backend`` (the base class every kernel adapter implements), ``capabilities`` (what a
backend declares), ``registry`` (the backends and the selection among them), ``platform``
(which device and communication library), ``processor`` (diffusers-style processor
names), ``reference`` (the float64 attention every result is checked against).  It imports
only :mod:`usp_hal.sequence`.
"""
from ..lazy import submodules

__getattr__ = submodules(__name__)   # usp_hal.<layer>.<module> after a plain import usp_hal
