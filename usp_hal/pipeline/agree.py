"""Step 2 of a call: every rank learns every rank's local length and sees any rank's
refusal or any disagreement, from one small all-gather of the spec's metadata vector (on
the mesh's CPU side group when the group has no CPU transport), through the library's one
agreement primitive, :func:`usp_hal.parallel.comm.agree`.  All ranks then raise the
same error together, so none waits in a data collective."""
from __future__ import annotations

import builtins
from typing import Optional

from ..parallel import comm
from ..parallel.comm import AgreementError
from ..sequence.positions import local_lengths, local_positions
from .entry import Agreed, Checked
from .spec import CallSpec, compare, digest_ints, field_index, meta_length
from .validate import MASK_UNCHECKED, USPError, mask_seqlen, share

_WHAT = "attention call metadata"   # the label of its all-gather in traces and errors


def joint_total(spec: CallSpec) -> int:
    return int(spec.joint.split(":")[1])


def agree(pipe, mesh, checked: Checked) -> Agreed:
    """Every rank's local length (and what else every rank learnt: :class:`Agreed`), after
    making sure every rank can run this call and all agree on it; raises the same error on
    every rank otherwise.  ``checked``: this rank's call (its spec, or its refusal; a packed
    call's validated document boundaries, whose digest is in the spec).  Reads the pipeline's
    configuration and fills its caches; what changes is returned.

    ``pipe.check_ranks`` picks what is exchanged: ``"every_call"`` (every call: the spec's
    metadata vector, compared), ``"first_call"`` (that once; later calls of the same spec
    exchange nothing, a call of another spec, or one this rank refuses, raises
    :class:`~usp_hal.parallel.comm.OutOfStepError` on the rank that sees it and ends the use of the
    mesh's groups there: :func:`out_of_step`), ``"off"`` (every call: the local lengths,
    refusals, and whether a mask awaits its check at the agreed length)."""
    spec, err, cu_seqlens = checked.spec, checked.err, checked.cu_seqlens
    if mesh.sp_size == 1:
        if err is not None:
            raise err
        assert spec is not None
        if cu_seqlens is not None:
            check_layout(pipe, mesh, spec, [spec.local_len], None, cu_seqlens)
        return Agreed([spec.local_len])
    compare_meta = pipe.check_ranks != "off"
    if pipe.check_ranks == "first_call" and pipe.frozen is not None:
        frozen, lengths = pipe.frozen
        if err is None and spec is not None and spec == frozen:
            return Agreed(lengths)
        out_of_step(mesh, frozen, spec, err)
    group = mesh.metadata_group
    where = mesh.where("sequence-parallel")
    problem = None if err is None else f"{type(err).__name__}: {err}"
    rep = pipe.repeats.get((spec, group)) if err is None and spec is not None else None
    width, values = row_values(pipe, spec, err, rep)
    if rep is None and err is None and spec is not None:
        # a call of this spec again: one all-gather and one comparison of host integers
        rep = pipe.repeats.put((spec, group), comm.Repeat(values))

    def differences(rows):
        if not compare_meta or all(r == rows[0] for r in rows[1:]):
            return None
        if spec is not None and spec.mask:
            # a mask digested at the last masked call's length says nothing when the length has
            # changed, or when a rank could not evaluate it there: every rank then compares the
            # masks again at the agreed length (maskcheck.agree_mask), so the digests are left out
            m, n = field_index("mask") - 1, field_index("local_len") - 1
            if sum(r[n] for r in rows) != mask_seqlen(pipe, cu_seqlens) \
                    or any(r[m] == MASK_UNCHECKED for r in rows):
                rows = [r[:m] + [0] + r[m + 1:] for r in rows]
                if all(r == rows[0] for r in rows[1:]):
                    return None
        return compare([[0] + r for r in rows], mesh.sp_ranks, spec)

    try:   # one all-gather of every rank's metadata (a second one with the reasons, only on a refusal)
        rows = comm.agree(problem, group, what=_WHAT, where=where, values=values, width=width,
                          ranks=mesh.sp_ranks, check=differences, repeat=rep)
    except AgreementError as exc:
        if exc.problems:     # the same error on every rank, the refusing ones included
            raise refusal(exc.problems) from err
        found = str(exc)[len(_WHAT) + 2:].strip()
        raise USPError("ranks of the sequence-parallel group disagree on this attention call "
                       "(every rank must pass the same shapes and options):\n  " + found) from None
    assert spec is not None      # no rank flagged an error, so this one has a spec
    # the same on every rank (from the rows): some rank's mask was not digested before the agreement
    flag = field_index("mask") - 1 if compare_meta else 1
    unchecked = bool(any(r[flag] == MASK_UNCHECKED for r in rows) if compare_meta else any(r[flag] for r in rows))
    if rep is not None and rep.hit and rep.result is not None:
        return Agreed(rep.result, unchecked)     # the same rows as the last call whose checks all passed
    rows = [[0] + r for r in rows]
    lengths = [r[field_index("local_len")] for r in rows] if compare_meta else [r[1] for r in rows]
    check_layout(pipe, mesh, spec, lengths, rows if compare_meta else None, cu_seqlens)
    if rep is not None:
        rep.result = lengths
    return Agreed(lengths, unchecked, (spec, lengths) if pipe.check_ranks == "first_call" else None)


def out_of_step(mesh, frozen: CallSpec, spec: Optional[CallSpec], err) -> None:
    """Raise for a ``check_ranks="first_call"`` call that is not the first (checked) one on
    this rank: another spec, or a call this rank refuses.  The other ranks check nothing
    after the first call, so they may already be in this call's data exchanges with the
    first call's shapes; nothing this rank can do now reaches them without a host read on
    their steady path.  So the use of the mesh's groups ends on this rank: this call and
    every later call of the library on them raise :class:`~usp_hal.parallel.comm.OutOfStepError`
    here before communicating, and none of this rank's later calls can pair with theirs."""
    if err is not None or spec is None:
        what = f"this rank refuses the call ({type(err).__name__}: {err})"
    else:
        what = "it differs from the first one:\n  " + "\n  ".join(
            compare([frozen.meta(), spec.meta()], ["first call", "this call"], spec))
    msg = (f"check_ranks='first_call' (static_shapes=True): a later call on this rank is not the first (checked) "
           f"call, and the other ranks of the {mesh.where('sequence-parallel')} check nothing after it, so they "
           f"may be running it already; the use of this mesh's process groups ends here on this rank (this and "
           f"every later usp_hal call on them raise OutOfStepError before communicating, so no later call of "
           f"this rank pairs with theirs; a rank that went on waits in the call's first data exchange until the "
           f"process group's timeout, then raises CommError, and its later calls raise OutOfStepError too). "
           f"Rebuild the process groups and the mesh to go on, and use check_ranks='every_call' for calls that "
           f"change. This call: {what}")
    comm.end_use(mesh.groups(), msg)
    raise comm.OutOfStepError(msg) from err


_REFUSALS: dict = {}


def refusal(problems) -> USPError:
    """The error every rank raises when some rank(s) refused a call: it names each refusing
    rank and its reason (``"<type>: <message>"``), and is also an instance of the refusals'
    exception type when they share one (``except TypeError`` still works)."""
    kinds = {str(m).split(":", 1)[0] for m in problems.values()}
    base = getattr(builtins, kinds.pop(), None) if len(kinds) == 1 else None
    cls: type = USPError
    if isinstance(base, type) and issubclass(base, Exception) and not issubclass(base, ValueError):
        cls = _REFUSALS.get(base) or USPError
        if base not in _REFUSALS:
            try:
                cls = _REFUSALS[base] = type(f"USP{base.__name__}", (USPError, base), {"__module__": __name__})
            except TypeError:        # an incompatible layout
                _REFUSALS[base] = USPError
    return cls(f"attention call refused on rank(s) {list(problems)} of the sequence-parallel group:\n"
               + "\n".join(f"  rank {r}: {m}" for r, m in problems.items()))


def row_values(pipe, spec: Optional[CallSpec], err, rep=None):
    """``(width, values)``: what this rank sends after its flag in the agreement (its spec's
    metadata, or only its length with ``check_ranks="off"``; nothing for a refusal)."""
    if pipe.check_ranks != "off":
        width = meta_length() - 1
        values = [] if spec is None or err is not None else rep.values if rep is not None else pipe.meta_of(spec)[1:]
    else:     # the length, and whether the mask was digested before the agreement (maskcheck)
        values = [] if spec is None or err is not None else [spec.local_len, int(spec.mask == MASK_UNCHECKED)]
        width = 2
    return width, values


def check_layout(pipe, mesh, spec: CallSpec, lengths, rows, cu=None) -> None:
    """The ranks' lengths (and, with ``positions=``, their positions) fit the layout."""
    R, U = mesh.ring_degree, mesh.ulysses_degree
    if spec.joint:   # the main tokens' lengths follow the layout; the joint shares were checked locally
        total = joint_total(spec)
        lengths = [n - share(total, mesh.sp_size, i)[1] for i, n in enumerate(lengths)]
    seqlen = sum(lengths)
    layout = pipe.layout.name
    key = (tuple(lengths), R, U, layout, cu, spec.causal or spec.positional)
    if rows is None or not spec.positions:
        if key in pipe.checked_layouts:
            return
    per = [[lengths[mesh.sp_index(r, u)] for u in range(U)] for r in range(R)]
    if cu is not None and cu[-1] != seqlen:
        raise USPError(f"cu_seqlens ends at {cu[-1]}, but the ranks hold {seqlen} tokens in all "
                       f"(local lengths {per}, ring x ulysses); the last boundary must be the global length S")
    if spec.causal or spec.positional or cu is not None:
        expect = local_lengths(layout, seqlen, R, U, cu_seqlens=cu)
        if per != expect:
            how = f"layout={layout!r}" + (", cu_seqlens=cu_seqlens" if cu is not None else "")
            raise USPError(f"local sequence lengths {per} (ring x ulysses) do not match the {layout!r} layout "
                           f"for S={seqlen}{' and these documents' if cu is not None else ''} (expected "
                           f"{expect}); shard inputs with usp_hal.shard(x, {how}) (causal/window/alibi and "
                           f"document boundaries depend on positions)")
    if rows is not None and spec.positions:
        idx = field_index("positions")
        wrong = []
        for i, r in enumerate(rows):
            pos = local_positions(layout, seqlen, R, U, mesh.ring_of(i), mesh.ulysses_of(i), cu_seqlens=cu)
            if r[idx] != digest_ints(pos.tolist()):
                wrong.append(mesh.sp_ranks[i])
        if wrong:
            raise USPError(f"rank(s) {wrong} hold other positions than the {layout!r} layout gives them for "
                           f"S={seqlen} (checked because positions= was passed); shard inputs with "
                           f"usp_hal.shard(x, layout={layout!r})")
        return
    pipe.checked_layouts.add(key)
