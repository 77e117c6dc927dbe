"""parlab.failures.resume and elastic: a run that loses a rank at step 6 and resumes from its
step 4 checkpoint ends where the uninterrupted run ends: bit for bit on the same world size,
within parlab.numerics' band on fewer ranks (the sharded state resharded); and under torchrun
--max-restarts 1, the restarted attempt resumes and ends in the same band."""

import json

import pytest
import torch

from parlab import train as launching
from parlab.failures.resume import recovery_yardstick, reshard, train_with_failure
from parlab.numerics import assert_equivalent

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
def test_resume_on_the_same_ranks_is_bit_for_bit(cluster2, tmp_path):
    check_recovery(train_with_failure(cluster2, STEPS, INTERVAL, FAIL_AT, str(tmp_path), timeout=30), False)


@pytest.mark.timeout(90)
def test_resume_on_fewer_ranks_4_to_2(cluster4, cluster2, tmp_path):
    check_recovery(train_with_failure(cluster4, STEPS, INTERVAL, FAIL_AT, str(tmp_path), lost_rank=1,
                                      resume_on=cluster2, timeout=30), True)
    metadata = json.loads((tmp_path / "step4_on2" / "metadata.json").read_text())
    assert metadata["world_size"] == 2 and [layout["rank"] for layout in metadata["layouts"]] == [0, 1]


@pytest.mark.timeout(120)
def test_resume_on_fewer_ranks_8_to_4(cluster8, cluster4, tmp_path):
    check_recovery(train_with_failure(cluster8, STEPS, INTERVAL, FAIL_AT, str(tmp_path), resume_on=cluster4,
                                      timeout=60), True)


def test_reshard_refuses_what_it_cannot_cut(tmp_path):
    (tmp_path / "metadata.json").write_text(json.dumps({"world_size": 1}))
    torch.save({"layout": {"engine": "FSDP"}}, tmp_path / "rank0.pt")
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
