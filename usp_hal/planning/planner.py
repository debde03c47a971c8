"""``usp_hal.plan``: choose the Ulysses x Ring split, layout, rotation and wire format from a
cost model of the machine.

The model (docs/planning.md has the long form) predicts the time of one attention call
(forward, or forward + backward) for every valid configuration:

    time = kernel + imbalance + ulysses all-to-all + ring exposed comm + other

* **kernel**: the query-key pairs each rank scores, counted with the library's own block
  plans (``usp_hal.sequence.blocks.block_plans``: every ring rank x source block), times the heads
  the rank holds after the Ulysses split (``usp_hal.parallel.heads.head_plan``; ranks beyond H hold
  none), at the profile's throughput per (dtype, head dim), plus a cost per kernel call.
  Causal squares cost ``causal_factor`` of a full square (measured on CPU); a profile
  that measured it per size gives ``causal_tile`` instead: an n x n causal square costs
  ``0.5 + causal_tile / n`` of a full one (the diagonal tiles run whole), at most 1.
* **imbalance**: the ring runs in lock step, so each step costs the slowest rank's
  compute; the excess over the mean rank is reported as imbalance (idle heads included).
* **ulysses all-to-all**: ``latency + bytes / bandwidth`` per collective, exposed (the
  async path, AsyncLongContextAttention with 2 head groups, hides all but one group's).
* **ring exposed comm**: p2p moves one K/V block per step while the previous block
  computes: exposed = max(0, comm - compute) (+ an overlap penalty for the slowdown of
  compute that shares the device with communication).  all-gather gathers every block
  while the own block computes.
* **other**: the online-softmax merges, the local re-layout copies and the per-call
  metadata all-gather.

Packed documents (``cu_seqlens``): the block plan then pairs only pieces of the same
document, so the kernel term counts exactly the calls the ring makes; ``varlen_zigzag``
joins the candidate layouts; a layout that keeps every document on one ring rank exchanges
no K/V (the ring's local-only rotation), so its ring term is zero.

Candidates come from the tables: every registered layout (``usp_hal.sequence.positions.LAYOUTS``; a
per-document one only with ``cu_seqlens``), every registered rotation
(``usp_hal.parallel.rotation.ROTATIONS``; modelled as p2p or all-gather by what it derives from),
and, with ``fp8=True``, every lossy wire codec (``usp_hal.parallel.codec.CODECS``) on q/v/out or
q/k/v/out, whose bytes are the codec's own ``wire_bytes``.

Machine descriptions are profiles (``usp_hal/profiles/*.json``): link bandwidths and
latencies, kernel throughput, memory, all with their sources; ``cpu`` is measured on the
machine that built the package (``usp-hal plan --calibrate`` measures another).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..parallel.codec import CODECS, get_codec
from ..parallel.heads import head_plan, most_groups
from ..parallel.rotation import ROTATIONS as _ROTATION_TABLE
from ..parallel.rotation import AllGatherRotation, P2PRotation
from ..sequence.blocks import balance, block_plans
from ..sequence.positions import LAYOUTS as _LAYOUT_TABLE
from ..sequence.positions import as_cu_seqlens, get_layout, ring_segments

PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "profiles")   # usp_hal/profiles/
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "half": "fp16"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
WIRE_PATTERNS = ("qvo", "qkvo")     # which Ulysses tensors a lossy codec carries: q, v, out (and k)
TERMS = ("kernel", "imbalance", "ulysses_a2a", "ring_exposed", "other")
FLOPS_PER_PAIR = 4        # x head_dim: QK^T (2D) + PV (2D) per query-key pair, forward
BWD_FLOPS_RATIO = 2.5     # backward: recompute QK^T + 4 more matmuls = 10D per pair


class PlanError(ValueError):
    """Invalid planning arguments (the message names a valid alternative)."""


# ---------------------------------------------------------------------------------- the tables
def layout_candidates(packed: bool = False) -> Tuple[str, ...]:
    """The registered layouts (``usp_hal.sequence.positions.LAYOUTS``, in registration order); a
    per-document layout only for packed documents (``packed``)."""
    return tuple(name for name, lay in _LAYOUT_TABLE.items()
                 if (packed or lay.per_document is None) and lay.fixed is None)


def rotation_candidates() -> Tuple[str, ...]:
    """The registered rotations (``usp_hal.parallel.rotation.ROTATIONS``)."""
    return tuple(_ROTATION_TABLE)


def rotation_model(name: str) -> Optional[str]:
    """How the cost model times a rotation: ``"allgather"`` (every block gathered while the
    own block computes) or ``"p2p"`` (one hop per step), by the class it derives from (or
    its ``cost_model`` attribute); None: the model does not know it."""
    cls = _ROTATION_TABLE.get(name)
    if cls is None:
        return None
    model = getattr(cls, "cost_model", None)
    if model in ("p2p", "allgather"):
        return str(model)
    if issubclass(cls, AllGatherRotation):
        return "allgather"
    if issubclass(cls, P2PRotation):
        return "p2p"
    return None


def wire_candidates(dtype: str) -> Tuple[str, ...]:
    """The Ulysses wire formats worth trying for ``dtype``: ``"none"``, and for 16-bit inputs
    every lossy codec of ``usp_hal.parallel.codec.CODECS`` on q/v/out (``"qvo"``) and on q/k/v/out
    (``"qkvo"``); the fp8 codec spelled as the bare pattern, another as ``"name:pattern"``."""
    out = ["none"]
    if dtype in ("bf16", "fp16"):
        for name, cls in CODECS.items():
            if getattr(cls, "lossy", False) and not getattr(cls, "identity", True):
                out += [pat if name == "fp8" else f"{name}:{pat}" for pat in WIRE_PATTERNS]
    return tuple(out)


def wire_codec(fp8: str) -> Tuple[str, str]:
    """A candidate's wire (``"none"``, ``"qvo"``, ``"bf16:qkvo"``, ...) as (codec, pattern)."""
    if fp8 == "none":
        return "identity", "none"
    name, _, pat = fp8.rpartition(":")
    return (name or "fp8"), pat


def __getattr__(name: str):
    # the candidate lists of earlier versions, now read from the tables
    if name == "LAYOUTS":
        return layout_candidates(False)
    if name == "PACKED_LAYOUTS":
        return layout_candidates(True)
    if name == "ROTATIONS":
        return rotation_candidates()
    if name == "FP8_WIRES":
        return ("none",) + WIRE_PATTERNS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------- profiles
def list_profiles() -> List[str]:
    try:
        return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
    except OSError:
        return []


def load_profile(name_or_path: str) -> dict:
    """A profile by name (``usp_hal/profiles/<name>.json``) or by path to a JSON file."""
    path = name_or_path
    if not os.path.isfile(path):
        path = os.path.join(PROFILE_DIR, f"{name_or_path}.json")
    if not os.path.isfile(path):
        raise PlanError(f"unknown profile {name_or_path!r}; built in: {', '.join(list_profiles())} "
                        f"(or pass a path to a profile JSON, e.g. one written by `usp-hal plan --calibrate`)")
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise PlanError(f"profile {path}: not a readable JSON profile ({type(exc).__name__}: {exc}); pass a built-in "
                        f"name ({', '.join(list_profiles())}) or a JSON file written by `usp-hal plan --calibrate`"
                        ) from None
    if not isinstance(prof, dict):
        raise PlanError(f"profile {path}: a profile is a JSON object, got {type(prof).__name__}")
    for key in ("intra", "kernel"):
        if key not in prof:
            raise PlanError(f"profile {path}: missing {key!r}")
    prof.setdefault("name", os.path.splitext(os.path.basename(path))[0])
    return prof


def save_profile(prof: dict, path: str) -> str:
    with open(path, "w") as f:
        json.dump(prof, f, indent=2)
        f.write("\n")
    return path


def profile_with_links(base: Optional[dict], *, intra_bw: Optional[float] = None, inter_bw: Optional[float] = None,
                       latency: Optional[float] = None, gpus_per_node: Optional[int] = None) -> dict:
    """A copy of ``base`` with explicit link numbers (bytes/s per rank and direction; seconds).
    Explicit numbers replace the profile's per-collective measurements too."""
    if base is None:
        raise PlanError("explicit --intra-bw/--inter-bw/--latency need a kernel throughput: add --profile NAME "
                        f"(its kernel numbers are kept; one of {', '.join(list_profiles())})")
    prof = json.loads(json.dumps(base))
    for scope, bw in (("intra", intra_bw), ("inter", inter_bw)):
        link = prof.setdefault(scope, dict(prof["intra"]))
        if bw is not None:
            if bw <= 0:
                raise PlanError(f"--{scope}-bw must be > 0 (bytes/s), got {bw}")
            link["bandwidth"] = float(bw)
        if latency is not None:
            if latency < 0:
                raise PlanError(f"--latency must be >= 0 (seconds), got {latency}")
            link["latency"] = float(latency)
    if intra_bw is not None or inter_bw is not None or latency is not None:
        prof.pop("collectives", None)
        prof["name"] = f"{prof.get('name', 'custom')}+links"
    if gpus_per_node:
        prof["gpus_per_node"] = int(gpus_per_node)
    return prof


# ---------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Problem:
    world: int
    heads: int
    seqlen: int
    head_dim: int
    kv_heads: Optional[int] = None
    batch: int = 1
    dtype: str = "bf16"
    causal: bool = False
    bwd: bool = False
    cu_seqlens: Optional[Tuple[int, ...]] = None      # packed documents: global boundaries
    mask: Optional[object] = None                     # a usp_hal.sequence.masks.Mask (its plan is priced)

    @property
    def hkv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Candidate:
    ulysses: int
    ring: int
    layout: str = "basic"
    rotation: str = "p2p"
    fp8: str = "none"          # Ulysses wire format: none | qvo | qkvo (fp8) | <codec>:qvo | <codec>:qkvo
    pipeline: int = 0          # >0: AsyncLongContextAttention(head_chunks=pipeline)
    low_memory: bool = False   # LongContextAttention(low_memory=True): head groups one after another

    @property
    def label(self) -> str:
        if self.ring == 1:
            name = f"ulysses{self.ulysses}"
        else:
            name = f"ring{self.ring}" if self.ulysses == 1 else f"usp{self.ulysses}x{self.ring}"
            name = f"{name} {self.layout} {self.rotation}"
        wire = (self.fp8 if ":" in self.fp8 else f"fp8:{self.fp8}") if self.fp8 != "none" else ""
        extra = [wire, f"async{self.pipeline}" if self.pipeline else "", "low_memory" if self.low_memory else ""]
        return " ".join([name] + [e for e in extra if e])


@dataclass
class Prediction:
    candidate: Candidate
    time: float
    terms: Dict[str, float]
    comm_bytes: float           # bytes one rank sends per call (slowest rank)
    mem_per_rank: float         # bytes: inputs, exchanged tensors, ring buffers, accumulators
    work_balance: Optional[float]   # max/min over ranks of query-key pairs x heads (None: a rank idles)
    collectives: int
    placement: str
    dominant: str = ""
    why: str = ""
    valid: bool = True
    reason: str = ""
    #: the model's parts before they are summed into terms (what :mod:`usp_hal.planning.stepcost`
    #: tabulates to price packed jobs from their documents)
    detail: Optional[dict] = field(default=None, repr=False, compare=False)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("detail", None)
        d["label"] = self.candidate.label
        return d


# ---------------------------------------------------------------------------------- work
def fit_causal_tile(points: Sequence[Tuple[int, float]]) -> float:
    """Least squares fit of ``share = 0.5 + tile / n`` to measured (n, causal share) points:
    the causal kernel runs its diagonal tiles whole, so small squares save less."""
    xs = [1.0 / n for n, _ in points]
    ys = [max(0.0, y - 0.5) for _, y in points]
    den = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / den if den else 0.0


@lru_cache(maxsize=256)
def ring_work(layout: str, seqlen: int, ring: int, causal: bool, cu_seqlens: Optional[Tuple[int, ...]] = None):
    """Per ring rank, per step (p2p order: step s meets the block of rank (r - s) mod R):
    a tuple of (rows, cols, causal_square) kernel calls, from the library's block planner
    (with ``cu_seqlens``: the per-document calls of a packed batch); the shard lengths; and
    whether no document spans two ring ranks (the ring then moves no K/V)."""
    rp = block_plans(layout, seqlen, ring, causal=causal, cu_seqlens=cu_seqlens)
    return tuple(rp.step_blocks(r) for r in range(ring)), rp.lengths, rp.local_only


def call_pairs(call) -> int:
    rows, cols, causal = call
    return rows * (rows + 1) // 2 if causal else rows * cols


# ---------------------------------------------------------------------------------- model
class _Machine:
    def __init__(self, prof: dict, world: int):
        self.p = prof
        self.g = int(prof.get("gpus_per_node") or world)
        self.world = world

    # ---- kernel
    def kernel_entry(self, dtype: str, head_dim: int) -> dict:
        table = self.p["kernel"]
        ent = table.get(dtype)
        if ent is None:
            raise PlanError(f"profile {self.p.get('name')!r} has no kernel throughput for {dtype}; it has "
                            f"{', '.join(k for k in table if not k.startswith('_'))} (pass --dtype one of them, or "
                            "calibrate with that dtype)")
        ent = dict(ent)
        # optional per-head-dim scale of the throughput (measured, or the closest one)
        scales = ent.get("head_dim_scale") or {}
        if scales:
            dims = sorted(int(k) for k in scales)
            best = min(dims, key=lambda d: (abs(math.log2(d) - math.log2(head_dim)), d))
            ent["scale"] = float(scales[str(best)])
        else:
            ent["scale"] = 1.0
        return ent

    # ---- links
    def link(self, scope: str) -> dict:
        return self.p.get(scope) or self.p["intra"]

    def coll(self, kind: str, scope: str):
        """(bandwidth bytes/s per rank, latency s) for one collective kind in a scope."""
        meas = (self.p.get("collectives") or {}).get(kind, {}).get(scope)
        if meas:
            return float(meas["bandwidth"]), float(meas["latency"])
        ln = self.link(scope)
        eff = float((self.p.get("efficiency") or {}).get(kind, 1.0))
        return float(ln["bandwidth"]) * eff, float(ln.get("latency", 0.0))

    def domain(self) -> int:
        return int(self.p["intra"].get("domain_size") or self.g)

    def a2a_time(self, send_to: Dict[int, float], ranks: Sequence[int], me: int) -> float:
        """One all-to-all from rank ``me``: ``send_to[peer]`` bytes.  Peers on other nodes go
        over the inter link, peers in another PCIe domain of the node over the shared
        cross-domain path, the rest over the intra link; the slowest path decides."""
        bw_i, lat_i = self.coll("all_to_all", "intra")
        intra = inter = cross = 0.0
        for peer, b in send_to.items():
            if peer // self.g != me // self.g:
                inter += b
            elif peer // self.domain() != me // self.domain():
                cross += b
            else:
                intra += b
        t = (intra + cross) / bw_i if intra + cross else 0.0
        lat = lat_i
        if cross:
            t = max(t, self._cross_time(cross, sum(1 for r in ranks if r // self.domain() == me // self.domain())))
        if inter:
            bw_x, lat_x = self.coll("all_to_all", "inter")
            t = max(t, inter / bw_x)
            lat = max(lat, lat_x)
        return lat + t

    def _cross_time(self, nbytes: float, senders: int) -> float:
        cb = self.p["intra"].get("cross_domain_bandwidth")
        if not cb:
            return 0.0
        return nbytes * max(1, senders) / float(cb)

    def p2p_time(self, nbytes: float, hop_scope: str, concurrent_cross: int) -> float:
        bw, lat = self.coll("p2p", "inter" if hop_scope == "inter" else "intra")
        t = nbytes / bw
        if hop_scope == "cross":
            t = max(t, self._cross_time(nbytes, concurrent_cross))
        return lat + t

    def gather_time(self, nbytes_total_recv: float, scope: str) -> float:
        bw, lat = self.coll("all_gather", scope)
        return lat + nbytes_total_recv / bw

    def small_collective(self) -> float:
        """The per-call metadata all-gather (none with one rank)."""
        if self.world == 1:
            return 0.0
        scope = "inter" if self.world > self.g else "intra"
        return self.coll("all_gather", scope)[1]


def call_fixed(profile: dict, world: int, bwd: bool) -> float:
    """The fixed seconds of one attention call (the library's own work per call: metadata,
    dispatch, Python), forward (+ what a backward adds); ``call_overhead_local`` where the
    profile measured a one-rank call apart (it makes no collective)."""
    fwd = profile.get("call_overhead_local") if world == 1 else None
    base = float(fwd if fwd is not None else profile.get("call_overhead", 0.0))
    if not bwd:
        return base
    extra = profile.get("call_overhead_bwd_local") if world == 1 else None
    return base + float(extra if extra is not None else profile.get("call_overhead_bwd", 0.0))


def kernel_varlen(entry: dict) -> bool:
    """Whether a profile's kernel runs packed documents as one varlen launch per kind: its
    ``varlen`` field, else what the registered backend it names declares (``VARLEN_KERNEL``)."""
    if "varlen" in entry:
        return bool(entry["varlen"])
    from ..dispatch.registry import REGISTRY
    try:
        cls = REGISTRY.get(str(entry.get("backend")))
    except (KeyError, ValueError, ImportError, RuntimeError):
        return False
    return bool(getattr(cls, "VARLEN_KERNEL", False))


def ring_pass(comps: Sequence[float], comm: float, penalty: float) -> Tuple[float, float]:
    """One lock-step pass of a p2p ring: ``comps`` the busiest rank's compute per step; the
    next block moves (``comm`` seconds) while a step computes.  Returns (time, compute)."""
    R = len(comps)
    time = sum(max(c, comm) + penalty * min(c, comm) for c in comps[:R - 1]) + comps[R - 1]
    return time, sum(comps)


def _placement(c: Candidate, world: int, g: int) -> str:
    inside = c.ulysses <= g and g % c.ulysses == 0
    nodes = max(1, -(-world // g))
    if nodes == 1:
        return "one node"
    return (f"{nodes} nodes; Ulysses groups inside a node, ring across nodes" if inside else
            f"{nodes} nodes; Ulysses groups span nodes (degree {c.ulysses} > {g} GPUs per node)")


def predict(problem: Problem, cand: Candidate, profile: dict) -> Prediction:
    """The predicted cost of one configuration (see the module docstring)."""
    P, C, M = problem, cand, _Machine(profile, problem.world)
    U, R, S, D, B = C.ulysses, C.ring, P.seqlen, P.head_dim, P.batch
    e = P.elem
    e_acc = 8 if P.dtype == "fp64" else 4
    hp = head_plan(P.heads, P.hkv, U)
    hq = [b - a for a, b in hp.q]                   # query heads per Ulysses rank
    hk = [b - a for a, b in hp.kv]                  # KV heads that travel to each Ulysses rank
    hk_local = [hp.local_heads(u)[1] for u in range(U)]
    if P.mask is not None:     # the masked plan: skipped tiles cost nothing, partial runs their rectangle
        from ..sequence.masks import ring_work as masked_ring_work
        work, shard, local_ring = masked_ring_work(P.mask, C.layout, S, R, P.causal, P.cu_seqlens)
    else:
        work, shard, local_ring = ring_work(C.layout, S, R, P.causal, P.cu_seqlens)
    kent = M.kernel_entry(P.dtype, D)
    fwd_rate = float(kent["fwd_flops"]) * kent["scale"]
    bwd_rate = float(kent.get("bwd_flops", fwd_rate / 1.2)) * kent["scale"]
    overhead = float(kent.get("call_overhead", 0.0))
    if R > 1:       # a ring step's call, with its piece of the accumulator's bookkeeping, where measured apart
        overhead = float(kent.get("ring_call_overhead", overhead))
    cf = float(kent.get("causal_factor", 0.5))
    tile = kent.get("causal_tile")
    key_half = float(kent.get("key_half", 0.0))   # keys per row at which the kernel runs at half its rate
    merge_s = float(profile.get("merge_s_per_elem", 0.0))
    copy_bw = float(profile.get("copy_bandwidth", 0.0)) or None
    penalty = float(profile.get("overlap_penalty", 0.0))
    fixed = call_fixed(profile, P.world, P.bwd)
    # a varlen kernel runs a step's per-document calls of one kind (causal squares, full
    # rectangles) as one launch (usp_hal.parallel.ring packs them); another kernel launches each
    varlen = P.cu_seqlens is not None and P.mask is None and kernel_varlen(kent)

    def kwork(call, h, bwd):
        """A call's kernel seconds without its launch overhead."""
        rows, cols, causal = call
        if h == 0:
            return 0.0
        share = (cf if tile is None else min(1.0, 0.5 + float(tile) / max(cols, 1))) if causal else 1.0
        pairs = rows * cols * share * (1.0 + key_half / max(cols, 1))
        if bwd:
            return BWD_FLOPS_RATIO * FLOPS_PER_PAIR * D * pairs * h * B / bwd_rate
        return FLOPS_PER_PAIR * D * pairs * h * B / fwd_rate

    def launches(calls) -> int:
        return len({c[2] for c in calls}) if varlen else len(calls)

    hmax = max(hq)
    passes = (False, True) if P.bwd else (False,)
    # per pass, ring rank, step: compute with the busiest Ulysses rank's heads, and its launches
    step_work = {b: [[sum(kwork(c, hmax, b) for c in work[r][s]) for s in range(R)] for r in range(R)]
                 for b in passes}
    step_calls = [[launches(work[r][s]) if hmax else 0 for s in range(R)] for r in range(R)]
    step_cost = {b: [[step_work[b][r][s] + overhead * step_calls[r][s] for s in range(R)] for r in range(R)]
                 for b in passes}
    busy = sum(1 for u in range(U) if hq[u])
    kernel_work = sum(kwork(c, hq[u], b) for b in passes for r in range(R) for u in range(U)
                      for st in work[r] for c in st) / (R * U)
    mean_calls = len(passes) * sum(step_calls[r][s] for r in range(R) for s in range(R)) * busy / (R * U)
    kernel_mean = kernel_work + overhead * mean_calls
    pairs_rank = [sum(call_pairs(c) for st in work[r] for c in st) * hq[u] for r in range(R) for u in range(U)]
    work_balance = balance(pairs_rank)
    merges = 0.0
    for r in range(R):
        # the ring's accumulator copies a row's first partial result and merges the later ones
        # (usp_hal.parallel.ring.Accumulator), so only rows that already hold one merge: packed
        # documents, whose calls cover disjoint rows and keys, merge nothing
        calls = [c for st in work[r] for c in st]
        again_q = max(0, sum(c[0] for c in calls) - shard[r])
        m = again_q * hmax * D * B
        if P.bwd:   # dq, dk, dv accumulation over the calls that meet the same rows / keys again
            again_k = max(0, sum(c[1] for c in calls) - shard[r])
            m += (again_q * hmax + 2 * again_k * max(hk_local)) * D * B
        merges = max(merges, m)
    other = merges * merge_s + fixed + M.small_collective()

    # ---- topology: ranks node-major; Ulysses ranks contiguous (use_ulysses_low=True)
    ring_ranks = [i * U for i in range(R)]
    if R > 1 and P.world > M.g:
        hop = "inter"
    elif R > 1 and len({r // M.domain() for r in ring_ranks}) > 1:
        hop = "cross"
    else:
        hop = "intra"
    cross_flows = U if hop == "cross" else 1

    # ---- Ulysses all-to-alls (rank 0 of each ring rank's group is representative; take the max)
    a2a_t, a2a_bytes, ncoll, fwd_t, copies = 0.0, 0.0, 0, 0.0, 0.0
    codec_name, pattern = wire_codec(C.fp8)
    fp8_q = pattern in ("qvo", "qkvo")
    fp8_k = pattern == "qkvo"
    # bytes per element on the wire, from the codec (fp8: D values + a float32 scale per token and head)
    coded_elem = get_codec(codec_name).wire_bytes((1, 1, D), TORCH_DTYPES[P.dtype]) / D if fp8_q else 0.0

    def wire(x_elem, coded):
        return coded_elem if coded else x_elem

    if U > 1:
        worst_t, worst_b = 0.0, 0.0
        for ringr in range(R):
            n_loc = shard[ringr] / U
            members = [ringr * U + u for u in range(U)]
            for u in range(U):
                me = members[u]
                fwd_in = {members[p]: B * n_loc * D
                          * (hq[p] * wire(e, fp8_q) + hk[p] * (wire(e, fp8_k) + wire(e, fp8_q)))
                          for p in range(U) if p != u}
                fwd_out = {members[p]: B * n_loc * D * hq[u] * wire(e, fp8_q) for p in range(U) if p != u}
                t = M.a2a_time(fwd_in, members, me) + M.a2a_time(fwd_out, members, me)
                b = sum(fwd_in.values()) + sum(fwd_out.values())
                fwd_t = max(fwd_t, t)
                if P.bwd:   # dout to heads, dq/dk/dv back (full precision)
                    bwd_in = {members[p]: B * n_loc * D * hq[p] * e for p in range(U) if p != u}
                    bwd_out = {members[p]: B * n_loc * D * (hq[u] + 2 * hk[u]) * e for p in range(U) if p != u}
                    t += M.a2a_time(bwd_in, members, me) + M.a2a_time(bwd_out, members, me)
                    b += sum(bwd_in.values()) + sum(bwd_out.values())
                worst_t, worst_b = max(worst_t, t), max(worst_b, b)
        a2a_t, a2a_bytes = worst_t, worst_b
        ncoll += 4 if P.bwd else 2
        if copy_bw:   # pack / unpack copies of everything that moves, both ends
            copies = 2 * a2a_bytes * U / max(U - 1, 1) / copy_bw
            other += copies
    ulysses_exposed = a2a_t
    if C.pipeline and U > 1:
        k = C.pipeline
        comp = kernel_mean
        ulysses_exposed = a2a_t / k + max(0.0, a2a_t * (k - 1) / k - comp * (k - 1) / k) \
            + penalty * min(a2a_t * (k - 1) / k, comp)
        ncoll = ncoll * k

    # ---- ring: each pass (forward; backward) runs in lock step over the R blocks
    ring_bytes = crit = ring_time = 0.0
    kv_block = max(B * shard[r] * 2 * max(hk) * D * e for r in range(R))   # K and V of a ring shard, after Ulysses
    grad_block = kv_block / e * e_acc
    scope = "inter" if hop == "inter" else "intra"
    steps: Dict[bool, List[Tuple[float, int]]] = {}       # per pass and step: the busiest rank's (work, launches)
    comms: Dict[bool, float] = {}
    for b in passes:
        cost = step_cost[b]
        busiest = [max(range(R), key=lambda r: cost[r][s]) for s in range(R)]
        steps[b] = [(step_work[b][r][s], step_calls[r][s]) for s, r in enumerate(busiest)]
        if R == 1 or local_ring:      # one block (or only the own block has work): no K/V moves
            comp = max(cost[r][0] for r in range(R))
            crit += comp
            ring_time += comp
            continue
        if rotation_model(C.rotation) != "allgather":
            nb = kv_block + (grad_block if b else 0.0)      # next K/V block (+ a dK/dV partial going home)
            comm = comms[b] = M.p2p_time(nb, hop, cross_flows)
            t, c = ring_pass([cost[r][s] for s, r in enumerate(busiest)], comm, penalty)
            ring_time += t
            crit += c
            ring_bytes += (R - 1) * nb
            ncoll += R - 1
        else:   # allgather: every block gathered while the own block computes
            gathered = kv_block * (R - 1)
            ag = M.gather_time(gathered, scope)
            if hop == "cross":   # about half the ring sits in the other domain, all rings send at once
                ag = max(ag, M._cross_time(kv_block * (R // 2), U * max(1, R // 2)))
            t_pass = c_pass = 0.0
            for r in range(R):
                own, rest = cost[r][0], sum(cost[r][1:])
                t = max(own, ag) + penalty * min(own, ag) + rest
                if b:   # the partial dK/dV go home in one all-to-all after the last block
                    bw, lat = M.coll("all_to_all", scope)
                    t += lat + grad_block * (R - 1) / bw
                t_pass, c_pass = max(t_pass, t), max(c_pass, own + rest)
            ring_time += t_pass
            crit += c_pass
            ring_bytes += gathered + ((R - 1) * grad_block if b else 0.0)
            ncoll += 2 if b else 1
    ring_exposed = max(0.0, ring_time - crit)
    imbalance = max(0.0, crit - kernel_mean)

    # ---- memory per rank: inputs, head-sharded copies, ring buffers, fp32 accumulators
    n_in = B * S / P.world * D
    n_r = B * max(shard) * D
    mem = n_in * (2 * P.heads + 2 * P.hkv) * e                             # q, k, v, out (sequence shards)
    if U > 1:
        mem += n_r * (2 * hmax + 2 * max(hk_local)) * e                    # q, k, v, out (head shards)
    mem += n_r * hmax * (e_acc + 4.0 / D)                                  # out/lse accumulators
    blocks = R if rotation_model(C.rotation) == "allgather" else 2
    mem += (blocks - 1) * kv_block if R > 1 and not local_ring else 0.0
    if P.bwd:
        mem *= 2
        mem += (n_r * 2 * max(hk_local) * e_acc if R > 1 else 0.0) + n_r * hmax * e_acc
    if C.low_memory:
        # head groups one after another: each group pays its own collectives and kernel calls,
        # and with Ulysses the backward exchanges each group's q, k, v and out to the head
        # layout again (the forward's all-to-alls once more)
        groups = most_groups(hp)
        n_calls = max(sum(len(st) for st in work[r]) for r in range(R)) * len(passes)
        other += (groups - 1) * (ncoll * M.small_collective() + n_calls * overhead)
        extra = 2 * groups if U > 1 and P.bwd else 0
        if extra:
            ulysses_exposed += fwd_t
        ncoll = ncoll * groups + extra
    terms = {"kernel": kernel_mean, "imbalance": imbalance, "ulysses_a2a": ulysses_exposed,
             "ring_exposed": ring_exposed, "other": other}
    total = sum(terms.values())
    pred = Prediction(C, total, terms, a2a_bytes + ring_bytes, mem, work_balance, ncoll + 1,
                      _placement(C, P.world, M.g))
    pred.dominant = max(("kernel", "imbalance", "ulysses_a2a", "ring_exposed"), key=lambda k: terms[k])
    pred.detail = {"kernel_work": kernel_work, "mean_calls": mean_calls, "overhead": overhead, "steps": steps,
                   "comm": comms, "local": R == 1 or local_ring, "penalty": penalty, "merges": merges * merge_s,
                   "fixed": fixed, "small": M.small_collective(), "a2a": ulysses_exposed, "copies": copies,
                   "bytes": a2a_bytes + ring_bytes, "collectives": ncoll + 1}
    limit = profile.get("memory_bytes")
    if limit and mem > float(limit) * float(profile.get("memory_usable", 0.9)):
        pred.valid = False
        pred.reason = (f"needs ~{mem / 2**30:.1f} GiB per rank, over {float(profile.get('memory_usable', 0.9)):.0%} of "
                       f"{float(limit) / 2**30:.0f} GiB")
    return pred


# ---------------------------------------------------------------------------------- candidates
def candidates(problem: Problem, *, layouts: Optional[Sequence[str]] = None,
               rotations: Optional[Sequence[str]] = None, fp8: bool = False,
               pipelines: Sequence[int] = (0,), low_memory: Sequence[bool] = (False,)) -> List[Candidate]:
    """Every configuration to predict; ``layouts``/``rotations`` default to the registered
    ones (:func:`layout_candidates`, :func:`rotation_candidates`), ``fp8``: the lossy wires
    too (:func:`wire_candidates`)."""
    if layouts is None:
        layouts = layout_candidates(problem.cu_seqlens is not None)
    if rotations is None:
        rotations = rotation_candidates()
    out = []
    N = problem.world
    for U in [u for u in range(N, 0, -1) if N % u == 0]:
        R = N // U
        wires = list(wire_candidates(problem.dtype)) if fp8 and U > 1 else ["none"]
        for wire in wires:
            for pipe in pipelines:
                if pipe and U == 1:
                    continue
                if R == 1:
                    out.append(Candidate(U, 1, "basic", "p2p", wire, pipe))
                    continue
                # without a causal mask every layout does the same work: keep one
                # (packed documents and masks: layouts differ in which work stays on one rank)
                lays = layouts if problem.causal or problem.cu_seqlens is not None or problem.mask is not None else \
                    [("basic" if "basic" in layouts else layouts[0])]
                for lay in lays:
                    for rot in rotations:
                        out.append(Candidate(U, R, lay, rot, wire, pipe))
    # low_memory runs the head groups one after another: no pipelined variant of it
    return [replace(c, low_memory=lm) for c in out for lm in low_memory if not (lm and c.pipeline)]


def _check(problem: Problem) -> None:
    if problem.world < 1:
        raise PlanError(f"--world must be >= 1, got {problem.world}")
    for name, v in (("heads", problem.heads), ("seqlen", problem.seqlen), ("head-dim", problem.head_dim),
                    ("batch", problem.batch)):
        if v < 1:
            raise PlanError(f"--{name} must be >= 1, got {v}")
    if problem.hkv < 1 or problem.heads % problem.hkv:
        raise PlanError(f"--heads {problem.heads} is not a multiple of --kv-heads {problem.hkv}; each key/value "
                        f"head serves the same number of query heads (e.g. --kv-heads "
                        f"{math.gcd(problem.heads, problem.hkv)})")
    if problem.dtype not in DTYPE_BYTES:
        raise PlanError(f"--dtype {problem.dtype!r}; valid: {', '.join(DTYPE_BYTES)}")
    if problem.seqlen < problem.world:
        raise PlanError(f"--seqlen {problem.seqlen} is shorter than --world {problem.world}: every rank needs a "
                        f"token; use --world <= {problem.seqlen}")


def _invalid_reason(problem: Problem, c: Candidate) -> str:
    if c.ring > 1 and rotation_model(c.rotation) is None:
        return (f"rotation {c.rotation!r} has no cost model (derive it from P2PRotation or AllGatherRotation, "
                "or give it cost_model = 'p2p' or 'allgather')")
    if c.ring > 1 and problem.mask is not None and not get_layout(c.layout).contiguous:
        return f"a mask needs contiguous shards; the {c.layout} layout is strided"
    if c.ring > 1:
        lens = [sum(s.count for s in ring_segments(c.layout, problem.seqlen, c.ring, r, cu_seqlens=problem.cu_seqlens))
                for r in range(c.ring)]
        if min(lens) < c.ulysses:
            return f"{c.layout} layout leaves a rank without tokens at S={problem.seqlen}"
    elif problem.seqlen < c.ulysses:
        return "fewer tokens than Ulysses ranks"
    return ""


def _why(p: Prediction, best: Prediction) -> str:
    if p is best:
        return "winner"
    if p.time <= best.time * 1.005:
        return "ties the winner (within 0.5%)"
    d = {k: p.terms[k] - best.terms[k] for k in TERMS}
    k = max(d, key=lambda name: d[name])
    names = {"kernel": "more kernel time (smaller, less efficient blocks / more calls)",
             "imbalance": "work imbalance (the busiest rank sets the pace)",
             "ulysses_a2a": "more all-to-all time", "ring_exposed": "ring comm not hidden by compute",
             "other": "more merge / copy / call overhead"}
    pct = 100.0 * (p.time / best.time - 1) if best.time else 0.0
    return f"+{pct:.0f}%: {names[k]} (+{d[k] * 1e3:.3g} ms)"


def plan(world: int, heads: int, seqlen: int, head_dim: int, *, kv_heads: Optional[int] = None,
         dtype: str = "bf16", causal: bool = False, bwd: bool = False, batch: int = 1,
         profile="cpu", gpus_per_node: Optional[int] = None, intra_bw: Optional[float] = None,
         inter_bw: Optional[float] = None, latency: Optional[float] = None, fp8: bool = False,
         pipelines: Sequence[int] = (0,), layouts: Optional[Sequence[str]] = None,
         rotations: Optional[Sequence[str]] = None, cu_seqlens=None, mask=None,
         memory_budget: Optional[float] = None, meter: Optional[Callable] = None) -> dict:
    """Every valid configuration ranked by predicted time per attention call.

    ``profile``: a profile name (``list_profiles()``), a path, or a dict.  Returns a dict with
    ``rows`` (best first; each a :class:`Prediction` as a dict), ``invalid``, ``winner``,
    ``init`` and ``module`` (the two lines to use), ``profile`` and ``problem``.
    ``cu_seqlens``: a packed batch's global document boundaries (the layouts then include
    ``varlen_zigzag``; shard and call with the same boundaries).  ``mask``: a
    :class:`usp_hal.sequence.masks.Mask` (or what ``forward(mask=)`` takes): each candidate is priced
    with its masked block plan (skipped tiles free, partial runs as their whole rectangle).
    ``memory_budget``: bytes per rank.  The candidates then include ``low_memory=True``, each
    one's memory per rank is metered (:func:`metered_memory`) by ``meter``, and one over
    :data:`BUDGET_HEADROOM` of the budget is not valid; the winner is the fastest that fits.
    ``meter(specs, seqlen)``: each spec's peak bytes per rank above its inputs, e.g.
    :func:`usp_hal.harness.memprobe.probe` (what ``usp-hal plan --memory-budget`` passes)."""
    dtype = DTYPE_ALIASES.get(str(dtype), str(dtype))
    if kv_heads is not None and kv_heads < 1:
        raise PlanError(f"--kv-heads must be >= 1, got {kv_heads} (leave it out for --heads: no GQA)")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node must be >= 1, got {gpus_per_node} (leave it out for the profile's)")
    if memory_budget is not None:
        if not memory_budget > 0:
            raise PlanError(f"--memory-budget must be a positive number of bytes, got {memory_budget!r}")
        if cu_seqlens is not None or mask is not None:
            raise PlanError("--memory-budget meters plain (optionally causal) calls; plan packed documents or a "
                            "mask without it, or plan the same shape without them for the memory")
        if any(pipelines) or fp8:
            raise PlanError("--memory-budget meters the synchronous module without a wire codec; drop --async/--fp8")
        if meter is None:
            raise PlanError("memory_budget= needs meter=: a function giving each candidate's peak bytes per rank, "
                            "e.g. usp_hal.harness.memprobe.probe (what `usp-hal plan --memory-budget` passes)")
    try:
        cu = None if cu_seqlens is None else as_cu_seqlens(cu_seqlens, seqlen)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"--cu-seqlens: {exc}") from None
    if mask is not None:
        from ..sequence.masks import Mask
        mask = Mask.of(mask)
    problem = Problem(world, heads, seqlen, head_dim, kv_heads, batch, dtype, bool(causal), bool(bwd), cu, mask)
    _check(problem)
    valid_layouts = layout_candidates(cu is not None)
    per_document = [n for n in layout_candidates(True) if n not in valid_layouts]
    layouts = tuple(layouts) if layouts is not None else valid_layouts
    for lay in layouts:
        if lay not in valid_layouts:
            raise PlanError(f"layout {lay!r}; valid: {', '.join(valid_layouts)}"
                            + (f" ({', '.join(per_document)}: with --cu-seqlens)" if per_document else ""))
    valid_rotations = rotation_candidates()
    rotations = tuple(rotations) if rotations is not None else valid_rotations
    for rot in rotations:
        if rot not in valid_rotations:
            raise PlanError(f"rotation {rot!r}; valid: {', '.join(valid_rotations)}")
    prof = profile if isinstance(profile, dict) else load_profile(profile)
    if any(x is not None for x in (intra_bw, inter_bw, latency)) or gpus_per_node:
        prof = profile_with_links(prof, intra_bw=intra_bw, inter_bw=inter_bw, latency=latency,
                                  gpus_per_node=gpus_per_node)
    rows: List[Prediction] = []
    invalid: List[dict] = []
    todo: List[Candidate] = []
    for c in candidates(problem, layouts=layouts, rotations=rotations, fp8=fp8, pipelines=pipelines,
                        low_memory=(False, True) if memory_budget is not None else (False,)):
        why = _invalid_reason(problem, c)
        if why:
            invalid.append({"label": c.label, "reason": why})
        else:
            todo.append(c)
    metered = metered_memory(problem, todo, meter) if meter is not None and memory_budget is not None else {}
    for c in todo:
        p = predict(problem, c, prof)
        if memory_budget is not None:
            p.mem_per_rank = metered[c]
            usable = memory_budget * BUDGET_HEADROOM
            if p.mem_per_rank > usable:
                p.valid = False
                p.reason = (f"needs {_fmt_bytes(p.mem_per_rank)} per rank (metered), over {BUDGET_HEADROOM:.0%} of the "
                            f"{_fmt_bytes(memory_budget)} budget")
        if p.valid:
            rows.append(p)
        else:
            invalid.append({"label": c.label, "reason": p.reason})
    if not rows:
        raise PlanError("no configuration fits: " + "; ".join(f"{i['label']}: {i['reason']}" for i in invalid[:4])
                        + " (use more ranks, a shorter --seqlen, or a profile with more memory)")
    rows.sort(key=lambda p: p.time)
    best = rows[0]
    for p in rows:
        p.why = _why(p, best)
    c = best.candidate
    g = int(prof.get("gpus_per_node") or world)
    init = (f"usp_hal.init_sequence_parallel(ulysses_degree={c.ulysses}, ring_degree={c.ring}, "
            f"use_ulysses_low=True)  # ranks node-major: {_placement(c, world, g)}")
    mod_args = [f"ring_impl_type={c.layout!r}", f"rotation={c.rotation!r}"]
    codec_name, pattern = wire_codec(c.fp8)
    if c.fp8 != "none" and codec_name != "fp8":
        names = ("q", "k", "v", "out") if pattern == "qkvo" else ("q", "v", "out")
        mod_args.append("wire_codecs={" + ", ".join(f"{n!r}: {codec_name!r}" for n in names) + "}")
    elif c.fp8 != "none":
        mod_args.append("ulysses_float8=True")
        if c.fp8 == "qkvo":
            mod_args.append("float8_key=True")
    if c.low_memory:
        mod_args.append("low_memory=True")
    cls = "AsyncLongContextAttention" if c.pipeline else "LongContextAttention"
    if c.pipeline:
        mod_args.append(f"head_chunks={c.pipeline}")
    module = f"usp_hal.{cls}({', '.join(mod_args)})"
    pdict = {**asdict(replace(problem, mask=None)), "mask": getattr(problem.mask, "name", None)}
    return {"problem": pdict, "profile": prof.get("name"), "rows": [p.as_dict() for p in rows],
            "invalid": invalid, "winner": best.candidate.label, "init": init, "module": module,
            "memory_budget": memory_budget}


#: the share of a memory budget a plan may fill: the metered figure leaves out what the
#: communication library holds (on gloo ranks the meter read up to 1.15x of it)
BUDGET_HEADROOM = 0.85


_METERED: Dict[tuple, int] = {}      # a probe's result per spec and length (the code does not change under it)


def _spec_key(spec: dict, seqlen: int) -> tuple:
    return tuple(sorted(spec.items())) + (("seqlen", seqlen),)


def metered_memory(problem: Problem, cands: Sequence[Candidate], meter: Callable) -> Dict[Candidate, float]:
    """Bytes per rank of one call of each candidate, inputs included (q, k, v, and dout for
    ``bwd``): the worst rank's peak above them from ``meter`` (the CLI's is
    :func:`usp_hal.harness.memprobe.probe`: the real module on a fake process group in a fresh
    interpreter, extrapolated in S; forward+backward with ``bwd``, else the forward without
    autograd)."""
    P = problem
    def spec(c: Candidate) -> dict:       # what sets the memory: the layout and rotation only on a ring
        ring = c.ring > 1
        return dict(ulysses=c.ulysses, ring=c.ring, layout=c.layout if ring else "basic",
                    rotation=c.rotation if ring else "p2p", low_memory=c.low_memory, heads=P.heads,
                    kv_heads=P.hkv, head_dim=P.head_dim, dtype=P.dtype, causal=P.causal, batch=P.batch, bwd=P.bwd)

    keys = {c: _spec_key(spec(c), P.seqlen) for c in cands}
    todo = {k: spec(c) for c, k in keys.items() if k not in _METERED}
    if todo:
        for k, peak in zip(todo, meter(list(todo.values()), P.seqlen)):
            _METERED[k] = peak
    tokens = math.ceil(P.seqlen / P.world)
    inputs = P.batch * tokens * P.head_dim * ((2 if P.bwd else 1) * P.heads + 2 * P.hkv) * P.elem
    return {c: inputs + _METERED[k] for c, k in keys.items()}


# ---------------------------------------------------------------------------------- output
def _fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def format_plan(res: dict) -> str:
    p = res["problem"]
    lines = [f"usp-hal plan: {p['world']} ranks, B={p['batch']} H={p['heads']} Hkv={p['kv_heads'] or p['heads']} "
             f"S={p['seqlen']} D={p['head_dim']} {p['dtype']} {'causal' if p['causal'] else 'full'} "
             f"{'fwd+bwd' if p['bwd'] else 'fwd'}; profile {res['profile']}",
             "time = predicted per attention call; terms: kernel / imbalance / ulysses all-to-all / ring exposed "
             "comm / other (ms)", ""]
    headers = ["#", "config", "ms", "kernel", "imbal", "a2a", "ring", "other", "sent/rank", "mem/rank",
               "work bal", "dominated by", "vs winner"]
    rows = []
    for i, r in enumerate(res["rows"], 1):
        t = r["terms"]
        rows.append([i, r["label"], f"{r['time'] * 1e3:.3g}"] + [f"{t[k] * 1e3:.3g}" for k in TERMS] +
                    [_fmt_bytes(r["comm_bytes"]), _fmt_bytes(r["mem_per_rank"]),
                     "idle rank" if r["work_balance"] is None else f"{r['work_balance']:.2f}",
                     r["dominant"], r["why"]])
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines.append("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip() for r in rows]
    budget = res.get("memory_budget")
    if budget:
        lines.append(f"mem/rank: metered (the module run per rank on a fake process group, inputs included); "
                     f"budget {_fmt_bytes(budget)}, of which a plan may fill {BUDGET_HEADROOM:.0%}")
    else:
        lines.append("mem/rank: a rough estimate; --memory-budget meters every candidate and adds low_memory ones")
    for inv in res["invalid"]:
        lines.append(f"not valid: {inv['label']}: {inv['reason']}")
    lines += ["", "use:", "  " + res["init"], "  attn = " + res["module"]]
    if res["problem"].get("cu_seqlens"):
        lay = res["module"].split("ring_impl_type=")[1].split(",")[0]
        lines += [f"  x = usp_hal.shard(x, layout={lay}, cu_seqlens=cu_seqlens)   # q, k, v; then "
                  "attn(q, k, v, causal=..., cu_seqlens=cu_seqlens)"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- bench check
def _bench_candidate(row: dict) -> Candidate:
    fp8 = "none"
    for part in row["config"].split():
        if part.startswith("fp8:"):
            fp8 = part[4:]
    return Candidate(int(row["ulysses"]), int(row["ring"]), row.get("ring_impl") or "basic",
                     row.get("rotate") or "p2p", fp8, 0)


def compare_bench(report: dict, profile) -> List[dict]:
    """Predicted against measured for every group of a ``usp-hal bench --json`` report.

    One dict per group: ``rows`` (config, measured s, predicted s, ratio), ``spread`` (the
    group's run-to-run spread: median over its configs of (max - min) / median of the
    measured iterations), ``order_ok`` (every pair of configs whose predicted order differs
    from the measured one is within that spread) and ``discordant`` (those pairs)."""
    prof = profile if isinstance(profile, dict) else load_profile(profile)
    meta = report["meta"]
    groups: Dict[str, List[dict]] = {}
    for r in report["results"]:
        groups.setdefault(r["group"], []).append(r)
    out = []
    for label, rs in groups.items():
        r0 = rs[0]
        problem = Problem(int(meta["nproc"]), int(meta["heads"]), int(r0["seqlen"]), int(meta["head_dim"]),
                          int(meta["kv_heads"]), int(meta["batch"]), meta["dtype"], bool(r0["causal"]),
                          r0["mode"] == "fwd+bwd")
        rows = []
        for r in rs:
            p = predict(problem, _bench_candidate(r), prof)
            its = sorted(r["iter_times"])
            spread = (its[-1] - its[0]) / r["time"] if len(its) > 1 and r["time"] else 0.0
            rows.append({"config": r["config"], "measured": r["time"], "predicted": p.time,
                         "ratio": p.time / r["time"], "spread": spread, "dominant": p.dominant})
        spreads = sorted(x["spread"] for x in rows)
        spread = spreads[len(spreads) // 2]
        disc = []
        for i, a in enumerate(rows):
            for b in rows[i + 1:]:
                if (a["predicted"] - b["predicted"]) * (a["measured"] - b["measured"]) < 0:
                    gap = abs(a["measured"] - b["measured"]) / min(a["measured"], b["measured"])
                    disc.append({"pair": (a["config"], b["config"]), "measured_gap": gap,
                                 "within_spread": gap <= max(spread, a["spread"], b["spread"])})
        out.append({"group": label, "rows": rows, "spread": spread, "discordant": disc,
                    "order_ok": all(d["within_spread"] for d in disc)})
    return out
