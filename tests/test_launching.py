"""parlab.train launched for real: by torchrun on one machine (2 processes, gloo), by two
torchrun "nodes" on localhost, in a parlab.Cluster and as one plain process (this one), each
equal to one process trained on the full batch (within parlab.numerics' band: the ranks sum
their shards' gradients in another order); and parlab.slurm's sbatch script, parsed by bash
and run with stand-ins for srun, scontrol and torchrun. Every subprocess has a deadline and
is killed, with its children, if it misses it or fails."""

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parlab import slurm, train
from parlab.numerics import assert_equivalent, ring_orders
from parlab.runtime import RankError

STEPS, BATCH, LR = 2, 8, 0.5
OPTIONS = ["--steps", str(STEPS), "--batch", str(BATCH), "--lr", str(LR), "--backend", "gloo"]
# torchrun beside this interpreter first (the venv's), then wherever PATH finds it.
SEARCH_PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
TORCHRUN = train.torchrun_path()
needs_torchrun = pytest.mark.skipif(TORCHRUN is None, reason="torchrun is not on PATH")
DEADLINE = 120  # seconds for a launch; a hang fails the test instead of the session


@functools.cache
def one_process(world_size=1, order=None):
    """(weights, losses) of parlab.train.one_process: the reference (world_size 1) or one of
    the yardstick's runs (the ranks' shards summed in ``order``)."""
    return train.one_process(STEPS, BATCH, LR, world_size=world_size, order=order)


def assert_like_one_process(weights, losses, world_size, label):
    """Weights and losses equal the full-batch reference's within the rounding band of
    world_size ranks (for one rank: only the floor, the kernels may round differently)."""
    decomposed = [one_process(world_size, tuple(order)) for order in ring_orders(world_size)] if world_size > 1 else []
    reference = one_process()
    assert_equivalent(weights, reference[0], [d[0] for d in decomposed], f"{label}: weights")
    assert_equivalent(torch.tensor(losses), reference[1], [d[1] for d in decomposed], f"{label}: losses")


def run_together(commands, directory, deadline=DEADLINE):
    """Run ``commands`` at the same time in ``directory`` (``parlab.train.run_with_deadline``);
    return their outputs once all have exited 0. A command that fails or is still running at
    the deadline fails the test, every process started having been killed, children included."""
    codes, outputs = train.run_with_deadline(commands, directory, deadline)
    if codes != [0] * len(commands):
        report = "\n".join(f"$ {' '.join(c)}\n(exit {code})\n{out[-3000:]}" for c, code, out in
                           zip(commands, codes, outputs))
        pytest.fail(f"exit codes {codes} (None: still running after {deadline} s, killed)\n{report}")
    return outputs


def running(pid):
    """Whether ``pid`` still runs (a killed process no one has reaped yet, a zombie, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_launch_past_its_deadline_is_killed_with_its_children(tmp_path):
    # The child in a session of its own, as torchrun starts its workers.
    command = ["bash", "-c", "setsid sleep 300 & echo $! > child; sleep 300"]
    with pytest.raises(pytest.fail.Exception, match="still running after 2 s, killed"):
        run_together([command], tmp_path, deadline=2)
    child = int((tmp_path / "child").read_text())
    end = time.monotonic() + 10
    while running(child) and time.monotonic() < end:
        time.sleep(0.1)
    assert not running(child)


def written_result(directory, name):
    summary = json.loads((directory / f"{name}.json").read_text())
    weights = torch.load(directory / f"{name}.pt")
    assert summary["checksum"] == train.checksum(weights)
    return summary, weights


@needs_torchrun
@pytest.mark.timeout(DEADLINE + 30)
def test_torchrun_on_one_machine_trains_like_one_process(tmp_path):
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "parlab.train", *OPTIONS,
               "--out", "run.json", "--weights", "run.pt"]
    (output,) = run_together([command], tmp_path)
    summary, weights = written_result(tmp_path, "run")
    assert summary["world_size"] == 2 and f"weights {summary['checksum']}" in output
    assert_like_one_process(weights, summary["losses"], 2, "torchrun --standalone --nproc-per-node 2")


@needs_torchrun
@pytest.mark.timeout(DEADLINE + 30)
def test_two_torchrun_nodes_on_localhost_train_like_one_process(tmp_path):
    port = str(train.free_port())
    commands = [[TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                 "--master-addr", "127.0.0.1", "--master-port", port, "-m", "parlab.train", *OPTIONS,
                 "--out", "run.json", "--weights", "run.pt"] for node in (0, 1)]
    run_together(commands, tmp_path)  # both in one directory: only rank 0 (on node 0) writes
    summary, weights = written_result(tmp_path, "run")
    assert summary["world_size"] == 2
    assert_like_one_process(weights, summary["losses"], 2, "two torchrun nodes")


@pytest.mark.timeout(DEADLINE + 30)
def test_the_command_line_cluster_trains_like_one_process(tmp_path):
    # As __main__, the script must ship parlab.train's function (its ranks import it by name).
    run_together([[sys.executable, "-m", "parlab.train", "--world-size", "2", *OPTIONS, "--out", "run.json",
                   "--weights", "run.pt"]], tmp_path)
    summary, weights = written_result(tmp_path, "run")
    assert summary["world_size"] == 2
    assert_like_one_process(weights, summary["losses"], 2, "python -m parlab.train --world-size 2")


@pytest.mark.timeout(60)
def test_a_plain_process_is_the_reference_and_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    """``python -m parlab.train`` without torchrun: main, in this process (as from a notebook)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    train.main([*OPTIONS, "--out", "run.json", "--weights", "run.pt"])
    summary, weights = written_result(tmp_path, "run")
    assert summary["world_size"] == 1
    assert summary["losses"] == one_process()[1].tolist()  # the same operations in the same process
    assert_like_one_process(weights, summary["losses"], 1, "python -m parlab.train")
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)  # parlab.launch would think it is under torchrun


@pytest.mark.timeout(90)
def test_the_cluster_way_trains_like_one_process(cluster2):
    results = cluster2.run(train.train, steps=STEPS, batch=BATCH, lr=LR)
    # DDP gives every rank the same averaged gradient: the replicas are equal bit for bit.
    assert results[0]["checksum"] == results[1]["checksum"] == train.checksum(results[1]["weights"])
    assert results[0]["losses"] == results[1]["losses"]
    assert_like_one_process(results[0]["weights"], results[0]["losses"], 2, "parlab.Cluster(2)")
    with pytest.raises(RankError, match="does not split into 2 equal shards"):
        cluster2.run(train.train, batch=7)


def test_the_sbatch_script_parses_and_says_how_to_launch(tmp_path):
    text = slurm.sbatch_script(nodes=2, gpus_per_node=4, arguments=["--steps=3", "a b"])
    script = tmp_path / "train.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --nodes=2\n" in text and "#SBATCH --gpus-per-node=4\n" in text
    assert "#SBATCH --ntasks-per-node=1\n" in text  # one torchrun per node
    assert 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)\n' in text
    assert "srun bash -c 'torchrun --nnodes \"$SLURM_NNODES\" --node-rank \"$SLURM_NODEID\" --nproc-per-node 4" in text
    for variable in ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NODEID", "MASTER_ADDR", "MASTER_PORT",
                     "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        assert f"#   {variable} " in text, f"no comment line says what {variable} means"


def test_the_sbatch_script_runs_one_torchrun_per_node(tmp_path):
    """With stand-ins: scontrol lists two hosts, srun runs its command once per node with
    SLURM_NODEID set (as SLURM does), torchrun prints what it was given. Each node's torchrun
    gets its own --node-rank, the first host as MASTER_ADDR and one free port."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    programs = {
        "scontrol": 'printf "node07\\nnode08\\n"',
        "srun": 'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@"; done',
        "torchrun": 'printf "%s|" "$MASTER_ADDR" "$MASTER_PORT" "$@"; echo',  # | between its words
    }
    for name, body in programs.items():
        (stand_ins / name).write_text(f"#!/bin/bash\n{body}\n")
        (stand_ins / name).chmod(0o755)
    script = tmp_path / "train.sbatch"
    script.write_text(slurm.sbatch_script(nodes=2, gpus_per_node=3, arguments=["--steps=3", "a b"]))
    environment = dict(os.environ, PATH=os.pathsep.join([str(stand_ins), SEARCH_PATH]),
                       SLURM_JOB_NODELIST="node[07-08]", SLURM_NNODES="2")
    lines = subprocess.run(["bash", str(script)], env=environment, capture_output=True, text=True, timeout=60,
                           check=True).stdout.splitlines()
    assert len(lines) == 2
    ports = set()
    for node, line in enumerate(lines):
        address, port, *arguments = line.split("|")
        assert address == "node07" and port.isdigit()
        ports.add(port)
        assert arguments == ["--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "3", "--master-addr",
                             "node07", "--master-port", port, "-m", "parlab.train", "--steps=3", "a b", ""]
    assert len(ports) == 1


def test_learner_mistakes_are_refused_with_a_sentence():
    with pytest.raises(ValueError, match="at least one node"):
        slurm.sbatch_script(nodes=0, gpus_per_node=4)
    with pytest.raises(ValueError, match="gpus_per_node"):
        slurm.sbatch_script(nodes=2, gpus_per_node=True)
    with pytest.raises(ValueError, match="list of words"):
        slurm.sbatch_script(nodes=2, gpus_per_node=4, arguments="--steps 3")
    with pytest.raises(ValueError, match="job_name must be a word without spaces"):
        slurm.sbatch_script(nodes=2, gpus_per_node=4, job_name="my job")
    with pytest.raises(ValueError, match="--world-size must be a whole number >= 1"):
        train.main(["--world-size", "0"])
    with pytest.raises(ValueError, match="multiple of nodes x GPUs per node"):
        train.main(["--sbatch", "--nodes", "2", "--gpus-per-node", "3", "--batch", "8"])
