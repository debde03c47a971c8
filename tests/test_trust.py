"""What single-device attention guarantees and every call must keep: non-finite inputs come
out non-finite where they should, a second backward through one call works, grad modes
interleave on one module, and threads with their own modules and groups do not meet.
Every case compares with the float64 single-process reference (tests/dist_trust.py)."""
import pytest

from tests import dist_trust
from usp_hal.pipeline.options import CallOptions, check_mode

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("U,R", [(1, 2), (2, 1)])
def test_nonfinite_inputs_stay_nonfinite(pools, U, R):
    """A NaN in q, k or v (and an inf in q) in every layout and rotation, causal or not:
    outputs and gradients that depend on it are non-finite (exactly the rows for a bad q or
    k), no other head is touched, and every finite value is the reference's.  On 3768c1e
    a causal or full Ring-2 call with a NaN query returned a finite row (the CPU kernel
    hides it in float32 and the guard was off)."""
    res = pools(2).run(dist_trust.nonfinite_sweep, timeout=240, U=U, R=R)
    for r in res:
        assert r["expected"] > 0, r
        assert not r["fails"], r["fails"][:3]


def test_nonfinite_inputs_u2r2(pools):
    res = pools(4).run(dist_trust.nonfinite_sweep, timeout=240, U=2, R=2, layouts=("zigzag",), rotations=("p2p",))
    for r in res:
        assert not r["fails"], r["fails"][:3]
    assert sum(r["expected"] for r in res) > 0, res


@pytest.mark.parametrize("U,R,mode,low_memory", [(1, 2, "retain", False), (1, 2, "grad", False),
                                                 (2, 1, "retain", False), (2, 1, "grad", False),
                                                 (2, 1, "retain", 2)])
def test_backward_twice(pools, U, R, mode, low_memory):
    """``backward(retain_graph=True)`` twice gives twice the gradients; ``autograd.grad``
    twice (over q, then over k and v) gives each.  On 3768c1e the second raised."""
    for errs in pools(2).run(dist_trust.backward_twice, timeout=60, U=U, R=R, mode=mode, low_memory=low_memory):
        assert all(e <= 1 for e in errs.values()), errs


@pytest.mark.parametrize("which", ["q", "k", "v", "out"])
def test_modified_in_place_after_forward(pools, which):
    """A tensor the backward needs, modified in place after the forward: single-device
    attention refuses the backward.  On Ring-2 the head layout is the call's own q/k/v and
    output, so the backward refuses too (before, it computed the gradients of the modified
    values without a word); on Ulysses-2 it works on its own head-layout copies, whose
    gradients are those of the values the forward used."""
    for r in pools(2).run(dist_trust.modified_after_forward, timeout=60, U=1, R=2, which=which):
        assert r[0] == "raised" and "modified by an inplace operation" in r[1], r
    for r in pools(2).run(dist_trust.modified_after_forward, timeout=60, U=2, R=1, which=which):
        assert r[0] == "grads" and all(e <= 1 for e in r[1].values()), r


@pytest.mark.parametrize("U,R", [(1, 2), (2, 1)])
def test_grad_modes_interleave(pools, U, R):
    """inference_mode, no_grad and grad calls on one module, in turns.  On 3768c1e the first
    grad call after an inference-mode call raised CommError on every rank (the agreement's
    reused buffer was an inference tensor)."""
    for errs in pools(2).run(dist_trust.grad_modes, timeout=60, U=U, R=R):
        assert len(errs) == 9 and all(e <= 1 for e in errs), errs


def test_two_threads_two_modules(pools):
    """Two threads per rank, each with its own module and groups, steady calls at once: right
    results, and a change on one rank is refused on both ranks of that thread's group.  On
    3768c1e the threads shared one list of agreements in flight and the call hung."""
    for res in pools(2).run(dist_trust.two_threads, timeout=90):
        for i, r in enumerate(res):
            assert r is not None and "error" not in r, res
            assert len(r["errs"]) == (39 if i == 0 else 40) and all(e <= 1 for e in r["errs"]), r
        assert res[0]["refused"] and "disagree" in res[0]["refused"] and "causal" in res[0]["refused"], res


def test_check_modes_and_aliases():
    assert check_mode(True) == check_mode(None) == check_mode("every_call") == "every_call"
    assert check_mode(False) == check_mode("off") == "off"
    assert check_mode(True, static_shapes=True) == check_mode("first_call") == "first_call"
    with pytest.raises(ValueError, match="check_ranks"):
        check_mode("sometimes")
    with pytest.raises(ValueError, match="first_call"):
        check_mode(False, static_shapes=True)


def test_options_key_follows_every_keyword():
    """The options cache key is made of every keyword passed, so a keyword added to
    ``forward`` (here: one more field passed to ``CallOptions.of``) changes the key and is
    never served stale options."""
    import inspect
    names = [n for n in inspect.signature(CallOptions.of).parameters]
    base = {n: inspect.signature(CallOptions.of).parameters[n].default for n in names}
    k0 = CallOptions.key(**base)
    assert k0 is not None
    changed = {"dropout_p": 0.5, "softmax_scale": 0.25, "causal": True, "window_size": (3, 0), "softcap": 2.0,
               "deterministic": True, "return_lse": True, "joint_strategy": "front", "joint_total": 4,
               "mask": object(), "sinks": True}
    assert set(changed) == set(names), "a new CallOptions.of keyword: add a changed value for it here"
    for n in names:
        assert CallOptions.key(**{**base, n: changed[n]}) != k0, n
    assert CallOptions.key(**base, new_keyword=1) != k0
    cache: dict = {}
    a = CallOptions.cached(cache, causal=True)
    assert CallOptions.cached(cache, causal=True) is a
    assert CallOptions.cached(cache, causal=True, return_lse=True).return_lse
    import torch
    assert CallOptions.key(softmax_scale=torch.tensor(0.5)) is None      # a tensor scale is read every call


def test_nan_guard_marks_exactly_the_nonfinite_rows():
    """The guard is 0 for a finite row, also one whose sum overflows, and NaN for a row with
    a NaN or an infinity, in every input dtype; it is made under inference_mode and then used
    outside it (a cached column that stays a normal tensor)."""
    import torch

    from usp_hal.pipeline.run import nan_guard
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        big = torch.finfo(dtype).max / 2
        q = torch.ones(2, 3, 4, 16, dtype=dtype)
        q[0, 1, 2] = big                              # finite; its sum overflows to inf
        q[1, 0, 3, 5] = float("nan")
        q[1, 2, 0, 7] = float("-inf")
        with torch.inference_mode():
            g = nan_guard(q)
        g = nan_guard(q.requires_grad_(False))
        assert g.shape == (2, 3, 4, 1) and not g.is_inference()
        bad = torch.isnan(g).flatten().nonzero().flatten().tolist()
        want = [(1 * 3 + 0) * 4 + 3, (1 * 3 + 2) * 4 + 0]
        assert bad == want, (dtype, bad)
        assert bool((g.flatten()[[i for i in range(24) if i not in want]] == 0).all()), dtype
