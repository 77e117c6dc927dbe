"""The analytic model of a DDP step: when each bucket's all-reduce runs, and how much of it
the backward pass hides (lecture 02, section 5).

    predict_overlap(bucket_bytes, ready_times, N_d, alpha, beta)   one backward pass and its all-reduces
    bucket_overlap(model, bucket_cap_mb, N_d, alpha, beta, ...)    the same for a module's real buckets
    predict_step(model, timing, N_d, alpha, beta, variant, ...)    a whole step of a DDP variant

Each bucket's all-reduce is a ring over the N_d ranks, the all-reduce parlab's DDP runs when
the links are emulated, costing 2 (N_d - 1) alpha + 2 (N_d - 1)/N_d D_i beta for D_i bytes
(``parlab.alpha_beta.cost_model("ring", ...)``, lecture 01). The buckets are
``parlab.ddp.assign_buckets``' plan, the one the DDP wrapper all-reduces.
"""

from parlab._checks import module, real_number, whole_number
from parlab.alpha_beta import cost_model
from parlab.ddp.engine import VARIANTS, assign_buckets, trainable_parameters
from parlab.units import MIB


def predict_overlap(bucket_bytes, ready_times, N_d, alpha, beta):
    """The analytic model of one backward pass with overlapped all-reduces.

    ``bucket_bytes``: D_i, the bytes of each bucket i in launch order (i = 1, 2, ...);
    ``ready_times``: ready_i, the seconds after the start of backward at which bucket i's
    last gradient is ready. The all-reduces are rings over the same N_d ranks, so they run
    one at a time, in order:

        start_i = max(ready_i, end_{i-1})      (end_0 = 0)
        end_i   = start_i + 2 (N_d - 1) alpha + 2 (N_d - 1)/N_d D_i beta
        T_bwd   = max_i ready_i                (backward ends with its last gradient)
        T_step  = max(T_bwd, end_last)
        exposed = T_step - T_bwd               (communication that backward does not hide)

    One bucket (ready at T_bwd) hides nothing: all of its all-reduce is exposed. Many small
    buckets, with a backward long enough, hide all but the last one; but each pays the
    latency term 2 (N_d - 1) alpha, so with many buckets and a short backward the latencies
    queue up. Returns ``(intervals, T_step, exposed)`` with ``intervals`` the list of
    (start_i, end_i).
    """
    if len(bucket_bytes) != len(ready_times) or not bucket_bytes:
        raise ValueError(
            f"predict_overlap needs one ready time per bucket and at least one bucket; got "
            f"{len(bucket_bytes)} buckets and {len(ready_times)} ready times."
        )
    whole_number("N_d (the data-parallel degree)", N_d, "give the number of ranks that average gradients, e.g. 4.")
    for ready in ready_times:
        real_number("every ready time", ready, "give the seconds after the start of backward, from 0.")
    intervals, end = [], 0.0
    for nbytes, ready in zip(bucket_bytes, ready_times):
        start = max(ready, end)
        end = start + cost_model("ring", nbytes, N_d, alpha, beta)
        intervals.append((start, end))
    backward = max(ready_times)
    step_end = max(backward, end)
    return intervals, step_end, step_end - backward


def bucket_overlap(model, bucket_cap_mb, N_d, alpha, beta, backward_seconds=None, parameter_ready=None,
                   variant="bucketed"):
    """``predict_overlap`` for the real buckets of ``model`` wrapped by ``DDP(model, variant,
    bucket_cap_mb)``.

    Gradient readiness: ``parameter_ready`` (seconds after the start of backward at which
    each trainable parameter's gradient is ready, in registration order, e.g. measured by
    ``parlab.bench.ddp_steps.time_single_process_step``) or, if not given, backward time
    proportional to size: the gradients arrive in reverse registration order and parameter
    i takes ``backward_seconds`` x (its bytes / all bytes). A bucket is ready with its last
    gradient; for the variants that launch after backward ("naive", "flat") every bucket is
    ready at T_bwd.

    Returns a dict: ``names`` and ``nbytes`` of the parameters and ``ready`` (their ready
    times) in launch order (reverse registration order), ``buckets`` (lists of positions in
    that order), ``bucket_bytes``, ``intervals``, ``backward`` (T_bwd), ``step_end`` and
    ``exposed``.
    """
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}; got {variant!r}: pick the "
                         "DDP variant to model.")
    named = trainable_parameters(module("model", model, "pass the torch.nn.Module that DDP wraps."))
    sizes = [p.numel() * p.element_size() for _, p in named]
    if parameter_ready is None:
        if backward_seconds is None:
            raise ValueError("give backward_seconds (time proportional to size) or parameter_ready (measured).")
        real_number("backward_seconds", backward_seconds, "give the seconds of one backward pass, e.g. 0.01.",
                    above=True)
        elapsed, parameter_ready = 0.0, [0.0] * len(sizes)
        for index in reversed(range(len(sizes))):
            elapsed += backward_seconds * sizes[index] / sum(sizes)
            parameter_ready[index] = elapsed
    if len(parameter_ready) != len(sizes):
        raise ValueError(f"parameter_ready needs one time per trainable parameter of the model ({len(sizes)}), "
                         f"got {len(parameter_ready)}.")
    cap_mb, during_backward = VARIANTS[variant]
    last = len(sizes) - 1
    plan = assign_buckets(sizes, (bucket_cap_mb if cap_mb is None else cap_mb) * MIB)
    buckets = [[last - index for index in bucket] for bucket in plan]
    order = list(reversed(range(len(sizes))))
    ready = [parameter_ready[index] for index in order]
    bucket_bytes = [sum(sizes[order[i]] for i in bucket) for bucket in buckets]
    bucket_ready = [max(ready[i] for i in bucket) if during_backward else max(ready) for bucket in buckets]
    intervals, step_end, exposed = predict_overlap(bucket_bytes, bucket_ready, N_d, alpha, beta)
    return dict(names=[named[index][0] for index in order], nbytes=[sizes[index] for index in order], ready=ready,
                buckets=buckets, bucket_bytes=bucket_bytes, intervals=intervals, backward=max(ready),
                step_end=step_end, exposed=exposed)


def predict_step(model, timing, N_d, alpha, beta, variant="bucketed", bucket_cap_mb=25):
    """Predicted seconds of one DDP training step of ``model`` on N_d ranks:

        T_step = T_fwd + max(T_bwd, end_last) + T_opt

    with T_fwd, T_bwd, T_opt and every parameter's gradient-ready time measured without
    communication (``timing``: a dict with ``forward``, ``backward``, ``optimizer`` and
    ``parameter_ready``, as ``parlab.bench.ddp_steps.time_single_process_step`` returns it), and
    end_last the end of the last all-reduce (``bucket_overlap``). What it leaves out: copying
    gradients into and out of the buckets, and the CPU time each message costs."""
    missing = {"forward", "backward", "optimizer", "parameter_ready"} - set(timing)
    if missing:
        raise ValueError(f"timing needs the keys {sorted(missing)}: pass what time_single_process_step returns.")
    plan = bucket_overlap(model, bucket_cap_mb, N_d, alpha, beta, parameter_ready=timing["parameter_ready"],
                          variant=variant)
    return timing["forward"] + max(timing["backward"], plan["step_end"]) + timing["optimizer"]
