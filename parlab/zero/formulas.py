"""What parlab's ZeRO engines hold beyond the ZeRO paper's table, as formulas: stage 2's peak
of gradient bytes during backward, and ZeRO-Offload's split of the model states between the
device and the host. The engines compute with these (``parlab.zero.buckets``,
``parlab.zero.stages``) and their tests measure against them; ``parlab.memory`` holds the
paper's model states at rest.

    stage2_peak_gradient_bytes(buckets, shard_numel)       the largest gradient bytes alive in a step
    offload_state_bytes(padded_numel, n_d, stage, kappa)   (device, host) model states at rest
    offload_bytes_per_step(padded_numel, n_d)              bytes moved each way per step

Symbols: Psi trainable parameters laid end to end in one flat buffer padded to a multiple of
N_d (padded Psi), a shard padded Psi / N_d elements; E = ``element_bytes`` per element (4 in
fp32; not the glossary's e, backup workers); kappa bytes of optimizer state per parameter.

Stage 1's gradient peak is its flat gradient, E padded Psi, all the time. Stage 2's, with its
buckets launched in order b = 0, 1, ... during backward, each bucket's gradients arriving one
at a time before the next bucket's (a chain of layers), B_b elements in bucket b and G_b in its
largest gradient, and bucket b - 1's reduce-scatter in flight (alive until waited for, when b
is launched: ``parlab.zero.buckets``) while bucket b fills:

    E max( B_0 + max(G_0, padded Psi / N_d),  max over b >= 1 of  B_(b-1) + B_b + G_b + padded Psi / N_d )

bucket b's buffer, the gradient just produced that is being added into it, the buffer of bucket
b - 1 in flight, and the shard's averaged gradient, which is allocated at the first launch
(after bucket 0's last gradient was added and freed) and lives to the next ``zero_grad``. A
bucket that is one gradient (G_b = B_b) takes that gradient as its buffer: G_b counts 0 there.
Below stage 1's when every B_(b-1) + B_b + G_b < (N_d - 1)/N_d padded Psi: buckets much smaller
than the model. A single bucket for the whole model (B_0 = padded Psi) peaks at
E (padded Psi + max(G_0, padded Psi / N_d)), above stage 1: its buffer is a whole flat gradient.
"""

from parlab import _checks
from parlab.memory import ModelState


def stage2_peak_gradient_bytes(buckets, shard_numel, element_bytes=4):
    """The formula above: ``buckets`` lists (B_b, G_b) for each bucket in the order they are
    launched, its elements and the elements of its largest gradient; ``shard_numel``
    is padded Psi / N_d; ``element_bytes`` E."""
    buckets = list(buckets)
    if not buckets:
        raise ValueError("buckets is empty: pass (bucket elements, largest gradient elements) for each bucket, "
                         "e.g. engine.buckets.sizes().")
    for numel, gradient in buckets:
        _checks.whole_number("a bucket's elements", numel, "pass (B_b, G_b) pairs of element counts.")
        _checks.whole_number("a bucket's largest gradient", gradient, "pass (B_b, G_b) pairs of element counts.")
        if gradient > numel:
            raise ValueError(f"a bucket of {numel} elements cannot hold a gradient of {gradient}: pass (B_b, G_b) "
                             "with G_b <= B_b.")
    _checks.whole_number("shard_numel", shard_numel, "pass padded Psi / N_d (layout.shard_numel).")
    e = _checks.whole_number("element_bytes", element_bytes, "pass the bytes of one element, 4 in fp32.")
    copied = [(numel, 0 if gradient == numel else gradient) for numel, gradient in buckets]  # G_b = B_b: no copy
    (first, first_gradient), in_flight = copied[0], [numel for numel, _ in buckets]
    peaks = [first + max(first_gradient, shard_numel),
             *(in_flight[b - 1] + numel + gradient + shard_numel for b, (numel, gradient) in enumerate(copied) if b)]
    return e * max(peaks)


def offload_state_bytes(padded_numel, n_d, stage, kappa, element_bytes=4):
    """``ZeroDP(..., stage, offload=True)``'s model states after a step, as (device, host)
    ``ModelState``s (Adam's step counter, one scalar, not counted):

        device  params   E padded Psi                 every rank computes with all of them
                grads    E padded Psi at stage 1      its flat gradient buffer
                         0 at stage 2                 the shard's gradient went to the host
                optimizer 0
        host    params   E padded Psi / N_d           the optimizer's copy of the shard
                grads    E padded Psi / N_d           its averaged gradient
                optimizer kappa padded Psi / N_d
    """
    shard = _shard(padded_numel, n_d)
    if stage not in (1, 2):
        raise ValueError(f"offload needs ZeRO stage 1 or 2, got stage={stage!r}.")
    _checks.real_number("kappa", kappa, "give the optimizer-state bytes per parameter, e.g. 8 for fp32 Adam.")
    e = _checks.whole_number("element_bytes", element_bytes, "pass the bytes of one element, 4 in fp32.")
    device = ModelState(params=e * padded_numel, grads=e * padded_numel if stage == 1 else 0, optimizer=0)
    return device, ModelState(params=e * shard, grads=e * shard, optimizer=kappa * shard)


def offload_bytes_per_step(padded_numel, n_d, element_bytes=4):
    """Bytes that ``ZeroDP(..., offload=True)`` moves per rank and step between device and
    host: {"gradients to host": n, "parameters to device": n}, n = E padded Psi / N_d (a shard)."""
    shard = _shard(padded_numel, n_d)
    e = _checks.whole_number("element_bytes", element_bytes, "pass the bytes of one element, 4 in fp32.")
    return {"gradients to host": e * shard, "parameters to device": e * shard}


def _shard(padded_numel, n_d):
    _checks.whole_number("padded_numel", padded_numel, "pass the flat buffer's padded numel (layout.padded_numel).")
    N = _checks.whole_number("n_d (N_d)", n_d, "pass the number of ranks, e.g. 4.")
    if padded_numel % N:
        raise ValueError(f"padded_numel ({padded_numel}) must be a multiple of N_d ({N}): pass the padded numel "
                         "(engine.layout.padded_numel), not Psi.")
    return padded_numel // N
