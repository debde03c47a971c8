"""The scalar options of one attention call, as one frozen value.

Every face of the pipeline (the module's ``forward``, the compiled custom op, the async
paths) turns its keyword arguments into a :class:`CallOptions` and hands that on; the
compiled op carries it as one string (:meth:`CallOptions.encode`), so a new option is a
new field here plus what the kernels do with it, not a change of the op's schema.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass, fields
from typing import Any, Optional, Tuple

import torch

from ..bounded import put
from ..dispatch.capabilities import KernelCall


class Sinks:
    """The values of :attr:`CallOptions.sinks` (plain ints: the options travel as one string
    of literals through the compiled op).  Any other value is a :meth:`digest`: the sink
    logits' values and whether they take a gradient, compared across ranks like ALiBi
    slopes (:func:`usp_hal.pipeline.sink_options`)."""

    NONE = 0        #: no sink logits
    GIVEN = 1       #: sink logits travel beside the options (not digested yet)
    GIVEN_GRAD = 2  #: the same, taking a gradient (how the compiled op's string says so)

    @classmethod
    def given(cls, present: bool, grad: bool = False) -> int:
        """The value before the logits are digested: :attr:`NONE`, :attr:`GIVEN` or :attr:`GIVEN_GRAD`."""
        return cls.NONE if not present else cls.GIVEN_GRAD if grad else cls.GIVEN

    @staticmethod
    def digest(values: int, grad: bool) -> int:
        """The value once the logits are digested (``values``: a digest of their values)."""
        from ..parallel.comm import digest_ints
        return digest_ints([values, int(bool(grad))])


@dataclass(frozen=True)
class CallOptions:
    """What ``forward``'s keywords say, before validation (``validate`` checks the values).

    ``scale``: the softmax scale as given (None: 1/sqrt(head_dim)).  ``joint_strategy`` /
    ``joint_total``: joint (MMDiT) tokens, once they are part of the rows."""

    causal: bool = False
    scale: Optional[float] = None
    window: Any = (-1, -1)
    softcap: Any = 0.0
    deterministic: bool = False
    return_lse: bool = False
    dropout_p: Any = 0.0
    joint_strategy: str = "none"
    joint_total: int = 0
    mask: Any = None          # a usp_hal.sequence.masks.Mask (hashed by identity: one object, one cached plan)
    #: per-head sink logits (the tensor travels beside the options): one of :class:`Sinks`
    sinks: int = Sinks.NONE

    @classmethod
    def of(cls, *, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
           deterministic=False, return_lse=False, joint_strategy="none", joint_total=0, mask=None,
           sinks=False) -> "CallOptions":
        """From ``forward``'s keyword names (a list window becomes a tuple so the value hashes)."""
        if isinstance(window_size, list):
            window_size = tuple(window_size)
        return cls(causal=bool(causal), scale=softmax_scale, window=window_size, softcap=softcap,
                   deterministic=bool(deterministic), return_lse=bool(return_lse), dropout_p=dropout_p,
                   joint_strategy=joint_strategy or "none", joint_total=int(joint_total), mask=mask,
                   sinks=Sinks.given(bool(sinks)))

    @classmethod
    def key(cls, **kw) -> Optional[tuple]:
        """The cache key of :meth:`of` with these keywords: every keyword's name and value, so a
        keyword added to a call site is part of the key without further edits.  None when
        the options must be made again on every call (a tensor scale or softcap, whose value
        may change, or an unhashable value)."""
        if not all(plain(kw.get(n)) for n in ("softmax_scale", "softcap", "dropout_p")):
            return None
        key = tuple(kw.items())
        try:
            hash(key)
        except TypeError:
            return None
        return key

    @classmethod
    def cached(cls, cache: Optional[dict], **kw) -> "CallOptions":
        """``cls.of(**kw)``, kept in ``cache`` (None: no cache; a plain dict is bounded at 64
        entries, a :class:`~usp_hal.bounded.BoundedCache` at its own limit) under :meth:`key`."""
        key = cls.key(**kw) if cache is not None else None
        got = cache.get(key) if key is not None else None     # type: ignore[union-attr]
        if got is None:
            got = cls.of(**kw)
            if key is not None:
                assert cache is not None
                put(cache, key, got, getattr(cache, "limit", 64))
        return got

    @property
    def plain(self) -> bool:
        """Scale, softcap and dropout are Python numbers (the options may key a cache); computed once."""
        got = self.__dict__.get("_plain")
        if got is None:
            got = self.__dict__["_plain"] = plain(self.scale) and plain(self.softcap) and plain(self.dropout_p)
        return got

    def with_(self, **kw) -> "CallOptions":
        return type(self)(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **kw})

    def literal(self) -> "CallOptions":
        """The options with every number a Python literal (scale, softcap and dropout as floats,
        the window as ints): what the compiled op's one string carries."""
        return self.with_(scale=float(self.scale) if self.scale is not None else None,
                          window=tuple(int(x) for x in self.window), softcap=float(self.softcap),
                          dropout_p=float(self.dropout_p))

    def kernel_call(self, *, head_dim: int, heads: int, batch: int, alibi_slopes=None, sinks=None, q=None,
                    **flags) -> KernelCall:
        """The options checked (:func:`check_options`) as the call's
        :class:`~usp_hal.dispatch.capabilities.KernelCall` (``flags``: ``needs_grad``,
        ``needs_lse``): what the attention call's plan and a decode step build their kernel
        calls from.  The scale is a float (``1/sqrt(head_dim)`` when not given)."""
        win, cap, scale = check_options(window=self.window, softcap=self.softcap, scale=self.scale,
                                        head_dim=head_dim, alibi_slopes=alibi_slopes, heads=heads, batch=batch,
                                        sinks=sinks, q=q)
        return KernelCall(scale=scale, causal=bool(self.causal), window=win, softcap=cap, alibi_slopes=alibi_slopes,
                          dropout_p=float(self.dropout_p or 0.0), deterministic=bool(self.deterministic), **flags)

    def __hash__(self) -> int:       # computed once: the value keys the pipeline's caches on every call
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(tuple(getattr(self, f.name) for f in fields(self)))
        return h

    # the compiled op's one string argument --------------------------------------------
    def encode(self) -> str:
        """``name=repr(value);...`` (plain string formatting, which torch.compile traces); a
        mask is written as its handle (:attr:`usp_hal.sequence.masks.Mask.handle`)."""
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "mask" and value is not None:
                value = value.handle
            parts.append(f"{f.name}={value!r}")
        return ";".join(parts)

    @classmethod
    def decode(cls, text: str) -> "CallOptions":
        names = {f.name for f in fields(cls)}
        kw = {}
        for item in text.split(";"):
            name, _, value = item.partition("=")
            if name in names:
                kw[name] = ast.literal_eval(value)
        if kw.get("mask") is not None:
            from ..sequence.masks import Mask
            kw["mask"] = Mask.by_handle(kw["mask"])
        return cls(**kw)


def check_scale(scale: float) -> None:
    """Refuse a softmax scale that is not a finite positive number: kernels (torch's own CPU
    flash kernel among them) return NaN for a negative or zero scale together with a causal
    mask, and a non-finite scale has no finite answer."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale={scale!r}: the scale must be a finite number > 0; for a negative scale "
                         "-s pass softmax_scale=s with the query negated (-q), and for scale 0 (uniform attention) "
                         "pass a zero query with any positive scale")


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


def check_options(*, window, softcap, scale, head_dim: int, alibi_slopes, heads: int, batch: int, sinks=None,
                  q=None) -> Tuple[Tuple[int, int], float, float]:
    """The options an attention call and a decode step share, checked alike for both
    (:meth:`CallOptions.kernel_call`):
    ``(window, softcap, scale)`` as numbers (``scale`` None: ``1/sqrt(head_dim)``);
    ``alibi_slopes`` ``[heads]`` or ``[batch, heads]``; ``sinks`` (when given) one floating
    logit per query head of ``q``, on its device."""
    win = window_pair(window)
    if len(win) != 2 or any(x < -1 for x in win):
        raise ValueError(f"window_size must be (left, right) with -1 for unbounded, got {window}")
    softcap = float(softcap)
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0, got {softcap}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(f"alibi_slopes must be a tensor of shape ({heads},) or ({batch}, {heads}), got "
                             f"{tuple(getattr(alibi_slopes, 'shape', ()))}")
    if sinks is not None:
        err = check_sinks(sinks, q)
        if err is not None:
            raise err
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
    check_scale(scale)
    return (win[0], win[1]), softcap, scale


def plain(x) -> bool:
    """A Python number (or None): a value that cannot change behind a cached option."""
    return x is None or type(x) in (float, int, bool)


def window_pair(window) -> Tuple[int, ...]:
    """``window`` as a tuple of ints, or () when it is not a pair of integers."""
    try:
        return tuple(int(x) for x in window)
    except (TypeError, ValueError):
        return ()


#: the values of ``check_ranks`` (see :func:`usp_hal.pipeline.agree.agree`)
CHECK_MODES = ("every_call", "first_call", "off")


def check_mode(check_ranks, static_shapes: bool = False) -> str:
    """``check_ranks`` as one of :data:`CHECK_MODES`: True is ``"every_call"``, False
    ``"off"``; ``static_shapes=True`` is ``"first_call"`` (with ``check_ranks`` left at its
    default or True)."""
    if check_ranks is True or check_ranks is None:
        mode = "every_call"
    elif check_ranks is False:
        mode = "off"
    elif isinstance(check_ranks, str) and check_ranks in CHECK_MODES:
        mode = check_ranks
    else:
        raise ValueError(f"check_ranks={check_ranks!r}; valid: {', '.join(map(repr, CHECK_MODES))} "
                         "(or True for 'every_call', False for 'off')")
    if static_shapes:
        if mode == "off":
            raise ValueError("static_shapes=True with check_ranks=False: the first call must be checked; pass "
                             "check_ranks='first_call' (checked once, then no host collective)")
        mode = "first_call"
    return mode


def sink_options(pipe, opts: CallOptions, sinks, grad: bool) -> CallOptions:
    """``opts`` whose ``sinks`` field is a digest of the sink logits' values and of whether
    they take a gradient here, so the ranks compare both like ALiBi slopes (the values are
    read once per tensor version: no host read per call in steady state).  ``pipe``: the
    :class:`~usp_hal.pipeline.Pipeline` (its digests and its cache of these options)."""
    token = Sinks.digest(pipe.digest(sinks), grad)
    return pipe.sink_opts.get_or((opts, token), lambda: opts.with_(sinks=token))
