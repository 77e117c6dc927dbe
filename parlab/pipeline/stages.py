"""Cutting a model into pipeline stages.

    partition(model, num_stages)   contiguous nn.Sequential stages, balanced by parameter count

A pipeline stage is a contiguous slice of an ``nn.Sequential``. ``partition`` returns views
of the model's own layers (no copies), so the gradients that a pipeline accumulates in the
stages are the model's gradients. Stages that only take time are ``parlab.emulated.SleepLayer``.
"""

import numbers

from torch import nn


def partition(model, num_stages, split=None):
    """Cut ``model`` (an ``nn.Sequential``) into ``num_stages`` contiguous, non-empty
    ``nn.Sequential`` stages sharing the model's layers (K v stages for a schedule of K ranks
    with v chunks each).

    split: layer counts per stage (``num_stages`` whole numbers >= 1 adding up to the model's
    layers). Without it, the stages are balanced by parameter count: with Psi_j the
    parameters of layers 0..j and Psi all of them, cut i (i = 1 .. num_stages - 1) follows
    the layer whose Psi_j is closest to i Psi / num_stages, the later layer on ties (so a
    parameter-free activation stays with the layer before it), and every stage keeps at
    least one layer. A model without parameters is balanced by layer count.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"partition cuts an nn.Sequential into slices of layers; got {type(model).__name__}: "
                         f"write the model as nn.Sequential(layer, layer, ...).")
    layers, n = list(model), num_stages
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= len(layers):
        raise ValueError(f"a model of {len(layers)} layers cannot be cut into {n!r} non-empty stages: use "
                         f"between 1 and {len(layers)} stages, or a deeper model.")
    if split is None:
        split = _balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], n)
    elif (not isinstance(split, (list, tuple)) or len(split) != n
          or any(isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1 for count in split)
          or sum(split) != len(layers)):
        raise ValueError(f"split={split!r} must give {n} layer counts, each at least 1, adding up to the "
                         f"model's {len(layers)} layers: list how many layers each stage takes.")
    bounds = [sum(split[:i]) for i in range(n + 1)]
    return [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(n)]


def _balanced_split(sizes, n):
    if sum(sizes) == 0:
        sizes = [1] * len(sizes)
    cumulative = [sum(sizes[:j + 1]) for j in range(len(sizes))]
    cuts, previous = [], -1  # cut after layer j: stage i ends with layer cuts[i]
    for i in range(1, n):
        target = i * cumulative[-1] / n
        # keep a layer for each stage still to come
        candidates = range(previous + 1, len(sizes) - (n - i))
        previous = min(candidates, key=lambda j: (abs(cumulative[j] - target), -j))
        cuts.append(previous)
    ends = cuts + [len(sizes) - 1]
    return [ends[0] + 1] + [ends[i] - ends[i - 1] for i in range(1, n)]
