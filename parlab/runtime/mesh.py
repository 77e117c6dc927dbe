"""The ranks of a world as a grid with one axis per parallelism: ``Mesh(dp=2, pp=2, tp=2)``.

Axes, outermost first: ``pp`` (pipeline stages), ``dp`` (data-parallel replicas), ``tp``
(tensor-parallel shards). Tensor parallelism is innermost, as in Megatron-LM and torchtitan:
it talks in every layer, on the critical path, so its ranks are neighbours, which on a real
machine share a node and its fast links; pipeline stages, whose messages are one
micro-batch's activations, are farthest apart. The global rank of coordinates
(i_pp, i_dp, i_tp) is

    rank = (i_pp * dp + i_dp) * tp + i_tp

the ranks numbered in row-major order over the shape (pp, dp, tp), as
``torch.distributed.device_mesh.init_device_mesh(device, (pp, dp, tp),
mesh_dim_names=("pp", "dp", "tp"))`` numbers them. The group of an axis is the ranks that
differ from this one only in that axis's coordinate. The 2 x 2 x 2 mesh of 8 ranks:

    pp = 0:  dp = 0: ranks 0 1  (a tp group)     pp = 1:  dp = 0: ranks 4 5
             dp = 1: ranks 2 3                            dp = 1: ranks 6 7

its dp groups are {0, 2}, {1, 3}, {4, 6}, {5, 7}; its pp groups {0, 4}, {1, 5}, {2, 6}, {3, 7}.

A mesh is built on every rank of a world (a ``parlab.Cluster``'s, or any
``init_process_group``'s), in the same order on all of them: each rank creates every group
of every axis, as torch.distributed requires. ``close`` (or leaving a ``with`` block)
destroys them.
"""

import itertools
import math
import numbers

AXES = ("pp", "dp", "tp")
AXIS_NAMES = {"pp": "pipeline stages", "dp": "data-parallel replicas", "tp": "tensor-parallel shards"}


class Mesh:
    """This rank's place in a (pp, dp, tp) grid of the world's ranks (module docstring):
    ``size(axis)``, ``coordinate(axis)``, ``ranks(axis)`` (the global ranks of this rank's
    group along ``axis``, in coordinate order) and ``group(axis)`` (its process group)."""

    def __init__(self, dp=1, pp=1, tp=1):
        import torch.distributed as dist

        self.sizes = {axis: _size(axis, value) for axis, value in (("pp", pp), ("dp", dp), ("tp", tp))}
        world = dist.get_world_size()
        if math.prod(self.sizes.values()) != world:
            shape = " x ".join(f"{axis} = {size}" for axis, size in self.sizes.items())
            raise ValueError(f"a mesh of {shape} needs {math.prod(self.sizes.values())} ranks, but {world} are "
                             f"running: choose sizes whose product is {world}.")
        self.rank = dist.get_rank()
        self.coordinates = dict(zip(AXES, _unravel(self.rank, self.shape)))
        self._groups = {}
        for axis in AXES:
            for ranks in self.all_groups(axis):  # every rank creates every group, in one order
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._groups[axis] = (ranks, group)

    @property
    def shape(self):
        return tuple(self.sizes[axis] for axis in AXES)

    def size(self, axis):
        axis = _axis(axis)
        return self.sizes[axis]

    def coordinate(self, axis):
        axis = _axis(axis)
        return self.coordinates[axis]

    def ranks(self, axis):
        axis = _axis(axis)
        return list(self._groups[axis][0])

    def group(self, axis):
        axis = _axis(axis)
        return self._groups[axis][1]

    def all_groups(self, axis):
        """Every group along ``axis``, as lists of global ranks: one per coordinate of the
        other axes, in row-major order (``axis_groups``)."""
        return axis_groups(axis, **self.sizes)

    def close(self):
        """Destroy this mesh's groups (on every rank, as they were made)."""
        import torch.distributed as dist

        for _, group in self._groups.values():
            dist.destroy_process_group(group)
        self._groups = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        place = ", ".join(f"{axis} {self.coordinates[axis]} of {self.sizes[axis]}" for axis in AXES)
        return f"Mesh(rank {self.rank}: {place})"


def axis_groups(axis, dp=1, pp=1, tp=1):
    """Every group along ``axis`` of a mesh of these sizes, as lists of global ranks, one per
    coordinate of the other axes in row-major order; no world needed (a lecture draws the
    layout with it): ``axis_groups("pp", dp=2, pp=2) == [[0, 2], [1, 3]]``."""
    axis = _axis(axis)
    sizes = {name: _size(name, value) for name, value in (("pp", pp), ("dp", dp), ("tp", tp))}
    shape = tuple(sizes[name] for name in AXES)
    position = AXES.index(axis)
    others = [range(size) for other, size in zip(AXES, shape) if other != axis]
    groups = []
    for fixed in itertools.product(*others):
        coordinates = [list(fixed[:position]) + [i] + list(fixed[position:]) for i in range(shape[position])]
        groups.append([_ravel(c, shape) for c in coordinates])
    return groups


def _size(axis, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{axis} (the number of {AXIS_NAMES[axis]}) must be a whole number >= 1, got {value!r}: "
                         f"give it as a count, such as {axis}=2, or leave it out for 1.")
    return int(value)


def _axis(axis):
    if axis not in AXES:
        raise ValueError(f"a mesh has the axes {', '.join(AXES)}, not {axis!r}: name one of them.")
    return axis


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
