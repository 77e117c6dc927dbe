"""Gradient compressors C(x) as plain callables, and error feedback.

Every compressor is called on a gradient x of d elements and returns what a receiver
reconstructs from its message, a tensor shaped like x; ``bytes(x)`` is the exact size of that
message. In training, w_{t+1} = w_t - gamma * (1/N) sum_r C(g_r): each rank r compresses its
gradient g_r and ``aggregate(g_r)`` returns, on every rank, the average of the N
reconstructions, communicated as ``parlab.compression.communication`` describes
(``sent_bytes(x, N)`` is what each rank sends, equal to the trace's count;
``parlab.compression.costs`` has the formulas). Symbols: N ranks, d elements, k the
compressor's budget (elements kept), q QSGD's levels (the paper's s), gamma the learning rate.
On one axis of a ``parlab.Mesh``, ``aggregate(g_r, group=mesh.group("dp"))`` averages over
that group's ranks only: N is then the group's size.

    compressor      C(x)                                            unbiased  message      travels by
    Identity        x                                               yes       4 d          all-reduce
    FP16, BF16      x rounded to 16 bits                            ~         2 d          all-reduce
    FP8(dtype)      fp8(x sigma) / sigma, sigma = largest / max|x|  ~         4 + d        all-gather
    RandK(k, seed)  d/k x on k random positions (the same on all)  yes       4 k          all-reduce
    TopK(k)         x on its k largest |x_j|                        no        (4 + 8) k    all-gather
    QSGD(q)         ||x|| sign(x_j) l_j / q, l_j rounded at random  yes       4 + d        all-gather
    TernGrad()      max|x| sign(x_j) xi_j, xi_j ~ Bernoulli(|x_j|/max) yes    4 + d        all-gather
    ScaledSign()    ||x||_1 / d sign(x)                             no        4 + d        all-gather
    SignSGD()       sign(x); the ranks step with the majority vote  no        d            all-reduce of int8
                    sign(sum_r sign(g_r))

A biased compressor (top-k, signs) drops the same part of the gradient step after step;
``ErrorFeedback`` keeps what was dropped and adds it back to the next step's gradient.

One contract for every compressor, PowerSGD and ``ErrorFeedback`` included: ``bytes(x,
shapes=None)``, ``collectives(x, shapes=None)``, ``sent_bytes(x, N, shapes=None)`` and
``aggregate(x, key=0, shapes=None, group=None)``. ``shapes`` lists the shapes of the
gradients that x holds, in order (a DDP bucket holds several: ``[p.shape for p in
model.parameters()]``); PowerSGD needs them to view each gradient as a matrix, the
compressors here check them (``gradient_shapes``) and treat x as one vector of d elements.
"""

import torch
import torch.distributed as dist

from parlab import fp8
from parlab._checks import real_number, whole_number
from parlab.compression.communication import all_gather, all_reduce_sum, pack, place_in, unpack
from parlab.compression.costs import sent


class Compressor:
    """The common part: ``__call__``, ``bytes``, ``aggregate`` and ``sent_bytes`` from a
    subclass's ``encode`` (x -> (message, a list of tensors; what the decoder needs besides)),
    ``decode`` (message, that context, x -> the reconstruction, shaped like x) and ``layout``
    (x -> [(numel, dtype)] of the message's parts, known without encoding)."""

    all_reduced = True  # one dense-shaped payload, at the same positions on every rank: summable

    def __call__(self, x):
        message, context = self.encode(x)
        return self.decode(message, context, x)

    def bytes(self, x, shapes=None):
        """Bytes of this rank's message for ``x`` (``shapes``: see the module's docstring)."""
        gradient_shapes(x, shapes)
        return sum(numel * dtype.itemsize for numel, dtype in self.layout(x))

    def aggregate(self, x, key=0, shapes=None, group=None):
        """(mean, own) on every rank: the average over ranks of the reconstructions of each
        rank's ``x``, and this rank's own reconstruction C(x) (what error feedback subtracts).
        ``key`` names the tensor for compressors that keep state per tensor (a DDP bucket);
        ``shapes``, those of the parameters a bucket holds, matter to PowerSGD only: the
        compressors here check them and treat a bucket as one vector of d elements. ``group``:
        the ranks to average over (default: all of them), e.g. ``mesh.group("dp")``; called by
        its members only."""
        gradient_shapes(x, shapes)
        _, N = place_in(group)
        message, context = self.encode(x)
        own = self.decode(message, context, x)
        if self.all_reduced:  # the sum of the payloads decodes to the sum of the reconstructions
            return self.decode([all_reduce_sum(message[0].clone(), group)], context, x) / N, own
        rows = all_gather(pack(*message), group)  # (N, bytes of one message)
        return sum(self.decode(unpack(row, self.layout(x)), context, x) for row in rows) / N, own

    def collectives(self, x, shapes=None):
        """The collectives ``aggregate`` makes for ``x``: [("all-reduce", numel, element
        bytes)] or [("all-gather", message bytes)], for ``costs.sent`` and ``costs.seconds``."""
        gradient_shapes(x, shapes)
        if self.all_reduced:
            ((numel, dtype),) = self.layout(x)
            return [("all-reduce", numel, dtype.itemsize)]
        return [("all-gather", self.bytes(x))]

    def sent_bytes(self, x, N, shapes=None):
        """Bytes each rank sends in ``aggregate`` of a tensor shaped like ``x``, per rank."""
        return sent(self.collectives(x, shapes), N)

    def __repr__(self):
        return f"{type(self).__name__}()"


class Identity(Compressor):
    """No compression: fp32 through a ring all-reduce, i.e. plain DDP."""

    def layout(self, x):
        return [(x.numel(), x.dtype)]

    def encode(self, x):
        return [x.reshape(-1)], None

    def decode(self, message, context, x):
        return message[0].view_as(x)


class FP16(Compressor):
    """Round to float16: half the bytes, a relative error up to 2^-11 per element (and
    overflow above 65504)."""

    dtype = torch.float16

    def layout(self, x):
        return [(x.numel(), self.dtype)]

    def encode(self, x):
        return [x.reshape(-1).to(self.dtype)], None

    def decode(self, message, context, x):
        return message[0].to(x.dtype).view_as(x)

    def aggregate(self, x, key=0, shapes=None, group=None):
        gradient_shapes(x, shapes)
        # As torch's fp16_compress_hook: divide by N before the 16-bit sum, so that N large
        # values cannot overflow it, then the sum is already the mean.
        payload = x.reshape(-1).to(self.dtype).div_(place_in(group)[1])
        return all_reduce_sum(payload, group).to(x.dtype).view_as(x), self(x)


class BF16(FP16):
    """Round to bfloat16: fp32's range, 8 bits of mantissa (relative error up to 2^-8)."""

    dtype = torch.bfloat16


class FP8(Compressor):
    """Round to 8-bit floats with one scale for the tensor (``parlab.fp8``, lecture 10):
    C(x) = fp8(x sigma) / sigma with sigma = the format's largest / max|x|, a relative error up
    to u per element in the normal range (2^-4 in E4M3, the default; 2^-3 in E5M2). The message:
    1/sigma (4 bytes) and one byte per element. Each rank's scale is its own, so the payloads
    cannot be summed on the way as a ring all-reduce sums: they travel by all-gather, (N - 1)
    (4 + d) bytes per rank, against 16 bits' 2 (N - 1)/N 2 d by ring all-reduce, the same at
    N = 4. Streaming DiLoCo's pseudo-gradients travel in 4 bits in its paper; this is the
    nearest format torch has."""

    all_reduced = False

    def __init__(self, dtype=torch.float8_e4m3fn):
        if dtype not in fp8.FORMATS:
            raise ValueError(f"dtype must be torch.float8_e4m3fn (E4M3) or torch.float8_e5m2 (E5M2), got {dtype!r}.")
        self.dtype = dtype

    def layout(self, x):
        return [(1, torch.float32), (x.numel(), self.dtype)]

    def encode(self, x):
        q, inverse_scale = fp8.to_fp8(x.reshape(-1), self.dtype)
        return [inverse_scale.reshape(1), q], None

    def decode(self, message, context, x):
        inverse_scale, q = message
        return fp8.from_fp8(q, inverse_scale, x.dtype).view_as(x)

    def __repr__(self):
        return f"FP8({self.dtype})"


def budget(k, d):
    """Elements kept of d: k itself (a whole number, at most d), or a fraction 0 < k < 1 of d
    (at least one element)."""
    if isinstance(k, float) and 0 < k < 1:
        return max(1, int(k * d))
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= d:
        raise ValueError(f"k must be a whole number of elements from 1 to d = {d}, or a fraction between 0 and 1 "
                         f"of them; got {k!r}.")
    return k


class RandK(Compressor):
    """Random-k: keep k random positions, scaled by d/k so that E[C(x)] = x (unbiased);
    variance E||C(x) - x||^2 = (d/k - 1) ||x||^2. Every rank draws the same positions (the
    same ``seed``, the same calls in the same order), so only the k values travel, summed by
    an all-reduce."""

    def __init__(self, k, seed=0):
        whole_number("seed", seed, "pass the same whole number on every rank, e.g. 0.", minimum=0)
        self.k = k
        self.generator = torch.Generator().manual_seed(seed)

    def layout(self, x):
        return [(budget(self.k, x.numel()), x.dtype)]

    def encode(self, x):
        flat = x.reshape(-1)
        indices = torch.randperm(flat.numel(), generator=self.generator)[: budget(self.k, flat.numel())]
        return [flat[indices.to(flat.device)]], indices

    def decode(self, message, indices, x):
        flat = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
        flat[indices.to(x.device)] = message[0] * (x.numel() / indices.numel())
        return flat.view_as(x)

    def __repr__(self):
        return f"RandK(k={self.k})"


class TopK(Compressor):
    """Top-k: keep the k entries of largest magnitude. Biased, and contractive:
    ||x - C(x)||^2 <= (1 - k/d) ||x||^2. Each rank keeps other positions, so its (values,
    indices) travel by all-gather: (N - 1) k (4 + 8) bytes per rank with int64 indices."""

    all_reduced = False

    def __init__(self, k):
        self.k = k

    def layout(self, x):
        k = budget(self.k, x.numel())
        return [(k, x.dtype), (k, torch.int64)]

    def encode(self, x):
        flat = x.reshape(-1)
        indices = flat.abs().topk(budget(self.k, flat.numel()), sorted=False).indices
        return [flat[indices], indices], None

    def decode(self, message, context, x):
        values, indices = message
        return torch.zeros(x.numel(), dtype=x.dtype, device=x.device).index_put_((indices,), values).view_as(x)

    def __repr__(self):
        return f"TopK(k={self.k})"


class QSGD(Compressor):
    """QSGD with q levels (the paper's s): C(x)_j = ||x||_2 sign(x_j) l_j / q, where l_j is
    q |x_j| / ||x||_2 rounded down or up at random (up with the fractional part's probability),
    so E[C(x)] = x; E||C(x) - x||^2 <= min(d / q^2, sqrt(d) / q) ||x||^2. The message: the norm
    (4 bytes) and one signed level per element (int8, so q <= 127). Ranks draw independent
    roundings."""

    all_reduced = False
    norm_order = 2

    def __init__(self, levels, seed=0):
        whole_number("levels (q)", levels, "QSGD's levels travel as int8: pick q from 1 to 127.")
        if levels > 127:
            raise ValueError(f"levels (q) travel as int8: pick q from 1 to 127, got {levels}.")
        whole_number("seed", seed, "pass a whole number, e.g. 0.", minimum=0)
        self.levels, self.seed, self.generator = levels, seed, None

    def layout(self, x):
        return [(1, torch.float32), (x.numel(), torch.int8)]

    def encode(self, x):
        if self.generator is None:  # each rank its own stream, so the roundings are independent
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.generator = torch.Generator().manual_seed(self.seed + 1_000_003 * rank)
        flat = x.reshape(-1).float()
        scale = flat.norm(p=self.norm_order).reshape(1)
        ratio = flat.abs() / scale.clamp_min(torch.finfo(torch.float32).tiny) * self.levels  # in [0, q]
        level = ratio.floor() + (torch.rand(ratio.shape, generator=self.generator) < ratio - ratio.floor())
        return [scale, (flat.sign() * level).to(torch.int8)], None

    def decode(self, message, context, x):
        scale, signed_levels = message
        return (signed_levels.float() * (scale / self.levels)).to(x.dtype).view_as(x)

    def __repr__(self):
        return f"QSGD(levels={self.levels})"


class TernGrad(QSGD):
    """TernGrad: C(g)_j = ||g||_inf sign(g_j) xi_j with xi_j ~ Bernoulli(|g_j| / ||g||_inf) (the
    paper's s_t and b_t; b is the micro-batch here): values in {-||g||_inf, 0, ||g||_inf}, unbiased,
    variance ||g||_inf ||g||_1 - ||g||_2^2. QSGD with one level and the max-norm as its scale."""

    norm_order = float("inf")

    def __init__(self, seed=0):
        super().__init__(1, seed)

    def __repr__(self):
        return "TernGrad()"


class ScaledSign(Compressor):
    """Scaled sign: C(x) = ||x||_1 / d sign(x). Biased (it is the sign's direction), but
    contractive, so error feedback makes it converge (EF-signSGD). Message: the scale (4 bytes)
    and one int8 sign per element, by all-gather."""

    all_reduced = False
    layout = QSGD.layout

    def encode(self, x):
        flat = x.reshape(-1).float()
        return [flat.abs().mean().reshape(1), flat.sign().to(torch.int8)], None

    def decode(self, message, context, x):
        scale, signs = message
        return (signs.float() * scale).to(x.dtype).view_as(x)


class SignSGD(Compressor):
    """signSGD with majority vote: every rank r sends sign(g_r) (int8), the all-reduce sums the
    votes, every rank steps with sign(sum_r sign(g_r)): d bytes, 2 (N - 1)/N d on the ring.
    Biased twice over (the sign, and the vote ignores magnitudes), so it can stall where the
    ranks disagree; the vote sums int8, so at most 127 ranks."""

    def layout(self, x):
        return [(x.numel(), torch.int8)]

    def encode(self, x):
        return [x.reshape(-1).sign().to(torch.int8)], None

    def decode(self, message, context, x):
        return message[0].sign().to(x.dtype).view_as(x)

    def aggregate(self, x, key=0, shapes=None, group=None):
        gradient_shapes(x, shapes)
        if place_in(group)[1] > 127:
            raise ValueError("signSGD's votes are summed in int8: use at most 127 ranks.")
        (votes,), _ = self.encode(x)
        own = self.decode([votes], None, x)
        return self.decode([all_reduce_sum(votes, group)], None, x), own


class ErrorFeedback:
    """Error feedback around a compressor C, with one gradient-sized residual epsilon per tensor
    (``key``), zero at first:

        p = gamma g + epsilon;   delta = C(p);   epsilon = p - delta

    and the step is w <- w - delta (``__call__``; ``aggregate`` steps with the mean of the
    deltas of the ranks of ``group``, default: all). What C drops is not lost but sent later,
    so biased compressors (top-k, signs) converge. In a DDP hook gamma stays 1: the optimizer
    multiplies by the learning rate afterwards (exact for a constant learning rate)."""

    def __init__(self, compressor):
        if not callable(getattr(compressor, "aggregate", None)):
            raise ValueError(f"ErrorFeedback wraps a compressor such as TopK(k), got {compressor!r}.")
        self.compressor, self.residuals = compressor, {}

    def __call__(self, g, gamma=1.0, key=0):
        p = self._corrected(g, gamma, key)
        delta = self.compressor(p)
        self.residuals[key] = p - delta
        return delta

    def aggregate(self, g, key=0, shapes=None, gamma=1.0, group=None):
        p = self._corrected(g, gamma, key)
        mean, own = self.compressor.aggregate(p, key, shapes=shapes, group=group)
        self.residuals[key] = p - own
        return mean, own

    def bytes(self, x, shapes=None):
        """The wrapped compressor's: error feedback changes what is sent, not its size."""
        return self.compressor.bytes(x, shapes=shapes)

    def sent_bytes(self, x, N, shapes=None):
        return self.compressor.sent_bytes(x, N, shapes=shapes)

    def collectives(self, x, shapes=None):
        return self.compressor.collectives(x, shapes=shapes)

    def _corrected(self, g, gamma, key):
        real_number("gamma (the learning rate)", gamma, "pass a step size above 0, e.g. 0.1.", above=True)
        residual = self.residuals.get(key)
        # torch's DDP may rebuild its buckets after the first step: a residual of another
        # size belongs to a bucket that no longer exists
        return gamma * g if residual is None or residual.shape != g.shape else gamma * g + residual

    def __repr__(self):
        return f"ErrorFeedback({self.compressor!r})"


def gradient_shapes(x, shapes=None):
    """The shapes of the gradients that ``x`` holds, in order, as a list of tuples: ``shapes``
    (a list or tuple of shapes whose elements add up to x's), checked, or [x.shape] when it is
    None (x is one gradient)."""
    if shapes is None:
        return [tuple(x.shape)]
    if not isinstance(shapes, (list, tuple)) or not all(_is_shape(shape) for shape in shapes):
        raise ValueError(f"shapes must be a list of the shapes of the gradients that the tensor holds, in order, "
                         f"e.g. [p.shape for p in model.parameters()] ([x.shape], or nothing, for one gradient); "
                         f"got {shapes!r}.")
    if sum(torch.Size(shape).numel() for shape in shapes) != x.numel():
        raise ValueError(f"shapes {list(shapes)} do not add up to the {x.numel()} elements of the tensor: pass the "
                         "shapes of the parameters whose gradients it holds, in order.")
    return [tuple(shape) for shape in shapes]


def _is_shape(shape):
    return isinstance(shape, (list, tuple)) and all(
        isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape)
