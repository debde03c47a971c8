"""The Ulysses exchange (per-destination packing, one all-to-all, views back) against the
plain head/sequence slices and sums (and the bytes path),
for U simulated ranks in one process: ``torch.distributed.all_to_all_single`` is replaced
by a recorder, and the recorded sends are delivered by hand before each rank waits."""
import threading
import weakref

import pytest
import torch
import torch.distributed as dist

from usp_hal.parallel import ulysses
from usp_hal.parallel.ulysses import UlyssesExchange, head_plan, split_plan


class Net:
    """Records every rank's all_to_all_single; :meth:`deliver` moves the data like the wire."""

    def __init__(self):
        self.calls = []

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                 async_op=False):
        assert output.is_contiguous() and input.is_contiguous()
        self.calls.append((output, input.clone(), list(output_split_sizes), list(input_split_sizes)))
        return None

    def deliver(self):
        """Rank ``u``'s call is ``calls[u]``; splits count rows of dim 0 of each tensor."""
        U = len(self.calls)
        sent = []
        for _, inp, _, isz in self.calls:
            per = inp.numel() // max(inp.shape[0], 1)
            flat, chunks, off = inp.reshape(-1), [], 0
            for n in isz:
                chunks.append(flat[off:off + n * per])
                off += n * per
            sent.append(chunks)
        for dst, (out, _, osz, _) in enumerate(self.calls):
            per = out.numel() // max(out.shape[0], 1)
            flat, off = out.view(-1), 0
            for src in range(U):
                n = osz[src] * per
                assert sent[src][dst].numel() == n, (src, dst)
                flat[off:off + n].copy_(sent[src][dst])
                off += n
        wire = [torch.cat([c.reshape(-1).view(torch.uint8) for c in chunks]) for chunks in sent]
        self.calls = []
        return wire


def _shard(x, lens):
    return list(torch.split(x, list(lens), dim=1))


def _run_qkv(exs, qs, ks, vs, net):
    pend = [ex.start_qkv(q, k, v) for ex, q, k, v in zip(exs, qs, ks, vs)]
    wire = net.deliver()
    return [p.wait() for p in pend], wire


def _run_out(exs, outs, dtype, net, **kw):
    pend = [ex.start_out(o, dtype, **({k: v[i] for k, v in kw.items()} if kw else {})) for i, (ex, o)
            in enumerate(zip(exs, outs))]
    wire = net.deliver()
    return [p.wait() for p in pend], wire


CASES = [  # heads, kv heads, ulysses, lengths, batch
    (4, 4, 2, (16, 16), 1),      # the per-call overhead benchmark's shape
    (8, 2, 2, (5, 3), 2),        # GQA, uneven lengths, B > 1
    (6, 3, 2, (4, 4), 1),        # a rank's query heads cut a GQA group (KV heads repeated locally)
    (8, 1, 4, (2, 3, 1, 2), 1),  # one KV head that every rank receives
    (6, 6, 4, (3, 3, 3, 3), 2),  # uneven head counts: the general path
]


@pytest.mark.parametrize("H,Hkv,U,lens,B", CASES)
@pytest.mark.parametrize("strided", [False, True])
def test_exchange_matches_the_slices(monkeypatch, H, Hkv, U, lens, B, strided):
    g = torch.Generator().manual_seed(H * 100 + U)
    D, S = 8, sum(lens)
    full = [torch.randn(B, S, h, D, generator=g) for h in (H, Hkv, Hkv)]
    if strided:   # [B, H, S, D] memory seen as [B, S, H, D]
        full = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in full]
    plan = head_plan(H, Hkv, U)
    shards = [_shard(x, lens) for x in full]
    net = Net()
    monkeypatch.setattr(dist, "all_to_all_single", net)

    def exchanges():
        return [UlyssesExchange(plan, None, u, lens) for u in range(U)]

    got, wire = _run_qkv(exchanges(), *shards, net)
    for u, (qh, kh, vh) in enumerate(got):
        (a, c), (ka, kc) = plan.q[u], plan.kv[u]
        exp = plan.kv_expand[u]
        idx = torch.arange(ka, kc) if exp is None else torch.tensor(exp) + ka
        torch.testing.assert_close(qh, full[0][:, :, a:c], rtol=0, atol=0)
        torch.testing.assert_close(kh, full[1][:, :, idx], rtol=0, atol=0)
        torch.testing.assert_close(vh, full[2][:, :, idx], rtol=0, atol=0)

    # back: each rank's head-layout output to the sequence layout, fresh or into a full-width tensor
    out_full = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    outs = [out_full[:, :, a:c] for a, c in plan.q]
    res, wire_out = _run_out(exchanges(), outs, torch.float32, net)
    for u, (local, lse, kept) in enumerate(res):
        o = sum(lens[:u])
        torch.testing.assert_close(local, out_full[:, o:o + lens[u]].float(), rtol=0, atol=0)
        assert local.is_contiguous() and local._base is None and lse is None and kept is None


@pytest.mark.parametrize("H,Hkv,U,chunks", [(8, 4, 2, 2), (8, 8, 2, 4), (12, 4, 2, 3)])
def test_head_groups_write_into_the_full_width_output(monkeypatch, H, Hkv, U, chunks):
    g = torch.Generator().manual_seed(7)
    B, D, lens = 1, 4, (3, 5)
    S = sum(lens)
    net = Net()
    monkeypatch.setattr(dist, "all_to_all_single", net)
    out_full = torch.randn(B, S, H, D, generator=g)
    q_full = torch.randn(B, S, H, D, generator=g)
    k_full = torch.randn(B, S, Hkv, D, generator=g)
    into = [torch.zeros(B, n, H, D) for n in lens]
    for sub in split_plan(head_plan(H, Hkv, U), chunks):
        exs = [UlyssesExchange(sub, None, u, lens) for u in range(U)]
        got, _ = _run_qkv(exs, _shard(q_full, lens), _shard(k_full, lens), _shard(k_full, lens), net)
        for u, (qh, kh, _) in enumerate(got):
            (a, c), (ka, kc) = sub.q[u], sub.kv[u]
            torch.testing.assert_close(qh, q_full[:, :, a:c], rtol=0, atol=0)
            torch.testing.assert_close(kh, k_full[:, :, ka:kc], rtol=0, atol=0)
        outs = [out_full[:, :, a:c] for a, c in sub.q]
        res, _ = _run_out(exs, outs, torch.float32, net, into=into)
        assert all(r[0] is t for r, t in zip(res, into))
    for u, t in enumerate(into):
        o = sum(lens[:u])
        torch.testing.assert_close(t, out_full[:, o:o + lens[u]], rtol=0, atol=0)


def test_out_guard_dtype_and_kept_heads(monkeypatch):
    H, U, lens, B, D = 4, 2, (4, 2), 2, 8
    S = sum(lens)
    plan = head_plan(H, H, U)
    net = Net()
    monkeypatch.setattr(dist, "all_to_all_single", net)
    g = torch.Generator().manual_seed(3)
    out_full = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    guard_full = torch.zeros(B, S, H, 1, dtype=torch.float64)
    guard_full[0, 1, 3] = float("nan")
    exs = [UlyssesExchange(plan, None, u, lens) for u in range(U)]
    outs = [out_full[:, :, a:c] for a, c in plan.q]
    guards = [guard_full[:, :, a:c] for a, c in plan.q]
    res, _ = _run_out(exs, outs, torch.float32, net, q_guard=guards, keep_heads=[True] * U)
    want = (out_full + guard_full).float()
    for u, (local, _, kept) in enumerate(res):
        o = sum(lens[:u])
        torch.testing.assert_close(local, want[:, o:o + lens[u]], rtol=0, atol=0, equal_nan=True)
        a, c = plan.q[u]
        torch.testing.assert_close(kept, want[:, :, a:c], rtol=0, atol=0, equal_nan=True)
    # same dtype, no guard: the kernel's output itself is the send buffer when it is sequence-major
    same = [torch.randn(S, B, H // U, D, generator=g).transpose(0, 1) for _ in range(U)]
    res, _ = _run_out(exs, same, torch.float32, net, keep_heads=[True] * U)
    for u, (local, _, kept) in enumerate(res):
        assert kept.data_ptr() == same[u].data_ptr()
        o = sum(lens[:u])
        want = torch.cat([x[:, o:o + lens[u]] for x in same], dim=2)
        torch.testing.assert_close(local, want, rtol=0, atol=0)


# ------------------------------------------------------------------ backward: saved_to_heads, start_grads
class ThreadNet:
    """Every rank in its own thread; each all_to_all_single moves the data at once (all ranks
    meet at a barrier), so blocking exchanges (``saved_to_heads``) run as on the wire.
    ``wire[u]``: per call of rank ``u``, the bytes it sent to each destination."""

    def __init__(self, U):
        self.U, self.local = U, threading.local()
        self.barrier = threading.Barrier(U, timeout=60)
        self.slot = [None] * U
        self.wire = [[] for _ in range(U)]

    def __call__(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                 async_op=False):
        assert output.is_contiguous() and input.is_contiguous()
        u = self.local.rank
        self.slot[u] = (input, list(input_split_sizes))
        self.barrier.wait()
        per_o = output.numel() // max(output.shape[0], 1)
        flat, off = output.view(-1), 0
        for src, n_rows in enumerate(output_split_sizes):
            inp, isz = self.slot[src]
            per_i = inp.numel() // max(inp.shape[0], 1)
            start, n = sum(isz[:u]) * per_i, isz[u] * per_i
            assert n == n_rows * per_o, (src, u)
            flat[off:off + n].copy_(inp.reshape(-1)[start:start + n])
            off += n
        per_i = input.numel() // max(input.shape[0], 1)
        b = input.reshape(-1).view(torch.uint8)
        step = input.element_size() * per_i
        cuts = [0]
        for n in input_split_sizes:
            cuts.append(cuts[-1] + n * step)
        self.wire[u].append([b[cuts[i]:cuts[i + 1]].clone() for i in range(self.U)])
        self.barrier.wait()
        return _Work() if async_op else None

    def run(self, fn):
        """``[fn(u) for every rank u]``, each in its own thread."""
        res, errs = [None] * self.U, []

        def body(u):
            self.local.rank = u
            try:
                res[u] = fn(u)
            except BaseException as e:   # noqa: BLE001 - re-raised below
                errs.append(e)
                self.barrier.abort()
        ts = [threading.Thread(target=body, args=(u,)) for u in range(self.U)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]
        return res

    def take(self):
        w, self.wire = self.wire, [[] for _ in range(self.U)]
        return w


class _Work:
    def wait(self):
        return True


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    a, b = a.contiguous(), b.contiguous()
    assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a.view(_INT[a.element_size()]),
                       b.view(torch.uint8) if b.element_size() == 1 else b.view(_INT[b.element_size()]))


_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_wire(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):         # per rank
        assert len(ra) == len(rb)
        for ca, cb in zip(ra, rb):   # per call
            for x, y in zip(ca, cb):  # per destination
                assert torch.equal(x, y)


def _kv_index(plan, u):
    (ka, kc), exp = plan.kv[u], plan.kv_expand[u]
    return torch.arange(ka, kc) if exp is None else torch.tensor(exp) + ka


SAVED_CASES = [  # heads, kv heads, ulysses, lengths, batch, dtype, head groups
    (8, 8, 2, (16, 16), 1, torch.float32, 1),
    (8, 2, 2, (5, 3), 2, torch.bfloat16, 1),     # GQA 8/2, uneven lengths, bf16
    (6, 3, 2, (4, 4), 1, torch.float32, 1),      # a cut GQA group (KV heads repeated locally)
    (6, 3, 2, (3, 5), 2, torch.bfloat16, 3),     # a cut group, split into head groups
    (8, 1, 4, (2, 3, 1, 2), 1, torch.float32, 1),
    (6, 6, 4, (3, 3, 3, 3), 2, torch.float32, 1),  # uneven head counts: packed per destination
    (8, 4, 2, (3, 5), 1, torch.float32, 2),      # head groups of whole KV groups
    (8, 2, 2, (5, 3), 1, torch.bfloat16, 2),     # head groups sharing one KV head
    (12, 4, 2, (7, 2), 2, torch.float64, 3),
    (8, 8, 2, (4, 6), 1, torch.float32, 4),
]


def _saved_inputs(H, Hkv, lens, B, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    D, S = 8, sum(lens)
    full = [torch.randn(B, S, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv, H, H)]
    if strided:
        full = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in full]
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.randn(B, H, S, generator=g).to(lse_dtype)
    return full, lse


def _run_saved(net, plan, lens, full, lse):
    offs = [sum(lens[:u]) for u in range(len(lens))]

    def rank(u):
        sl = [x[:, offs[u]:offs[u] + lens[u]] for x in full]
        ex = UlyssesExchange(plan, None, u, lens)
        return ex.saved_to_heads(*sl, lse[:, :, offs[u]:offs[u] + lens[u]])
    return net.run(rank)


@pytest.mark.parametrize("H,Hkv,U,lens,B,dtype,groups", SAVED_CASES)
def test_saved_to_heads_matches_the_slices_and_the_bytes_path(monkeypatch, H, Hkv, U, lens, B, dtype, groups):
    net = ThreadNet(U)
    monkeypatch.setattr(dist, "all_to_all_single", net)
    for strided in (False, True):
        full, lse = _saved_inputs(H, Hkv, lens, B, dtype, H * 10 + U + groups, strided)
        for sub in split_plan(head_plan(H, Hkv, U), groups):
            got = _run_saved(net, sub, lens, full, lse)
            wire = net.take()
            for u, (qh, kh, vh, oh, dh, lh) in enumerate(got):
                a, c = sub.q[u]
                idx = _kv_index(sub, u)
                want = (full[0][:, :, a:c], full[1][:, :, idx], full[2][:, :, idx], full[3][:, :, a:c],
                        full[4][:, :, a:c], lse[:, a:c])
                for x, w in zip((qh, kh, vh, oh, dh, lh), want):
                    _same_bits(x, w)
                assert lh.is_contiguous()
                if c > a and sub.kv_expand[u] is None:
                    # q, k, v and out are views of one receive buffer (no unpack copies)
                    ptr = qh.untyped_storage().data_ptr()
                    assert all(t.untyped_storage().data_ptr() == ptr for t in (kh, vh, oh))
            assert len(wire) == U
            # the same values as the bytes path (every part as bytes, unpacked by copies)
            with monkeypatch.context() as m:
                m.setattr(ulysses, "_homogeneous", lambda tensors: False)
                ref_bytes = _run_saved(net, sub, lens, full, lse)
                net.take()
            for rb, gt in zip(ref_bytes, got):
                for y, z in zip(rb, gt):
                    _same_bits(y, z)


def test_saved_to_heads_one_rank_narrows_kv_of_its_head_group():
    H, Hkv, lens, B = 8, 4, (6,), 1
    full, lse = _saved_inputs(H, Hkv, lens, B, torch.float32, 1)
    for sub in split_plan(head_plan(H, Hkv, 1), 2):
        a, c = sub.q[0]
        ex = UlyssesExchange(sub, None, 0, lens)
        q, out, dout = (x.narrow(2, a, c - a) for x in (full[0], full[3], full[4]))
        got = ex.saved_to_heads(q, full[1], full[2], out, dout, lse.narrow(1, a, c - a))
        idx = _kv_index(sub, 0)
        for x, w in zip(got, (q, full[1][:, :, idx], full[2][:, :, idx], out, dout, lse[:, a:c])):
            _same_bits(x, w)


GRAD_CASES = [  # heads, kv heads, ulysses, lengths, batch, dtype, head groups
    (4, 4, 2, (16, 16), 1, torch.float32, 1),
    (8, 2, 2, (5, 3), 2, torch.bfloat16, 1),
    (6, 3, 2, (4, 4), 1, torch.float32, 1),      # cut group: gradients of repeated KV heads summed
    (6, 3, 2, (3, 5), 2, torch.bfloat16, 3),
    (8, 1, 4, (2, 3, 1, 2), 1, torch.float32, 1),  # one KV head shared by every rank
    (6, 6, 4, (3, 3, 3, 3), 2, torch.float32, 1),  # uneven head counts: the general path
    (8, 4, 2, (3, 5), 1, torch.bfloat16, 2),
    (8, 2, 2, (5, 3), 1, torch.float32, 2),      # a KV head in both head groups: added into ``into``
    (12, 4, 2, (7, 2), 2, torch.float64, 3),
]


def _grads_inputs(plan, lens, B, seed):
    """Per head group and rank: float32 head-layout gradients ``[B, S, h, D]`` (dk/dv with
    the kernel's KV heads: repeated ones for a cut group)."""
    g = torch.Generator().manual_seed(seed)
    S, D = sum(lens), 8
    out = []
    for u in range(plan.size):
        hq, hk = plan.local_heads(u)
        out.append(tuple(torch.randn(B, S, h, D, generator=g) for h in (hq, hk, hk)))
    return out


def _run_grads(net, subs, lens, grads, dtype, use_into, async_op):
    B, D = grads[0][0][0].shape[0], grads[0][0][0].shape[3]
    plan = subs[0]

    def rank(u):
        into = None
        if use_into:
            into = tuple(torch.zeros(B, lens[u], n, D, dtype=dtype)
                         for n in (plan.num_heads, plan.num_kv_heads, plan.num_kv_heads))
        outs = []
        for sub, gr in zip(subs, grads):
            ex = UlyssesExchange(sub, None, u, lens)
            held = [t.clone() for t in gr[u]]
            refs = [weakref.ref(t) for t in held]
            p = ex.start_grads(held, dtype=dtype, into=into, async_op=async_op)
            assert held == []
            assert all(r() is None for r in refs)    # the head-layout gradients went once packed
            outs.append(p)
        res = [p.wait() for p in outs]
        return into if use_into else res[0]
    return net.run(rank)


@pytest.mark.parametrize("H,Hkv,U,lens,B,dtype,groups", GRAD_CASES)
def test_grads_match_the_plain_sums(monkeypatch, H, Hkv, U, lens, B, dtype, groups):
    net = ThreadNet(U)
    monkeypatch.setattr(dist, "all_to_all_single", net)
    subs = split_plan(head_plan(H, Hkv, U), groups)
    grads = [_grads_inputs(sub, lens, B, H + U + groups + i) for i, sub in enumerate(subs)]
    use_into = groups > 1
    ref = None
    for async_op in (False, True):
        got = _run_grads(net, subs, lens, grads, dtype, use_into, async_op)
        net.take()
        if ref is not None:      # asynchronous: the same bits as synchronous
            for r, gt in zip(ref, got):
                for x, y in zip(r, gt):
                    _same_bits(x, y)
                    assert y.is_contiguous()
        ref = got
    # and against the plain sums: each rank's heads of every group, KV heads summed over ranks
    # (and over the repeated heads of a cut group), in float64
    S, D = sum(lens), 8
    want = [torch.zeros(B, S, n, D, dtype=torch.float64) for n in (H, Hkv, Hkv)]
    for sub, gr in zip(subs, grads):
        for u in range(U):
            (a, c), idx = sub.q[u], _kv_index(sub, u)
            want[0][:, :, a:c] += gr[u][0].double()
            for i in (1, 2):
                want[i].index_add_(2, idx, gr[u][i].double())
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    for u, res in enumerate(got):
        o = sum(lens[:u])
        for x, w in zip(res, want):
            torch.testing.assert_close(x.double(), w[:, o:o + lens[u]], **tol)
