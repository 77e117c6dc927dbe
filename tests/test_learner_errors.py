"""Bad input from a learner gets a ValueError whose message says what to change: wrong types,
non-finite numbers, zero or negative counts, world sizes that do not fit, mismatched lengths.

Each case is (what is called, a regex on the message's fix): the sentence must name the
argument and say what to pass instead, not only that something is wrong."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parlab import alpha_beta, collectives, ddp, emulated, flat, memory, processes_vs_threads, trace, viz
from parlab.bench import collectives as bench_collectives
from parlab.bench import ddp as bench_ddp
from parlab.bench import pipeline as bench_pipeline
from parlab.bench import runtime as bench_runtime
from parlab.bench import zero as bench_zero
from parlab.ddp import sampler
from parlab.pipeline import executor, grid, schedule, stages
from parlab.pipeline.simulate import bubble_formula, bubble_fraction, bubble_ratio_playbook, idle_fraction, simulate
from parlab.runtime import mesh
from parlab.zero import checkpoint, fsdp, units
from parlab.zero import stages as zero_stages

pytestmark = pytest.mark.timeout(30)

LINEAR = nn.Linear(2, 2)
SCHEDULE = schedule.gpipe(1, 2)
CASES = {
    # --- pipeline ---------------------------------------------------------------------------
    "bubble_formula K = 0": (lambda: bubble_formula(0, 4), r"K \(the number of ranks\).*such as K = 2"),
    "bubble_formula M = 0": (lambda: bubble_formula(4, 0), r"M \(the number of micro-batches\).*M = 2"),
    "bubble_formula negative v": (lambda: bubble_formula(4, 8, -1), r"v \(the number of chunks.*v = 2"),
    "bubble_formula K = True": (lambda: bubble_formula(True, 4), r"got True: give K as a count"),
    "bubble_ratio_playbook M = 0": (lambda: bubble_ratio_playbook(4, 0), r"give M as a count"),
    "ZB-H1 names itself": (lambda: schedule.zero_bubble_h1(4, 2), r"^ZB-H1 needs .*raise M or use gpipe"),
    "make_schedule of a list": (lambda: schedule.make_schedule(["gpipe"], 2, 4), r"choose one of naive, gpipe"),
    "validate a list": (lambda: schedule.validate([["0F0"]]), r"build one with a generator"),
    "simulate nan t_f": (lambda: simulate(SCHEDULE, t_f=math.nan), r"t_f .*give t_f as a number"),
    "simulate infinite t_b": (lambda: simulate(SCHEDULE, t_b=math.inf), r"t_b .*finite.*give t_b"),
    "simulate text t_comm": (lambda: simulate(SCHEDULE, t_comm="1"), r"t_comm .*give t_comm as a number"),
    "bubble_fraction of a simulation": (lambda: bubble_fraction(simulate(SCHEDULE)),
                                        r"pass what cluster.trace\(...\) returns, or a Simulation's .timeline"),
    "idle_fraction of no time": (lambda: idle_fraction([0, 0], 0), r"give the ranks' compute spans durations"),
    "partition into True stages": (lambda: stages.partition(nn.Sequential(LINEAR, LINEAR), True),
                                   r"use between 1 and 2 stages"),
    "partition split not a list": (lambda: stages.partition(nn.Sequential(LINEAR, LINEAR), 2, split=2),
                                   r"list how many layers each stage takes"),
    "SleepLayer nan": (lambda: emulated.SleepLayer(math.nan, 0.1), r"forward_s .*give each in seconds"),
    "SleepLayer text": (lambda: emulated.SleepLayer(0.1, "0.1"), r"backward_s .*give each in seconds"),
    "SleepLayer in ms": (lambda: emulated.SleepLayer(20, 0.01), r"forward_s .*at most 10 .*20 ms is 20e-3"),
    "ComputeTime in ms": (lambda: emulated.ComputeTime(0.01, 50), r"backward_s .*at most 10 .*50 ms is 50e-3"),
    "executor without a schedule": (lambda: executor.PipelineExecutor("gpipe", {}, nn.functional.mse_loss),
                                    r"make_schedule\(name, K, M\)"),
    "executor with a list of stages": (lambda: executor.PipelineExecutor(SCHEDULE, [LINEAR], nn.functional.mse_loss),
                                       r"pass \{s: stages\[s\] for s in schedule.stages_of\(rank\)\}"),
    "executor loss not a function": (lambda: executor.PipelineExecutor(SCHEDULE, {0: LINEAR}, "mse"),
                                     r"pass e.g. torch.nn.functional.mse_loss"),
    "mesh dp = 0": (lambda: mesh.axis_groups("pp", dp=0, pp=2),
                    r"dp \(the number of data-parallel replicas\).*such as dp=2"),
    # --- collectives and the alpha-beta model ---------------------------------------------------
    "collective on a list": (lambda: collectives.ring_all_reduce([1.0, 2.0]), r"pass one, e.g. torch.tensor"),
    "ring_steps N = 2.5": (lambda: collectives.ring_steps(2.5), r"N \(the number of ranks\).*such as N = 4"),
    "ring_steps phase": (lambda: collectives.ring_steps(3, "all-reduce"), r"pass one of them \(None: both"),
    "ring_contributions step -1": (lambda: collectives.ring_contributions(3, -1), r"count the steps.*from 0 to"),
    "cost_model N = 2.5": (lambda: alpha_beta.cost_model("ring", 1e6, 2.5, 1e-5, 1e-9), r"such as N = 4"),
    "cost_model nan alpha": (lambda: alpha_beta.cost_model("ring", 1e6, 4, math.nan, 1e-9), r"alpha = 1e-5"),
    "cost_model negative D": (lambda: alpha_beta.cost_model("ring", -1, 4, 1e-5, 1e-9), r"D = 4 \* numel"),
    "cost_model text beta": (lambda: alpha_beta.cost_model("ring", 1, 4, 1e-5, "1e-9"), r"beta = 1e-9 for 1 GB/s"),
    "fit_alpha_beta lengths": (lambda: alpha_beta.fit_alpha_beta([1, 2, 3], [1e-5, 2e-5]),
                               r"pass their times in the same order"),
    "fit_alpha_beta nan time": (lambda: alpha_beta.fit_alpha_beta([1, 2], [1e-5, math.nan]),
                                r"needs measured times above zero"),
    # --- data parallelism ----------------------------------------------------------------------
    "assign_buckets '25'": (lambda: ddp.assign_buckets([12], "25"), r"pass a number of bytes, e.g. 25 \* MIB"),
    "assign_buckets nan": (lambda: ddp.assign_buckets([12], math.nan), r"math.inf one bucket for all"),
    "DDP bucket_cap_mb nan": (lambda: ddp.DDP(LINEAR, bucket_cap_mb=math.nan), r"a number of MiB such as 25"),
    "DDP bucket_cap_mb '25'": (lambda: ddp.DDP(LINEAR, bucket_cap_mb="25"), r"a number of MiB such as 25"),
    "DDP of a function": (lambda: ddp.DDP(lambda x: x), r"pass the model itself"),
    "DDP all_reduce called": (lambda: ddp.DDP(LINEAR, all_reduce=1), r"itself, not its result"),
    "sampler rank '0'": (lambda: sampler.DistributedSampler(10, 2, "0"), r"leave it out to use dist.get_rank"),
    "sampler num_replicas 0": (lambda: sampler.DistributedSampler(10, 0, 0), r"leave it out to use the world size"),
    "sampler length -1": (lambda: sampler.DistributedSampler(-1, 2, 0), r"pass the dataset .* or its number"),
    "sampler length 2.5": (lambda: sampler.DistributedSampler(2.5, 2, 0), r"pass the dataset .* or its number"),
    "sampler epoch 1.5": (lambda: sampler.DistributedSampler(10, 2, 0).set_epoch(1.5), r"count epochs from 0"),
    "threads_throughput 0 replicas": (lambda: processes_vs_threads.threads_throughput(0, 5), r"number of threads"),
    "make_model depth 0": (lambda: processes_vs_threads.make_model(depth=0), r"number of blocks, e.g. 48"),
    "train_replica 0 steps": (lambda: processes_vs_threads.train_replica(0), r"at least one training step"),
    # --- flat buffers, ZeRO, FSDP, memory ----------------------------------------------------
    "FlatLayout world_size '2'": (lambda: flat.FlatLayout([(2,)], "2"), r"e.g. dist.get_world_size\(\)"),
    "FlatLayout shapes": (lambda: flat.FlatLayout(["ab"], 2), r"pass \[p.shape for p in parameters\]"),
    "FlatLayout shard of rank 2": (lambda: flat.FlatLayout([(4,)], 2).shard(torch.zeros(4), 2),
                                   r"this layout has 2 shards, one per rank"),
    "ZeroDP of a function": (lambda: zero_stages.ZeroDP(lambda x: x, torch.optim.SGD), r"pass the model to shard"),
    "FSDP of an optimizer": (lambda: fsdp.FSDP(LINEAR, torch.optim.SGD(LINEAR.parameters(), lr=0.1)),
                             r"pass the class and its options \(lr=...\)"),
    "FSDP strategy list": (lambda: fsdp._shard_group_size(["FULL_SHARD"], 2, None), r"pick one \(FULL_SHARD"),
    "FSDP shard_group_size text": (lambda: fsdp._shard_group_size("HYBRID_SHARD", 4, "2"),
                                   r"give the number of ranks of one shard group"),
    "min_params(0)": (lambda: units.min_params(0), r"n >= 1 parameters .*min_params\(10_000\)"),
    "init_by_unit of a dict": (lambda: units.init_by_unit({"w": torch.zeros(2)}), r"pass the ordinary model"),
    "init_by_unit init_fn not a function": (lambda: units.init_by_unit(nn.Sequential(nn.Linear(2, 2)), init_fn="x"),
                                            r"pass the function itself, or None"),
    "init_by_unit seed 0.5": (lambda: units.init_by_unit(nn.Sequential(nn.Linear(2, 2)), seed=0.5),
                              r"init_seed.*the same on every rank"),
    "plan_units of a dict": (lambda: units.plan_units({"w": torch.zeros(2)}), r"pass the model whose parameters"),
    "checkpoint of a module": (lambda: checkpoint.full_state_dict(LINEAR), r"torch.save\(module.state_dict\(\)"),
    "model_state_bytes nan psi": (lambda: memory.model_state_bytes(math.nan, 1, 8), r"give the number of parameters"),
    "model_state_bytes text k": (lambda: memory.model_state_bytes(100, 1, 8, kappa="12"), r"optimizer-state bytes"),
    "model_state_bytes n_d nan": (lambda: memory.model_state_bytes(100, 1, math.nan), r"e.g. n_d=64"),
    "model_state_bytes stage True": (lambda: memory.model_state_bytes(100, True, 8), r"pick one of them"),
    "ring_traffic_bytes n_d 0": (lambda: memory.ring_traffic_bytes(100, 0, 4, 1), r"e.g. n_d=64"),
    "deepspeed nodes 1.5": (lambda: memory.deepspeed_zero2_estimate(100, nodes=1.5), r"number of machines"),
    "activations t 0": (lambda: memory.transformer_activation_bytes(8, 1, 16, 4, t=0), r"1 for none"),
    "activations t 3": (lambda: memory.transformer_activation_bytes(8, 1, 16, 4, t=3), r"pick a t that divides"),
    "fits nan device": (lambda: memory.fits(1e9, math.nan), r"e.g. 80 \* GB"),
    # --- pictures ----------------------------------------------------------------------------
    "plot_timeline of a list": (lambda: trace.plot_timeline([]), r"pass what cluster.trace\(...\) returns"),
    "plot_collective rows": (lambda: viz.plot_collective([[1], [2]], [[3]], "sum"), r"a row \(or None\) for every"),
    # --- benches, before anything starts -----------------------------------------------------
    "bench_collectives world size 0": (lambda: bench_collectives.bench_collectives([2, 0], [1024]),
                                       r"each of world_sizes .*got 0: a count of at least 1"),
    "bench_collectives device": (lambda: bench_collectives.bench_collectives([2], [1024], "gpu"),
                                 r"'cpu' or 'cuda'.*pick where"),
    "bench_ddp nan bucket": (lambda: bench_ddp.bench_ddp([2], bucket_cap_mb=math.nan), r"25 is torch's default"),
    "bench_ddp steps 0": (lambda: bench_ddp.bench_ddp([2], steps=0), r"steps .*a count of at least 1"),
    "bench_pipeline infinite sleep": (lambda: bench_pipeline.bench_pipeline([2], sleep_s=math.inf),
                                      r"sleep_s .*give a time in seconds"),
    "bench_zero no world sizes": (lambda: bench_zero.bench_zero([]), r"world_sizes is empty: give at least one"),
    "bench_runtime 1.5 repeats": (lambda: bench_runtime.bench_runtime(2, repeats=1.5), r"a count of at least 1"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_says_what_to_change(name):
    call, fix = CASES[name]
    with pytest.raises(ValueError, match=fix):
        call()


# --- on ranks: a root that is not a rank, a pipeline grid that does not fit ------------------


def bad_roots():
    messages = []
    for root in ("0", 2, 1.0):
        try:
            collectives.tree_broadcast(torch.zeros(2), root=root)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_a_root_that_is_not_a_rank_says_which_ranks_there_are(cluster2):
    for messages in cluster2.run(bad_roots, timeout=30):
        assert len(messages) == 3
        assert all("choose the rank that holds (or receives) the result, 0 to 1" in message for message in messages)


def grid_of_true_pipelines():
    try:
        grid.PipelineDataParallel(schedule.gpipe(2, 2), {dist.get_rank(): LINEAR}, nn.functional.mse_loss, True)
    except ValueError as error:
        return str(error)


def test_a_grid_degree_of_true_is_refused(cluster2):
    assert all("N_d (the number of pipelines) must be a whole number >= 1, got True" in message
               for message in cluster2.run(grid_of_true_pipelines))


@pytest.mark.parametrize("argv, complaint", [
    (["bench", "ddp", "--bucket-cap-mb", "nan"], "--bucket-cap-mb: expected a number above 0 such as 25"),
    (["bench", "ddp", "--bucket-cap-mb", "inf"], "--bucket-cap-mb: expected a number above 0 such as 25"),
    (["bench", "pipeline", "--sleep-ms", "-5"], "--sleep-ms: expected a number above 0 such as 25"),
    (["bench", "collectives", "--sizes", "1e400K"], "expected a size of at least 4 bytes such as 4096"),
])
def test_bad_bench_options_are_refused_with_the_usage(argv, complaint, capsys):
    from parlab import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err
