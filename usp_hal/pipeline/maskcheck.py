"""The cross-rank check of a masked call's mask, by what the mask selects.

Before the agreement, :func:`usp_hal.pipeline.validate.mask_digest` puts in the spec a digest
of what the mask keeps (:meth:`usp_hal.sequence.masks.Predicate.digest`) at a global length every
rank knows alike: the documents' total with ``cu_seqlens``, else the length of the module's
last masked call.  When the agreed length is another one (the module's first masked call,
or a new length), every rank sees that from the same agreed lengths and digests its mask at
the agreed length; one more small all-gather (on the metadata group) compares the digests,
and a mask that fails to evaluate on some rank is reported there, so every rank raises the
same error and none waits in a data collective.  In steady state (the same length as the
last masked call) the first agreement already compared the digests, which are cached per
mask state, length and options: no extra collective and no mask evaluation."""
from __future__ import annotations

from ..parallel import comm
from ..parallel.comm import AgreementError
from .entry import Agreed, Checked
from .validate import USPError, mask_seqlen

_WHAT = "attention mask digest"


def agree_mask(pipe, mesh, checked: Checked, agreed: Agreed) -> int:
    """After the agreement of a masked call: compare the masks at the agreed length when the
    spec's digest was not taken at it (see the module doc).  Returns the agreed global length
    (the pipeline's next ``mask_seqlen``)."""
    from ..sequence.masks import Predicate
    spec, local = checked.spec, checked.local
    assert spec is not None and local is not None
    S = sum(int(n) for n in agreed.lengths)
    # the same decision on every rank: from the agreed lengths, and from every rank's digest
    # (agreed.mask_unchecked: some rank could not digest its mask before the agreement)
    stale = S != mask_seqlen(pipe, local.cu_seqlens) or agreed.mask_unchecked
    # every check_ranks mode, "off" included: a mask that fails on one rank must be a refusal on every
    # rank (the "off" agreement carries the mask flag for this); "first_call" calls after the first
    # one never get here stale (the same length, or out of step before)
    if stale and mesh.sp_size > 1:
        err = None
        digest = 0
        try:
            pred = Predicate(local.mask, causal=spec.causal, window=(int(spec.window[0]), int(spec.window[1])),
                             cu_seqlens=local.cu_seqlens, batch=spec.batch)
            digest = pred.digest(S)
        except Exception as exc:      # any failure of the mask function: a refusal every rank sees
            err = exc
        try:
            problem = None if err is None else f"mask {local.mask.name!r}: {type(err).__name__}: {err}"
            comm.agree(problem, mesh.metadata_group, what=_WHAT, where=mesh.where("sequence-parallel"),
                       values=[digest], width=1, ranks=mesh.sp_ranks,
                       check=lambda rows: None if all(r == rows[0] for r in rows) else "differs")
        except AgreementError as exc:     # the same message on every rank
            if exc.problems:
                raise USPError(f"the mask failed on rank(s) {list(exc.problems)} of the sequence-parallel group "
                               "(each rank's own mask named):\n"
                               + "\n".join(f"  rank {r}: {m}" for r, m in exc.problems.items())) from err
            raise USPError(mismatch_text(exc.rows, mesh.sp_ranks)) from None
    return S


def mismatch_text(rows, ranks) -> str:
    shown = ", ".join(f"rank {r}: {row[0] & 0xffffffff:08x}" for r, row in zip(ranks, rows or []))
    return ("ranks of the sequence-parallel group pass masks that select different (query, key) pairs "
            f"(digests of each rank's tile classification and partial tiles: {shown}); every rank must pass "
            "the same mask, with the same parameters and data")
