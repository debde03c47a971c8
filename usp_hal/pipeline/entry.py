"""The values the pipeline's steps pass each other: a call's cache entry (per call
signature), this rank's checked call (the local step, :func:`check`), and what the
agreement found."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from ..parallel.comm import CommError
from .options import CallOptions
from .spec import CallSpec
from .validate import Local, validate


@dataclass
class CallEntry:
    """One call signature's checked call (cached per signature): the mesh it was checked on,
    the spec and local record validation made, and on one rank the plan (nothing to agree
    on there, and the lengths are the query's: a repeated call reuses it as it is)."""

    mesh: Any
    spec: CallSpec
    local: Local
    solo: Optional[Any] = None       # the CallPlan of a one-rank call without cu_seqlens


@dataclass(frozen=True)
class Checked:
    """This rank's call after the local step (nothing communicated): its signature (None:
    never cached), its cache entry when the signature was seen on this mesh, the spec and
    local record (None after a refusal), and this rank's refusal (None: it can run)."""

    sig: Optional[tuple]
    entry: Optional[CallEntry]
    spec: Optional[CallSpec]
    local: Optional[Local]
    err: Optional[BaseException]

    @property
    def cu_seqlens(self):
        return self.local.cu_seqlens if self.local is not None else None


@dataclass(frozen=True)
class Agreed:
    """What the agreement step found, the same on every rank: every rank's local length,
    whether some rank's mask was not digested before it (``maskcheck``), and, with
    ``check_ranks="first_call"``, the (spec, lengths) that later calls must repeat."""

    lengths: List[int]
    mask_unchecked: bool = False
    frozen: Optional[Tuple[CallSpec, List[int]]] = None


def signature(mesh, q, k, v, opts: CallOptions, needs_grad, cu_seqlens, mask_seqlen: int) -> Optional[tuple]:
    """What a call's validation and plan depend on, or None when it cannot be cached."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    if not opts.plain:
        return None          # e.g. a tensor scale: read again on every call
    if cu_seqlens is None:
        cu = None
    elif isinstance(cu_seqlens, (list, tuple)):
        cu = tuple(cu_seqlens)
    else:
        return None          # a tensor: its values are read (and digested) by validation
    # the device type follows from the device; ``opts`` hashes its cached value
    sig: tuple = (id(mesh), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
           bool(needs_grad), opts, cu)
    if opts.mask is not None:      # the spec holds the mask's digest: valid for this state and length
        sig += (opts.mask.state(), mask_seqlen)
    try:
        hash(sig)
    except TypeError:
        return None
    return sig


def check(pipe, mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad, head_groups,
          cu_seqlens) -> Checked:
    """Step 1 of a call: this rank's call checked (:func:`~usp_hal.pipeline.validate.validate`),
    or found in ``pipe``'s signature cache; nothing communicated.  A call with alibi slopes,
    positions, joint tokens or head groups is never cached."""
    sig = None
    if err is None and alibi_slopes is None and positions is None and joint is None and head_groups is None \
            and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        if needs_grad is None:
            needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        sig = signature(mesh, q, k, v, opts, needs_grad, cu_seqlens, pipe.mask_seqlen)
    entry = pipe.signatures.get(sig) if sig is not None else None
    if entry is not None and entry.mesh is mesh:
        return Checked(sig, entry, entry.spec, entry.local, None)
    if err is not None:
        return Checked(sig, None, None, None, err)
    try:
        spec, local = validate(pipe, mesh, q, k, v, opts, alibi_slopes, positions, joint,
                                         needs_grad, cu_seqlens)
    except CommError:
        raise
    except Exception as exc:     # any failure of this rank's call is a refusal every rank sees
        return Checked(sig, None, None, None, exc)
    if sig is not None:
        pipe.signatures.put(sig, CallEntry(mesh, spec, local))
    return Checked(sig, None, spec, local, None)
