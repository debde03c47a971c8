"""The price of a training step: every job a rank runs, whole (not only its attention).

A *job* is one model call, forward and backward, on a group of ``g`` ranks with one
Ulysses x Ring split, holding one sequence or several packed ones.  Its time on the busiest
rank of the group is

    layers x one attention call            usp_hal.planning.planner.predict: kernel, merges, the all-to-alls,
                                           the ring's exposed exchange, the call's fixed cost
  + token-proportional layers              tokens per rank x (GEMM flops / the profile's linear rate
                                           + elementwise bytes / its elementwise bandwidth): the
                                           q/k/v/o projections, the MLP, norms, RoPE, residuals,
                                           the LM head and the loss
  + per-call overheads                     layers x ``layer_overhead`` + ``model_overhead``

and a step on a rank is its jobs one after another; the step takes as long as its slowest rank,
plus what every schedule pays alike (:meth:`StepModel.step_constant`: the gradient all-reduce
over the world and the optimizer step).

Packed documents share no keys: their attention is priced as the kernel runs them, per
document, without any merge between them, and with one launch per kind of call when the
profile's kernel has a varlen entry point (``usp_hal.planning.planner.kernel_varlen``); the packed
call's fixed cost, its all-to-alls and its ring messages are paid once, for all its tokens.

Pricing must be cheap enough to run every step.  A :class:`StepModel` therefore tabulates the
planner's prediction of one sequence on each (group size, Ulysses degree, layout) at a grid of
lengths (every length up to :data:`DENSE`, then :data:`PER_OCTAVE` per octave) and
interpolates; tests/test_stepcost.py holds the tables to the direct prediction.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..sequence.positions import local_lengths
from .planner import DTYPE_ALIASES, DTYPE_BYTES, Candidate, PlanError, Problem, kernel_varlen, load_profile, predict

#: lengths below this are tabulated one by one (where shards are a few tokens, rounding matters)
DENSE = 64
#: grid points per doubling of the length above :data:`DENSE`
PER_OCTAVE = 16
#: the parts a job's time is reported in (they sum to it)
PARTS = ("attention", "tokens", "communication", "overhead")
#: what a whole-step calibration scales (:meth:`StepModel.set_part_scale`): each part, and the
#: step's constant part
SCALED = PARTS + ("constant",)

# ATen ops of transformers' LlamaDecoderLayer with SDPA attention, counted with a dispatch mode
# (transformers 5.23.0): 77 in the forward, 142 in the backward; the elementwise traffic per token
# and layer in the forward, in elements: two RMSNorms (8 x hidden each, eager: pow, mean, rsqrt,
# two multiplies, casts), two residual adds (3 x hidden each), RoPE on q and k (8 per element:
# two multiplies, rotate_half's slice and cat, an add), SiLU(gate) x up (5 x intermediate), the
# attention output's transposes (4 per q element); the backward moves about twice as much
_LAYER_ELEMS_HIDDEN = 22
_LAYER_ELEMS_INTER = 5
_LAYER_ELEMS_QK = 8
_LAYER_ELEMS_Q = 4
# the loss on fp32 logits: upcast, log-softmax, gather, and their backward, about 10 passes over
# a row of the vocabulary per token
_LOSS_PASSES = 10
# AdamW (torch's foreach path) reads the parameter, its gradient and both moments and writes three
# of them: 7 fp32 words per parameter
_ADAMW_WORDS = 7


@dataclass(frozen=True)
class AttentionShape:
    """A model's shape as the step's price needs it.  ``heads``, ``head_dim``, ``kv_heads``,
    ``dtype``, ``causal``, ``bwd`` describe its attention call; ``hidden``, ``intermediate``,
    ``layers`` and ``vocab`` its token-proportional layers (Llama-shaped: q/k/v/o projections,
    a gated MLP, an LM head).  ``hidden=0`` prices attention alone (one call per job).
    :meth:`from_config` reads them from a transformers config."""
    heads: int
    head_dim: int
    kv_heads: Optional[int] = None
    dtype: str = "bf16"
    causal: bool = True
    bwd: bool = True
    hidden: int = 0
    intermediate: int = 0
    layers: int = 1
    vocab: int = 0

    @classmethod
    def from_config(cls, config, *, dtype: str = "bf16", causal: bool = True, bwd: bool = True) -> "AttentionShape":
        """A transformers config's shape (``num_attention_heads``, ``head_dim`` or ``hidden_size
        / heads``, ``num_key_value_heads``, ``intermediate_size`` (a MoE's active experts'
        ``moe_intermediate_size`` x ``num_experts_per_tok``, plus its shared experts'),
        ``num_hidden_layers``, ``vocab_size``)."""
        cfg = getattr(config, "get_text_config", lambda: config)()
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        inter = int(getattr(cfg, "intermediate_size", 0) or 0)
        per_tok = getattr(cfg, "num_experts_per_tok", None)
        moe = getattr(cfg, "moe_intermediate_size", None)
        if per_tok and moe:
            inter = int(moe) * int(per_tok) + int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        return cls(heads, head_dim, int(getattr(cfg, "num_key_value_heads", None) or heads),
                   DTYPE_ALIASES.get(str(dtype), str(dtype)), causal, bwd, hidden, inter,
                   int(cfg.num_hidden_layers), int(getattr(cfg, "vocab_size", 0) or 0))

    def describe(self) -> str:
        att = f"H={self.heads} Hkv={self.kv_heads or self.heads} D={self.head_dim} {self.dtype}"
        if not self.hidden:
            return f"{att} (attention only)"
        return (f"{self.layers} layers, hidden {self.hidden}, intermediate {self.intermediate}, vocab {self.vocab}, "
                f"{att}")

    # ---- the token-proportional layers
    def gemm_flops_per_token(self) -> float:
        """GEMM flops per token of one model call (forward; the backward is twice this)."""
        layer, head = self._gemm()
        return self.layers * layer + head

    def elementwise_bytes_per_token(self) -> float:
        """Bytes the elementwise ops move per token of one model call (forward)."""
        layer, head = self._elementwise()
        return self.layers * layer + head

    def _gemm(self) -> Tuple[float, float]:
        """GEMM flops per token, forward: one decoder layer's, the LM head's."""
        if not self.hidden:
            return 0.0, 0.0
        q = self.heads * self.head_dim
        kv = (self.kv_heads or self.heads) * self.head_dim
        layer = 2 * (self.hidden * q + 2 * self.hidden * kv + q * self.hidden + 3 * self.hidden * self.intermediate)
        return float(layer), float(2 * self.hidden * self.vocab)

    def _elementwise(self) -> Tuple[float, float]:
        """Elementwise bytes per token, forward: one decoder layer's, the loss's (fp32 logits)."""
        if not self.hidden:
            return 0.0, 0.0
        q = self.heads * self.head_dim
        kv = (self.kv_heads or self.heads) * self.head_dim
        per_layer = (_LAYER_ELEMS_HIDDEN * self.hidden + _LAYER_ELEMS_INTER * self.intermediate
                     + _LAYER_ELEMS_QK * (q + kv) + _LAYER_ELEMS_Q * q)
        return float(per_layer * DTYPE_BYTES[self.dtype]), float(_LOSS_PASSES * self.vocab * 4 / 3)

    def token_cost(self, linear_flops: float, elementwise_bandwidth: float) -> Tuple[float, float]:
        """Seconds per token of one decoder layer and of the head and loss, forward and backward
        (the backward moves and computes twice the forward), at these rates."""
        passes = 3.0 if self.bwd else 1.0
        (g_layer, g_head), (e_layer, e_head) = self._gemm(), self._elementwise()
        rate = 1.0 / linear_flops if linear_flops else 0.0
        bw = 1.0 / elementwise_bandwidth if elementwise_bandwidth else 0.0
        return passes * (g_layer * rate + e_layer * bw), passes * (g_head * rate + e_head * bw)

    def parameters(self) -> int:
        """Parameters of the model (untied embedding and head)."""
        if not self.hidden:
            return 0
        q = self.heads * self.head_dim
        kv = (self.kv_heads or self.heads) * self.head_dim
        layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


@dataclass(frozen=True)
class Cost:
    """One job's price on its group: the split, what the busiest rank of the group pays, and
    the time in :data:`PARTS`."""
    ulysses: int
    ring: int
    layout: str
    time: float          # predicted seconds of the whole model call (forward and backward with bwd)
    pairs: int           # query-key pairs x query heads the busiest rank scores (forward, one layer)
    bytes: float         # bytes the busiest rank sends (all layers)
    collectives: int     # collectives of the call (all layers)
    attention: float = 0.0
    tokens: float = 0.0
    communication: float = 0.0
    overhead: float = 0.0

    def parts(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in PARTS}


# columns of a table: the assembled one-sequence parts, then the components a packed job sums
_TOTALS = ("time", "attention", "communication", "overhead", "bytes", "collectives", "pairs")
_PACK = ("kernel_work", "merges", "w0_f", "wr_f", "w0_b", "wr_b", "c0", "cr", "k0", "kr", "busy")
_AT_N = ("a2a", "copies", "comm_f", "comm_b", "bytes", "collectives")


class _Table:
    """One (group size, Ulysses degree, layout)'s predictions of one sequence on a grid of
    lengths from 1 (a document in a pack may be shorter than the group; a sequence alone needs
    :func:`least_tokens`), every length up to a few dozen, then geometric; extended when a
    longer length is asked for.  Large groups and rings (whose predictions cost the most) get a
    sparser grid; the per-document columns of packed jobs (:data:`_PACK`) are predicted only
    once a packed job on this split is priced."""

    def __init__(self, model: "StepModel", g: int, u: int, layout: str, top: int):
        self.model, self.g, self.u, self.r, self.layout = model, g, u, g // u, layout
        self.least = least_tokens(g, u, layout)
        self.dense = DENSE if g <= 8 else 16
        self.ratio = 2 ** (1.0 / (PER_OCTAVE if g <= 8 else 8 if self.r <= 16 else 4))
        self.n = np.zeros(0)
        self.cols: Dict[str, np.ndarray] = {}
        self.packs = False
        self._extend(max(1, int(top)))

    def _rows(self, new: Sequence[int], which) -> Dict[str, np.ndarray]:
        rows = [which(self.g, self.u, self.layout, n) for n in new]
        return {k: np.array([row[k] for row in rows], dtype=np.float64) for k in rows[0]}

    def _extend(self, top: int) -> None:
        last = int(self.n[-1]) if len(self.n) else 0
        new: List[int] = []
        while last < min(top, self.dense):
            last += 1
            new.append(last)
        while last < top:
            last = max(last + 1, int(round(last * self.ratio)))
            new.append(last)
        if not new:
            return
        add = self._rows(new, self.model._predict_one)
        if self.packs:
            add.update(self._rows(new, self.model._predict_pack))
        self.cols = {k: np.concatenate([self.cols[k], add[k]]) if k in self.cols else add[k] for k in add}
        self.n = np.concatenate([self.n, np.array(new, dtype=np.float64)])
        self.top = int(self.n[-1])
        # the split's constants, read at the longest length (every rank has work)
        self.fixed, self.small, self.launch, self.penalty = (float(self.cols[k][-1])
                                                             for k in ("overhead", "small", "launch", "penalty"))
        if self.packs:
            self.busy = float(self.cols["busy"][-1])

    def at(self, n, cols, extrapolate: bool = False) -> Dict[str, np.ndarray]:
        """``cols`` at lengths ``n`` (interpolated).  Past the grid's end the table grows, or
        with ``extrapolate`` (columns affine in the length: bytes and their transfer times)
        continues the last segment."""
        x = np.asarray(n, dtype=np.float64)
        if x.size and float(x.min()) < 1:
            raise ValueError(f"a length must be >= 1, got {float(x.min())}")
        if not self.packs and any(c in _PACK for c in cols):
            self.packs = True
            self.cols.update(self._rows([int(v) for v in self.n], self.model._predict_pack))
            self.busy = float(self.cols["busy"][-1])
        hi = float(x.max()) if x.size else 0.0
        if hi > self.top and not extrapolate:
            self._extend(max(int(hi), 2 * self.top))
        out = {k: np.interp(x, self.n, self.cols[k]) for k in cols}
        if extrapolate and hi > self.top:
            far = x > self.top
            n0, n1 = self.n[-2], self.n[-1]
            for k in cols:
                c0, c1 = self.cols[k][-2], self.cols[k][-1]
                out[k][far] = c1 + (x[far] - n1) * (c1 - c0) / (n1 - n0)
        return out


def least_tokens(g: int, u: int, layout: str) -> int:
    """The fewest tokens a sequence needs so that every rank of a ``u x (g / u)`` group holds
    one in ``layout`` (what ``usp_hal.parallel.sharding.empty_rank_problem`` asks of the model path)."""
    if g == 1:
        return 1
    r = g // u
    n = g
    while min(min(row) for row in local_lengths(layout, n, r, u)) < 1:
        n += 1
    return n


def fits_packed(lengths: Sequence[int], g: int, u: int, layout: str) -> bool:
    """Whether a packed job of ``lengths`` gives every rank of its group a token."""
    if g == 1:
        return True
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return min(min(row) for row in local_lengths(layout, cu[-1], g // u, u, cu_seqlens=cu)) >= 1


class StepModel:
    """Whole-step prices of jobs for one model shape on one profile.

    ``shape``: an :class:`AttentionShape` (with its token-proportional layers, or
    ``hidden=0`` for attention alone); ``profile``: a planner profile (name, path or dict);
    ``top``: the tokens per rank the tables start out covering (a group of g ranks: g x top;
    they grow when asked for longer)."""

    def __init__(self, shape: AttentionShape, profile="h100-nvlink", *, top: int = 1 << 13):
        self.shape = shape
        self.profile = load_profile(profile) if isinstance(profile, str) else profile
        self.top = int(top)
        dt = shape.dtype
        kern = self.profile.get("kernel", {})
        if dt not in kern:
            have = ", ".join(k for k in kern if not k.startswith("_"))
            raise PlanError(f"profile {self.profile.get('name')!r} has no attention kernel rate for {dt} (it has "
                            f"{have}): train in one of those dtypes, pick a profile with {dt}, or calibrate this "
                            f"machine (`usp-hal calibrate --dtype {dt}`) and pass the profile it writes")
        self.varlen = kernel_varlen(kern[dt])
        lin = (self.profile.get("linear") or {}).get(dt)
        if shape.hidden and not lin:
            raise PlanError(f"profile {self.profile.get('name')!r} has no linear-layer rate for {dt}, so the "
                            f"token-proportional layers cannot be priced: calibrate this machine (`usp-hal calibrate "
                            f"--dtype {dt}`) and pass the profile it writes, or pick a profile with a 'linear' entry")
        self.linear_flops = float(lin["flops"]) if lin else 0.0
        self.elem_bw = float(self.profile.get("elementwise_bandwidth") or self.profile.get("copy_bandwidth") or 0.0)
        self.layer_overhead = float(self.profile.get("layer_overhead", 0.0)) if shape.hidden else 0.0
        self.model_overhead = float(self.profile.get("model_overhead", 0.0)) if shape.hidden else 0.0
        #: a model path's own cost per call on a split against this model's price: (seconds per
        #: call, seconds per token per rank), measured on the run's own model
        #: (usp_hal.integrations.transformers.calibrate_calls; a profile's "call_extra")
        self.call_extra: Dict[Tuple[int, int], Tuple[float, ...]] = {}
        #: the model path's attention over its price, the same on every split (calibrate_calls;
        #: a profile's call_extra["attention"]; 1 where not measured)
        self.call_attention = 1.0
        #: measured whole steps over their price, per part (:func:`fit_part_scale`; a profile's
        #: "part_scale"; 1 where not measured)
        self.part_scale: Dict[str, float] = {k: 1.0 for k in SCALED}
        #: measured whole steps against their price, per split beyond the parts' factors
        #: (:func:`fit_part_scale`'s ``"g,u"`` entries): a job on (g, u) pays each part at
        #: its factor plus this (0 where not measured)
        self.split_shift: Dict[Tuple[int, int], float] = {}
        self._tables: Dict[Tuple[int, int, str], _Table] = {}
        self._jobs: Dict[tuple, Cost] = {}
        self.set_call_extra(self.profile.get("call_extra") or {})
        self.set_part_scale(self.profile.get("part_scale") or {})

    def set_part_scale(self, scale: dict) -> None:
        """``{part: factor}`` for the parts of :data:`SCALED` (others stay 1): each job's
        attention, token layers, communication and per-call overhead, and the step's constant
        part, times its factor (what :func:`fit_part_scale` measures on whole steps); and
        ``{"g,u": shift}``: a job on a group of g ranks with Ulysses degree u pays each part at
        its factor plus the shift (the split's own error beyond the common factors; none given:
        0).  A part's factor plus a shift is kept at least a fifth of the factor."""
        splits = {k: v for k, v in scale.items() if _split_key(k) is not None}
        bad = sorted(set(scale) - set(SCALED) - set(splits))
        if bad:
            raise ValueError(f"part_scale: unknown parts {bad}; the parts are {list(SCALED)} and \"g,u\" splits")
        for k in SCALED:
            f = float(scale.get(k, 1.0))
            if not (math.isfinite(f) and f > 0):
                raise ValueError(f"part_scale: {k} must be a positive number, got {scale.get(k)!r}")
            self.part_scale[k] = f
        self.split_shift.clear()
        for k, v in splits.items():
            d = float(v)
            if not math.isfinite(d):
                raise ValueError(f"part_scale: split {k} must have a finite shift, got {v!r}")
            if d:
                self.split_shift[_split_key(k)] = d     # type: ignore[index]
        self.__dict__.pop("_token_s", None)
        self._jobs.clear()

    def factors(self) -> Dict[str, float]:
        """What :meth:`set_part_scale` was given, as it holds it: every part's factor and each
        split's shift (``"g,u"``) that is not 0."""
        return {**self.part_scale, **{split_key(g, u): d for (g, u), d in sorted(self.split_shift.items())}}

    def part_factors(self, g: int, u: int) -> Dict[str, float]:
        """What each part of a job on (g, u) is priced at over its unscaled price: the part's
        factor plus the split's shift (:meth:`set_part_scale`)."""
        d = self.split_shift.get((int(g), int(u)), 0.0)
        return {k: shifted_factor(self.part_scale[k], d) for k in PARTS}

    def _shifted(self, g: int, u: int, parts: Dict[str, Any]) -> Dict[str, Any]:
        """``parts`` (priced at the parts' factors) moved to the split's own
        (:meth:`part_factors`), in place; ``time`` summed again where present."""
        if (g, u) not in self.split_shift:
            return parts
        f = self.part_factors(g, u)
        for k in PARTS:
            if k in parts:
                parts[k] = parts[k] * (f[k] / self.part_scale[k])
        if "time" in parts:
            parts["time"] = parts["attention"] + parts["communication"] + parts["tokens"] + parts["overhead"]
        return parts

    @property
    def attention_scale(self) -> float:
        """The factor on every priced attention: the whole-step calibration's (``part_scale``)
        times the model path's own (``call_attention``)."""
        return self.part_scale["attention"] * self.call_attention

    def set_call_extra(self, extra: dict) -> None:
        """``{"g,u,r": [seconds per call, per token per rank, per packed document]}`` (a number:
        per call), and ``"attention"``: the factor on every job's priced attention."""
        self.call_extra.clear()
        att = float(extra.get("attention", 1.0))
        if not (math.isfinite(att) and att > 0):
            raise ValueError(f"call_extra: attention must be a positive number, got {extra.get('attention')!r}")
        self.call_attention = att
        for key, val in extra.items():
            if key == "attention":
                continue
            g, u, _ = (int(x) for x in str(key).split(","))
            vals = [float(val)] if isinstance(val, (int, float)) else [float(v) for v in val]
            self.call_extra[(g, u)] = tuple(vals + [0.0] * (3 - len(vals)))
        self._jobs.clear()

    def _extra(self, g: int, u: int, tokens_per_rank, docs=1):
        """The model path's own cost of a job on (g, u) beyond the price: (its per-call and
        per-document part, its per-token part)."""
        fixed, per_token, per_doc = self.call_extra.get((g, u), (0.0, 0.0, 0.0))
        return (fixed + per_doc * (np.asarray(docs, dtype=np.float64) - 1),
                per_token * np.asarray(tokens_per_rank, dtype=np.float64))

    @property
    def layers(self) -> int:
        return self.shape.layers if self.shape.hidden else 1

    # ---------------------------------------------------------------- the token-proportional part
    def tokens_time(self, tokens_per_rank):
        """Seconds of the token-proportional layers for this many tokens on a rank (array ok):
        each token's GEMMs at the linear rate and elementwise bytes at the elementwise bandwidth,
        times the profile's ``token_scale`` (a calibration's measured over priced token, per
        layer and for the head; 1 where not measured)."""
        return np.asarray(tokens_per_rank, dtype=np.float64) * self._per_token

    @property
    def _per_token(self) -> float:
        got = self.__dict__.get("_token_s")
        if got is None:
            layer, head = self.shape.token_cost(self.linear_flops, self.elem_bw)
            scale = self.profile.get("token_scale") or {}
            got = self.__dict__["_token_s"] = ((self.layers * layer * float(scale.get("layer", 1.0)) if
                                                self.shape.hidden else 0.0) + head * float(scale.get("head", 1.0))
                                               ) * self.part_scale["tokens"]
        return got

    def call_overhead(self) -> float:
        """The fixed seconds of one model call beyond its attention calls (unscaled)."""
        return self.layers * self.layer_overhead + self.model_overhead

    def step_constant(self, world: int) -> float:
        """What every schedule of a step pays alike: the gradients summed over the world (one
        all-reduce) and the optimizer step (AdamW)."""
        return self._step_constant(world) * self.part_scale["constant"]

    def _step_constant(self, world: int) -> float:
        params = self.shape.parameters()
        if not params:
            return 0.0
        grad_bytes = params * (4 if self.shape.dtype in ("fp32", "fp64") else 2)
        t = _ADAMW_WORDS * 4.0 * params / self.elem_bw if self.elem_bw else 0.0
        t += float(self.profile.get("optimizer_overhead", 0.0))
        if world > 1:
            meas = (self.profile.get("collectives") or {}).get("all_reduce", {}).get("intra")
            if meas:
                bw, lat = float(meas["bandwidth"]), float(meas["latency"])
                t += lat + grad_bytes / bw
            else:
                gpn = int(self.profile.get("gpus_per_node") or world)
                link = self.profile.get("inter" if world > gpn else "intra") or self.profile["intra"]
                eff = float((self.profile.get("efficiency") or {}).get("all_gather", 1.0))
                t += float(link.get("latency", 0.0)) + 2 * (world - 1) / world * grad_bytes / (
                    float(link["bandwidth"]) * eff)
        return t

    # ---------------------------------------------------------------- attention, tabulated
    def _predict_one(self, g: int, u: int, layout: str, n: int) -> dict:
        """The table row of length ``n``: one sequence's assembled parts (:data:`_TOTALS`), what
        a packed job pays once at its total length (:data:`_AT_N`), the split's constants."""
        s = self.shape
        p = predict(Problem(g, s.heads, n, s.head_dim, s.kv_heads, 1, s.dtype, s.causal, s.bwd),
                    Candidate(u, g // u, layout), self.profile)
        d = p.detail
        assert d is not None
        return {"time": p.time, "attention": p.terms["kernel"] + p.terms["imbalance"] + d["merges"] + d["copies"],
                "communication": p.terms["ulysses_a2a"] + p.terms["ring_exposed"] + d["small"],
                "overhead": d["fixed"], "bytes": p.comm_bytes, "collectives": float(p.collectives),
                "pairs": float(_pairs(n, g // u, layout, s.causal) * _heads_on_busiest(s, u)),
                # paid once by a packed job, at its total length
                "a2a": d["a2a"], "copies": d["copies"], "comm_f": d["comm"].get(False, 0.0),
                "comm_b": d["comm"].get(True, 0.0),
                # constants of the split
                "small": d["small"], "launch": d["overhead"], "penalty": d["penalty"]}

    def _predict_pack(self, g: int, u: int, layout: str, n: int) -> dict:
        """The per-document columns of a packed job (:data:`_PACK`) at length ``n``: from a pack
        of two documents of ``n`` tokens, halved (inside a pack the block plan cuts every call at
        the documents' boundaries, so a document costs more than alone on a ring)."""
        s = self.shape
        pair = predict(Problem(g, s.heads, 2 * n, s.head_dim, s.kv_heads, 1, s.dtype, s.causal, s.bwd, (0, n, 2 * n)),
                       Candidate(u, g // u, layout), self.profile)
        dp = pair.detail
        assert dp is not None
        f = dp["steps"][False]
        b = dp["steps"].get(True, [(0.0, 0)] * len(f))
        rest = range(1, len(f))
        launches = sum(c for _, c in f)
        return {"kernel_work": dp["kernel_work"] / 2, "merges": dp["merges"] / 2,
                "w0_f": f[0][0] / 2, "wr_f": max((f[i][0] for i in rest), default=0.0) / 2,
                "w0_b": b[0][0] / 2, "wr_b": max((b[i][0] for i in rest), default=0.0) / 2,
                "c0": f[0][1] / 2, "cr": max((f[i][1] for i in rest), default=0) / 2,
                "k0": float(_kinds(2 * n, g // u, layout, s.causal, 0, (0, n, 2 * n))),
                "kr": float(_kinds(2 * n, g // u, layout, s.causal, 1, (0, n, 2 * n))),
                # launches on the mean rank per launch on the busiest (idle Ulysses ranks launch none)
                "busy": dp["mean_calls"] / (launches * (2 if s.bwd else 1)) if launches else 1.0}

    def table(self, g: int, u: int, layout: str) -> _Table:
        """The table of a split, built at its first use up to ``top`` tokens per rank."""
        key = (g, u, layout)
        t = self._tables.get(key)
        if t is None:
            t = self._tables[key] = _Table(self, g, u, layout, min(self.top * g, 1 << 20))
        return t

    def alone(self, lengths, g: int, u: int, layout: str, cols: Sequence[str] = _TOTALS) -> Dict[str, np.ndarray]:
        """One sequence's job on ``u x (g / u)`` for each of ``lengths`` (arrays, one entry per
        length; ``time`` and the :data:`PARTS`, ``bytes``, ``collectives``, ``pairs``; ``cols``
        those needed: ``("time",)`` is the cheapest).  The lengths must give every rank a token
        (:func:`least_tokens`)."""
        n = np.asarray(lengths, dtype=np.float64)
        want = set(cols) | ({"attention", "communication", "overhead"} if "time" in cols else set())
        t = self.table(g, u, layout).at(n, [c for c in _TOTALS if c in want and c not in ("time", "tokens")])
        L = self.layers
        out: Dict[str, np.ndarray] = {}
        for k in ("attention", "communication", "bytes", "collectives"):
            if k in t:
                out[k] = L * t[k]
        if "pairs" in t:
            out["pairs"] = t["pairs"]
        sc = self.part_scale
        if "attention" in out:
            out["attention"] = out["attention"] * self.attention_scale
        if "communication" in out:
            out["communication"] = out["communication"] * sc["communication"]
        fixed, per_token = self._extra(g, u, np.ceil(n / g))
        if "overhead" in t:
            out["overhead"] = (L * t["overhead"] + self.call_overhead() + fixed) * sc["overhead"]
        if "tokens" in want or "time" in want:
            out["tokens"] = self.tokens_time(np.ceil(n / g)) + per_token * sc["tokens"]
        if "time" in want:
            out["time"] = out["attention"] + out["communication"] + out["tokens"] + out["overhead"]
        return self._shifted(g, u, out)

    def job(self, lengths: Tuple[int, ...], g: int, u: int, layout: str) -> Cost:
        """The price of one job: one sequence, or several packed (each document priced on its
        own, the call's fixed cost, all-to-alls and ring messages paid once for all)."""
        key = (tuple(lengths), g, u, layout)
        got = self._jobs.get(key)
        if got is None:
            if len(self._jobs) > 200_000:
                self._jobs.clear()
            got = self._jobs[key] = self.costs([tuple(lengths)], g, u, layout)[0]
        return got

    def costs(self, jobs: Sequence[Tuple[int, ...]], g: int, u: int, layout: str) -> List[Cost]:
        """:meth:`job` for many jobs of one split at once (one table lookup per column)."""
        out: List[Optional[Cost]] = [None] * len(jobs)
        ones = [k for k, ls in enumerate(jobs) if len(ls) == 1]
        if ones:
            a = self.alone([jobs[k][0] for k in ones], g, u, layout)
            for j, k in enumerate(ones):
                out[k] = Cost(u, g // u, layout, float(a["time"][j]), int(a["pairs"][j]), float(a["bytes"][j]),
                              int(round(float(a["collectives"][j]))), float(a["attention"][j]), float(a["tokens"][j]),
                              float(a["communication"][j]), float(a["overhead"][j]))
        many = [k for k, ls in enumerate(jobs) if len(ls) > 1]
        if many:
            for k, c in zip(many, self._packed([jobs[k] for k in many], g, u, layout)):
                out[k] = c
        return out    # type: ignore[return-value]

    def job_exact(self, lengths: Tuple[int, ...], g: int, u: int, layout: str) -> Cost:
        """:meth:`job` from one direct prediction of the packed call (its exact block plan, any
        layout; slower: what the tables are checked against)."""
        s = self.shape
        total = int(sum(lengths))
        cu = None
        if len(lengths) > 1:
            acc = [0]
            for n in lengths:
                acc.append(acc[-1] + int(n))
            cu = tuple(acc)
        p = predict(Problem(g, s.heads, total, s.head_dim, s.kv_heads, 1, s.dtype, s.causal, s.bwd, cu),
                    Candidate(u, g // u, layout), self.profile)
        d = p.detail
        assert d is not None
        L, sc = self.layers, self.part_scale
        attention = L * (p.terms["kernel"] + p.terms["imbalance"] + d["merges"] + d["copies"]) * self.attention_scale
        communication = L * (p.terms["ulysses_a2a"] + p.terms["ring_exposed"] + d["small"]) * sc["communication"]
        fixed, per_token = self._extra(g, u, math.ceil(total / g), len(lengths))
        overhead = (L * d["fixed"] + self.call_overhead() + float(fixed)) * sc["overhead"]
        tokens = float(self.tokens_time(math.ceil(total / g)) + per_token * sc["tokens"])
        moved = self._shifted(g, u, {"attention": attention, "tokens": tokens, "communication": communication,
                                     "overhead": overhead})
        attention, tokens, communication, overhead = (moved[k] for k in PARTS)
        from .planner import call_pairs, ring_work
        work, _, _ = ring_work(layout, total, g // u, s.causal, cu)
        pairs = max(sum(call_pairs(c) for st in rank for c in st) for rank in work) * _heads_on_busiest(s, u)
        return Cost(u, g // u, layout, attention + communication + overhead + tokens, pairs, L * p.comm_bytes,
                    L * p.collectives, attention, tokens, communication, overhead)

    def _packed(self, jobs: Sequence[Tuple[int, ...]], g: int, u: int, layout: str) -> List[Cost]:
        tab = self.table(g, u, layout)
        sizes = np.array([len(ls) for ls in jobs])
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        flat = np.array([n for ls in jobs for n in ls], dtype=np.float64)
        docs = tab.at(flat, _PACK + ("pairs",))
        total = np.add.reduceat(flat, starts)
        at_n = tab.at(total, _AT_N, extrapolate=True)

        def summed(k):
            return np.add.reduceat(docs[k], starts)
        ov, r, pen = tab.launch, g // u, tab.penalty
        if self.varlen:     # one launch per kind of call and step
            c0, cr = np.maximum.reduceat(docs["k0"], starts), np.maximum.reduceat(docs["kr"], starts)
        else:
            c0, cr = summed("c0"), summed("cr")
        crit = np.zeros(len(jobs))
        ring_time = np.zeros(len(jobs))
        for p in ("f", "b") if self.shape.bwd else ("f",):
            comm = at_n[f"comm_{p}"]
            first = summed(f"w0_{p}") + ov * c0
            rest = summed(f"wr_{p}") + ov * cr
            crit += first + (r - 1) * rest
            if r == 1:
                ring_time += first
            else:     # each step but the last hides the next block's move behind its compute (planner.ring_pass)
                hop_first = np.maximum(first, comm) + pen * np.minimum(first, comm)
                hop_rest = np.maximum(rest, comm) + pen * np.minimum(rest, comm)
                ring_time += hop_first + (r - 2) * hop_rest + rest
        launches = (c0 + cr * (r - 1)) * (2 if self.shape.bwd else 1) * tab.busy
        kmean = summed("kernel_work") + ov * launches
        L, sc = self.layers, self.part_scale
        work = kmean + np.maximum(0.0, crit - kmean) + summed("merges") + at_n["copies"]
        attention = L * work * self.attention_scale
        communication = L * (at_n["a2a"] + np.maximum(0.0, ring_time - crit) + tab.small) * sc["communication"]
        fixed, per_token = self._extra(g, u, np.ceil(total / g), sizes)
        overhead = (L * tab.fixed + self.call_overhead() + fixed) * sc["overhead"]
        tokens = self.tokens_time(np.ceil(total / g)) + per_token * sc["tokens"]
        moved = self._shifted(g, u, {"attention": attention, "tokens": tokens, "communication": communication,
                                     "overhead": overhead})
        attention, tokens, communication, overhead = (moved[k] for k in PARTS)
        time = attention + communication + overhead + tokens
        pairs = summed("pairs")
        return [Cost(u, r, layout, float(time[k]), int(pairs[k]), L * float(at_n["bytes"][k]),
                     int(round(L * float(at_n["collectives"][k]))), float(attention[k]), float(tokens[k]),
                     float(communication[k]), float(overhead[k])) for k in range(len(jobs))]


#: how strongly a fitted factor is held near 1 (per factor, in squared relative error: 0.01 is
#: one step's 10% error), and the factors' range
PRIOR = 0.01
SCALE_RANGE = (0.2, 5.0)
#: how strongly a split's shift is held at 0: as much as one step made only of that split's
#: jobs (on this CPU a step's time moves by about as much as a split's error, 5-10%, so one
#: step alone should not set it; eight such steps carry it most of the way)
SHIFT_PRIOR = 1.0


def fit_part_scale(samples: Sequence[Tuple[Dict[str, float], float]],
                   apart: Sequence[str] = ("overhead",), shift_prior: float = SHIFT_PRIOR) -> Dict[str, float]:
    """Factors for the parts of :data:`SCALED` that bring priced steps nearest their measured
    times: ``samples`` of (a schedule's slowest-rank parts, :meth:`Schedule.parts` priced with
    every factor 1 (``unscaled=True``), and the step's measured seconds).  One factor common to
    every part, and one of its own for each part in ``apart`` (the per-call overhead: what
    separates a schedule of many calls from one of few; parts that every schedule of a batch
    pays alike, such as the token layers and the step's constant part, cannot be told apart by
    a few batches, so they share the common one).  Where the parts carry ``"g,u"`` entries (the
    slowest rank's jobs on each split, unscaled, as :meth:`Schedule.parts` gives them), also a
    shift per split: what a job on that split pays beyond the common factors, per second of its
    unscaled price (a split whose kernel, messages or calls the profile misses by more than the
    others).  Least squares on the relative error, each factor held near 1 by :data:`PRIOR`
    (a part no sample exercises keeps the common factor) and each shift near 0 by
    ``shift_prior`` (:data:`SHIFT_PRIOR`; a split no sample exercises pays the common factors),
    the factors kept within :data:`SCALE_RANGE` and the shifts within it less 1; the idle part
    is not scaled.  Returns ``{part: factor}`` and, with splits, ``{"g,u": shift}``.  A pure
    function: ranks given the same samples get the same factors."""
    apart = [k for k in apart if k in SCALED]
    common = [k for k in SCALED if k not in apart]
    splits = sorted({k for parts, _ in samples for k in parts if _split_key(k) is not None},
                    key=lambda k: _split_key(k))     # type: ignore[arg-type,return-value]
    rows, target = [], []
    for parts, took in samples:
        if not (took > 0 and math.isfinite(took)):
            raise ValueError(f"fit_part_scale: a measured step of {took!r} seconds")
        rows.append([sum(float(parts.get(k, 0.0)) for k in common) / took] +
                    [float(parts.get(k, 0.0)) / took for k in apart] +
                    [float(parts.get(k, 0.0)) / took for k in splits])
        target.append(1.0 - float(parts.get("idle", 0.0)) / took)
    n = 1 + len(apart)
    w = math.sqrt(PRIOR)
    prior = np.diag([w] * n + [math.sqrt(float(shift_prior))] * len(splits))
    a = np.vstack([np.array(rows, dtype=np.float64).reshape(-1, n + len(splits)), prior])
    b = np.concatenate([np.array(target, dtype=np.float64), w * np.ones(n), np.zeros(len(splits))])
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    lo, hi = SCALE_RANGE
    factors = [float(min(hi, max(lo, v))) for v in x[:n]]
    out = {k: factors[0] for k in common}
    out.update({k: factors[1 + i] for i, k in enumerate(apart)})
    res = {k: out[k] for k in SCALED}
    res.update({k: float(min(hi - 1.0, max(lo - 1.0, x[n + i]))) for i, k in enumerate(splits)})
    return res


def shifted_factor(factor: float, shift: float) -> float:
    """A part's factor on a split with that shift: their sum, kept at least a fifth of the factor
    (what a job is priced at, and what :meth:`Schedule.parts` divides by to undo it)."""
    return max(factor + shift, 0.2 * factor)


def fitted_seconds(parts: Dict[str, float], factors: Dict[str, float]) -> float:
    """A step's seconds as :func:`fit_part_scale` models them: its unscaled parts
    (:meth:`Schedule.parts` with ``unscaled=True``) each at its factor, each split's share at
    its shift, and the idle part as it is (``factors``: what :meth:`StepModel.factors` gives;
    a part it lacks at 1, a split at 0)."""
    return (sum(parts[k] * factors.get(k, 1.0) for k in SCALED) + parts["idle"] +
            sum(v * factors.get(k, 0.0) for k, v in parts.items() if _split_key(k) is not None))


def _split_key(key) -> Optional[Tuple[int, int]]:
    """``"g,u"`` -> (g, u); None for anything else (a part's name)."""
    bits = str(key).split(",")
    if len(bits) != 2 or not all(b.strip().isdigit() for b in bits):
        return None
    return int(bits[0]), int(bits[1])


def split_key(g: int, u: int) -> str:
    """The ``"g,u"`` name of a split in :meth:`Schedule.parts` and :func:`fit_part_scale`."""
    return f"{int(g)},{int(u)}"


#: a measured step more than this many times from the window's median (over its unscaled
#: price) is left out of :class:`StepRefit`'s fit
REFIT_OUTLIER = 2.0


class StepRefit:
    """The whole-step factors (:func:`fit_part_scale`) kept fitted to a run's last ``window``
    measured steps, so the price follows the machine's speed as the run goes on instead of
    holding what a few calibration batches measured before it.

    ``record(parts, seconds)``: a step's slowest-rank parts priced with every factor 1
    (:meth:`usp_hal.planning.schedule.Schedule.parts` with ``unscaled=True``) and its measured
    seconds (the slowest rank's, the same on every rank); the factors are refitted to the window
    and set on ``model``, for every job priced after it.  A step whose time over its unscaled
    price is more than :data:`REFIT_OUTLIER` times from the window's median (a period that held
    an evaluation or a checkpoint, say) stays in the window but out of the fit, so one such step
    cannot move the price; a lasting change of speed becomes the median within half a window.
    ``samples``: where the window starts (what
    :meth:`usp_hal.planning.dynamic.DynamicDegree.calibrate_steps` measured).  A pure function
    of what it is given: ranks fed the same steps hold the same factors."""

    def __init__(self, model: "StepModel", window: int, samples: Sequence[Tuple[Dict[str, float], float]] = ()):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"StepRefit: window must be an int >= 1 (the measured steps fitted), got {window!r}")
        self.model = model
        self.window = window
        self.samples: "deque[Tuple[Dict[str, float], float]]" = deque(maxlen=window)
        for parts, took in samples:
            self._add(parts, took)

    def _add(self, parts: Dict[str, float], seconds: float) -> None:
        took = float(seconds)
        if not (took > 0 and math.isfinite(took)):
            raise ValueError(f"StepRefit: a measured step of {seconds!r} seconds")
        self.samples.append(({k: float(v) for k, v in parts.items()}, took))

    def record(self, parts: Dict[str, float], seconds: float) -> Dict[str, float]:
        """One more measured step; returns the factors (and split shifts) now set on the model."""
        self._add(parts, seconds)
        ratios = [took / max(sum(p.get(k, 0.0) for k in SCALED + ("idle",)), 1e-30) for p, took in self.samples]
        mid = float(np.median(ratios))
        kept = [s for s, x in zip(self.samples, ratios) if mid / REFIT_OUTLIER <= x <= mid * REFIT_OUTLIER]
        scale = fit_part_scale(kept)
        self.model.set_part_scale(scale)
        return self.model.factors()


def fit_call_extra(samples: Sequence[Tuple[Tuple[int, int, int], int, int, Cost, float]]) -> Dict[str, Any]:
    """The model path's own cost against its price (what
    :func:`usp_hal.integrations.transformers.calibrate_calls` measures), from ``samples`` of
    (split ``(g, u, r)``, tokens per rank, packed documents, the job's price (a :class:`Cost`
    priced without any ``call_extra``), the job's measured seconds).

    The single-sequence jobs' excess (measured less priced) is fitted by one least-squares fit
    on the relative error: per split a part per call and one per token, and one factor on the
    priced attention common to every split (the kernel as the model path runs it against the
    kernel the profile measured: what grows with the square of a job's length, which a part
    per token cannot follow; kept within :data:`SCALE_RANGE`).  A packed job's excess beyond
    that fit, over its documents but one, is the split's part per packed document (0 where
    none was measured; never below 0).  A split's part per token is never below half its
    price per token, and its part per call never below minus its priced overhead.  Each split
    needs single-sequence jobs of two sizes or more.  Returns ``{"attention": factor, "g,u,r":
    [seconds per call, seconds per token per rank, seconds per document], ...}``, what
    :meth:`StepModel.set_call_extra` takes.  A pure function: ranks given the same samples get
    the same result."""
    splits = sorted({tuple(int(v) for v in s[0]) for s in samples})
    single = [s for s in samples if s[2] == 1]
    for split in splits:
        have = {int(n) for sp, n, _, _, _ in single if tuple(sp) == split}
        if len(have) < 2:
            raise ValueError(f"fit_call_extra: split {split} has single-sequence jobs of {sorted(have)} tokens per "
                             "rank; two sizes or more tell its part per call from its part per token")
    for s in samples:
        if not (s[4] > 0 and math.isfinite(s[4])):
            raise ValueError(f"fit_call_extra: a measured job of {s[4]!r} seconds")
    rows = np.zeros((len(single), 2 * len(splits) + 1))
    rhs = np.zeros(len(single))
    for k, (sp, n, _, cost, took) in enumerate(single):
        i = splits.index(tuple(sp))
        w = 1.0 / max(cost.time, 1e-9)
        rows[k, 2 * i], rows[k, 2 * i + 1], rows[k, -1] = w, w * float(n), w * cost.attention
        rhs[k] = w * (took - cost.time)
    x = np.linalg.lstsq(rows, rhs, rcond=None)[0]
    lo, hi = SCALE_RANGE
    att = float(min(hi, max(lo, 1.0 + x[-1])))
    out: Dict[str, Any] = {"attention": att}
    for i, split in enumerate(splits):
        mine = [s for s in single if tuple(s[0]) == split]
        top = max(mine, key=lambda s: s[1])
        least = min(mine, key=lambda s: s[1])
        per_token = max(float(x[2 * i + 1]), -0.5 * top[3].tokens / top[1])
        fixed = max(float(x[2 * i]), -least[3].overhead)
        docs = [max(0.0, (took - cost.time - (fixed + per_token * n + (att - 1.0) * cost.attention)) / (d - 1))
                for sp, n, d, cost, took in samples if tuple(sp) == split and d > 1]
        out["{},{},{}".format(*split)] = [fixed, per_token, sum(docs) / len(docs) if docs else 0.0]
    return out


def _heads_on_busiest(shape: AttentionShape, u: int) -> int:
    from ..parallel.heads import head_plan
    return max(b - a for a, b in head_plan(shape.heads, shape.kv_heads or shape.heads, u).q)


def _pairs(n: int, r: int, layout: str, causal: bool) -> int:
    from .planner import call_pairs, ring_work
    work, _, _ = ring_work(layout, n, r, causal)
    return max(sum(call_pairs(c) for step in rank_steps for c in step) for rank_steps in work)


def _kinds(n: int, r: int, layout: str, causal: bool, step: int, cu=None) -> int:
    """Kinds of call (causal square, full rectangle) at ``step`` on the busiest ring rank."""
    from .planner import ring_work
    work, _, _ = ring_work(layout, n, r, causal, cu)
    if step >= r:
        return 0
    return max(len({c[2] for c in rank_steps[step]}) for rank_steps in work)


def shape_fields() -> Tuple[str, ...]:
    return tuple(f.name for f in fields(AttentionShape))
