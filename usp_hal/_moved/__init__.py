"""The modules' former import paths.

``usp_hal/__init__.py`` adds this folder to the package's ``__path__``, so ``import
usp_hal.comm`` finds ``comm.py`` here, which puts the module's new home
(``usp_hal.parallel.comm``) in its place: both names are one module object, so an attribute
set through either is seen through both.  ``layout`` and ``varlen`` are re-export modules
(their names now live in several modules).  :data:`FORMER` maps each former path to its home.
"""

FORMER = {
    "usp_hal.positions": "usp_hal.sequence.positions",
    "usp_hal.blocks": "usp_hal.sequence.blocks",
    "usp_hal.masks": "usp_hal.sequence.masks",
    "usp_hal.backend": "usp_hal.dispatch.backend",
    "usp_hal.capabilities": "usp_hal.dispatch.capabilities",
    "usp_hal.registry": "usp_hal.dispatch.registry",
    "usp_hal.platform": "usp_hal.dispatch.platform",
    "usp_hal.reference": "usp_hal.dispatch.reference",
    "usp_hal.processor": "usp_hal.dispatch.processor",
    "usp_hal.comm": "usp_hal.parallel.comm",
    "usp_hal.mesh": "usp_hal.parallel.mesh",
    "usp_hal.wire": "usp_hal.parallel.wire",
    "usp_hal.codec": "usp_hal.parallel.codec",
    "usp_hal.heads": "usp_hal.parallel.heads",
    "usp_hal.ulysses": "usp_hal.parallel.ulysses",
    "usp_hal.rotation": "usp_hal.parallel.rotation",
    "usp_hal.ring": "usp_hal.parallel.ring",
    "usp_hal.spec": "usp_hal.pipeline.spec",
    "usp_hal.compiled": "usp_hal.pipeline.compiled",
    "usp_hal.hybrid": "usp_hal.mixers.head_parallel",
    "usp_hal.state_passing": "usp_hal.mixers.state_passing",
    "usp_hal.layout": "usp_hal.sequence.positions",
    "usp_hal.varlen": "usp_hal.sequence.blocks",
}
