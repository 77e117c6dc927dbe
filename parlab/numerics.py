"""Numerical equivalence: "the parallel result equals one process's" within what rounding
allows, measured in the same run instead of a tolerance that held on one CPU.

Ranks compute the same mathematics as one process on the full batch, in another order: each
rank's gradient is a sum over its shard of the batch, and the shards' gradients are summed
in the order the collective visits the ranks. Floating-point addition is not associative,
so the results differ in the last bits, and training can amplify that (Adam divides each
gradient by its own running magnitude, so a gradient that is a near-cancelling sum is all
rounding). How far it gets depends on the model, the data and the CPU's kernels, so it is
measured in the same run, in one process and with no communication: the **yardstick** is
the largest difference from the full-batch reference of the same training with the gradient
computed as the ranks compute it (``backward_in_shards``: N shards, their gradients summed
in each order a ring of N ranks uses, ``ring_orders``). The check is

    max |parallel - reference|  <=  FACTOR x yardstick  +  ULPS x eps(dtype) x max |reference|

for every tensor of the result (``assert_equivalent``). A wrong shard, a missing average or
a stale parameter misses by the size of a step, far outside this band. Where the arithmetic
is the same operation for operation (integer-valued data, power-of-two scalings, one order)
compare exactly with ``torch.equal`` instead.
"""

import torch

FACTOR = 2.0
"""Allowance for orders that no one-process run reproduces exactly: the ranks' result mixes
the ring's orders element by element, and workers run other thread counts. On lecture 04's
model (30 seeds, 3 Adam steps, 4 shards) the worst of all 24 summation orders of the shards
and the pairwise one stayed within 1.23 x the yardstick of the ring's orders; 2 leaves room
for that and is still 40 x below a missing Adam step there."""

ULPS = 16
"""The floor, in units of the reference's rounding (eps of its dtype x its largest
magnitude): what a few steps of final roundings leave when the yardstick is zero or nearly
so (one rank, integer-valued data). In fp32 at magnitude 1 it is 1.9e-6."""


def ring_orders(n):
    """The N orders in which a ring of N ranks sums N shards: chunk c of a ring
    reduce-scatter starts at one rank and goes once around, so each rotation of
    0, 1, ..., N-1 occurs. ring_orders(3) == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of shards must be a whole number >= 1, got {n!r}")
    return [[(start + i) % n for i in range(n)] for start in range(n)]


def backward_in_shards(loss_of, parameters, shards, order=None, dtype=None):
    """In one process, set ``.grad`` of every trainable parameter as N ranks compute it: the
    N ``shards``' gradients, summed in ``order`` (default 0, 1, ..., N-1), divided by N.

    loss_of(*shard) returns one shard's scalar loss (a rank's mean loss on its part);
    shards: N tuples of arguments, one per rank. dtype: sum in this dtype and cast back, as
    a communication hook that all-reduces a cast copy does (e.g. torch.float16).
    With one shard this is the gradient of the full batch. Returns the gradients it set, in
    the order of the trainable parameters."""
    parameters = [p for p in parameters if p.requires_grad]
    order = list(range(len(shards))) if order is None else list(order)
    if not shards or sorted(order) != list(range(len(shards))):
        raise ValueError(f"order must name each of the {len(shards)} shards once, got {order}")
    per_shard = [torch.autograd.grad(loss_of(*shards[s]), parameters) for s in order]
    for p, grads in zip(parameters, zip(*per_shard)):
        total = grads[0].to(dtype or grads[0].dtype)
        for g in grads[1:]:
            total = total + g.to(total.dtype)
        p.grad = total.to(grads[0].dtype) / len(shards)
    return [p.grad for p in parameters]


def max_abs_difference(a, b):
    """max |a - b| over every element of every tensor; ``a`` and ``b`` are results: tensors,
    or dicts or lists of tensors, with the same names (positions) and shapes."""
    a, b = _named(a), _named(b)
    if a.keys() != b.keys():
        raise ValueError(f"the results hold different tensors: {sorted(a)} vs {sorted(b)}")
    return max((_difference(a[name], b[name]) for name in b), default=0.0)


def rounding_band(reference, decomposed, factor=FACTOR, ulps=ULPS):
    """The largest difference from ``reference`` that rounding explains, and its parts:
    (band, yardstick, floor) with band = factor x yardstick + floor, where

    - yardstick: max over the one-process results ``decomposed`` (a list: the same
      computation in the ranks' decomposition, e.g. one per ring order) of their max
      abs difference from ``reference``; an empty list where the ranks do the very
      operations of the reference and only their kernels may round differently;
    - floor: ulps x eps x the reference's largest magnitude, eps that of the coarsest float
      dtype among the reference and ``decomposed`` (a float64 reference of fp32 runs: fp32's;
      0 for integers)."""
    if not isinstance(decomposed, list):
        raise ValueError("decomposed must be a list of one-process results (one per summation order)")
    yardstick = max((max_abs_difference(d, reference) for d in decomposed), default=0.0)
    tensors = [t for t in _named(reference).values() if t.numel()]
    scale = max((t.detach().abs().max().item() for t in tensors), default=0.0)
    dtypes = {t.dtype for result in [reference, *decomposed] for t in _named(result).values()}
    eps = max((torch.finfo(dtype).eps for dtype in dtypes if dtype.is_floating_point), default=0.0)
    floor = ulps * eps * scale
    return factor * yardstick + floor, yardstick, floor


def assert_equivalent(parallel, reference, decomposed, what="result", factor=FACTOR, ulps=ULPS):
    """Assert that every tensor of ``parallel`` lies within ``rounding_band(reference,
    decomposed)`` of the reference's; the message names ``what`` and the tensor and gives
    the difference, the band and its parts."""
    band, yardstick, floor = rounding_band(reference, decomposed, factor, ulps)
    assert_within(parallel, reference, band, what,
                  f"{factor:g} x yardstick {yardstick:.2e} (one process, the ranks' shards) + floor {floor:.2e}")


def assert_within(actual, expected, band, what="result", band_is=""):
    """Assert max |actual - expected| <= band for each tensor (NaN fails); the message names
    ``what`` and the first tensor outside, with its difference and the band (``band_is``:
    how the band was made). Two results that are each within ``band`` of a reference are
    within 2 x band of each other."""
    actual, expected = _named(actual), _named(expected)
    if actual.keys() != expected.keys():
        raise AssertionError(f"{what}: holds tensors {sorted(actual)}, expected {sorted(expected)}")
    for name in expected:
        if actual[name].shape != expected[name].shape:
            raise AssertionError(f"{what}, {name}: shape {tuple(actual[name].shape)}, "
                                 f"expected {tuple(expected[name].shape)}")
        difference = _difference(actual[name], expected[name])
        if not difference <= band:
            raise AssertionError(f"{what}, {name}: max abs difference {difference:.2e} is outside the band "
                                 f"{band:.2e}" + (f" = {band_is}" if band_is else ""))


def _named(result):
    if torch.is_tensor(result):
        return {"tensor": result}
    if isinstance(result, dict):
        return result
    if isinstance(result, (list, tuple)):
        return dict(enumerate(result))
    raise ValueError(f"expected a tensor, or a dict or list of tensors, got {type(result).__name__}")


def _difference(a, b):
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if not a.numel():
        return 0.0
    return (a.detach().double() - b.detach().double()).abs().max().item()
