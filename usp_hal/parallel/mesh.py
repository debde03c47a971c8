"""The 2-D sequence-parallel mesh (ulysses x ring), immutable.

World ranks are split into data-parallel replicas of ``ulysses_degree * ring_degree``
consecutive ranks.  Inside a replica, by default (``use_ulysses_low=True``) each Ulysses
group is a run of consecutive ranks and ring groups go across them::

    U=2, R=2 (one replica)        sp rank = ring_rank * U + ulysses_rank
      ulysses groups: {0,1} {2,3}
      ring groups:    {0,2} {1,3}

With ``use_ulysses_low=False`` ring groups are the consecutive runs instead.
"""
from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Optional, Tuple

import torch.distributed as dist

_DEFAULT_MESH: "Optional[SequenceParallelMesh]" = None


@dataclass(frozen=True)
class SequenceParallelMesh:
    ulysses_degree: int
    ring_degree: int
    rank: int                      # global rank
    world_size: int
    use_ulysses_low: bool = True
    ulysses_ranks: Tuple[int, ...] = ()
    ring_ranks: Tuple[int, ...] = ()
    sp_ranks: Tuple[int, ...] = ()
    ulysses_group: Any = field(default=None, compare=False, repr=False)
    ring_group: Any = field(default=None, compare=False, repr=False)
    sp_group: Any = field(default=None, compare=False, repr=False)
    dp_group: Any = field(default=None, compare=False, repr=False)
    meta_group: Any = field(default=None, compare=False, repr=False)
    timeout: Optional[datetime.timedelta] = field(default=None, compare=False)

    def where(self, kind: str) -> str:
        """A group's name for messages, e.g. ``"ulysses group (ranks 0, 1)"`` (made once per kind)."""
        names = self.__dict__.get("_where")
        if names is None:
            names = {}
            object.__setattr__(self, "_where", names)    # a cache on a frozen mesh: not a field
        got = names.get(kind)
        if got is None:
            ranks = {"ulysses": self.ulysses_ranks, "ring": self.ring_ranks, "sequence-parallel": self.sp_ranks}[kind]
            got = names[kind] = f"{kind} group (ranks {', '.join(map(str, ranks))})"
        return got

    def groups(self) -> tuple:
        """The process groups this mesh's calls communicate on (sequence-parallel, Ulysses,
        ring, metadata; None where it has none)."""
        return (self.sp_group, self.ulysses_group, self.ring_group, self.meta_group)

    @property
    def metadata_group(self):
        """The group for the small per-call metadata exchange: a CPU (gloo) group over the
        sequence-parallel ranks, so the check never synchronises an accelerator."""
        return self.meta_group if self.meta_group is not None else self.sp_group

    @property
    def sp_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def sp_rank(self) -> int:
        return self.sp_ranks.index(self.rank) if self.sp_ranks else 0

    @property
    def dp_degree(self) -> int:
        return self.world_size // self.sp_size

    @property
    def ulysses_rank(self) -> int:
        return self.ulysses_of(self.sp_rank)

    @property
    def ring_rank(self) -> int:
        return self.ring_of(self.sp_rank)

    def ring_of(self, sp_rank: int) -> int:
        """Ring rank of the process at position ``sp_rank`` in the sequence-parallel group."""
        return sp_rank // self.ulysses_degree if self.use_ulysses_low else sp_rank % self.ring_degree

    def ulysses_of(self, sp_rank: int) -> int:
        return sp_rank % self.ulysses_degree if self.use_ulysses_low else sp_rank // self.ring_degree

    def sp_index(self, ring_rank: int, ulysses_rank: int) -> int:
        if self.use_ulysses_low:
            return ring_rank * self.ulysses_degree + ulysses_rank
        return ulysses_rank * self.ring_degree + ring_rank

    def local_positions(self, seqlen: int, layout: str = "basic", device=None, *, cu_seqlens=None):
        """Global positions (a LongTensor, in local order) of the tokens this rank holds when
        a sequence of ``seqlen`` tokens is sharded with ``usp_hal.shard(x, layout=layout)``:
        what rotary embeddings and other position-dependent parts of a model need.

        For a packed batch pass its ``cu_seqlens`` (as to ``shard``): the result is then the
        positions in the packed stream; for RoPE, which restarts at every document, use
        :meth:`local_position_ids`."""
        from ..sequence.positions import check_layout, local_positions
        pos = local_positions(check_layout(layout), int(seqlen), self.ring_degree, self.ulysses_degree,
                              self.ring_rank, self.ulysses_rank, cu_seqlens=cu_seqlens)
        return pos if device is None else pos.to(device)

    # packed sequences ------------------------------------------------------------------
    def local_position_ids(self, seqlen: int, layout: str = "basic", device=None, *, cu_seqlens=None):
        """Position ids (a LongTensor, in local order) of the tokens this rank holds: each
        token's position inside its own document, restarting at 0 at every boundary of
        ``cu_seqlens`` (what rotary embeddings of a packed batch need; equal to
        :meth:`local_positions` without ``cu_seqlens``)."""
        pos = self.local_positions(seqlen, layout, cu_seqlens=cu_seqlens)
        if cu_seqlens is not None:
            from ..sequence.positions import document_positions
            pos = document_positions(pos, cu_seqlens)
        return pos if device is None else pos.to(device)

    def local_document_ids(self, seqlen: int, layout: str = "basic", device=None, *, cu_seqlens):
        """Index of the document each local token belongs to (a LongTensor, in local order)."""
        from ..sequence.positions import document_ids
        ids = document_ids(self.local_positions(seqlen, layout, cu_seqlens=cu_seqlens), cu_seqlens)
        return ids if device is None else ids.to(device)

    def ring_peer(self, ring_rank: int) -> int:
        """Global rank of the ring member with ring index ``ring_rank`` (this rank's ring)."""
        return self.ring_ranks[ring_rank]


def _check_degrees(ulysses_degree, ring_degree, world_size):
    for name, val in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be a positive integer, got {val!r}")
    sp = ulysses_degree * ring_degree
    if world_size % sp:
        raise ValueError(f"ulysses_degree x ring_degree = {ulysses_degree} x {ring_degree} = {sp} does not "
                         f"divide the world size {world_size}; choose degrees whose product divides it")


def _layout_ranks(ulysses_degree, ring_degree, world_size, use_ulysses_low):
    """All groups of every kind, as lists of global ranks (same order on every rank)."""
    sp = ulysses_degree * ring_degree
    sp_groups, uly_groups, ring_groups = [], [], []
    for base in range(0, world_size, sp):
        sp_groups.append(list(range(base, base + sp)))
        if use_ulysses_low:
            uly_groups += [[base + r * ulysses_degree + u for u in range(ulysses_degree)] for r in range(ring_degree)]
            ring_groups += [[base + r * ulysses_degree + u for r in range(ring_degree)] for u in range(ulysses_degree)]
        else:
            ring_groups += [[base + u * ring_degree + r for r in range(ring_degree)] for u in range(ulysses_degree)]
            uly_groups += [[base + u * ring_degree + r for u in range(ulysses_degree)] for r in range(ring_degree)]
    dp_groups = [[base + i for base in range(0, world_size, sp)] for i in range(sp)]
    return sp_groups, uly_groups, ring_groups, dp_groups


def _agree(values, what: str, labels=True) -> None:
    """Every rank must pass the same ``values``; otherwise every rank raises the same error
    (one small all-gather over the world, before any group is created)."""
    from .comm import agree
    agree(None, None, what=what, where="default process group", values=values, same=labels)


def _resolve_timeout(timeout) -> Optional[datetime.timedelta]:
    if timeout is None:
        from .comm import group_timeout
        return group_timeout(None)
    if isinstance(timeout, (int, float)):
        return datetime.timedelta(seconds=float(timeout))
    return timeout


def _needs_cpu_side_group(group) -> bool:
    from .comm import host_transport
    return not host_transport(group)


_GROUPS: Dict[Any, Any] = {}   # see _group: the default group under "world", then (role, ranks, backend, timeout)


def _group(ranks, role: str, backend: Optional[str] = None, timeout: Optional[datetime.timedelta] = None,
           reuse: bool = False):
    """``torch.distributed.new_group(ranks)``; with ``reuse``, once per (role, ranks, backend,
    timeout) for the life of the default process group: a mesh built again with the same
    layout and ``reuse_groups=True`` (another ``DynamicDegree``, a second trainer) gets the
    groups the first one created.

    Each group costs every member a communicator (threads and buffers; on NCCL, GPU memory
    and seconds to create), so creating them on every call grows a long-lived process
    without bound.  Every rank must still call this for every group in the same order,
    which ``init_sequence_parallel`` does on every rank alike, so every rank either finds a
    group or creates it.  ``role`` ("sp", "ulysses", "ring", "dp", "meta") keeps a mesh's
    groups of equal ranks apart.  A new default group (after ``destroy_process_group``) or a
    group destroyed by the caller starts afresh."""
    kw: Dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if backend is not None:
        kw["backend"] = backend
    if not reuse:
        return dist.new_group(list(ranks), **kw)
    world = dist.distributed_c10d._get_default_group()
    if _GROUPS.get("world") is not world:
        _GROUPS.clear()
        _GROUPS["world"] = world
    key = (role, tuple(int(r) for r in ranks), backend, timeout)
    grp = _GROUPS.get(key)
    if grp is None or grp not in dist.distributed_c10d._world.pg_map:
        grp = _GROUPS[key] = dist.new_group(list(ranks), **kw)
    return grp


def init_sequence_parallel(ulysses_degree: Optional[int] = None, ring_degree: Optional[int] = None, *,
                           use_ulysses_low: bool = True, device_mesh=None,
                           set_default: bool = True, timeout=None, reuse_groups: bool = False) -> SequenceParallelMesh:
    """Build the sequence-parallel mesh (call after ``torch.distributed.init_process_group``).

    Every rank must call this with the same arguments (it creates process groups); the
    arguments are compared across ranks first, and a mismatch raises the same ValueError
    on every rank.  ``ulysses_degree``/``ring_degree`` default to a Ulysses-only mesh over
    the whole world.  Without an initialised process group only the trivial 1 x 1 mesh is
    possible.

    ``device_mesh``: a torch DeviceMesh, or a slice of a larger one, for data parallel (or
    tensor parallel) x sequence parallel: either 2-D with dims named "ulysses" and "ring"
    (``mesh["ulysses", "ring"]`` of a ``("dp", "ulysses", "ring")`` mesh; its own groups are
    used), or 1-D (``mesh["sp"]``), split into ``ulysses_degree`` x ``ring_degree`` (all
    Ulysses by default; a dim named "ring" is all Ring).  Every rank of the world must call
    it, with its own slice: the groups of every replica are created on every rank.

    ``reuse_groups=True``: a mesh built again with the same layout and timeout shares the
    process groups the first such mesh created, instead of creating more (each is a
    communicator per member: threads, buffers, on NCCL GPU memory and set-up time).  Meshes
    that share groups must not run collectives at the same time (from two threads), and a
    shared group whose use has ended (an out-of-step call) stays ended for every mesh on it;
    by default every mesh has its own groups.

    ``timeout`` (seconds or a timedelta) applies to every group the mesh creates; by
    default they inherit the timeout of the default process group.  When the default group
    has no CPU transport (e.g. plain ``nccl``), a gloo side group over the same ranks is
    created for the per-call metadata check, so that check never synchronises the device.
    """
    if device_mesh is not None:
        return _from_device_mesh(device_mesh, ulysses_degree, ring_degree, use_ulysses_low, set_default, timeout,
                                 reuse_groups)
    if not (dist.is_available() and dist.is_initialized()):
        u, r = ulysses_degree or 1, ring_degree or 1
        _check_degrees(u, r, 1)
        mesh = SequenceParallelMesh(1, 1, 0, 1, use_ulysses_low, (0,), (0,), (0,))
        if set_default:
            _set_default(mesh)
        return mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    if world > 1:
        _agree([-1 if ulysses_degree is None else int(ulysses_degree) if isinstance(ulysses_degree, int) else -2,
                -1 if ring_degree is None else int(ring_degree) if isinstance(ring_degree, int) else -2,
                int(bool(use_ulysses_low)), int(bool(reuse_groups))],
               "init_sequence_parallel: the ranks were called with different arguments (every rank must pass the "
               "same ones; None is -1, a non-integer -2)",
               ("ulysses_degree", "ring_degree", "use_ulysses_low", "reuse_groups"))
    tmo = _resolve_timeout(timeout)
    if ulysses_degree is None and ring_degree is None:
        ulysses_degree, ring_degree = world, 1
    elif ulysses_degree is None:
        assert ring_degree is not None
        _check_degrees(1, ring_degree, world)
        ulysses_degree = world // ring_degree
    elif ring_degree is None:
        _check_degrees(ulysses_degree, 1, world)
        ring_degree = world // ulysses_degree
    assert ulysses_degree is not None and ring_degree is not None
    _check_degrees(ulysses_degree, ring_degree, world)
    sp_groups, uly_groups, ring_groups, dp_groups = _layout_ranks(ulysses_degree, ring_degree, world, use_ulysses_low)
    mine = {}
    for kind, groups in (("sp", sp_groups), ("ulysses", uly_groups), ("ring", ring_groups), ("dp", dp_groups)):
        for ranks in groups:
            if len(ranks) == world and timeout is None:
                grp = dist.group.WORLD
            else:
                grp = _group(ranks, kind, timeout=tmo, reuse=reuse_groups)   # every rank, every group, in order
            if rank in ranks:
                mine[kind] = (tuple(ranks), grp)
    meta = None
    if _needs_cpu_side_group(mine["sp"][1]) and dist.is_backend_available("gloo"):
        for ranks in sp_groups:   # a CPU group for the metadata check (no device sync per call)
            grp = _group(ranks, "meta", backend="gloo", timeout=tmo, reuse=reuse_groups)
            if rank in ranks:
                meta = grp
    mesh = SequenceParallelMesh(
        ulysses_degree, ring_degree, rank, world, use_ulysses_low,
        ulysses_ranks=mine["ulysses"][0], ring_ranks=mine["ring"][0], sp_ranks=mine["sp"][0],
        ulysses_group=mine["ulysses"][1], ring_group=mine["ring"][1], sp_group=mine["sp"][1],
        dp_group=mine["dp"][1], meta_group=meta, timeout=tmo)
    if set_default:
        _set_default(mesh)
    return mesh


def _device_mesh_layout(dm, ulysses_degree, ring_degree, use_ulysses_low):
    """(U, R, use_ulysses_low, sp_ranks, uses the mesh's own groups) of this rank's slice."""
    names = tuple(dm.mesh_dim_names or ())
    flat = [int(x) for x in dm.mesh.flatten()]
    if dm.ndim == 2 and set(names) == {"ulysses", "ring"}:
        u_dim, r_dim = names.index("ulysses"), names.index("ring")
        grid = dm.mesh
        udeg, rdeg = int(grid.shape[u_dim]), int(grid.shape[r_dim])
        for name, given, deg in (("ulysses_degree", ulysses_degree, udeg), ("ring_degree", ring_degree, rdeg)):
            if given is not None and given != deg:
                raise ValueError(f"init_sequence_parallel: {name}={given} but the device_mesh's dim has size {deg}; "
                                 f"pass only device_mesh, or degrees that match it")
        low = u_dim == 1      # ulysses varies fastest along the mesh's last dim

        def at(r, u):
            return int(grid[r, u] if r_dim == 0 else grid[u, r])
        order = ((r, u) for r in range(rdeg) for u in range(udeg)) if low else \
            ((r, u) for u in range(udeg) for r in range(rdeg))
        return udeg, rdeg, low, tuple(at(r, u) for r, u in order), True
    if dm.ndim == 1:
        n, name = len(flat), (names[0] if names else "")
        if name == "ulysses" or (name != "ring" and ulysses_degree is None and ring_degree is None):
            udeg, rdeg = n, 1
        elif name == "ring":
            udeg, rdeg = 1, n
        else:
            for arg, val in (("ulysses_degree", ulysses_degree), ("ring_degree", ring_degree)):
                if val is not None and (not isinstance(val, int) or val < 1 or n % val):
                    raise ValueError(f"init_sequence_parallel: {arg}={val!r} does not divide {n}, the size of the "
                                     f"1-D device_mesh {name!r}; choose degrees whose product is {n}")
            udeg = ulysses_degree if ulysses_degree is not None else n // int(ring_degree)
            rdeg = ring_degree if ring_degree is not None else n // int(ulysses_degree)
        if name in ("ulysses", "ring") and (ulysses_degree, ring_degree) not in ((None, None), (udeg, rdeg)):
            raise ValueError(f"init_sequence_parallel: a 1-D device_mesh named {name!r} is {udeg} x {rdeg} "
                             f"(ulysses x ring); got ulysses_degree={ulysses_degree}, ring_degree={ring_degree}")
        _check_degrees(udeg, rdeg, n)
        if udeg * rdeg != n:
            raise ValueError(f"init_sequence_parallel: ulysses_degree x ring_degree = {udeg} x {rdeg} != {n}, the "
                             f"size of the 1-D device_mesh {name!r}")
        return udeg, rdeg, bool(use_ulysses_low), tuple(flat), False
    raise ValueError(f"device_mesh must be 2-D with dims named 'ulysses' and 'ring' (e.g. mesh['ulysses', 'ring']), "
                     f"or 1-D (a sequence-parallel dim, split by ulysses_degree/ring_degree); got ndim={dm.ndim} "
                     f"names={names}")


def _from_device_mesh(dm, ulysses_degree, ring_degree, use_ulysses_low, set_default: bool,
                      timeout=None, reuse_groups: bool = False) -> SequenceParallelMesh:
    """The mesh of a torch DeviceMesh, or of a slice of a larger one (``mesh["ulysses", "ring"]``
    of a ``("dp", "ulysses", "ring")`` mesh, a 1-D ``mesh["sp"]``).

    ``torch.distributed.new_group`` must be called by every rank of the world for every group,
    in the same order; a slice only knows its own replica's ranks.  So every rank first
    gathers every rank's slice (one small all-gather over the world), and then every rank
    creates the groups of every replica in the same order.  Bad or inconsistent slices raise
    the same error on every rank.
    """
    from .comm import agree
    rank, world = dist.get_rank(), dist.get_world_size()
    problem, layout = "", None
    try:
        if dm.get_coordinate() is None:
            raise ValueError(f"rank {rank} is not part of the given device_mesh")
        layout = _device_mesh_layout(dm, ulysses_degree, ring_degree, use_ulysses_low)
    except ValueError as exc:
        problem = str(exc)
    row = [] if layout is None else [layout[0], layout[1], int(layout[2]), len(layout[3]), *layout[3]]
    rows = agree(problem, None, what="init_sequence_parallel(device_mesh=...) refused",
                 where="default process group", values=row + [-1] * (world + 4 - len(row)), width=world + 4,
                 check=_slices_problem)
    assert layout is not None
    udeg, rdeg, low, sp_ranks, own_groups = layout
    replicas = []
    for r in rows:
        ranks = tuple(r[4:4 + r[3]])
        if ranks not in replicas:
            replicas.append(ranks)
    replicas.sort()
    tmo = _resolve_timeout(timeout)
    mine: Dict[str, Any] = {}
    per = [_replica_groups(ranks, udeg, rdeg, low) for ranks in replicas]
    dp_groups = [[ranks[i] for ranks in replicas] for i in range(udeg * rdeg)]
    kinds = [("sp", [p[0][0] for p in per])]
    if not own_groups:
        kinds += [("ulysses", [g for p in per for g in p[1]]), ("ring", [g for p in per for g in p[2]])]
    kinds.append(("dp", dp_groups))
    for kind, groups in kinds:   # every rank creates every replica's groups, in the same order
        for ranks in groups:
            grp = dist.group.WORLD if len(ranks) == world and timeout is None else _group(ranks, kind, timeout=tmo,
                                                                                     reuse=reuse_groups)
            if rank in ranks:
                mine[kind] = (tuple(ranks), grp)
    sp_group = mine["sp"][1]
    meta = None
    if _needs_cpu_side_group(sp_group) and dist.is_backend_available("gloo"):
        for p in per:
            grp = _group(p[0][0], "meta", backend="gloo", timeout=tmo, reuse=reuse_groups)
            if rank in p[0][0]:
                meta = grp
    mine_rep = next(p for p in per if rank in p[0][0])
    ulysses_ranks = next(tuple(g) for g in mine_rep[1] if rank in g)
    ring_ranks = next(tuple(g) for g in mine_rep[2] if rank in g)
    if own_groups:
        uly_group, ring_group = dm.get_group("ulysses"), dm.get_group("ring")
    else:
        uly_group, ring_group = mine["ulysses"][1], mine["ring"][1]
    mesh = SequenceParallelMesh(udeg, rdeg, rank, world, low, ulysses_ranks, ring_ranks, tuple(sp_ranks),
                                ulysses_group=uly_group, ring_group=ring_group, sp_group=sp_group,
                                dp_group=mine["dp"][1], meta_group=meta, timeout=tmo)
    if set_default:
        _set_default(mesh)
    return mesh


def _slices_problem(rows) -> Optional[str]:
    """Why the ranks' device_mesh slices (``[U, R, ulysses-low, n, *sp ranks]`` per rank) do not
    make one mesh, or None; evaluated on every rank over the same rows."""
    replicas: list = []
    for i, r in enumerate(rows):
        ranks = tuple(r[4:4 + r[3]])
        if tuple(r[:3]) != tuple(rows[0][:3]):
            return ("the ranks' slices differ in degrees (ulysses, ring, ulysses-low per rank: " + ", ".join(
                f"rank {j}: {tuple(x[:3])}" for j, x in enumerate(rows)) + ")")
        if i not in ranks:
            return f"rank {i}'s slice {ranks} does not hold it"
        if ranks not in replicas:
            replicas.append(ranks)
    seen = [x for ranks in replicas for x in ranks]
    if len(seen) != len(set(seen)):
        return (f"the slices overlap: {replicas}; pass a slice of one DeviceMesh (such as mesh['ulysses', 'ring']) "
                "on every rank")
    udeg, rdeg, low = rows[0][0], rows[0][1], bool(rows[0][2])
    for ranks in replicas:
        for kind, groups in zip(("sequence-parallel", "ulysses", "ring"),
                                _replica_groups(ranks, udeg, rdeg, low)[:3]):
            for g in groups:
                if list(g) != sorted(g):
                    return (f"the {kind} group {list(g)} does not list its ranks in increasing order (a process "
                            "group orders its members by rank); use a mesh whose ranks increase along every dim, "
                            "as init_device_mesh makes it")
    return None


def _replica_groups(sp_ranks, udeg, rdeg, low):
    """([sp group], ulysses groups, ring groups) of one replica, ``sp_ranks`` in sp order."""
    if low:
        uly = [[sp_ranks[r * udeg + u] for u in range(udeg)] for r in range(rdeg)]
        ring = [[sp_ranks[r * udeg + u] for r in range(rdeg)] for u in range(udeg)]
    else:
        ring = [[sp_ranks[u * rdeg + r] for r in range(rdeg)] for u in range(udeg)]
        uly = [[sp_ranks[u * rdeg + r] for u in range(udeg)] for r in range(rdeg)]
    return [list(sp_ranks)], uly, ring


def _set_default(mesh: Optional[SequenceParallelMesh]) -> None:
    global _DEFAULT_MESH
    _DEFAULT_MESH = mesh


def current_default_mesh() -> Optional[SequenceParallelMesh]:
    """The default mesh, or None when none was made (unlike :func:`get_default_mesh`, this
    makes none: yunchang's extract functions read the placement with it)."""
    return _DEFAULT_MESH


@contextlib.contextmanager
def default_mesh_set_to(mesh: SequenceParallelMesh) -> Iterator[SequenceParallelMesh]:
    """Within the block, ``mesh`` is the default mesh (what modules and integrations built with
    ``mesh=None`` use); the previous default comes back afterwards."""
    old = _DEFAULT_MESH
    _set_default(mesh)
    try:
        yield mesh
    finally:
        _set_default(old)


def get_default_mesh() -> SequenceParallelMesh:
    if _DEFAULT_MESH is None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("no sequence-parallel mesh: call usp_hal.init_sequence_parallel(ulysses_degree, "
                               "ring_degree) (or set_seq_parallel_pg) first, or pass mesh=")
        return init_sequence_parallel(1, 1, set_default=True)
    return _DEFAULT_MESH


def set_seq_parallel_pg(sp_ulysses_degree: int, sp_ring_degree: int, rank: int, world_size: int,
                        use_ulysses_low: bool = True) -> None:
    """yunchang-compatible: build the mesh and make it the default one (read it back with
    :func:`get_default_mesh`).  Returns None, as yunchang 0.6.4's does (yunchang/globals.py,
    ``set_seq_parallel_pg``, which stores its two groups in ``PROCESS_GROUP``)."""
    if dist.is_initialized():
        from .comm import agree
        problem = None
        if rank != dist.get_rank() or world_size != dist.get_world_size():
            problem = (f"rank/world_size ({rank}/{world_size}) differ from the process group "
                       f"({dist.get_rank()}/{dist.get_world_size()})")
        agree(problem, None, what="set_seq_parallel_pg", where="default process group")
    init_sequence_parallel(sp_ulysses_degree, sp_ring_degree, use_ulysses_low=use_ulysses_low, set_default=True)


def mesh_of_group(group, kind: str) -> SequenceParallelMesh:
    """A one-dimensional mesh over an existing process group (None: the default group):
    ``kind`` "ulysses" (all-to-all over it) or "ring" (blocks rotate over it).  Creates no
    group and runs no collective, so any rank may build it at any time.

    The per-call metadata check runs over ``group`` itself; on a group without a host
    transport (plain nccl) that is one small device all-gather per call (the meshes of
    ``init_sequence_parallel`` add a gloo side group for it instead)."""
    if kind not in ("ulysses", "ring"):
        raise ValueError(f"kind must be 'ulysses' or 'ring', got {kind!r}")
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return SequenceParallelMesh(1, 1, 0, 1, True, (0,), (0,), (0,))
    if group is None:
        group = dist.group.WORLD
    ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not a member of the given process group (ranks {ranks})")
    n = len(ranks)
    if kind == "ulysses":
        return SequenceParallelMesh(n, 1, rank, world, True, ulysses_ranks=ranks, ring_ranks=(rank,), sp_ranks=ranks,
                                    ulysses_group=group, ring_group=None, sp_group=group)
    return SequenceParallelMesh(1, n, rank, world, True, ulysses_ranks=(rank,), ring_ranks=ranks, sp_ranks=ranks,
                                ulysses_group=None, ring_group=group, sp_group=group)
