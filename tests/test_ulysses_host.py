"""The Ulysses exchange's steady-state routes (one gathered copy, one all-to-all of whole
blocks, views back) against the general path and against the plain head/sequence slices,
for U simulated ranks in one process: ``torch.distributed.all_to_all_single`` is replaced
by a recorder, and the recorded sends are delivered by hand before each rank waits."""
import pytest
import torch
import torch.distributed as dist

from usp_hal.ulysses import UlyssesExchange, head_plan, split_plan


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


def _no_routes(monkeypatch):
    monkeypatch.setattr(UlyssesExchange, "_route_heads", lambda self, *a, **k: False)
    monkeypatch.setattr(UlyssesExchange, "_route_out", lambda self, *a, **k: False)


CASES = [  # heads, kv heads, ulysses, lengths, batch
    (4, 4, 2, (16, 16), 1),      # the per-call overhead benchmark's shape
    (8, 2, 2, (5, 3), 2),        # GQA, uneven lengths, B > 1
    (6, 3, 2, (4, 4), 1),        # a rank's query heads cut a GQA group (KV heads repeated locally)
    (8, 1, 4, (2, 3, 1, 2), 1),  # one KV head that every rank receives
    (6, 6, 4, (3, 3, 3, 3), 2),  # uneven head counts: the general path
]


@pytest.mark.parametrize("H,Hkv,U,lens,B", CASES)
@pytest.mark.parametrize("strided", [False, True])
def test_routes_match_the_slices_and_send_the_same_bytes(monkeypatch, H, Hkv, U, lens, B, strided):
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

    _no_routes(monkeypatch)
    _, wire_ref = _run_qkv(exchanges(), *shards, net)
    _, wire_out_ref = _run_out(exchanges(), outs, torch.float32, net)
    for a, b in zip(wire + wire_out, wire_ref + wire_out_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("H,Hkv,U,chunks", [(8, 4, 2, 2), (8, 8, 2, 4), (12, 4, 2, 3)])
def test_head_group_routes_write_into_the_full_width_output(monkeypatch, H, Hkv, U, chunks):
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


def test_out_route_guard_dtype_and_kept_heads(monkeypatch):
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
