"""Pure position code: no process group, no kernel, no tensor beyond index tensors.

``positions`` (segments, layouts, document boundaries), ``blocks`` (the block plan of every
ring rank against every source block, and its per-rank work), ``masks`` (mask descriptions
and their block-sparse plans).  It imports nothing else of the package.
"""
from ..lazy import submodules

__getattr__ = submodules(__name__)   # usp_hal.<layer>.<module> after a plain import usp_hal
