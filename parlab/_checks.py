"""Checks of what a learner passes in, so that every technique refuses bad input alike:

    ValueError("<name> must be <what it must be>, got <value>: <what to change>")

The caller names the argument in the lecture's words (``"K (the number of ranks)"``) and
says what to change (``fix``); these functions only decide and word the middle. A count is a
whole number (an int or a numpy integer; not a bool, not 2.0); a size or a time is a real
number that is not nan and, unless said otherwise, not infinite.
"""

import math
import numbers


def whole_number(name, value, fix, minimum=1):
    """``value`` as an int, if it is a whole number of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        refuse(name, f"a whole number >= {minimum}", value, fix)
    return int(value)


def real_number(name, value, fix, minimum=0, above=False, infinite=False):
    """``value``, if it is a real number of at least ``minimum`` (above it if ``above``),
    finite unless ``infinite``."""
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
    if not (is_number and (infinite or math.isfinite(value)) and (value > minimum if above else value >= minimum)):
        bound = f"above {minimum:g}" if above else f"at least {minimum:g}"
        refuse(name, f"{bound} (a {'' if infinite else 'finite '}number)", value, fix)
    return value


def rank(name, value, world_size, fix):
    """``value`` as an int, if it is one of ``world_size`` ranks: 0 .. world_size - 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < world_size:
        refuse(name, f"a rank, a whole number from 0 to {world_size - 1}", value, fix)
    return int(value)


def optimizer_class(value):
    """``value``, if it is a torch optimizer class (an engine builds it over its shards)."""
    import torch

    if not (isinstance(value, type) and issubclass(value, torch.optim.Optimizer)):
        refuse("optimizer_class", "a torch optimizer class such as torch.optim.Adam", value,
               "pass the class and its options (lr=...), not an optimizer: the engine builds it over its shards.")
    return value


def module(name, value, fix):
    """``value``, if it is a torch.nn.Module."""
    import torch

    if not isinstance(value, torch.nn.Module):
        refuse(name, "a torch.nn.Module", value, fix)
    return value


def refuse(name, requirement, value, fix):
    raise ValueError(f"{name} must be {requirement}, got {value!r}: {fix}")


def place_in(group, fix="pass each rank the group it belongs to (e.g. mesh.group(\"dp\")), call on its members."):
    """(r, N): this rank's place in the process group ``group`` and the group's size
    (``group=None``: the whole world); a ValueError, ending with ``fix``, on a rank outside it
    (only a group's members may call its collectives)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not in the group it passed: {fix}")
    return rank, dist.get_world_size(group)
