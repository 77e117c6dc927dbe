"""Graded: the 1F1B schedule and the work of one stage in parlab's executor (``pipeline.py``).

``one_f_one_b`` is compared, action by action, with golden grids for (K, M) = (2, 2), (3, 5)
and (4, 8), derived below from the rule (K - r - 1 warm-up forwards, (F, B) pairs, the
cool-down backwards); parlab's validator must accept it for K = 1..5; M < K must raise a
ValueError that says so; parlab's simulator must find rank r holding at most K - r
micro-batches of activations.

``forward_step`` and ``backward_step`` are plugged into parlab's ``PipelineExecutor``, which
runs parlab's own GPipe and 1F1B schedules (so the two tasks are graded apart) on an MLP cut
into K = 1 (in this process), 2 and 4 stages, with M = 4, 4 and 8 micro-batches. The
gradients must equal those of one process on the full batch, within the rounding band of
``parlab.numerics`` (twice what one process differs by when it sums the M micro-batches'
gradients, plus 16 roundings of the largest gradient), and the losses those of each
micro-batch (within 16 roundings: the same forward); a traced 1F1B step at K = 4 must send exactly the
schedule's activations and gradients across each stage boundary and show one forward or
backward span per action, in the schedule's order.
"""

import functools
from itertools import zip_longest

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parlab import trace
from parlab.numerics import backward_in_shards, max_abs_difference, ring_orders, rounding_band
from parlab.pipeline import Schedule, make_schedule, one_f_one_b, simulate, validate
from parlab.pipeline.executor import PipelineExecutor, backward_step, forward_step, partition

RUN_TIMEOUT_S = 10
# A process's first pipeline step imports what torch needs for meta tensors (sympy): seconds
# per rank on a busy machine. Each rank runs one step of parlab's own executor beforehand
# under this timeout, so that a hang in the learner's code still ends after RUN_TIMEOUT_S.
WARM_UP_TIMEOUT_S = 60
WORLD_SIZES = [2, 4]
SCHEDULE_NAMES = ("gpipe", "1f1b")
IN, HIDDEN, OUT, LINEARS, BATCH = 5, 12, 3, 8, 24  # 24 samples: M = 4 or 8 micro-batches of 6 or 3
SEND_OPS = ("send", "isend")

# Rank r: K - r - 1 warm-up forwards | F(m) B(m - warm-up) pairs | the cool-down backwards.
GOLDEN = {
    (2, 2): [
        "0F0 | 0F1 0B0 | 0B1",
        "| 1F0 1B0 1F1 1B1 |",
    ],
    (3, 5): [
        "0F0 0F1 | 0F2 0B0 0F3 0B1 0F4 0B2 | 0B3 0B4",
        "1F0 | 1F1 1B0 1F2 1B1 1F3 1B2 1F4 1B3 | 1B4",
        "| 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3 2F4 2B4 |",
    ],
    (4, 8): [
        "0F0 0F1 0F2 | 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 | 0B5 0B6 0B7",
        "1F0 1F1 | 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 | 1B6 1B7",
        "2F0 | 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 | 2B7",
        "| 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7 |",
    ],
}
PHASES = ("warm-up: K - r - 1 forwards", "steady state: one forward, then one backward",
          "cool-down: the backwards still to do")


def ranks(world_size):
    return f"{world_size} ranks"


@pytest.mark.task("one_f_one_b")
class TestOneFOneB:
    @pytest.mark.points(2)
    def test_golden_grids(self, impl):
        for (K, M), rows in GOLDEN.items():
            check_grid(impl, K, M, [[phase.split() for phase in row.split("|")] for row in rows])

    @pytest.mark.points(1)
    def test_the_validator_accepts_it(self, impl):
        for K in range(1, 6):
            for M in (K, K + 1, 2 * K + 1):
                try:
                    validate(schedule_of(impl, K, M))
                except ValueError as exc:
                    assert False, f"one_f_one_b({K}, {M}) is refused by parlab.pipeline.validate: {exc}"

    @pytest.mark.points(1)
    def test_fewer_microbatches_than_ranks_raise_value_error(self, impl):
        try:
            impl.one_f_one_b(3, 3)
        except ValueError as exc:
            assert False, f"one_f_one_b(3, 3) raised ValueError({str(exc)!r}): M = K micro-batches fill the warm-up"
        for K, M in [(4, 3), (2, 1), (5, 2)]:
            with pytest.raises(ValueError) as raised:
                impl.one_f_one_b(K, M)
                assert False, f"one_f_one_b({K}, {M}) returned a schedule: with M < K, raise ValueError"
            message = str(raised.value)
            assert str(K) in message and str(M) in message and len(message.split()) >= 5, (
                f"one_f_one_b({K}, {M}) raised ValueError({message!r}): say in a sentence that 1F1B needs M >= K, "
                f"with the values M = {M} and K = {K}, and what to change"
            )

    @pytest.mark.points(1)
    def test_rank_r_holds_k_minus_r_microbatches(self, impl):
        for K, M in [(2, 2), (3, 5), (4, 8), (4, 16)]:
            schedule = schedule_of(impl, K, M)
            try:
                held = simulate(schedule).peak_activations
            except ValueError as exc:
                assert False, f"one_f_one_b({K}, {M}) cannot be simulated: {exc}"
            for r in range(K):
                assert held[r] == K - r, (
                    f"one_f_one_b({K}, {M}): rank {r} holds up to {held[r]} micro-batches of activations at once "
                    f"(forwards run, backwards not yet); 1F1B holds K - r = {K - r}: its first backward follows "
                    f"K - r - 1 = {K - r - 1} warm-up forwards and one more forward, then each forward is "
                    "followed by a backward"
                )


def schedule_of(impl, K, M):
    """The learner's one_f_one_b(K, M) as a parlab Schedule (a Schedule returned is taken as is)."""
    rows = impl.one_f_one_b(K, M)
    rows = rows.actions if isinstance(rows, Schedule) else rows
    try:
        return Schedule("1f1b", K, M, 1, tuple(tuple(row) for row in rows))
    except (TypeError, ValueError) as exc:
        assert False, f"one_f_one_b({K}, {M}) must return K lists of Action(stage, kind, microbatch) ({exc})"


def check_grid(impl, K, M, golden):
    """Compare the learner's rows with the golden ones (per rank: warm-up, steady, cool-down
    phases), naming the first wrong action and the phase it belongs to."""
    rows = [[str(action) for action in row] for row in schedule_of(impl, K, M).actions]
    assert len(rows) == K, f"one_f_one_b({K}, {M}) returned {len(rows)} rank lists: give one per rank, K = {K}"
    for r, (row, phases) in enumerate(zip(rows, golden)):
        expected = [action for phase in phases for action in phase]
        for i, (got, want) in enumerate(zip_longest(row, expected)):
            if got == want:
                continue
            phase = PHASES[0 if i < len(phases[0]) else 1 if i < len(phases[0]) + len(phases[1]) else 2]
            hint = ""
            warmup = next((j for j, action in enumerate(row) if "B" in action), len(row))
            if warmup != K - r - 1:
                hint = (f"; rank {r} runs {warmup} forwards before its first backward, 1F1B's warm-up is "
                        f"K - r - 1 = {K - r - 1}")
            assert False, (
                f"one_f_one_b({K}, {M}), rank {r}, action {i}: got {got or 'nothing'}, expected {want or 'nothing'} "
                f"({phase}){hint}; expected rank {r}: {' '.join(expected)}"
            )


@pytest.mark.task("stage_step")
class TestStageStep:
    @pytest.mark.points(1)
    def test_one_stage_in_one_process(self, impl):
        # K = 1 needs no process group: the stage is the first and the last, nothing is sent.
        for name in SCHEDULE_NAMES:
            check_step([pipelined_steps(impl.forward_step, impl.backward_step, (name,), 4)[name]], name, 1, 4)

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cluster", WORLD_SIZES, indirect=True, ids=ranks)
    def test_gradients_like_one_process_on_the_full_batch(self, cluster, impl):
        K = cluster.world_size
        per_rank = run_steps(cluster, impl, SCHEDULE_NAMES, 2 * K)
        for name in SCHEDULE_NAMES:
            check_step([steps[name] for steps in per_rank], name, K, 2 * K)

    @pytest.mark.points(1)
    def test_sends_the_schedules_activations_and_gradients(self, cluster4, impl):
        timeline = run_steps(cluster4, impl, ("1f1b",), 8, traced=True)
        sent = {}
        for event in timeline.select(kind=trace.COMM):
            if event.name in SEND_OPS:
                sent[event.rank, event.peer] = sent.get((event.rank, event.peer), 0) + event.nbytes
        assert sent, "no message was traced: send with executor.send and receive with executor.receive"
        expected = {}
        for b, nbytes in enumerate(boundary_bytes(4)):
            expected[b, b + 1] = expected[b + 1, b] = nbytes
        for source, destination in sorted(expected.keys() | sent.keys()):
            what = "activations" if destination == source + 1 else "gradients"
            got, want = sent.get((source, destination), 0), expected.get((source, destination), 0)
            assert got == want, (
                f"1f1b, K = 4, M = 8: rank {source} sent {got} bytes to rank {destination}, expected {want} (the "
                f"{what} of the 8 micro-batches: one message per {'F' if what == 'activations' else 'B'} of stage "
                f"{source}, sent with executor.send)"
                if want else
                f"1f1b, K = 4, M = 8: rank {source} sent {got} bytes to rank {destination}, which is not its "
                "neighbour: activations go to stage s + 1 and gradients to stage s - 1"
            )

    @pytest.mark.points(1)
    def test_traces_one_span_per_action(self, cluster4, impl):
        timeline = run_steps(cluster4, impl, ("1f1b",), 8, traced=True)
        schedule = one_f_one_b(4, 8)
        for r in range(4):
            spans = [(ev.name, ev.stage, ev.microbatch) for ev in timeline.select(rank=r, kind=trace.COMPUTE)]
            expected = [({"F": "forward", "B": "backward"}[a.kind], a.stage, a.microbatch) for a in schedule.actions[r]]
            for kind in ("forward", "backward"):
                assert any(span[0] == kind for span in spans), (
                    f"1f1b, K = 4: rank {r} traced no {kind} span: wrap executor.run_{kind}(s, m, ...) in "
                    f'trace.span("{kind}", stage=s, microbatch=m)'
                )
            for i, (got, want) in enumerate(zip_longest(spans, expected)):
                assert got == want, (
                    f"1f1b, K = 4: rank {r}'s trace span {i} is {got}, expected (name, stage, micro-batch) = {want}: "
                    "one span per action, named forward or backward, with the action's stage and micro-batch"
                )


# --- The model, the data and one process's reference --------------------------------------


def build_mlp():
    torch.manual_seed(0)
    layers = [nn.Linear(IN, HIDDEN)]
    for _ in range(LINEARS - 2):
        layers += [nn.ReLU(), nn.Linear(HIDDEN, HIDDEN)]
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(HIDDEN, OUT))


def full_batch():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, IN, generator=generator), torch.randn(BATCH, OUT, generator=generator)


@functools.cache
def reference(M=1, order=None):
    """One process on the full batch: the gradients of the mean loss, by parameter name. With
    M > 1 the pipeline's arithmetic (parlab.numerics): the M micro-batches' gradients summed
    in ``order``, divided by M."""
    model = build_mlp()
    micro_batches = list(zip(*(part.chunk(M) for part in full_batch())))
    backward_in_shards(lambda x, y: F.mse_loss(model(x), y), model.parameters(), micro_batches, order)
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@functools.cache
def gradient_band(M):
    """How far from ``reference()`` rounding may take a pipeline's gradients: the band of one
    process summing the M micro-batches in each ring order."""
    return rounding_band(reference(), [reference(M, tuple(order)) for order in ring_orders(M)])[0]


def reference_losses(M):
    model, (x, y) = build_mlp(), full_batch()
    with torch.no_grad():
        return [F.mse_loss(model(xm), ym) for xm, ym in zip(x.split(BATCH // M), y.split(BATCH // M))]


def stage_of_parameters(K):
    model = build_mlp()
    stage_of = {id(p): s for s, stage in enumerate(partition(model, K)) for p in stage.parameters()}
    return {name: stage_of[id(p)] for name, p in model.named_parameters()}


def boundary_bytes(K):
    """Bytes of the whole batch's output of stages 0..K-2: what crosses each boundary, once
    forward as activations and once backward as gradients."""
    x = full_batch()[0]
    sizes = []
    with torch.no_grad():
        for stage in partition(build_mlp(), K)[:-1]:
            x = stage(x)
            sizes.append(x.numel() * x.element_size())
    return sizes


# --- On the ranks -------------------------------------------------------------------------


def run_steps(cluster, impl, schedule_names, M, traced=False):
    """``pipelined_steps`` with the learner's step functions on the cluster (run, or traced),
    once every rank has run a step with parlab's own."""
    cluster.run(pipelined_steps, forward_step, backward_step, ("gpipe",), M, timeout=WARM_UP_TIMEOUT_S)
    call = cluster.trace if traced else cluster.run
    return call(pipelined_steps, impl.forward_step, impl.backward_step, schedule_names, M, timeout=RUN_TIMEOUT_S)


def pipelined_steps(forward, backward, schedule_names, M):
    """One step of each of parlab's schedules ``schedule_names`` (K = world size) with the
    step functions ``forward`` and ``backward``: {name: (this rank's gradients by parameter name, the losses
    step returned)}."""
    K, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    results = {}
    for name in schedule_names:
        model = build_mlp()
        stage = partition(model, K)[rank]
        executor = PipelineExecutor(make_schedule(name, K, M), {rank: stage}, F.mse_loss,
                                    forward_step=forward, backward_step=backward)
        losses = executor.step(*full_batch())
        mine = {id(p) for p in stage.parameters()}
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if id(p) in mine}
        results[name] = grads, losses
    return results


# --- Checks in the parent -----------------------------------------------------------------


def close(a, b, band):
    return a is not None and a.shape == b.shape and max_abs_difference(a, b) <= band


def check_step(per_rank, name, K, M):
    """Compare one step's gradients and losses with one process's, naming the first
    difference and, where it recognises one, the mistake behind it."""
    where = f"{name}, K = {K}, M = {M}"
    grads = {n: g for rank_grads, _ in per_rank for n, g in rank_grads.items()}
    stage_of, band = stage_of_parameters(K), gradient_band(M)
    for n, expected in reference().items():
        got, stage = grads[n], stage_of[n]
        if close(got, expected, band):
            continue
        if got is None:
            why = (f"{n} (stage {stage}) has no gradient: backward_step must run executor.run_backward for each B "
                   "of its stage")
        elif close(got, M * expected, M * band):
            why = (f"the gradients are M = {M} times too large: scale each micro-batch loss by 1/M (start the last "
                   "stage's backward from 1/M, not 1)")
        elif close(got, expected / M, band / M):
            why = f"the gradients are M = {M} times too small: scale each micro-batch loss by 1/M once, not twice"
        else:
            worst = max_abs_difference(got, expected)
            why = (f"the gradient of {n} (stage {stage}) differs from one process's by up to {worst:.3g} (rounding "
                   f"explains {band:.1g})")
        assert False, f"{where}: {why}"
    losses = per_rank[-1][1]
    loss_band = rounding_band(reference_losses(M), [])[0]  # the same forward as one process: only the floor
    for m, expected in enumerate(reference_losses(M)):
        got = losses[m] if losses is not None and m < len(losses) else None
        assert got is not None, (
            f"{where}: the loss of micro-batch {m} is missing: on the last stage keep it (detached) in "
            "executor.losses[m]"
        )
        assert close(torch.as_tensor(got), expected, loss_band), (
            f"{where}: the loss of micro-batch {m} is {float(got):.6g}, expected {float(expected):.6g}: keep the "
            "loss run_forward returns on the last stage, unscaled"
        )

