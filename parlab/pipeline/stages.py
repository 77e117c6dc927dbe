"""Cutting a model into pipeline stages.

    partition(model, S)          contiguous nn.Sequential stages, balanced by parameter count

A pipeline stage is a contiguous slice of an ``nn.Sequential``. ``partition`` returns views
of the model's own layers (no copies), so the gradients that a pipeline accumulates in the
stages are the model's gradients. Stages that only take time are ``parlab.emulated.SleepLayer``.
"""

import numbers

from torch import nn


def partition(model, num_stages, split=None):
    """Cut ``model`` (an ``nn.Sequential`` of L layers) into ``num_stages`` = S contiguous,
    non-empty ``nn.Sequential`` stages sharing the model's layers.

    split: layer counts per stage (S whole numbers >= 1 adding up to L). Without it, the
    stages are balanced by parameter count: with P_j the parameters of layers 0..j, the
    cut i (i = 1..S-1) follows the layer whose P_j is closest to i P_L / S, the later
    layer on ties (so a parameter-free activation stays with the layer before it), and
    every stage keeps at least one layer. A model without parameters is balanced by
    layer count.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"partition cuts an nn.Sequential into slices of layers; got {type(model).__name__}: "
                         f"write the model as nn.Sequential(layer, layer, ...).")
    layers, S = list(model), num_stages
    if isinstance(S, bool) or not isinstance(S, numbers.Integral) or not 1 <= S <= len(layers):
        raise ValueError(f"a model of {len(layers)} layers cannot be cut into {S!r} non-empty stages: use "
                         f"between 1 and {len(layers)} stages, or a deeper model.")
    if split is None:
        split = _balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], S)
    elif (not isinstance(split, (list, tuple)) or len(split) != S
          or any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1 for n in split)
          or sum(split) != len(layers)):
        raise ValueError(f"split={split!r} must give {S} layer counts, each at least 1, adding up to the "
                         f"model's {len(layers)} layers: list how many layers each stage takes.")
    bounds = [sum(split[:i]) for i in range(S + 1)]
    return [nn.Sequential(*layers[bounds[i]:bounds[i + 1]]) for i in range(S)]


def _balanced_split(sizes, S):
    if sum(sizes) == 0:
        sizes = [1] * len(sizes)
    cumulative = [sum(sizes[:j + 1]) for j in range(len(sizes))]
    cuts, previous = [], -1  # cut after layer j: stage i ends with layer cuts[i]
    for i in range(1, S):
        target = i * cumulative[-1] / S
        # keep a layer for each stage still to come
        candidates = range(previous + 1, len(sizes) - (S - i))
        previous = min(candidates, key=lambda j: (abs(cumulative[j] - target), -j))
        cuts.append(previous)
    ends = cuts + [len(sizes) - 1]
    return [ends[0] + 1] + [ends[i] - ends[i - 1] for i in range(1, S)]
