"""The ranks of a world as a grid with one axis per parallelism: ``Mesh(dp=2, pp=2, tp=2)``.

Axes, outermost first: ``pp`` (pipeline stages), ``dp`` (data-parallel replicas), ``ep``
(expert-parallel shards: each holds E / ep of the experts), ``cp`` (context-parallel shards:
each holds s / cp of the sequence), ``tp`` (tensor-parallel shards). Tensor parallelism is
innermost, as in Megatron-LM and torchtitan: it talks in every layer, on the critical path,
so its ranks are neighbours, which on a real machine share a node and its fast links;
pipeline stages, whose messages are one micro-batch's activations, are farthest apart. The
order is Megatron-LM's default, ``order="tp-cp-ep-dp-pp"`` (innermost first,
``megatron/core/parallel_state.py``). The global rank of coordinates (i_pp, i_dp, i_ep, i_cp, i_tp) is

    rank = (((i_pp * dp + i_dp) * ep + i_ep) * cp + i_cp) * tp + i_tp

the ranks numbered in row-major order over the shape (pp, dp, ep, cp, tp), as
``torch.distributed.device_mesh.init_device_mesh(device, shape, mesh_dim_names=AXES)``
numbers them. The group of an axis is the ranks that differ from this one only in that
axis's coordinate. The 2 x 2 x 2 mesh of 8 ranks (dp, pp, tp; ep = cp = 1):

    pp = 0:  dp = 0: ranks 0 1  (a tp group)     pp = 1:  dp = 0: ranks 4 5
             dp = 1: ranks 2 3                            dp = 1: ranks 6 7

its dp groups are {0, 2}, {1, 3}, {4, 6}, {5, 7}; its pp groups {0, 4}, {1, 5}, {2, 6}, {3, 7}.

The data axes. Ranks that differ only in dp, ep or cp hold the same dense parameters and read
different tokens, so a dense gradient is averaged over all three: ``mesh.group("dp", "ep",
"cp")``. An expert's gradient is averaged over ``group("dp", "cp")``, the ranks holding that
expert. (Megatron's data-parallel group of the dense layers is our dp x ep, its
expert-data-parallel group our dp.)

A mesh is built on every rank of a world (a ``parlab.Cluster``'s, or any
``init_process_group``'s), in the same order on all of them: each rank creates every group
of every axis and of every combination of data axes, as torch.distributed requires (a group
whose ranks equal one made already is that one). ``close`` (or leaving a ``with`` block)
destroys them.
"""

import itertools
import math
import numbers

AXES = ("pp", "dp", "ep", "cp", "tp")
AXIS_NAMES = {"pp": "pipeline stages", "dp": "data-parallel replicas", "ep": "expert-parallel shards",
              "cp": "context-parallel shards", "tp": "tensor-parallel shards"}
DATA_AXES = ("dp", "ep", "cp")  # hold the same dense parameters, read different tokens
# The groups a mesh makes: one per axis, and one per combination of two or three data axes.
COMBINATIONS = [(axis,) for axis in AXES] + [("dp", "ep"), ("dp", "cp"), ("ep", "cp"), ("dp", "ep", "cp")]


class Mesh:
    """This rank's place in a (pp, dp, ep, cp, tp) grid of the world's ranks (module
    docstring): ``size(axis)``, ``coordinate(axis)``, ``ranks(*axes)`` (the global ranks of
    this rank's group along ``axes``, in coordinate order) and ``group(*axes)`` (its process
    group): one axis, or several data axes (``group("dp", "cp")``)."""

    def __init__(self, dp=1, pp=1, tp=1, cp=1, ep=1):
        import torch.distributed as dist

        given = {"pp": pp, "dp": dp, "ep": ep, "cp": cp, "tp": tp}
        self.sizes = {axis: _size(axis, given[axis]) for axis in AXES}
        world = dist.get_world_size()
        if math.prod(self.sizes.values()) != world:
            shape = " x ".join(f"{axis} = {size}" for axis, size in self.sizes.items() if size > 1) or "1 rank"
            raise ValueError(f"a mesh of {shape} needs {math.prod(self.sizes.values())} ranks, but {world} are "
                             f"running: choose sizes whose product is {world}.")
        self.rank = dist.get_rank()
        self.coordinates = dict(zip(AXES, _unravel(self.rank, self.shape)))
        self._groups, made = {}, {}
        for axes in COMBINATIONS:
            for ranks in self.all_groups(*axes):  # every rank creates every group, in one order
                if tuple(ranks) not in made:
                    made[tuple(ranks)] = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[axes] = (ranks, made[tuple(ranks)])
        self._made = list(made.values())

    @property
    def shape(self):
        return tuple(self.sizes[axis] for axis in AXES)

    def size(self, axis):
        (axis,) = _axes((axis,))
        return self.sizes[axis]

    def coordinate(self, axis):
        (axis,) = _axes((axis,))
        return self.coordinates[axis]

    def ranks(self, *axes):
        return list(self._groups[_axes(axes)][0])

    def group(self, *axes):
        return self._groups[_axes(axes)][1]

    def all_groups(self, *axes):
        """Every group along ``axes``, as lists of global ranks: one per coordinate of the
        other axes, in row-major order (``axis_groups``)."""
        return axis_groups(axes, **self.sizes)

    def close(self):
        """Destroy this mesh's groups (on every rank, as they were made)."""
        import torch.distributed as dist

        for group in self._made:
            dist.destroy_process_group(group)
        self._groups, self._made = {}, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        place = ", ".join(f"{axis} {self.coordinates[axis]} of {self.sizes[axis]}" for axis in AXES)
        return f"Mesh(rank {self.rank}: {place})"


def axis_groups(axes, dp=1, pp=1, tp=1, cp=1, ep=1):
    """Every group along ``axes`` (an axis, or a tuple of data axes) of a mesh of these sizes,
    as lists of global ranks, one per coordinate of the other axes in row-major order; no
    world needed (a lecture draws the layout with it): ``axis_groups("pp", dp=2, pp=2) ==
    [[0, 2], [1, 3]]``, ``axis_groups(("dp", "cp"), dp=2, cp=2, tp=2) == [[0, 2, 4, 6], [1, 3, 5, 7]]``."""
    along = _axes((axes,) if isinstance(axes, str) else tuple(axes))
    given = {"pp": pp, "dp": dp, "ep": ep, "cp": cp, "tp": tp}
    shape = tuple(_size(name, given[name]) for name in AXES)
    groups = {}
    for coordinates in itertools.product(*(range(size) for size in shape)):
        fixed = tuple(c for name, c in zip(AXES, coordinates) if name not in along)
        groups.setdefault(fixed, []).append(_ravel(coordinates, shape))
    return list(groups.values())


def _size(axis, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{axis} (the number of {AXIS_NAMES[axis]}) must be a whole number >= 1, got {value!r}: "
                         f"give it as a count, such as {axis}=2, or leave it out for 1.")
    return int(value)


def _axes(axes):
    """``axes`` (names given to ``group``, ``ranks`` or ``axis_groups``) in the mesh's order,
    refused with a sentence unless one axis or a combination of data axes."""
    for axis in axes:
        if axis not in AXES:
            raise ValueError(f"a mesh has the axes {', '.join(AXES)}, not {axis!r}: name one of them.")
    ordered = tuple(axis for axis in AXES if axis in axes)
    if ordered not in COMBINATIONS or len(ordered) != len(axes):
        raise ValueError(f"a mesh groups one axis, or several of the data axes {', '.join(DATA_AXES)} (ranks that "
                         f"hold the same dense parameters), not {axes!r}: e.g. group('tp') or group('dp', 'cp').")
    return ordered


def _unravel(rank, shape):
    coordinates = []
    for size in reversed(shape):
        rank, coordinate = divmod(rank, size)
        coordinates.append(coordinate)
    return tuple(reversed(coordinates))


def _ravel(coordinates, shape):
    rank = 0
    for coordinate, size in zip(coordinates, shape):
        rank = rank * size + coordinate
    return rank
