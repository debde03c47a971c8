"""Framework integrations: sequence parallelism for transformers and diffusers models.

``usp_hal.integrations.transformers``
    ``attn_implementation="usp_hal"`` for any model that goes through transformers'
    ``AttentionInterface``, plus :func:`~usp_hal.integrations.transformers.shard_batch`.
``usp_hal.integrations.trl``
    TRL's SFT, DPO and GRPO trainers over :class:`~usp_hal.integrations.training.trainer.USPTrainer`
    (``usp_trainer(SFTTrainer)``, ``usp_config(SFTConfig)``), for the ``engines`` extra.
``usp_hal.integrations.diffusers``
    :func:`~usp_hal.integrations.diffusers.parallelize` for diffusers models that declare a
    context-parallel plan and call ``dispatch_attention_fn`` (Flux and others).

``usp_hal.integrations.sequence_mixers``
    the check (and the sequence-parallel wiring) of layers that mix positions outside
    attention, for the transformers integration.
``usp_hal.integrations.training``
    the Hugging Face Trainer (``.trainer``), the gradient synchronisation (``.grads``) and the
    tiled loss (``.tiled_loss``).

The former paths of these modules are in the compat map (:mod:`usp_hal._moved`).

This package imports neither framework; each submodule imports its own on first use, and
importing one changes nothing in the framework (the transformers integration makes its
changes in ``register()`` and ``enable()``, listed by ``patched()``, and the gradient check
below installs its optimizer hook there too).  The helpers here are shared
by both:

* :func:`init_distributed`: the process group (from torchrun's environment) and the mesh;
* :func:`sync_gradients`: after ``backward()``, make every rank's gradients the gradients of
  the whole sequence (plain modules, DDP and FSDP2 alike: see :mod:`.training.grads` for the reduction
  each kind of gradient gets), and optionally return the loss of the whole sequence;
* the check behind it: an optimizer step after a sequence-parallel backward that
  :func:`sync_gradients` did not follow raises :class:`UnsyncedGradientsError`
  (:func:`set_sync_check`, :func:`mark_synced`).
"""
from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from .training.grads import UnsyncedGradientsError, mark_synced, set_sync_check, sync_gradients

__all__ = ["init_distributed", "sync_gradients", "set_sync_check", "mark_synced", "UnsyncedGradientsError"]


def init_distributed(ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None, *,
                     use_ulysses_low: bool = True):
    """Start the process group if needed and build the sequence-parallel mesh (made the default).

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the process group is created with the
    device's backend (``gloo`` on CPU) and this process is bound to its ``LOCAL_RANK``
    device.  Without them, and without a process group, the result is the trivial 1 x 1 mesh:
    the same script then runs as a single process.  Every rank must pass the same degrees.
    Called again with the same degrees, the mesh shares the first one's process groups
    (``init_sequence_parallel(..., reuse_groups=True)``).
    """
    import usp_hal
    from usp_hal.dispatch import platform as _platform

    if dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        device_type = _platform.default_device_type()
        _platform.set_device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(_platform.dist_backend_string(device_type))
    return usp_hal.init_sequence_parallel(ulysses_degree, ring_degree, use_ulysses_low=use_ulysses_low,
                                          reuse_groups=True)     # called again: the same groups
