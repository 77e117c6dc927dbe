"""parlab.failures.resume and elastic: a run that loses a rank at step 6 and resumes from its
step 4 checkpoint ends where the uninterrupted run ends, with ZeRO stage 2 and with FSDP:
bit for bit on the same world size, within parlab.numerics' band on fewer ranks (the sharded
state resharded, into the layout a real engine on fewer ranks has); and under torchrun
--max-restarts 1, the restarted attempt resumes and ends in the same band."""

import json

import pytest
import torch
import torch.nn.functional as F

from parlab import train as launching
from parlab.failures.resume import build_model, global_batch, recovery_yardstick, reshard, train_with_failure
from parlab.numerics import assert_equivalent
from parlab.zero import FSDP
from parlab.zero.checkpoint import _layout, full_state_dict, load_sharded, save_sharded

STEPS, INTERVAL, FAIL_AT = 12, 4, 6


def check_recovery(recovery, resharded):
    assert recovery["checkpoint_step"] == 4 and recovery["steps_lost"] == 2
    assert "killed by SIGKILL" in recovery["failure"]
    n, n2 = recovery["world_sizes"]
    reference, never_stopped = recovery_yardstick(STEPS, STEPS, (n, n))
    assert_equivalent(recovery["uninterrupted"], reference, never_stopped, f"{n} ranks, uninterrupted")
    if not resharded:  # the same operations in the same order
        for name, tensor in recovery["uninterrupted"].items():
            assert torch.equal(recovery["resumed"][name], tensor), name
    _, decomposed = recovery_yardstick(STEPS, 4, (n, n2))
    assert_equivalent(recovery["resumed"], reference, decomposed, f"{n} ranks, then {n2} from step 4")
    # a resume that lost or repeated a step misses by a step's size
    _, wrong = recovery_yardstick(STEPS - 1, 4, (n, n2))
    with pytest.raises(AssertionError):
        assert_equivalent(wrong[0], reference, decomposed)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", ["zero2", "fsdp"])
def test_resume_on_the_same_ranks_is_bit_for_bit(cluster2, tmp_path, engine):
    check_recovery(train_with_failure(cluster2, STEPS, INTERVAL, FAIL_AT, str(tmp_path), timeout=30, engine=engine),
                   False)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("engine", ["zero2", "fsdp"])
def test_resume_on_fewer_ranks_4_to_2(cluster4, cluster2, tmp_path, engine):
    check_recovery(train_with_failure(cluster4, STEPS, INTERVAL, FAIL_AT, str(tmp_path), lost_rank=1,
                                      resume_on=cluster2, timeout=30, engine=engine), True)
    metadata = json.loads((tmp_path / "step4_on2" / "metadata.json").read_text())
    assert metadata["world_size"] == 2 and [layout["rank"] for layout in metadata["layouts"]] == [0, 1]
    assert {layout["engine"] for layout in metadata["layouts"]} == {{"zero2": "ZeroDP", "fsdp": "FSDP"}[engine]}


@pytest.mark.timeout(120)
def test_resume_on_fewer_ranks_8_to_4(cluster8, cluster4, tmp_path):
    check_recovery(train_with_failure(cluster8, STEPS, INTERVAL, FAIL_AT, str(tmp_path), resume_on=cluster4,
                                      timeout=60), True)


FSDP_ENGINES = {  # strategy (and units kept whole) -> engine around build_model()
    "FULL_SHARD": lambda: FSDP(build_model(), torch.optim.Adam, wrap_policy="per_layer"),
    "SHARD_GRAD_OP": lambda: FSDP(build_model(), torch.optim.Adam, strategy="SHARD_GRAD_OP", wrap_policy="per_layer"),
    "NO_SHARD": lambda: FSDP(build_model(), torch.optim.Adam, strategy="NO_SHARD", wrap_policy="per_layer"),
    "FULL_SHARD, biases whole": lambda: FSDP(build_model(), torch.optim.Adam, wrap_policy="per_layer",
                                             replicate=lambda name, p: p.ndim == 1),
}


def step_and_save(kind, directory):
    """One Adam step (so the optimizer has state), the sharded checkpoint, the full state."""
    engine = FSDP_ENGINES[kind]()
    x, y = (part.chunk(torch.distributed.get_world_size())[torch.distributed.get_rank()] for part in global_batch(0))
    F.mse_loss(engine(x), y).backward()
    engine.step()
    save_sharded(engine, directory)
    return full_state_dict(engine)


def load_resharded(kind, directory):
    """(this engine's layout, the layout reshard wrote for this rank, the full state loaded)."""
    engine = FSDP_ENGINES[kind]()
    written = torch.load(f"{directory}/rank{torch.distributed.get_rank()}.pt")["layout"]
    load_sharded(engine, directory)
    return _layout(engine), written, full_state_dict(engine)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(FSDP_ENGINES))
def test_reshard_fsdp_writes_the_layout_of_an_engine_on_fewer_ranks(cluster4, cluster2, tmp_path, kind):
    saved = cluster4.run(step_and_save, kind, str(tmp_path / "on4"), timeout=30)[0]
    reshard(str(tmp_path / "on4"), str(tmp_path / "on2"), 2)
    loaded = cluster2.run(load_resharded, kind, str(tmp_path / "on2"), timeout=30)
    for real, written, _ in loaded:
        assert written == real
    state = loaded[0][2]  # the same parameters and Adam moments, moved, not computed: bit for bit
    for name, tensor in saved["model"].items():
        assert torch.equal(state["model"][name], tensor), name
    for position, moments in saved["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(state["optimizer"]["state"][position][key], value), (position, key)
    metadata = json.loads((tmp_path / "on2" / "metadata.json").read_text())
    assert metadata["world_size"] == 2 and [layout["rank"] for layout in metadata["layouts"]] == [0, 1]


@pytest.mark.parametrize("layout", [{"engine": "FSDP", "strategy": "HYBRID_SHARD"}, {"engine": "ZeroDP", "stage": 3},
                                    {"engine": "DDP"}])
def test_reshard_refuses_what_it_cannot_cut(tmp_path, layout):
    (tmp_path / "metadata.json").write_text(json.dumps({"world_size": 1}))
    torch.save({"layout": layout}, tmp_path / "rank0.pt")
    with pytest.raises(ValueError, match="save_full"):
        reshard(str(tmp_path), str(tmp_path / "out"), 2)


@pytest.mark.skipif(launching.torchrun_path() is None, reason="torchrun is not on PATH")
@pytest.mark.timeout(150)
def test_torchrun_restarts_and_resumes_from_the_checkpoint(tmp_path):
    command = [launching.torchrun_path(), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               "--monitor-interval", "0.1", "-m", "parlab.failures.elastic", "--steps", str(STEPS), "--interval",
               str(INTERVAL), "--kill-rank", "1", "--kill-step", str(FAIL_AT), "--directory", "ckpt", "--out",
               "final.pt"]
    codes, outputs = launching.run_with_deadline([command], tmp_path, 120)
    assert codes == [0], outputs[0][-3000:]
    assert "rank 1 killed itself with SIGKILL at step 6" in outputs[0]
    final = torch.load(tmp_path / "final.pt")
    assert final["attempt"] == 1 and final["resumed_from"] == 4
    reference, decomposed = recovery_yardstick(STEPS, STEPS, (2, 2))
    assert_equivalent(final["parameters"], reference, decomposed, "torchrun, restarted once")
