"""One training script, launched four ways (lecture 08): a tiny ``parlab.gpt`` GPT trained with
parlab's DDP for a few SGD steps on a deterministic stream of batches from the shipped text.

    python -m parlab.train --out one.json                       one process: the reference
    python -m parlab.train --world-size 2 --out cluster.json    a parlab.Cluster of 2 ranks
    torchrun --standalone --nproc-per-node 2 -m parlab.train --out torchrun.json
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 127.0.0.1 --master-port 29500 \\
        -m parlab.train --out nodes.json                        (and --node-rank 1 in a second shell)
    python -m parlab.train --sbatch --nodes 2 --gpus-per-node 4 > train.sbatch   (parlab.slurm)

Every way runs the same function, ``train``, on every rank of a default process group, and
rank 0 prints (and with ``--out`` writes as JSON) the loss of the last step and a checksum of
the weights. With the global batch B fixed, every world size N_d that divides it computes the
gradient of the same mean loss, so all ways end with the same weights up to the rounding of
summing the ranks' gradients in another order (``parlab.numerics``); ``--weights`` saves
them for that comparison.

``parlab.launch`` runs it. With ``--world-size N`` (N > 1) and no torchrun it starts a Cluster
of N ranks. Under torchrun it joins torch's group instead (``parlab.runtime.launch``), and a
plain process sets what torchrun would set for a job of one (``a_job_of_one``) and
joins the same way: ``init_process_group(backend)`` with the default ``init_method="env://"``
reads what torchrun sets for each process it starts:

    RANK          this process's rank among all, 0 .. WORLD_SIZE - 1
    WORLD_SIZE    the number of processes of the job, nodes x processes per node
    LOCAL_RANK    its index on its own node: the GPU it drives (cuda:LOCAL_RANK with nccl)
    MASTER_ADDR   the first node's host, MASTER_PORT the port of the store there

The rendezvous: a TCPStore (a small key-value server) listens at MASTER_ADDR:MASTER_PORT, the
ranks leave their addresses there until all WORLD_SIZE have arrived, then gloo (CPU) or
nccl (GPU) opens its own connections between the ranks and the store only coordinates. Who
opens the store: under torchrun, the agent of the first node (torchrun itself, not a worker)
hosts it and tells its workers TORCHELASTIC_USE_AGENT_STORE=True, so every worker, rank 0
included, connects as a client (torch 2.13, ``torch/distributed/rendezvous.py``,
``_create_c10d_store``); without torchrun (``a_job_of_one``, or a script given the variables by
hand) rank 0 opens it and the others connect.

``torchrun_path`` finds torchrun and ``run_with_deadline`` runs launches side by side, killing
what still runs at a deadline with its children: tests and graders launch with them.
"""

import argparse
import functools
import hashlib
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parlab import runtime, slurm
from parlab._checks import real_number, whole_number
from parlab.ddp import DDP, DistributedSampler
from parlab.gpt import GPT, CharDataset, GPTConfig
from parlab.runtime.launch import under_torchrun

# A GPT small enough that a few steps take well under a second on one CPU core.
SEQUENCE, HIDDEN, HEADS, LAYERS = 16, 32, 2, 1


@functools.cache
def dataset():
    """The shipped text as characters (``parlab.gpt.CharDataset``), read once per process."""
    return CharDataset()


def build_model(seed=0):
    """The model every rank builds: the same GPT (V from the shipped text) from ``seed``."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(V=dataset().V, s=SEQUENCE, h=HIDDEN, a=HEADS, L=LAYERS))


def full_batch(step, batch, seed=0):
    """Step ``step``'s global batch: ``batch`` sequences (B, s) and their targets, the same on
    every rank and in every run (drawn from a generator seeded with seed + step)."""
    generator = torch.Generator().manual_seed(seed + step)
    return dataset().batch(batch, SEQUENCE, generator)


def train(steps=3, batch=8, lr=0.5, seed=0):
    """Train on the default process group (N_d ranks); run on every rank.

    Each step, rank r takes its B / N_d sequences of the global batch (``DistributedSampler``
    without shuffling: r, r + N_d, ...), computes the mean loss on them, and DDP averages the
    gradients: the gradient of the mean loss over all B sequences. The replicas start from
    rank 0's weights. Returns ``{"world_size", "losses", "checksum", "weights"}``: the
    global batch's mean loss at each step (averaged over the ranks), the checksum of the
    final weights and the weights themselves (on the CPU)."""
    steps = whole_number("steps", steps, "train for at least one step, e.g. 3.")
    batch = whole_number("batch (B, the global batch in sequences)", batch, "give e.g. 8.")
    real_number("lr (the learning rate)", lr, "give a step size such as 0.5.", above=True)
    world_size = dist.get_world_size()
    if batch % world_size:
        raise ValueError(f"the global batch B = {batch} does not split into {world_size} equal shards: choose B a "
                         f"multiple of the world size (e.g. {world_size * max(1, batch // world_size)}), or the "
                         "ranks' mean losses would not average to the full batch's.")
    model = build_model(seed).to(runtime.device())
    ddp = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    shard = list(DistributedSampler(batch, shuffle=False))
    losses = []
    for step in range(steps):
        tokens, targets = (t[shard].to(runtime.device()) for t in full_batch(step, batch, seed))
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(tokens).flatten(0, 1), targets.flatten())  # (B/N_d s, V) logits
        loss.backward()
        ddp.finish_gradient_synchronization()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # equal shards: the mean of the ranks' means is the batch's mean
        losses.append(mean_loss.item() / world_size)
    weights = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return {"world_size": world_size, "losses": losses, "checksum": checksum(weights), "weights": weights}


def one_process(steps=3, batch=8, lr=0.5, seed=0, world_size=1, order=None):
    """``train``'s SGD in one process, the reference its launched runs are checked against:
    (weights, losses). ``world_size`` 1: the gradient of the full batch. Otherwise the ranks'
    arithmetic (``parlab.numerics``' yardstick runs): each rank's shard (``DistributedSampler``'s
    r, r + N_d, ...), their gradients summed in ``order`` and divided by ``world_size``, and the
    losses likewise."""
    from parlab.numerics import backward_in_shards

    model = build_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens, targets = full_batch(step, batch, seed)
        shards = [(tokens[r::world_size], targets[r::world_size]) for r in range(world_size)]
        backward_in_shards(model.loss, model.parameters(), shards, order)
        with torch.no_grad():
            losses.append(sum(model.loss(*shards[r]) for r in order or [0]) / world_size)
        optimizer.step()
    return dict(model.state_dict()), torch.tensor(losses)


def checksum(weights):
    """The first 16 hex digits of the SHA-256 of the weights' names and bytes, in the state
    dict's order: the same for weights equal bit for bit, another for a change in any bit.
    Runs that differ only in rounding (another summation order, other kernels) differ here:
    compare their weights with ``parlab.numerics`` instead."""
    digest = hashlib.sha256()
    for name, tensor in weights.items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@contextmanager
def a_job_of_one():
    """Within: what torchrun would set for a job of one process (rank 0 of 1, the store on a
    free port of this machine, opened by rank 0 itself: no agent hosts it), so that a plain
    process joins its group by the env:// rendezvous as torchrun's processes do, in this very
    process. The environment is restored after (a notebook that calls ``main`` stays outside
    torchrun)."""
    job = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    saved = {name: os.environ.get(name) for name in job}
    os.environ.update(job)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def free_port():
    """A TCP port of this machine that is free now: the one the operating system gives a
    socket bound to port 0 (another program may take it before it is used; rarely)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_path():
    """The torchrun program: the one beside this Python first (a virtual environment's, which
    launches this torch), else the first on PATH; None when there is none."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("torchrun", path=search)


def run_with_deadline(commands, directory, deadline):
    """Run ``commands`` (lists of words) at the same time in ``directory``, each writing its
    stdout and stderr to ``command<i>.log`` there, until all have exited, one has failed (the
    others may wait for it forever) or ``deadline`` seconds have passed. Every process still
    running then is killed, children included. Returns (exit codes, None for a process that
    was killed; outputs)."""
    logs = [Path(directory) / f"command{i}.log" for i in range(len(commands))]
    processes = []
    for command, log in zip(commands, logs):
        with open(log, "w") as output:
            processes.append(subprocess.Popen(command, cwd=directory, stdout=output, stderr=subprocess.STDOUT,
                                              start_new_session=True))
    end = time.monotonic() + deadline
    try:
        while any(p.poll() is None for p in processes) and time.monotonic() < end:
            if any(p.poll() not in (None, 0) for p in processes):
                break
            time.sleep(0.1)
        codes = [p.poll() for p in processes]
    finally:
        for process in processes:
            for pid in [*_descendants(process.pid), process.pid] if process.poll() is None else []:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
    return codes, [log.read_text() for log in logs]


def _descendants(pid):
    """The processes below ``pid``, read from /proc (none where there is no /proc): torchrun
    starts its workers in sessions of their own, so killing its process group misses them."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(prog="python -m parlab.train", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="B, the global batch in sequences")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1, help="ranks of the Cluster when not under torchrun")
    parser.add_argument("--out", help="write rank 0's result (losses, checksum) to this JSON file")
    parser.add_argument("--weights", help="save rank 0's final weights to this file (torch.save)")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                        help="auto: nccl with a GPU per process, else gloo")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds, for the Cluster way")
    sbatch = parser.add_argument_group("SLURM", "print an sbatch script that runs this training (parlab.slurm)")
    sbatch.add_argument("--sbatch", action="store_true")
    sbatch.add_argument("--nodes", type=int, default=2)
    sbatch.add_argument("--gpus-per-node", type=int, default=4)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_arguments(argv)
    options = dict(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
    if args.sbatch:
        arguments = [f"--{name}={value}" for name, value in options.items()]
        script = slurm.sbatch_script(args.nodes, args.gpus_per_node, arguments=arguments)
        if args.batch % (args.nodes * args.gpus_per_node):
            raise ValueError(f"--batch {args.batch} does not split over {args.nodes} x {args.gpus_per_node} "
                             "processes: give a global batch that is a multiple of nodes x GPUs per node.")
        print(script, end="")
        return
    whole_number("--world-size", args.world_size, "give the number of ranks of the Cluster, e.g. 2 (under torchrun, "
                 "torchrun's --nproc-per-node and --nnodes decide).")
    if under_torchrun() or args.world_size > 1:
        # The module's own train, not __main__'s: the Cluster's ranks import it by name.
        results = runtime.launch(importlib.import_module("parlab.train").train, args.world_size, backend=args.backend,
                                 timeout=args.timeout, **options)
    else:
        with a_job_of_one():
            results = runtime.launch(train, 1, backend=args.backend, **options)
    if int(os.environ.get("RANK", 0)) != 0:
        return
    result = results[0]
    summary = {key: result[key] for key in ("world_size", "losses", "checksum")}
    print(f"world size {result['world_size']}: loss {result['losses'][-1]:.6f} after {args.steps} steps, "
          f"weights {result['checksum']}")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(summary, file, indent=1)
    if args.weights:
        torch.save(result["weights"], args.weights)


if __name__ == "__main__":
    main()
