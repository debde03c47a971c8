"""Launches and bytes copied per attention call, per rank: usp-hal and yunchang on the same kernel.

One call (after three warm-up calls, so caches are in their steady state) runs under a
TorchDispatchMode and with the ``torch.distributed`` functions wrapped; per rank it counts

* **kernel**: attention kernel ops (aten ``_scaled_dot_product_*`` forward/backward, or any op
  whose name contains ``flash_attn``);
* **other**: every other aten op that launches work on the device: arithmetic, reductions,
  casts (``_to_copy``), ``copy_``, ``clone``, ``cat``, fills (``zero_``, ``fill_``, ``zeros``,
  ``full``), in-place ops, ``_local_scalar_dense`` (``.item()``, a device-to-host copy).  Not
  counted: views and aliases (ops whose schema returns an alias that is not written:
  ``view``, ``transpose``, ``split``, ``detach``, ...), ``_unsafe_view``/``_reshape_alias``,
  allocations without a fill (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``,
  ``empty_permuted``, ``new_empty_strided``) and metadata ops (``set_``, ``resize_``,
  ``sym_size``/``sym_stride``/``sym_numel``, ``is_contiguous``, ``lift_fresh``);
* **coll**: collectives: one per call of a ``torch.distributed`` function
  (``all_to_all_single``, ``all_to_all``, ``batch_isend_irecv`` - one grouped launch, as on
  NCCL -, ``all_gather``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
  ``all_reduce``, ``broadcast``), plus any ``c10d`` dispatcher op issued outside those calls
  (e.g. a bare ``isend``); ``c10d`` ops inside a wrapped call are that call;
* **copied**: bytes written by ops that copy existing data outside the kernel (as in
  ``copies_per_call.py``: ``copy_``, ``clone``, ``_to_copy``, ``cat``, index and padding ops,
  ``stack``, ``repeat``, ...).

Cases: Ulysses-2, Ring-2, Ring-2 causal (2 ranks) and Ulysses-2 x Ring-2 (4 ranks), basic
layout (the only ring yunchang lets take another kernel), fp32, B=1, H=8, D=64, S=1024 by
default; forward (inputs without grad, as ``usp-hal bench`` times it) and forward+backward
(``out.backward(dout)``).  yunchang 0.6.4 runs usp-hal's CPU kernel through its
``attn_processor`` hook (``usp_hal.harness.cases.yunchang_cpu_processor`` when that exists,
else an identical local copy); its backward cannot take that hook, so its forward+backward is
not measured (marked n/a).  yunchang is skipped when it is not installed.

Compare two trees by putting each on PYTHONPATH (the tree measured is printed):

    PYTHONPATH=path/to/tree python benchmarks/launches_per_call.py [--json out.json] [--ops] [--check-ranks MODE]
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ranks import run_on_ranks  # noqa: E402

COPY_OPS = {"copy_", "clone", "_to_copy", "cat", "index_select", "index", "gather", "constant_pad_nd",
            "stack", "repeat", "repeat_interleave", "expand_copy", "permute_copy", "transpose_copy"}
NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted",
             "_unsafe_view", "_reshape_alias", "set_", "resize_", "sym_size", "sym_stride", "sym_numel",
             "sym_storage_offset", "is_contiguous", "lift_fresh", "is_same_size", "is_nonzero"}
COLLECTIVES = ("all_to_all_single", "all_to_all", "batch_isend_irecv", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_reduce", "broadcast")

# label, ulysses, ring, causal
CASES = [("U2", 2, 1, False), ("R2", 1, 2, False), ("R2 causal", 1, 2, True), ("U2xR2", 2, 2, False)]


def _is_alias(func) -> bool:
    """A view/alias op: it returns an alias of an input that it does not write."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _is_kernel(name: str) -> bool:
    return name.startswith("_scaled_dot_product") or "flash_attn" in name


class LaunchMeter(TorchDispatchMode):
    """Counts launches (see the module docstring) and copied bytes while active; wraps the
    torch.distributed collectives for the same span."""

    def __init__(self):
        super().__init__()
        self.kernel = self.other = self.coll = self.copied = 0
        self.ops: dict = {}
        self._depth = 0          # > 0 inside a wrapped torch.distributed call
        self._orig: dict = {}

    def _note(self, name):
        self.ops[name] = self.ops.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns = func.namespace
        name = func.overloadpacket.__name__
        if ns == "c10d":
            if self._depth == 0:
                self.coll += 1
                self._note(f"c10d.{name}")
            return out
        if name in NO_LAUNCH or _is_alias(func):
            return out
        if _is_kernel(name):
            self.kernel += 1
        else:
            self.other += 1
        self._note(name)
        if name in COPY_OPS:
            outs = out if isinstance(out, (list, tuple)) else [out]
            self.copied += sum(t.numel() * t.element_size() for t in outs if isinstance(t, torch.Tensor))
        return out

    def _wrap(self, name, orig):
        def wrapped(*args, **kwargs):
            if self._depth == 0:
                self.coll += 1
                self._note(f"dist.{name}")
            self._depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                self._depth -= 1
        return wrapped

    def __enter__(self):
        for n in COLLECTIVES:
            orig = getattr(dist, n, None)
            if orig is not None:
                self._orig[n] = orig
                setattr(dist, n, self._wrap(n, orig))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for n, orig in self._orig.items():
                setattr(dist, n, orig)
            self._orig.clear()


def _yunchang_processor():
    try:
        from usp_hal.harness.cases import yunchang_cpu_processor
        return yunchang_cpu_processor
    except ImportError:      # a tree without it: the same function
        def proc(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **unused):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, bool(causal), scale=softmax_scale)
            return out.transpose(1, 2), lse
        return proc


def _inputs(rank, world, seqlen, heads, dim, bwd):
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seqlen, heads, dim, generator=g) for _ in range(4))
    # the basic layout: rank r holds the r-th contiguous chunk (both libraries, ulysses-low ranks)
    return [t.chunk(world, dim=1)[rank].contiguous().requires_grad_(bwd and i < 3)
            for i, t in enumerate((q, k, v, dout))]


def _measure_one(attn, q, k, v, dout, causal, bwd):
    def call():
        out = attn(q, k, v, causal=causal)
        if bwd:
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None
    for _ in range(3):
        call()
    dist.barrier()
    m = LaunchMeter()
    with m:
        call()
    return {"kernel": m.kernel, "other": m.other, "coll": m.coll, "launches": m.kernel + m.other + m.coll,
            "copied": m.copied, "ops": m.ops}


def measure(cases, seqlen, heads, dim, peers, check_ranks="every_call"):
    import usp_hal
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    have_yunchang = False
    if peers:
        try:
            import yunchang  # noqa: F401
            have_yunchang = True
        except ImportError:
            pass
    for label, u, r, causal in cases:
        for bwd in (False, True):
            mesh = usp_hal.init_sequence_parallel(u, r, set_default=False)
            attn = usp_hal.LongContextAttention(attn_type="sdpa", ring_impl_type="basic", mesh=mesh,
                                                check_ranks=check_ranks)
            q, k, v, dout = _inputs(rank, world, seqlen, heads, dim, bwd)
            rows.append({"case": label, "mode": "fwd+bwd" if bwd else "fwd", "lib": "usp-hal",
                         **_measure_one(attn, q, k, v, dout, causal, bwd)})
            if not peers:
                continue
            if not have_yunchang:
                rows.append({"case": label, "mode": rows[-1]["mode"], "lib": "yunchang", "na": "not installed"})
                continue
            if bwd:
                rows.append({"case": label, "mode": "fwd+bwd", "lib": "yunchang",
                             "na": "its backward does not take attn_processor (no same-kernel backward on cpu)"})
                continue
            from yunchang import LongContextAttention, set_seq_parallel_pg
            set_seq_parallel_pg(u, r, rank, world)
            yattn = LongContextAttention(ring_impl_type="basic", attn_type=None, attn_processor=_yunchang_processor())
            rows.append({"case": label, "mode": "fwd", "lib": "yunchang",
                         **_measure_one(yattn, q, k, v, dout, causal, False)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--no-peers", action="store_true", help="usp-hal only")
    ap.add_argument("--check-ranks", default="every_call", choices=("every_call", "first_call", "off"),
                    help="usp-hal's agreement mode (default every_call: one CPU-side all-gather per call)")
    ap.add_argument("--ops", action="store_true", help="also print rank 0's ops per row")
    ap.add_argument("--json", default=None, help="write every rank's rows as JSON")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for the ranks (default 600)")
    a = ap.parse_args()
    import usp_hal
    tree = os.path.dirname(os.path.dirname(os.path.abspath(usp_hal.__file__)))
    kw = dict(seqlen=a.seqlen, heads=a.heads, dim=a.head_dim, peers=not a.no_peers, check_ranks=a.check_ranks)
    two = run_on_ranks(measure, 2, timeout=a.timeout, cases=[c for c in CASES if c[1] * c[2] == 2], **kw)
    four = run_on_ranks(measure, 4, timeout=a.timeout, cases=[c for c in CASES if c[1] * c[2] == 4], **kw)
    per_rank = [list(x) for x in zip(*two)] + [list(x) for x in zip(*four)]   # row -> [rank results]
    print(f"launches per call, per rank: usp-hal from {tree} (usp_hal {getattr(usp_hal, '__version__', '?')}), "
          f"torch {torch.__version__}, S={a.seqlen} H={a.heads} D={a.head_dim} fp32 B=1, basic layout, "
          f"check_ranks={a.check_ranks}, one call after 3 warm-up calls")
    print("kernel = attention kernel ops; other = other launching aten ops; coll = collectives; "
          "launches = their sum (rank 0; all ranks in 'per rank'); copied = bytes copied outside the kernel, "
          "max over ranks")
    hdr = f"{'case':10s} {'mode':8s} {'library':9s} {'kernel':>6s} {'other':>6s} {'coll':>5s} {'launches':>8s}  " \
          f"{'per rank':16s} {'copied MiB':>10s}"
    print(hdr)
    print("-" * len(hdr))
    for ranks in per_rank:
        r0 = ranks[0]
        if "na" in r0:
            print(f"{r0['case']:10s} {r0['mode']:8s} {r0['lib']:9s} n/a: {r0['na']}")
            continue
        pr = "/".join(str(x["launches"]) for x in ranks)
        mib = max(x["copied"] for x in ranks) / 2 ** 20
        print(f"{r0['case']:10s} {r0['mode']:8s} {r0['lib']:9s} {r0['kernel']:6d} {r0['other']:6d} {r0['coll']:5d} "
              f"{r0['launches']:8d}  {pr:16s} {mib:10.2f}")
        if a.ops:
            print("    " + ", ".join(f"{k} {v}" for k, v in sorted(r0["ops"].items(), key=lambda kv: -kv[1])))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tree": tree, "torch": torch.__version__, "seqlen": a.seqlen, "heads": a.heads,
                       "head_dim": a.head_dim, "rows": per_rank}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
