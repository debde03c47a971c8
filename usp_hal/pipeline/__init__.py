"""The call pipeline: one attention call from this rank's tensors to its result, shared by
every face (:class:`~usp_hal.LongContextAttention` and its subclasses, the compiled custom
op in :mod:`usp_hal.compiled`, :func:`usp_hal.async_qkv_attention`).

    validate (validate.py)  tensors and options -> CallSpec + Local, nothing communicated
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
import torch.distributed as dist

from ..dispatch.capabilities import AttnRequest
from ..dispatch.registry import REGISTRY
from ..parallel import comm
from ..parallel.comm import CommError
from ..parallel.heads import HeadPlan
from . import agree as _agree
from . import plan as _plan
from . import run as _run
from . import validate as _validate
from .maskcheck import agree_mask
from .options import CallOptions, check_mode
from .plan import CallPlan
from .spec import CallSpec, TensorDigests
from .validate import Joint, JointInfo, USPError

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
        self.layout = layout
        self.rotation_cls = rotation_cls
        self.rotation: str = rotation_cls.name
        self.attn_type = attn_type
        self.wire = dict(wire)
        self.ring_wire = tuple(ring_wire)
        self.wire_name = ",".join(f"{n}={c}" for n, c in self.wire.items())
        if self.ring_wire != ("identity", "identity"):
            self.wire_name += f",ring_k={self.ring_wire[0]},ring_v={self.ring_wire[1]}"
        self.check_ranks = check_mode(check_ranks, static_shapes)
        self.mesh = mesh
        self.head_groups = head_groups
        #: run the head groups one after another, each group's buffers gone before the next
        #: starts, and keep only sequence-layout tensors for the backward (``low_memory``)
        self.sequential = sequential
        self.backends: Dict[AttnRequest, Any] = {}
        self.shapes: dict = {}
        self.frozen: Optional[Tuple[CallSpec, list]] = None
        self.digests = TensorDigests(_LIMIT)
        self.checked_blocks: set = set()
        self.checked_layouts: set = set()
        self.metas: Dict[CallSpec, list] = {}
        self.repeats: dict = {}          # (spec, metadata group) -> comm.Repeat of its agreement
        self.signatures: dict = {}       # call signature -> (mesh, spec, local)
        self.plans: dict = {}            # (signature, lengths) -> plan
        self.last_backend: Any = None
        #: the global length of the last masked call (what a mask is digested at before the agreement)
        self.mask_seqlen = 0
        self.mask_unchecked = False    # set by each agreement (pipeline.agree)
        self.sink_opts: dict = {}        # (options, sink digest) -> the options with it
        self.handle = next(_NEXT)
        _PIPELINES[self.handle] = self
        #: the mesh of the last call (its caches are dropped once its groups are destroyed)
        self.bound: Any = None

    # ------------------------------------------------------------------ caches
    def backend_for(self, req: AttnRequest):
        got = self.backends.get(req)
        if got is None:
            got = self.backends[req] = REGISTRY.select(self.attn_type, req)()
        return got

    def digest(self, t: torch.Tensor) -> int:
        """Digest of small tensors (alibi slopes), cached per tensor object and version."""
        return self.digests(t)

    def meta_of(self, spec: CallSpec) -> list:
        got = self.metas.get(spec)
        if got is None:
            if len(self.metas) > _LIMIT:
                self.metas.clear()
            got = self.metas[spec] = spec.meta()
        return got

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
        loc = self._local(mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad, head_groups,
                          cu_seqlens)
        return self._finish(mesh, *loc, lengths=lengths, head_groups=head_groups)

    def _local(self, mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad, head_groups,
               cu_seqlens) -> tuple:
        """``(signature, cache entry, spec, local, err)``: this rank's call checked (or found
        in the signature cache), nothing communicated."""
        sig, needs_grad = self._call_signature(mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad,
                                               head_groups, cu_seqlens)
        spec: Optional[CallSpec] = None
        local: Optional[_validate.Local] = None
        hit = self.signatures.get(sig) if sig is not None else None
        if hit is not None and hit[0] is mesh:
            spec, local = hit[1], hit[2]
        elif err is None:
            hit = None
            try:
                spec, local = _validate.validate(self, mesh, q, k, v, opts, alibi_slopes, positions, joint,
                                                 needs_grad, cu_seqlens)
            except Exception as exc:     # any failure of this rank's call is a refusal every rank sees
                if isinstance(exc, CommError):
                    raise
                err = exc
            if sig is not None and err is None:
                if len(self.signatures) > _LIMIT:
                    self.signatures.clear()
                    self.plans.clear()
                self.signatures[sig] = [mesh, spec, local, None]
        else:
            hit = None
        return sig, hit, spec, local, err

    def _finish(self, mesh, sig, hit, spec, local, err, *, lengths=None, head_groups=None) -> Tuple[CallSpec, CallPlan]:
        """Agree (unless ``lengths`` are given) and plan: the rest of :meth:`prepare`."""
        if hit is not None and lengths is None and mesh.sp_size == 1 and hit[3] is not None:
            # one rank: nothing to agree on and the lengths are the query's, so the plan is the last one
            self.last_backend = hit[3].backend
            return spec, hit[3]
        if lengths is None:
            lengths = _agree.agree(self, mesh, spec, err, local.cu_seqlens if local else None)
            if local is not None and local.mask is not None:
                agree_mask(self, mesh, spec, local, lengths)
        elif err is not None:
            raise err
        assert spec is not None and local is not None
        pkey = (sig, tuple(lengths)) if sig is not None else None
        plan = self.plans.get(pkey) if pkey is not None else None
        if plan is None:
            plan = _plan.build(self, mesh, spec, lengths, local, head_groups)
            if pkey is not None:
                if len(self.plans) > _LIMIT:
                    self.plans.clear()
                self.plans[pkey] = plan
        if sig is not None and mesh.sp_size == 1 and local.cu_seqlens is None:
            entry = hit if hit is not None else self.signatures.get(sig)
            if entry is not None:
                entry[3] = plan
        self.last_backend = plan.backend
        return spec, plan

    def _call_signature(self, mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad, head_groups,
                        cu_seqlens):
        """``(signature, needs_grad)``: the call's signature (:meth:`_signature`, with
        ``needs_grad`` worked out from the inputs when None), or None (and ``needs_grad`` as
        given) for a call that is never cached: one that failed already, or has alibi slopes,
        positions, joint tokens or head groups."""
        if err is not None or alibi_slopes is not None or positions is not None or joint is not None \
                or head_groups is not None:
            return None, needs_grad
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            return None, needs_grad          # validation refuses it
        if needs_grad is None:
            needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return self._signature(mesh, q, k, v, opts, needs_grad, cu_seqlens), needs_grad

    def _signature(self, mesh, q, k, v, opts, needs_grad, cu_seqlens):
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
        sig = (id(mesh), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               bool(needs_grad), opts, cu)
        if opts.mask is not None:      # the spec holds the mask's digest: valid for this state and length
            sig += (opts.mask.state(), self.mask_seqlen)
        try:
            hash(sig)
        except TypeError:
            return None
        return sig

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
        loc = self._local(mesh, q, k, v, opts, alibi_slopes, positions, joint, err, needs_grad, None, cu_seqlens)
        _, plan = self._finish(mesh, *loc)
        try:
            return _run.run(plan, q, k, v, received, sinks)
        except CommError as exc:
            # a data exchange failed (a peer died, timed out, or is at another call): a later
            # call on these groups could pair with a peer's other call, so their use ends here
            comm.end_use(mesh.groups(), f"a data exchange of an attention call failed: {exc}")
            raise



def sink_options(pipe: Pipeline, opts: CallOptions, sinks: torch.Tensor, grad: bool) -> CallOptions:
    """``opts`` whose ``sinks`` field is a digest of the sink logits' values and of whether
    they take a gradient here, so the ranks compare both like ALiBi slopes (the values are
    read once per tensor version: no host read per call in steady state)."""
    token = comm.digest_ints([pipe.digest(sinks), int(bool(grad))])
    key = (opts, token)
    got = pipe.sink_opts.get(key)
    if got is None:
        if len(pipe.sink_opts) > _LIMIT:
            pipe.sink_opts.clear()
        got = pipe.sink_opts[key] = opts.with_(sinks=token)
    return got


def is_live(mesh) -> bool:
    """The mesh's process groups are registered (not destroyed by ``destroy_process_group``)."""
    group = getattr(mesh, "sp_group", None)
    if group is None:
        return True
    world = getattr(dist.distributed_c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return pg_map is None or group in pg_map


def check_live(mesh) -> None:
    if not is_live(mesh):
        raise USPError(f"usp_hal: the sequence-parallel mesh of this call ({mesh.ulysses_degree} x "
                       f"{mesh.ring_degree}, ranks {list(mesh.sp_ranks)}) is on process groups that were destroyed "
                       "(torch.distributed.destroy_process_group); build a new mesh with "
                       "usp_hal.init_sequence_parallel(...) after init_process_group and pass it to the module "
                       "(module.mesh = mesh, or a new module), or use the default mesh (mesh=None)")


def check_sinks(sinks, q) -> Optional[Exception]:
    """The error for sink logits that do not fit the call (None: they do)."""
    h = q.shape[2] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or (h is not None and sinks.shape[0] != h):
        return ValueError(f"sinks must be a 1-D tensor of one logit per query head ({h}), got "
                          f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    if not sinks.is_floating_point():
        return ValueError(f"sinks must be floating point, got {sinks.dtype}")
    if isinstance(q, torch.Tensor) and sinks.device != q.device:
        return ValueError(f"sinks are on {sinks.device}, the query on {q.device}")
    return None
