"""The activations a transformer keeps for backward (Korthikanti et al. 2022)."""

from parlab._checks import whole_number
from parlab.memory._sizes import _check_sizes

RECOMPUTE = (None, "selective", "full")  # what a layer keeps for backward, as the docstring below


def check_recompute(recompute):
    """Refuse a ``recompute`` that is not one of ``RECOMPUTE``, with what each one keeps."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}: None keeps every activation, "
                         "\"selective\" recomputes the attention scores, \"full\" the whole layer.")


def transformer_activation_bytes(s, b, h, a, layers=1, recompute=None, t=1, sequence_parallel=False):
    """Activation bytes of ``layers`` transformer layers kept for backward, in 16-bit
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models"): sequence length ``s``, micro-batch ``b``, hidden size ``h``, ``a`` attention
    heads, tensor-parallel degree ``t``. Per layer:

        recompute=None          s b h (34 + 5 a s / h)               no parallelism (t = 1)
                                s b h (10 + 24 / t + 5 a s / (h t))  tensor parallel
                                s b h (34 / t + 5 a s / (h t))       tensor + sequence parallel
        recompute="selective"   the same without the 5 a s / h attention term (the softmax,
                                its dropout mask and the attention over values are recomputed)
        recompute="full"        2 s b h                              only the layer's input;
                                2 s b h / t with sequence parallelism, whose input is itself
                                split along s (the paper's table writes 2 s b h for every t)

    The 34 s b h: the attention block's input, Q, K, V, the output projection's input and a
    dropout mask (11), the MLP (19), the two layer norms' inputs (4); the 5 a s^2 b: the
    softmax output, its dropout mask and the dropout output, a x s x s per sample each.
    Embeddings and the output layer are not counted. The 5 a s / h term assumes attention
    written out, its (b, a, s, s) tensors stored; memory-efficient attention (FlashAttention,
    xformers, as LLaMA trains) never stores them, so its layers keep about the "selective"
    bytes (plus a few numbers per head and position). Megatron-LM's
    ``--recompute-activations`` is the selective kind; ``--recompute-granularity full`` the full.
    """
    _check_sizes(s=s, b=b, h=h, a=a, layers=layers)
    whole_number("t (the tensor-parallel degree)", t, "give the number of ranks a layer is split over, 1 for none.")
    if h % t or a % t:
        raise ValueError(f"t (the tensor-parallel degree) must divide h = {h} and a = {a}, got {t}: each of the t "
                         "ranks takes h / t of the hidden size and a / t of the heads; pick a t that divides both.")
    check_recompute(recompute)
    if recompute == "full":
        return 2 * s * b * h * layers / (t if sequence_parallel else 1)
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    attention = 0 if recompute == "selective" else 5 * a * s / (h * t)
    return s * b * h * (linear + attention) * layers
