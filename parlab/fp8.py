"""8-bit floats (fp8), lecture 10: two formats, a scale per tensor, fp8 matmuls and linear layers.

The formats (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv 2209.05433,
Table 1; the OCP 8-bit Floating Point Specification (OFP8) of 2023 fixes the same two), as
torch's dtypes and ``parlab.mixed_precision.edge_values`` (read from torch.finfo) give them:

    format  torch dtype           exponent/mantissa bits  largest  smallest normal  smallest subnormal  u
    E4M3    torch.float8_e4m3fn   4 / 3                   448      2^-6             2^-9                2^-4
    E5M2    torch.float8_e5m2     5 / 2                   57344    2^-14            2^-16               2^-3
    bf16    torch.bfloat16        8 / 7                   3.4e38   2^-126           2^-133              2^-8

u = eps / 2 (``unit_roundoff``) bounds rounding to the nearest in the normal range:
|fl(x) - x| <= u |x|; below the smallest normal the error is absolute, at most half the
smallest subnormal. E4M3 spends the codes of infinity on range (the paper's section 3: one NaN
pattern, no inf); E5M2 keeps IEEE's inf and NaN. Out of range, torch 2.13's casts (the
``fp8e4m3fn_from_fp32_value`` and ``fp8e5m2_from_fp32_value`` of torch/headeronly/util/
Float8_e4m3fn.h and Float8_e5m2.h) do different things: to E4M3 they saturate (1000, and
even inf, become 448; NaN stays NaN); to E5M2 they round to the nearest and give inf from
61440 up. Either way nothing signals it: scaling keeps a tensor inside the range.

Per-tensor scaling (the paper's section 4.3; torchao's and Transformer Engine's recipes): with
sigma = largest / amax(x), amax(x) = max |x|, the cast q = fp8(x sigma) puts the largest element
at the top of the format, and the tensor travels as (q, 1/sigma); x is read back as q / sigma
(``to_fp8``, ``from_fp8``). A matmul multiplies the fp8 values, accumulates in fp32 and
scales the result once by 1/(sigma_a sigma_b) (``fp8_matmul``), which is what an fp8 tensor core
(torch._scaled_mm) computes. Its error is at most (2u + u^2) (|a| @ |b|) element by element,
plus the fp32 accumulation's and the subnormals' (the test derives the bound).

Delayed scaling (Transformer Engine's DelayedScaling recipe): amax(x) is known only after a
pass over x, so step t casts with the scale of the largest amax of the last l steps
(``DelayedScaling``); a spike above them is clipped, and counted.

``Float8Linear`` trains with fp8 matmuls as torchao's tensorwise recipe does; ``precision_curves``
trains the small GPT in fp32, bf16 and fp8 for the lecture's plot. The FSDP all-gather in fp8:
``FSDP(..., all_gather_dtype=torch.float8_e4m3fn)`` (``parlab.zero.fsdp``).
"""

from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from parlab import _checks
from parlab.gpt import GPT, CharDataset, GPTConfig, batches
from parlab.mixed_precision import edge_values

__all__ = ["E4M3", "E5M2", "FORMATS", "unit_roundoff", "amax", "scale_for", "to_fp8", "from_fp8", "DelayedScaling",
           "fp8_matmul", "Float8Linear", "to_float8_linears", "precision_curves"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = (E4M3, E5M2)
# (256,) fp32: the value of each fp8 code 0..255 of each format, by torch's cast (``from_fp8``)
_CODE_VALUES = {dtype: torch.arange(256, dtype=torch.uint8).view(dtype).float() for dtype in FORMATS}
AMAX_FLOOR = 1e-12
"""torchao's EPS (torchao/float8/float8_utils.py): amax is clamped to it, so an all-zero
tensor (a bias at initialisation) gets a finite scale, and 0 x scale = 0."""


def unit_roundoff(dtype):
    """u = eps / 2 of a floating ``dtype``: E4M3 2^-4, E5M2 2^-3, bf16 2^-8, fp32 2^-24."""
    return edge_values(dtype).eps / 2


def amax(x):
    """max |x| over the whole tensor, as a 0-d fp32 tensor (no gradient)."""
    return x.detach().abs().max().float()


def scale_for(amax_value, dtype=E4M3, margin=0):
    """sigma = largest(dtype) / amax / 2^margin, in fp32 (elementwise for a tensor of amaxes);
    an amax below ``AMAX_FLOOR`` counts as it. Transformer Engine's formula (the ``margin``
    leaves 2^margin of headroom); torchao's with margin 0."""
    _check_format(dtype)
    amax_value = torch.as_tensor(amax_value, dtype=torch.float32)
    return edge_values(dtype).largest / amax_value.clamp(min=AMAX_FLOOR) / 2.0**margin


def to_fp8(x, dtype=E4M3, scale=None):
    """x -> (q, 1/sigma): q = fp8(x sigma) in ``dtype``, rounded to the nearest (saturated or inf
    past the range: module docstring). ``scale`` sigma: a number, or a tensor broadcast against
    x (one scale per parameter of a flat buffer, as FSDP's gather uses); None: the tensor's
    own, ``scale_for(amax(x), dtype)`` (dynamic per-tensor scaling)."""
    _check_format(dtype)
    scale = scale_for(amax(x), dtype) if scale is None else torch.as_tensor(scale, dtype=torch.float32)
    return (x.detach().float() * scale).to(dtype), 1 / scale


def from_fp8(q, inverse_scale, dtype=torch.float32):
    """(q, 1/sigma) -> q / sigma in ``dtype`` (computed as q x (1/sigma) in fp32, then cast).

    q's fp32 values are read from a table of the format's 256 codes (``_CODE_VALUES``), made
    once by torch's own cast, so they are the cast's values bit for bit: on CPU torch 2.13
    casts fp8 to fp32 one element at a time through bit manipulation
    (``fp8e4m3fn_to_fp32_value`` in torch/headeronly/util/Float8_e4m3fn.h), about 4 ns per
    element, six times a lookup's; FSDP's fp8 all-gather reads every gathered element back."""
    _check_format(q.dtype)
    codes = q.contiguous().view(torch.uint8).flatten().int()  # (numel,): each element's 8 bits
    values = _CODE_VALUES[q.dtype].to(q.device).index_select(0, codes).view(q.shape)
    return (values * inverse_scale).to(dtype)


class DelayedScaling:
    """The scale of step t from the amaxes of the steps before it (Transformer Engine's
    ``DelayedScaling`` recipe with ``amax_compute_algo="max"``): ``scale(x)`` returns

        sigma_t = largest / max(amax_{t-l}, ..., amax_{t-1}) / 2^margin

    and then records amax_t = amax(x) in the history, which keeps the last ``history`` = l.
    While the history holds no amax above 0 the scale stays at its start, 1 (TE keeps the
    previous scale then). The defaults are TE's (docs of transformer_engine.common.recipe:
    amax_history_len=1024, margin=0; releases before 1.0 kept l = 1, the most recent amax).

    An amax above the one the scale was made for, max(history) x 2^margin (largest when the
    scale is 1), puts x sigma_t past the format's largest: the cast clips it (E4M3 saturates).
    ``overflows`` counts those steps; the next steps' scales take the spike in."""

    def __init__(self, dtype=E4M3, history=1024, margin=0):
        _check_format(dtype)
        self.dtype, self.margin = dtype, margin
        self.history = deque(maxlen=_checks.whole_number("history", history, "keep at least the last step's amax."))
        self.overflows, self.current = 0, torch.tensor(1.0)

    def scale(self, x):
        """sigma_t for ``x`` (fp32, 0-d); records amax(x) and counts an overflow (class docstring)."""
        known = max(self.history, default=0.0)
        limit = edge_values(self.dtype).largest
        if known > 0:
            self.current, limit = scale_for(known, self.dtype, self.margin), known * 2.0**self.margin
        value = amax(x).item()
        self.overflows += value > limit
        self.history.append(value)
        return self.current


def fp8_matmul(a, b, a_dtype=E4M3, b_dtype=E4M3):
    """a @ b with both operands cast to fp8 with their own per-tensor scales: the fp8 values
    multiplied and accumulated in fp32, then scaled by 1/(sigma_a sigma_b). a (n, k), b (k, m) ->
    (n, m) fp32."""
    return _scaled_matmul(*to_fp8(a, a_dtype), *to_fp8(b, b_dtype))


def _scaled_matmul(qa, inverse_a, qb, inverse_b):
    return (qa.float() @ qb.float()) * (inverse_a * inverse_b)


class _Float8Matmul(torch.autograd.Function):
    """x W^T with fp8 operands: x, W in E4M3 forward, the output's gradient g in E5M2 backward
    (its range: gradients span more binades than weights and activations)."""

    @staticmethod
    def forward(ctx, x, weight):  # x (n, h_in), weight (h_out, h_in)
        qx, inverse_x = to_fp8(x, E4M3)
        qw, inverse_w = to_fp8(weight, E4M3)
        ctx.save_for_backward(qx, inverse_x, qw, inverse_w)  # the fp8 copies: 1 byte per element saved
        ctx.dtypes = x.dtype, weight.dtype
        return _scaled_matmul(qx, inverse_x, qw.t(), inverse_w).to(x.dtype)  # (n, h_out)

    @staticmethod
    def backward(ctx, grad):  # grad (n, h_out)
        qx, inverse_x, qw, inverse_w = ctx.saved_tensors
        qg, inverse_g = to_fp8(grad, E5M2)
        grad_x = _scaled_matmul(qg, inverse_g, qw, inverse_w)  # (n, h_in)
        grad_weight = _scaled_matmul(qg.t(), inverse_g, qx, inverse_x)  # (h_out, h_in)
        return grad_x.to(ctx.dtypes[0]), grad_weight.to(ctx.dtypes[1])


class Float8Linear(nn.Linear):
    """``nn.Linear`` whose three matmuls run in fp8 with dynamic per-tensor scales, as
    torchao's default recipe (``Float8LinearConfig``, tensorwise; torchao/float8/
    float8_linear.py casts input and weight to e4m3, the output's gradient to e5m2):

        forward    y = x W^T + bias          x, W in E4M3            (b, s, h_in) -> (b, s, h_out)
        backward   dx = g W,  dW = g^T x     g in E5M2, x, W saved in E4M3

    each accumulated in fp32 and rescaled (``fp8_matmul``). The weight and bias stay in their
    own dtype (fp32 master weights); the bias is added in it."""

    def forward(self, x):
        y = _Float8Matmul.apply(x.reshape(-1, self.in_features), self.weight)  # (b s, h_out)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def to_float8_linears(model):
    """Make every ``nn.Linear`` of ``model`` a ``Float8Linear``, in place, keeping its
    parameters (torchao's ``convert_to_float8_training`` without a filter). Returns ``model``."""
    _checks.module("model", model, "pass the model whose linear layers should compute in fp8.")
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Float8Linear  # same fields, fp8 forward: no copy of the weights
    return model


def precision_curves(steps=40, config=None, B=8, lr=3e-3, seed=0):
    """The small GPT (``parlab.gpt``) trained ``steps`` Adam steps from the same start
    (seed 0) on the same batches of B sequences, three ways: {"fp32": ..., "bf16": ...,
    "fp8": ...}, each the (steps,) fp32 losses before each step. bf16: forward and backward
    under ``torch.autocast("cpu", torch.bfloat16)`` (fp32 weights); fp8: every linear layer a
    ``Float8Linear`` (the attention scores, norms and the loss stay fp32). ``config``:
    default a tiny GPT (s = 32, h = 64, a = 4, L = 2) on parlab's text."""
    _checks.whole_number("steps", steps, "train at least one step, e.g. steps=40.")
    config = config or GPTConfig(V=CharDataset().V, s=32, h=64, a=4, L=2)
    data = batches(B, config.s, steps, seed)
    curves = {}
    for name in ("fp32", "bf16", "fp8"):
        torch.manual_seed(0)
        model = GPT(config)
        if name == "fp8":
            to_float8_linears(model)
        curves[name] = _train(model, data, lr, torch.bfloat16 if name == "bf16" else None)
    return curves


def _train(model, data, lr, autocast_dtype):
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for tokens, targets in data:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logits = model(tokens)  # (b, s, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        losses.append(loss.detach())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.stack(losses)


def scaled_mm_throughput(n=8192, repeats=20):
    """TFLOP/s (2 n^3 per product) of an n x n x n matmul on the GPU, the mean of ``repeats``
    after a warm-up: {"fp8 E4M3": torch._scaled_mm of E4M3 operands with per-tensor scales,
    fp32 accumulation and a bf16 result; "bf16": the same product in bf16}. torch._scaled_mm
    needs fp8 tensor cores (compute capability 8.9 or more: an H100), its second operand
    column-major and n a multiple of 16."""
    if not torch.cuda.is_available():
        raise ValueError("scaled_mm_throughput needs a CUDA GPU with fp8 tensor cores (e.g. an H100): run it there.")
    _checks.whole_number("n", n, "pick a multiple of 16, e.g. n=8192.")
    if n % 16:
        raise ValueError(f"n = {n} is not a multiple of 16, which torch._scaled_mm needs: e.g. n=8192.")
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    a8, b8 = a.to(E4M3), b.t().contiguous().to(E4M3).t()  # (n, n); b8 column-major
    a16, b16 = a.bfloat16(), b.bfloat16()
    one = torch.ones((), device="cuda")  # the per-tensor scales (1/sigma) of both operands
    products = {"fp8 E4M3": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                "bf16": lambda: a16 @ b16}
    tflops = {}
    for name, product in products.items():
        product()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            product()
        end.record()
        torch.cuda.synchronize()
        tflops[name] = 2 * n**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12
    return tflops


def _check_format(dtype):
    if dtype not in FORMATS:
        _checks.refuse("dtype", "torch.float8_e4m3fn (E4M3) or torch.float8_e5m2 (E5M2)", dtype,
                       "pick E4M3 for weights and activations, E5M2 for gradients.")
