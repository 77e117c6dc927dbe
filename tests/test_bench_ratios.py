"""One ratio convention in every bench: ratio = time of parlab / time of the reference (below 1,
parlab is faster), stated in each table's header and each JSON result. Checked on small
made-up measurements, so nothing is timed here."""

import re

import pytest

from parlab.bench import (
    async_sgd,
    collectives,
    compression,
    context_parallel,
    ddp,
    diloco,
    emulation,
    experts,
    pipeline,
    plan,
    ratio_header,
    runtime,
    tensor_parallel,
    time_ratio,
    zero,
)
from parlab.cli import BENCHES

CONVENTION = re.compile(r"ratio = time of parlab / time of .+ \(below 1: parlab is faster\)")
FAST, SLOW = 1.0, 4.0  # seconds: parlab FAST against a reference SLOW must give a ratio of 1/4


def collectives_result():
    measured = {"seconds": {"torch": SLOW, "naive": 8.0, "ring": FAST, "butterfly": SLOW}, "iters": 3,
                "backend": "gloo"}
    rows = collectives.bandwidth_rows(2, 4096, measured)
    return {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2, "rows": rows}


def ddp_result():
    seconds = {variant: [SLOW, SLOW, 9.0] for variant in ddp.VARIANTS}
    seconds["bucketed"] = [FAST, 0.5, 7.0]
    return {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2, "parameters": 72, "width": 8,
            "depth": 1, "batch_size": 4, "bucket_cap_mb": 25.0, "steps": 3, "rows": ddp.variant_rows(2, seconds)}


def pipeline_result():
    row = {"world_size": 2, "schedule": "1f1b", "v": 1, **pipeline.step_times([FAST, 2.0, 0.5], [SLOW, 3.0, 5.0]),
           "bubble_measured": 0.3, "bubble_simulated": 0.25, "bubble_formula": 0.2}
    return {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2, "parameters": 72,
            "width": 8, "depth": 1, "batch_size": 4, "microbatches": 2, "steps": 3, "sleep_s": 0.002, "repeats": 2,
            "rows": [row]}


def zero_result():
    def row(implementation, stage, median, total):
        state = {"params": total / 2, "grads": total / 4, "optimizer": total / 4, "total": total}
        return {"world_size": 2, "implementation": implementation, "stage": stage,
                "engine": f"{implementation} {stage}", "bytes": state, "per_rank_total": [total, total],
                "formula": state, "median_s": median, "seconds": [median]}

    rows = zero.add_ratios([row("parlab", 1, FAST, 300.0), row("torch", 1, SLOW, 400.0), row("parlab", 2, 2.0, 250.0)])
    return {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2, "parameters": 72,
            "hidden": 8, "depth": 1, "batch_size": 4, "steps": 1, "rows": rows}


def runtime_result():
    timings = runtime.summarise(3.0, [0.5, FAST, 2.0], [SLOW])
    return {"world_size": 2, "backend": "gloo", "torch_version": "t", "cpu_count": 2, "repeats": 3,
            "spawn_repeats": 1, **timings}


def emulation_result():
    rows = [emulation.message_row(2**20, FAST, [[0.0], [SLOW]]), emulation.compute_row(FAST, [[2 * SLOW]])]
    return {"torch_version": "t", "cpu_count": 2, "regime": "emulated: link", "repeats": 1, "rows": rows,
            "targets": emulation.targets(rows)}


def tensor_parallel_result():
    rows = [{"t": 2, "implementation": implementation, "variant": "TP", "seconds": [seconds], "median_s": seconds,
             "tokens_per_s": 128 / seconds, "mfu": None}
            for implementation, seconds in (("parlab", FAST), ("torch", SLOW))]
    return {"device": "cpu", "backend": "gloo", "torch_version": "t", "cpu_count": 2,
            "config": {"s": 16, "h": 32, "a": 4, "L": 1}, "batch_size": 8, "steps": 1,
            "rows": tensor_parallel.add_ratios(rows)}


def compression_result():
    def row(name, median, sent):
        return {"name": name, "seconds": [median], "median_s": median, "sent": sent, "losses": [0.5], "times": [median]}

    rows = compression.add_ratios([row("dense", SLOW, 800), row("top-k 1% + EF", FAST, 100)])
    torch_rows = compression.torch_ratios([row("torch dense", SLOW, 0), row("torch fp16_compress_hook", 2.0, 0)],
                                          rows, [(8, 8), (8,)])
    return {"torch_version": "t", "cpu_count": 2, "world_size": 2, "steps": 1, "hidden": 8, "depth": 1,
            "compute_s": 0.01, "parameters": 72, "ratio_means": ratio_header(compression.REFERENCE),
            "regimes": [{"link": {"latency": 1e-4, "bandwidth": 1e8}, "rows": rows}], "real": rows,
            "torch": torch_rows}


def async_result():
    def row(method, seconds):
        return {"method": method, "workers": 2, "gradients": 8, "seconds": seconds, "final_loss": 0.5,
                "losses": [1.0, 0.5], "times": [0.0, seconds]}

    return {"torch_version": "t", "cpu_count": 2, "world_size": 2, "steps": 4, "compute_s": 0.01, "period": 4,
            "regime": "emulated: link", "ratio_means": ratio_header(async_sgd.REFERENCE),
            "rows": async_sgd.add_ratios([row("sync", SLOW), row("gossip", FAST)])}


def plan_result():
    from parlab.plan import measure

    chosen = measure.predicted_plans(layouts=measure.LAYOUTS[:1])[0]
    row = plan.plan_row(measure.Measured(chosen, chosen.memory, chosen.time, 100, FAST * chosen.time.total))
    return {"torch_version": "t", "cpu_count": 2, "steps": 1, "cluster": "c", "link": "l", "cluster_flops": 1e9,
            "batch": 16, "psi": 8, "ratio_means": ratio_header(plan.REFERENCE), "rows": [row]}


def context_parallel_result():
    one = {"cp": 2, "s": 8, "method": context_parallel.ONE_PROCESS, "seconds_median": SLOW, "ratio": 1.0,
           "saved_bytes": 8, "memory_ratio": 1.0}
    ring = {"cp": 2, "s": 8, "method": "ring", "seconds": [FAST], "seconds_median": FAST,
            "ratio": time_ratio(FAST, SLOW), "saved_bytes": 4, "memory_ratio": 0.5, "forward_bytes": [8, 8],
            "backward_bytes": [8, 8], "bytes_equal_formula": True}
    return {"torch_version": "t", "cpu_count": 2, "link": {"latency": 1e-4, "bandwidth": 1e7}, "b": 1, "h": 8,
            "a": 2, "steps": 1, "ratio_means": ratio_header(context_parallel.REFERENCE),
            "memory_ratio_means": "m", "rows": [one, ring]}


def experts_result():
    def row(layer, median):
        return {"ep": 2, "layer": layer, "seconds": [median], "median_s": median, "comm_s": [median / 2],
                "comm_median_s": median / 2, "comm_share": 0.5, "sent_bytes": [8, 8], "formula_bytes": [8, 8],
                "predicted_comm_s": median / 4, "measured_over_predicted": 2.0}
    return {"torch_version": "t", "cpu_count": 2, "link": {"latency": 1e-4, "bandwidth": 1e9},
            "regime": "emulated: link", "config": {"h": 8, "E": 4, "k": 2, "T": 16, "capacity_factor": 1.25},
            "steps": 1, "ratio_means": ratio_header(experts.REFERENCE),
            "rows": experts.add_ratios([row(experts.LAYERS[0], FAST), row(experts.LAYERS[1], SLOW)])}


def diloco_result():
    def row(method, seconds):
        return {"method": method, "seconds": seconds, "time_to_target": seconds, "steps_to_target": 4,
                "final_loss": 0.01, "communication_share": 0.5, "seconds_per_step": seconds / 8,
                "predicted_seconds_per_step": seconds / 8, "losses": [1.0, 0.01], "times": [0.0, seconds]}

    rows = diloco.add_ratios([row("ddp", SLOW), row("diloco", FAST)])
    return {"torch_version": "t", "cpu_count": 2, "world_size": 2, "steps": 8, "compute_s": 0.01, "d": 64, "H": 4,
            "fragments": 2, "delay": 1, "mixing": 0.5, "target": 0.1, "ratio_means": ratio_header(diloco.REFERENCE),
            "regimes": [{"link": {"latency": 0.03, "bandwidth": 1e7}, "regime": "emulated: link", "rows": rows}]}


RESULTS = {"collectives": collectives_result, "ddp": ddp_result, "pipeline": pipeline_result, "zero": zero_result,
           "runtime": runtime_result, "emulation": emulation_result, "tensor_parallel": tensor_parallel_result,
           "compression": compression_result, "async": async_result, "diloco": diloco_result,
           "plan": plan_result, "experts": experts_result, "context_parallel": context_parallel_result}


def test_every_bench_is_checked_here():
    assert set(RESULTS) == set(BENCHES)


def test_the_ratio_is_parlab_over_the_reference():
    assert time_ratio(FAST, SLOW) == 0.25
    assert CONVENTION.fullmatch(ratio_header("torch DDP"))


@pytest.mark.parametrize("name", list(RESULTS))
def test_every_table_header_states_the_convention(name):
    module = BENCHES[name]
    report = module.format_report(RESULTS[name]())
    header = report.split("\n\n")[0]
    assert ratio_header(module.REFERENCE) in header
    assert CONVENTION.search(header), header


def test_collectives_ratio_is_time_over_torchs_time():
    rows = {row["algorithm"]: row for row in collectives_result()["rows"]}
    assert [rows[name]["ratio"] for name in ("torch", "naive", "ring", "butterfly")] == [1, 2, 0.25, 1]
    # busbw goes the other way: a quicker algorithm moves more bytes per second
    assert rows["ring"]["busbw"] == 4 * rows["torch"]["busbw"]
    assert "time / torch" in collectives.format_report(collectives_result())


def test_ddp_ratio_is_median_over_torch_ddps_median():
    rows = {row["variant"]: row for row in ddp_result()["rows"]}
    assert rows["bucketed"]["ratio"] == 0.25 and rows["naive"]["ratio"] == 1 and rows["torch"]["ratio"] == 1
    assert rows["bucketed"]["median_s"] == FAST


def test_pipeline_ratio_is_parlabs_median_over_torchs():
    (row,) = pipeline_result()["rows"]
    assert (row["parlab_median_s"], row["torch_median_s"], row["ratio"]) == (FAST, SLOW, 0.25)


def test_zero_ratios_are_parlab_over_torchs_engine_of_the_same_stage():
    rows = zero_result()["rows"]
    assert rows[0]["ratio"] == {"time": 0.25, "bytes": 0.75}
    assert rows[2]["ratio"] is None and "ratio" not in rows[1]  # torch has no stage-2 engine
    header = zero.format_report(zero_result()).split("\n\n")[0]
    assert "bytes of parlab / bytes of" in header and "below 1: parlab holds less" in header


def test_runtime_ratio_is_the_clusters_call_over_a_fresh_spawn():
    result = runtime_result()
    assert (result["cluster_median_s"], result["spawn_median_s"], result["ratio"]) == (FAST, SLOW, 0.25)


def test_tensor_parallel_ratio_is_parlabs_median_over_torchs_of_the_same_variant():
    parlab_row, torch_row = tensor_parallel_result()["rows"]
    assert parlab_row["ratio"] == 0.25 and "ratio" not in torch_row
    assert "time / torch" in tensor_parallel.format_report(tensor_parallel_result())


def test_compression_ratios_are_the_compressors_over_the_dense_step():
    result = compression_result()
    dense, topk = result["real"]
    assert (topk["time_ratio"], topk["bytes_ratio"], dense["time_ratio"]) == (0.25, 0.125, 1)
    torch_dense, fp16 = result["torch"]
    assert (fp16["time_ratio"], fp16["bytes_ratio"], fp16["parlab_over_torch"]) == (0.5, 0.5, None)
    assert torch_dense["parlab_over_torch"] == 1  # parlab's dense over torch's dense DDP


def test_context_parallel_ratio_is_each_methods_time_over_one_process():
    rows = context_parallel_result()["rows"]
    assert [row["ratio"] for row in rows] == [1.0, FAST / SLOW]
    assert "0.25" in context_parallel.format_report(context_parallel_result())


def test_async_ratio_is_each_methods_time_over_syncs():
    sync, gossip = async_result()["rows"]
    assert (sync["ratio"], gossip["ratio"]) == (1, 0.25)


def test_diloco_ratio_is_each_methods_time_to_the_target_over_ddps():
    ddp, diloco_row = diloco_result()["regimes"][0]["rows"]
    assert (ddp["ratio"], diloco_row["ratio"]) == (1, 0.25)
