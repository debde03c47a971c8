"""Meshes from a torch DeviceMesh and slices of one (data parallel x sequence parallel)."""
import pytest

from tests import dist_mesh


@pytest.mark.multirank
@pytest.mark.parametrize("shape", sorted(dist_mesh.SHAPES))
def test_device_mesh_slice_groups_and_attention(pools, shape):
    reps = pools(4).run(dist_mesh.submesh_case, shape=shape, timeout=60)
    dims, names, pick, degrees = dist_mesh.SHAPES[shape]
    for rank, rep in enumerate(reps):
        # every group sums exactly the ranks it names, and those include this rank
        for kind in ("sp", "ulysses", "ring"):
            assert rank in rep["ranks"][kind], (rank, rep)
            assert rep["sums"][kind] == sum(rep["ranks"][kind]), (rank, kind, rep)
        U, R, dp = rep["degrees"]
        assert U * R * dp == 4 and len(rep["ranks"]["sp"]) == U * R, rep
        assert all(v <= 1 for v in rep["errors"].values()), (rank, rep["errors"])
    # the replicas partition the world, and the dp group joins the ranks at one sp position
    replicas = {tuple(rep["ranks"]["sp"]) for rep in reps}
    assert sorted(r for rp in replicas for r in rp) == [0, 1, 2, 3], replicas
    for rank, rep in enumerate(reps):
        pos = rep["ranks"]["sp"].index(rank)
        assert rep["sums"]["dp"] == sum(rp[pos] for rp in replicas), (rank, rep, replicas)


@pytest.mark.multirank
@pytest.mark.parametrize("what,needle", [("three_dims", "2-D with dims named"),
                                         ("degree_mismatch", "does not divide"),
                                         ("one_rank_differs", "differ in degrees")])
def test_bad_device_mesh_raises_on_every_rank(pools, what, needle):
    res = pools(4).run_all(dist_mesh.bad_submesh, what=what, timeout=60)
    for r in res:
        assert r[0] == "err" and "ValueError" in r[1] and needle in r[1], res


def test_a_mesh_built_again_with_reuse_groups_shares_its_process_groups(pools):
    """Each process group costs its members a communicator (threads here, GPU memory and set-up
    time on NCCL): building the same meshes again with reuse_groups=True (another
    DynamicDegree, a second trainer) creates none; without it a mesh still gets its own."""
    for r in pools(4).run(dist_mesh.groups_reused, timeout=120):
        assert r["created"] == 0, r
        assert all(r["same"]) and r["sum"] == 2.0 and r["meshes"] >= 4 and r["own"], r
