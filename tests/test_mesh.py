"""parlab.Mesh: the same groups as torch's init_device_mesh for the same shape (each axis, and
each combination of data axes as torch's flattened sub-mesh), on real ranks, at 4 and 8
ranks; collectives on each group reach exactly its ranks; bad shapes and axis names are
refused with a sentence."""

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.runtime.mesh import AXES, COMBINATIONS, Mesh, axis_groups

pytestmark = pytest.mark.timeout(180)

SHAPES = {4: [dict(dp=4), dict(pp=4), dict(tp=4), dict(cp=4), dict(dp=2, tp=2), dict(pp=2, dp=2), dict(pp=2, tp=2),
              dict(dp=2, ep=2), dict(cp=2, tp=2)],
          8: [dict(dp=2, pp=2, tp=2), dict(pp=2, tp=4), dict(dp=4, tp=2), dict(dp=2, cp=2, tp=2),
              dict(dp=2, ep=2, cp=2), dict(pp=2, ep=2, tp=2)]}


def groups_beside_torchs(shapes):
    """On each rank, per shape: this rank's coordinates, its mesh ranks per axis, torch's
    DeviceMesh ranks per axis, and the sum of the global ranks all-reduced over each group."""
    from torch.distributed.device_mesh import init_device_mesh

    answers = []
    for sizes in shapes:
        with Mesh(**sizes) as mesh:
            torchs = init_device_mesh("cpu", mesh.shape, mesh_dim_names=AXES)
            sums = {}
            for axes in COMBINATIONS:
                x = torch.tensor([float(dist.get_rank())])
                dist.all_reduce(x, group=mesh.group(*axes))
                sums[axes] = x.item()
            answers.append({
                "coordinates": [mesh.coordinate(axis) for axis in AXES],
                "mesh": {axes: mesh.ranks(*axes) for axes in COMBINATIONS},
                "torch": {axes: dist.get_process_group_ranks(torchs[axes]._flatten().get_group() if len(axes) > 1
                                                             else torchs.get_group(axes[0])) for axes in COMBINATIONS},
                "sums": sums,
                "torch_coordinates": list(torchs.get_coordinate()),
            })
    return answers


@pytest.mark.parametrize("world_size", [4, 8])
def test_the_mesh_groups_are_torchs_device_mesh_groups(world_size, request):
    if world_size == 4:
        cluster, owned = request.getfixturevalue("cluster4"), None
    else:
        cluster = owned = parlab.Cluster(world_size=8, timeout=120)
    try:
        per_rank = cluster.run(groups_beside_torchs, SHAPES[world_size])
    finally:
        if owned is not None:
            owned.close()
    for rank, answers in enumerate(per_rank):
        for sizes, answer in zip(SHAPES[world_size], answers):
            assert answer["mesh"] == answer["torch"], (rank, sizes)
            assert answer["coordinates"] == answer["torch_coordinates"], (rank, sizes)
            assert answer["sums"] == {axis: float(sum(ranks)) for axis, ranks in answer["mesh"].items()}
            assert all(rank in ranks for ranks in answer["mesh"].values())


def test_the_layout_is_row_major_over_pp_dp_ep_cp_tp():
    # The 2 x 2 x 2 mesh of the docstring, read without ranks: every group of every axis.
    mesh = object.__new__(Mesh)
    mesh.sizes = {"pp": 2, "dp": 2, "ep": 1, "cp": 1, "tp": 2}
    assert mesh.all_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.all_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.all_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.all_groups("cp") == [[rank] for rank in range(8)]
    # cp sits between dp and tp, ep between dp and cp: rank = (((i_pp dp + i_dp) ep + i_ep) cp + i_cp) tp + i_tp
    assert axis_groups("cp", dp=2, cp=2, tp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(("dp", "cp"), dp=2, cp=2, tp=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert axis_groups("ep", dp=2, ep=2, cp=2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert axis_groups(("dp", "ep", "cp"), dp=2, ep=2, cp=2) == [list(range(8))]


def make_mesh(**sizes):
    try:
        Mesh(**sizes)
    except ValueError as error:
        return str(error)
    return None


def test_bad_shapes_are_refused_with_what_to_change(cluster4):
    assert cluster4.run(make_mesh, dp=3)[0] == (
        "a mesh of dp = 3 needs 3 ranks, but 4 are running: choose sizes whose product is 4.")
    assert cluster4.run(make_mesh, dp=2, tp=0)[0].startswith(
        "tp (the number of tensor-parallel shards) must be a whole number >= 1, got 0: give it as a count")
    assert cluster4.run(make_mesh, pp=2.0, dp=2)[0].startswith("pp (the number of pipeline stages) must be")
    with pytest.raises(ValueError, match="a mesh has the axes pp, dp, ep, cp, tp, not 'sp': name one of them."):
        object.__new__(Mesh).size("sp")
    with pytest.raises(ValueError, match=r"one axis, or several of the data axes dp, ep, cp .* not \('dp', 'tp'\)"):
        axis_groups(("dp", "tp"), dp=2, tp=2)
