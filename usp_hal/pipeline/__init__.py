"""The call pipeline: one attention call from this rank's tensors to its result, shared by
every face (:class:`~usp_hal.LongContextAttention` and its subclasses, the compiled custom
op in :mod:`usp_hal.pipeline.compiled`, :func:`usp_hal.async_qkv_attention`).

    validate (validate.py)  tensors and options -> CallSpec + Local (entry.py: cached per signature)
    agree    (agree.py)     one metadata all-gather: lengths, refusals, disagreements
    plan     (plan.py)      stages, exchanges, rotation, block plans (cached per shape)
    run      (run.py)       one forward and one backward loop over the stages

A :class:`Pipeline` holds one module's configuration and its caches.  A call whose
signature (shapes, dtypes, devices, options, mesh) was seen before skips validation and
planning: it reuses the checked spec and the plan, and only the agreement step (unless
``check_ranks="first_call"``) runs again, since another rank may have changed.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..bounded import BoundedCache
from ..dispatch.capabilities import AttnRequest
from ..dispatch.registry import Dispatch
from ..parallel import comm
from ..parallel.comm import CommError
from ..parallel.heads import HeadPlan
from . import agree as _agree
from . import plan as _plan
from . import run as _run
from .entry import Checked, check
from .maskcheck import agree_mask
from .options import CallOptions, check_mode, check_sinks, sink_options
from .plan import CallPlan
from .spec import CallSpec, TensorDigests
from .validate import Joint, JointInfo, USPError, check_live, is_live

__all__ = ["Pipeline", "CallOptions", "CallPlan", "USPError", "Joint", "JointInfo", "pipeline_of"]

_PIPELINES: "weakref.WeakValueDictionary[int, Pipeline]" = weakref.WeakValueDictionary()
_NEXT = itertools.count(1)
_LIMIT = 64          # cached signatures / plans per pipeline


def pipeline_of(handle: int) -> "Pipeline":
    """The pipeline behind a handle (how a compiled graph finds it without holding it)."""
    pipe = _PIPELINES.get(handle)
    if pipe is None:
        raise RuntimeError(f"usp_hal: the attention module of this compiled graph (handle {handle}) no longer exists")
    return pipe


def one_group(heads: HeadPlan) -> List[HeadPlan]:
    return [heads]


class Pipeline:
    """One module's call configuration and caches; see the module doc.  ``check_ranks``:
    ``"every_call"``, ``"first_call"`` or ``"off"`` (see :func:`~usp_hal.pipeline.agree.agree`;
    True/False and ``static_shapes=True`` are taken as their aliases)."""

    def __init__(self, *, layout, rotation_cls, attn_type, wire: Dict[str, str], ring_wire: Tuple[str, str],
                 check_ranks: Union[str, bool] = "every_call", static_shapes: bool = False, mesh=None,
                 head_groups: Callable[[HeadPlan], List[HeadPlan]] = one_group, sequential: bool = False):
        self.layout, self.rotation_cls, self.rotation = layout, rotation_cls, rotation_cls.name
        self.attn_type = attn_type
        self.wire, self.ring_wire = dict(wire), tuple(ring_wire)
        self.wire_name = ",".join(f"{n}={c}" for n, c in self.wire.items())
        if self.ring_wire != ("identity", "identity"):
            self.wire_name += f",ring_k={self.ring_wire[0]},ring_v={self.ring_wire[1]}"
        self.check_ranks = check_mode(check_ranks, static_shapes)
        self.mesh = mesh
        self.head_groups = head_groups
        #: run the head groups one after another, each group's buffers gone before the next
        #: starts, and keep only sequence-layout tensors for the backward (``low_memory``)
        self.sequential = sequential
        self.dispatch = Dispatch(attn_type)         # the backend instance of each dispatch request
        self.digests = TensorDigests(_LIMIT)
        self.frozen: Optional[Tuple[CallSpec, list]] = None      # check_ranks="first_call": the checked call
        self.plans: BoundedCache = BoundedCache(_LIMIT)          # (signature, lengths) -> CallPlan
        self.signatures: BoundedCache = BoundedCache(_LIMIT, also=self.plans.clear)   # signature -> CallEntry
        self.shapes: BoundedCache = BoundedCache(32)             # plan.shape_of
        self.metas: BoundedCache = BoundedCache(_LIMIT)          # spec -> its metadata vector
        self.repeats: BoundedCache = BoundedCache(64)            # (spec, metadata group) -> comm.Repeat
        self.checked_layouts: BoundedCache = BoundedCache(64)    # agree.check_layout
        self.checked_blocks: BoundedCache = BoundedCache(64)     # plan.check_blocks
        self.sink_opts: BoundedCache = BoundedCache(_LIMIT)      # (options, sink digest) -> the options with it
        self.last_backend: Any = None
        #: the global length of the last masked call (what a mask is digested at before the agreement)
        self.mask_seqlen = 0
        self.handle = next(_NEXT)
        _PIPELINES[self.handle] = self
        #: the mesh of the last call (its caches are dropped once its groups are destroyed)
        self.bound: Any = None

    # ------------------------------------------------------------------ caches
    def backend_for(self, req: AttnRequest):
        return self.dispatch(req)

    def digest(self, t: torch.Tensor) -> int:
        """Digest of small tensors (alibi slopes), cached per tensor object and version."""
        return self.digests(t)

    def meta_of(self, spec: CallSpec) -> list:
        return self.metas.get_or(spec, spec.meta)

    def resolve_mesh(self):
        """The mesh of this call (the module's, else the default one), checked to be on live
        process groups; a call on another mesh than the last one drops the caches of a mesh
        whose groups were destroyed, so they do not keep those groups (sockets, threads) alive."""
        if self.mesh is not None:
            mesh = self.mesh
        else:
            from ..parallel.mesh import get_default_mesh
            mesh = get_default_mesh()
        check_live(mesh)
        if comm.any_ended():
            comm.refuse_ended(mesh.groups(), mesh.where("sequence-parallel"))
        if mesh is not self.bound:
            if self.bound is not None and not is_live(self.bound):
                self.forget()
            self.bound = mesh
        return mesh

    def forget(self) -> None:
        """Drop every cache that holds a mesh, a group or a plan (they are rebuilt on use)."""
        for cache in (self.shapes, self.metas, self.repeats, self.signatures, self.plans,
                      self.checked_layouts, self.checked_blocks, self.sink_opts):
            cache.clear()
        self.frozen = None

    # ------------------------------------------------------------------ the call
    def prepare(self, mesh, q, k, v, opts: CallOptions, *, alibi_slopes=None, positions=None,
                joint: Optional[JointInfo] = None, err=None, needs_grad=None, lengths=None, head_groups=None,
                cu_seqlens=None) -> Tuple[CallSpec, CallPlan]:
        """Validate locally, agree across ranks (unless ``lengths`` are given: a plan is
        rebuilt for a backward), and build the call's plan; raises the same error on every
        rank.  (The faces that start their own exchanges use this.)"""
        checked = check(self, mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad, head_groups,
                        cu_seqlens)
        return self.finish(mesh, checked, lengths=lengths, head_groups=head_groups)

    def finish(self, mesh, checked: Checked, *, lengths=None, head_groups=None) -> Tuple[CallSpec, CallPlan]:
        """Agree (unless ``lengths`` are given) and plan: the rest of :meth:`prepare`."""
        entry, spec, local = checked.entry, checked.spec, checked.local
        if entry is not None and lengths is None and mesh.sp_size == 1 and entry.solo is not None:
            # one rank: nothing to agree on and the lengths are the query's, so the plan is the last one
            self.last_backend = entry.solo.backend
            return entry.spec, entry.solo
        if lengths is None:
            agreed = _agree.agree(self, mesh, checked)
            if agreed.frozen is not None:
                self.frozen = agreed.frozen
            lengths = agreed.lengths
            if local is not None and local.mask is not None:
                self.mask_seqlen = agree_mask(self, mesh, checked, agreed)
        elif checked.err is not None:
            raise checked.err
        assert spec is not None and local is not None
        pkey = (checked.sig, tuple(lengths)) if checked.sig is not None else None
        plan = self.plans.get(pkey) if pkey is not None else None
        if plan is None:
            plan = _plan.build(self, mesh, checked, lengths, head_groups)
            if pkey is not None:
                self.plans.put(pkey, plan)
        if checked.sig is not None and mesh.sp_size == 1 and local.cu_seqlens is None:
            entry = entry if entry is not None else self.signatures.get(checked.sig)
            if entry is not None:
                entry.solo = plan
        self.last_backend = plan.backend
        return spec, plan

    def __call__(self, mesh, q, k, v, opts: CallOptions, *, alibi_slopes=None, positions=None, joint=None,
                 err=None, cu_seqlens=None, received=None, sinks=None):
        """Run one call: ``(out, lse or None)``."""
        needs_grad = None
        if sinks is not None:
            if err is None:
                err = check_sinks(sinks, q)
            if err is None:
                grad = sinks.requires_grad and torch.is_grad_enabled()
                needs_grad = True if grad else None
                opts = sink_options(self, opts, sinks, grad)
        checked = check(self, mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad, None, cu_seqlens)
        _, plan = self.finish(mesh, checked)
        try:
            return _run.run(plan, q, k, v, received, sinks)
        except CommError as exc:
            # a data exchange failed (a peer died, timed out, or is at another call): a later
            # call on these groups could pair with a peer's other call, so their use ends here
            comm.end_use(mesh.groups(), f"a data exchange of an attention call failed: {exc}")
            raise
