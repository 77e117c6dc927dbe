"""Graded: the memory one GPU of a plan holds, and a script launched by torchrun (``planner.py``).

The three memory functions are compared with the planner's ``parlab.plan.plan_memory``, for
EXACT equality, on every plan that can be built of the small GPT on 8 GPUs (B = 32), a 7B on
64 (B = 512) and a 70B on 640 (B = 1536, so that K = 5 and 10 appear): every (N_d, t, K)
with t dividing a and K dividing L, every micro-batch size b of 1, 2, 4 that splits B,
M = B / (N_d b), with stages with fewer micro-batches than stages added (M < K). Model
states are graded at every ZeRO stage for mixed-precision Adam (data parallelism alone,
then with t K > 1) and for fp32 Adam and SGD with momentum; activations without a
pipeline, with one and with recompute (selective and full), with and without sequence
parallelism; the total on all of them. A wrong answer is compared with the classic mistakes (the model not split by
t K, a ZeRO stage's sharding misapplied, the micro-batches in flight forgotten, recompute
without what the recomputed layer rebuilds, ...) and the failure names the one it matches.

``torchrun_all_reduce`` is graded by running the file under ``torchrun --standalone
--nproc-per-node 2``, once for the three tests, each process contributing an integer too
large for float32: every process must return the sum one process computes, exactly, its
place in the job as torchrun set it, the backend for this machine, and have left the process
group. The launch has a deadline: what still runs then is killed with its children.
"""

import functools
import json
import re

import pytest
import torch

from parlab.memory import FP32_ADAM, FP32_SGD_MOMENTUM, MIXED_ADAM, model_state_bytes, transformer_activation_bytes
from parlab.plan import Model, Plan, grids, plan_memory
from parlab.train import run_with_deadline, torchrun_path

PRECISIONS = {"mixed-precision Adam": MIXED_ADAM, "fp32 Adam": FP32_ADAM, "fp32 SGD with momentum": FP32_SGD_MOMENTUM}
STAGES = (0, 1, 2, 3)
# (model, GPUs N, global batch B): 640 = 80 nodes of 8 gives the 70B stages of 5 and 10 layers.
SETUPS = ((Model.small_gpt, 8, 32), (Model.llama2_7b, 64, 512), (Model.llama2_70b, 640, 1536))
MICRO_BATCHES = (1, 2, 4)
PROCESSES = 2
VALUES = (2**40 + 7, 2**41 + 5)  # float32 keeps 24 bits: both round
DEADLINE_S = 45  # a launch takes a few seconds; a hang is killed after this


@functools.cache
def layouts():
    """(model, N_d, t, K, b, M) of every plan that can be built, then a few with M < K."""
    found = []
    for build, N, B in SETUPS:
        model = build()
        for N_d, t, K in grids(N):
            for b in MICRO_BATCHES:
                if model.a % t == 0 and model.L % K == 0 and B % (N_d * b) == 0:
                    found.append((model, N_d, t, K, b, B // (N_d * b)))
        found += [(model, 1, 1, K, 1, M) for K in (2, 4, 8) for M in range(1, K) if model.L % K == 0]
    return found


def every_plan(where=lambda N_d, t, K, M: True, stages=STAGES, recompute=(None, "selective", "full")):
    return [(model, Plan(N_d, t, K, zero, b, M, r)) for model, N_d, t, K, b, M in layouts() if where(N_d, t, K, M)
            for zero in stages for r in recompute]


def describe(model, plan):
    return (f"{model.name}, N_d={plan.N_d} t={plan.t} K={plan.K} ZeRO-{plan.zero} b={plan.b} M={plan.M} "
            f"recompute {plan.recompute or 'off'}")


def first_of(variants, got):
    """The sentence of the first (sentence, value) whose value equals ``got``."""
    return next((why for why, value in variants if value is not None and value == got), None)


def rounding(got, expected):
    """The sentence for an answer off by floating-point rounding only, or None."""
    try:
        near = all(abs(g - e) <= 1e-12 * abs(e) for g, e in zip(got, expected, strict=True))
    except (TypeError, ValueError):
        return None
    return ("equal up to floating-point rounding only: compute as the docstring says, calling the parlab.memory "
            "formula and multiplying in its order, and the roundings agree") if near else None


@pytest.mark.task("model_state_bytes_per_gpu")
class TestModelStateBytesPerGpu:
    @pytest.mark.points(1)
    def test_data_parallelism_replicates_or_shards_by_the_zero_stage(self, impl):
        data_parallel = every_plan(lambda N_d, t, K, M: t == K == 1, recompute=(None,))
        check_model_states(impl, data_parallel, "mixed-precision Adam")

    @pytest.mark.points(1)
    def test_tensor_and_pipeline_parallelism_split_the_model(self, impl):
        check_model_states(impl, every_plan(lambda N_d, t, K, M: t * K > 1, recompute=(None,)), "mixed-precision Adam")

    @pytest.mark.points(1)
    def test_with_the_precision_given(self, impl):
        for name in ("fp32 Adam", "fp32 SGD with momentum"):
            check_model_states(impl, every_plan(recompute=(None,)), name)


def check_model_states(impl, cases, precision_name):
    precision = PRECISIONS[precision_name]
    for model, plan in cases:
        expected = plan_memory(model, plan, precision).states
        got = impl.model_state_bytes_per_gpu(model, plan, precision)
        if not isinstance(got, tuple) or len(got) != 3:
            assert False, (f"model_state_bytes_per_gpu returned {got!r}: return a parlab.memory.ModelState (params, "
                           "grads, optimizer), as parlab.memory.model_state_bytes does")
        if tuple(got) == tuple(expected):
            continue
        why = first_of(model_state_mistakes(model, plan, precision), tuple(got)) or rounding(got, expected)
        assert False, (f"{describe(model, plan)}, {precision_name}: expected (params, grads, optimizer) = "
                       f"{tuple(expected)} bytes, got {tuple(got)}" + (f": {why}" if why else ""))


def model_state_mistakes(model, plan, precision):
    """(sentence, ModelState as a tuple) of each classic mistake on ``plan``."""
    N_d, t, K, zero, psi = plan.N_d, plan.t, plan.K, plan.zero, model.psi
    replicated = {0: "ZeRO-0 replicates every model state on the N_d ranks",
                  1: "ZeRO-1 shards only the optimizer state over N_d",
                  2: "ZeRO-2 shards the optimizer state and gradients over N_d, not the parameters",
                  3: "ZeRO-3 shards parameters, gradients and optimizer state over N_d"}[zero]
    mistakes = [
        (f"you divided Psi by N_d but {replicated}", model_state_bytes(psi / (t * K * N_d), 0, 1, *precision)),
        (f"you divided nothing by N_d but {replicated}", model_state_bytes(psi / (t * K), 0, 1, *precision)),
        ("each GPU holds the Psi / (t K) parameters of its slice: t splits every layer, K the layers; you counted "
         "the whole model", model_state_bytes(psi, zero, N_d, *precision)),
        ("you divided Psi by t but not by K: each of the K stages holds L / K of the layers",
         model_state_bytes(psi / t, zero, N_d, *precision) if K > 1 else None),
        ("you divided Psi by K but not by t: each tensor-parallel rank holds 1 / t of every layer",
         model_state_bytes(psi / K, zero, N_d, *precision) if t > 1 else None),
        ("you used mixed-precision Adam's bytes; use the precision given (kappa, param_bytes, grad_bytes)",
         model_state_bytes(psi / (t * K), zero, N_d, *MIXED_ADAM) if precision != MIXED_ADAM else None),
    ]
    for other in STAGES:
        if other != zero:
            mistakes.append((f"that is ZeRO-{other}'s sharding, but {replicated}",
                             model_state_bytes(psi / (t * K), other, N_d, *precision)))
    return [(why, None if value is None else tuple(value)) for why, value in mistakes]


@pytest.mark.task("activation_bytes_per_gpu")
class TestActivationBytesPerGpu:
    @pytest.mark.points(1)
    def test_without_a_pipeline(self, impl):
        check_activations(impl, every_plan(lambda N_d, t, K, M: K == 1, stages=(0,), recompute=(None,)))

    @pytest.mark.points(1)
    def test_the_micro_batches_in_flight_on_the_first_stage(self, impl):
        check_activations(impl, every_plan(lambda N_d, t, K, M: K > 1, stages=(0,), recompute=(None,)))

    @pytest.mark.points(1)
    def test_with_recompute(self, impl):
        check_activations(impl, every_plan(stages=(0,), recompute=("selective", "full")))


def check_activations(impl, cases):
    for model, plan in cases:
        for sequence_parallel in (True, False):
            expected = plan_memory(model, plan, MIXED_ADAM, sequence_parallel).activations
            got = impl.activation_bytes_per_gpu(model, plan, sequence_parallel)
            if got == expected:
                continue
            why = first_of(activation_mistakes(model, plan, sequence_parallel), got) or rounding([got], [expected])
            assert False, (f"{describe(model, plan)}, sequence parallelism {'on' if sequence_parallel else 'off'}: "
                           f"expected {expected} bytes of activations, got {got!r}" + (f": {why}" if why else ""))


def activation_mistakes(model, plan, sequence_parallel):
    """(sentence, bytes) of each classic mistake on ``plan``."""
    K, M, t, L = plan.K, plan.M, plan.t, model.L

    def layer(kept, t=t, sequence_parallel=sequence_parallel):
        return transformer_activation_bytes(model.s, plan.b, model.h, model.a, 1, kept, t, sequence_parallel)

    kept = plan.recompute
    in_flight = min(K, M)
    extra = layer(None) - layer(kept) if kept else 0  # what the recompute rebuilds of one layer

    def stage(kept=kept, layers=L // K, micro_batches=in_flight, **options):
        rebuilt = layer(None, **options) - layer(kept, **options) if kept else 0
        return layer(kept, **options) * layers * micro_batches + rebuilt

    mistakes = [
        (f"you forgot the micro-batches in flight on the first stage: 1F1B runs min(K, M) = {in_flight} forwards "
         "there before the first backward, and keeps the activations of each", stage(micro_batches=1)
         if in_flight > 1 else None),
        (f"you kept all M = {M} micro-batches (GPipe's count); 1F1B's first stage holds min(K, M) = {in_flight}"
         if K > 1 else f"you kept all M = {M} micro-batches; without a pipeline (K = 1) they run one after another, "
         "each backward freeing its activations before the next forward", stage(micro_batches=M) if M > K else None),
        (f"a stage cannot hold more micro-batches than the step has: min(K, M) = M = {M}",
         stage(micro_batches=K) if M < K else None),
        (f"each stage holds its L / K = {L // K} layers, not all L = {L}", stage(layers=L) if K > 1 else None),
        (f"you counted one layer; the stage holds L / K = {L // K}", stage(layers=1) if L // K > 1 else None),
        (f"you ignored t: each tensor-parallel rank keeps its share of a layer (t = {t})",
         stage(t=1) if t > 1 else None),
        (f"you computed with sequence parallelism {'off' if sequence_parallel else 'on'}; pass sequence_parallel "
         "on as given", stage(sequence_parallel=not sequence_parallel) if t > 1 else None),
    ]
    if kept:
        other = {"full": "selective", "selective": "full"}[kept]
        mistakes += [
            (f"with recompute={kept!r} a layer keeps {kept} recompute's activations, not all of them",
             stage(kept=None)),
            ("the layer being recomputed holds what its recompute rebuilds: add A(None) - A(kept) of one layer, "
             "for one micro-batch", stage() - extra),
            ("the layer being recomputed adds only what its recompute rebuilds, A(None) - A(kept): the part it "
             "kept is counted already", stage() - extra + layer(None)),
            ("the recomputed layer's activations are held for one micro-batch at a time, not min(K, M)",
             stage() + extra * (in_flight - 1) if in_flight > 1 else None),
            (f"that is recompute={other!r}; the plan says {kept!r}", stage(kept=other)),
        ]
    return mistakes


@pytest.mark.task("memory_per_gpu")
class TestMemoryPerGpu:
    @pytest.mark.points(1)
    def test_states_plus_activations_on_every_plan(self, impl):
        for model, plan in every_plan():
            for (name, precision), sequence_parallel in ((p, sp) for p in PRECISIONS.items() for sp in (True, False)):
                expected = plan_memory(model, plan, precision, sequence_parallel)
                got = impl.memory_per_gpu(model, plan, precision, sequence_parallel)
                if got == expected.total:
                    continue
                why = own_parts(impl, model, plan, precision, sequence_parallel, got) or first_of([
                    ("that is the model states alone; add the activations", expected.states.total),
                    ("that is the activations alone; add the model states", expected.activations),
                    ("pass precision on to model_state_bytes_per_gpu", plan_memory(model, plan).total),
                    ("pass sequence_parallel on to activation_bytes_per_gpu",
                     plan_memory(model, plan, precision).total),
                ], got) or rounding([got], [expected.total])
                assert False, (f"{describe(model, plan)}, {name}, sequence parallelism "
                               f"{'on' if sequence_parallel else 'off'}: expected {expected.total} bytes, got {got!r}"
                               + (f": {why}" if why else ""))


def own_parts(impl, model, plan, precision, sequence_parallel, got):
    """The sentence when ``got`` is the sum of the learner's own two parts: the mistake is there."""
    try:
        parts = impl.model_state_bytes_per_gpu(model, plan, precision).total + impl.activation_bytes_per_gpu(
            model, plan, sequence_parallel)
    except Exception:
        return None
    return ("that is your model_state_bytes_per_gpu's total plus your activation_bytes_per_gpu: the sum is right, "
            "one of the parts is not (see their tasks)") if parts == got else None


# --- torchrun_all_reduce: one launch under torchrun, read by three tests -------------------------------------------


@pytest.mark.task("torchrun_all_reduce")
@pytest.mark.timeout(DEADLINE_S + 30)  # the launch's own deadline ends a hang first, saying so
class TestTorchrunAllReduce:
    @pytest.mark.points(1)
    def test_every_process_gets_the_sum_one_process_computes(self, launched):
        expected = sum(VALUES)
        for rank, record in launched.items():
            total = record["result"].get("total")
            if isinstance(total, int) and total == expected:
                continue
            why = first_of([
                ("the values went through float32, which keeps 24 bits: all-reduce an int64 tensor (torch.tensor of "
                 "a Python int is one)", int(torch.tensor(VALUES, dtype=torch.float32).sum().item())),
                ("that is this process's own value: all-reduce it over the processes", VALUES[rank]),
                ("return the sum as a Python int (.item() of the int64 tensor)", float(expected)),
            ], total)
            assert False, (f"process {rank} of {PROCESSES} returned total = {total!r}, expected {expected} = "
                           f"{' + '.join(map(str, VALUES))}, the values of processes 0 and 1" + (f": {why}" if why
                                                                                                 else ""))

    @pytest.mark.points(1)
    def test_each_process_reads_its_place_from_torchrun(self, launched):
        on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= PROCESSES
        for rank, record in launched.items():
            environment = record["environment"]
            expected = {"rank": int(environment["RANK"]), "world_size": int(environment["WORLD_SIZE"]),
                        "local_rank": int(environment["LOCAL_RANK"]), "backend": "nccl" if on_gpus else "gloo"}
            got = {key: record["result"].get(key) for key in expected}
            wrong = [key for key in expected if got[key] != expected[key] or type(got[key]) is not type(expected[key])]
            texts = [key for key in wrong if isinstance(got[key], str) and got[key] == str(expected[key])]
            assert not wrong, (f"process {rank}: expected {expected}, got {got}" + (
                f": {', '.join(texts)} must be an int; the environment holds text, int(os.environ[...])" if texts
                else ""))

    @pytest.mark.points(1)
    def test_leaves_the_process_group(self, launched):
        for rank, record in launched.items():
            assert record["group_left"], (f"process {rank} still had its process group after torchrun_all_reduce "
                                          "returned: call dist.destroy_process_group() before returning")


# A worker's exception, as torchrun shows it: "[rank0]: RuntimeError: ...", or unprefixed.
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(?:\w+\.)*(?P<name>\w+(?:Error|Exception)): (?P<message>.*)$",
                        re.MULTILINE)
# gloo's words when the other process left while this one waited in a collective.
PEER_LEFT = re.compile(r"Connection (reset|closed) by peer")


@pytest.fixture(scope="module")
def launched(impl, tmp_path_factory):
    """{rank: the record main wrote} of one ``torchrun --standalone --nproc-per-node 2`` run of
    the implementation's file; a failure or a hang fails every test of the task, saying why."""
    torchrun = torchrun_path()
    if torchrun is None:
        pytest.skip("torchrun is not on PATH (it comes with torch: run from the environment torch is installed in)")
    directory = tmp_path_factory.mktemp("torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", str(PROCESSES), impl.__file__,
               "--values", ",".join(map(str, VALUES)), "--out", str(directory)]
    (code,), (output,) = run_with_deadline([command], directory, DEADLINE_S)
    if code is None:
        pytest.fail(f"timed out after {DEADLINE_S} s: the processes were killed (a collective that not every process "
                    "calls, or a rendezvous that never completes, waits forever)", pytrace=False)
    error = ERROR_LINE.search(output)
    if error and error["name"] == "NotImplementedError":
        raise NotImplementedError(error["message"])
    if code != 0:
        left = PEER_LEFT.search(error[0]) if error else None
        if left:
            why = (f"a process waited in a collective that the other never called (it left: gloo's {left[0]!r}): "
                   "every process must make the same collective calls, in the same order")
        else:
            why = f"{error['name']}: {error['message'][:300]}" if error else f"its output ends: {output[-500:]}"
        pytest.fail(f"torchrun exited with {code}: {why}", pytrace=False)
    records = {}
    for rank in range(PROCESSES):
        path = directory / f"rank{rank}.json"
        if not path.exists():
            pytest.fail(f"process {rank} wrote no result: main writes what torchrun_all_reduce returns", pytrace=False)
        records[rank] = json.loads(path.read_text())
        if not isinstance(records[rank]["result"], dict):
            pytest.fail(f"process {rank}: torchrun_all_reduce returned {records[rank]['result']!r}, not a dict",
                        pytrace=False)
    return records
