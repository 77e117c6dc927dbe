"""An sbatch script for SLURM that runs a training module on many nodes (lecture 08): SLURM
gives the job its nodes, ``srun`` starts one ``torchrun`` on each, each torchrun starts one
process per GPU, and the processes find each other at the TCPStore that the first node's
torchrun opens (the env:// rendezvous, ``parlab.train``'s docstring).

    print(sbatch_script(nodes=2, gpus_per_node=4))   # or: python -m parlab.train --sbatch --nodes 2
    # save it as train.sbatch, then on the cluster's login node: sbatch train.sbatch

The script says, next to each line, what every environment variable means.
"""

import shlex

from parlab._checks import whole_number

EXAMPLES = {"module": "parlab.train", "job_name": "parlab-train", "time_limit": "00:30:00"}

TEMPLATE = """\
#!/bin/bash
# {nodes} node(s) x {gpus_per_node} GPU(s) = {world_size} processes running `python -m {module}`.
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --time={time_limit}
# One task per node: that task is torchrun, which starts the node's {gpus_per_node} processes itself.
# Submit it with sbatch from a shell where `python -m {module}` works: the job inherits that shell's
# environment (PATH, the virtual environment).
set -euo pipefail

# What SLURM sets:
#   SLURM_JOB_NODELIST  the job's nodes in SLURM's short form (node[07-08]); `scontrol show hostnames`
#                       writes them out, one a line, in the order SLURM numbers them.
#   SLURM_NNODES        how many nodes the job has: torchrun's --nnodes.
#   SLURM_NODEID        in each task that srun starts, the index of its node, 0 .. SLURM_NNODES - 1:
#                       torchrun's --node-rank (node 0 holds rank 0).
# What this script sets for every process:
#   MASTER_ADDR         the first node (it holds rank 0): its torchrun opens the TCPStore where the ranks meet.
#   MASTER_PORT         a TCP port that is free there. This script runs on the first node, so the port
#                       the operating system gives a socket bound to port 0 here is free there.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
# What torchrun sets for each process it starts, and init_process_group reads (init_method env://):
#   WORLD_SIZE          SLURM_NNODES x {gpus_per_node} processes in all.
#   RANK                node rank x {gpus_per_node} + LOCAL_RANK: unique in the job. The first node's torchrun
#                       (its agent, not a process it starts) opens the TCPStore at MASTER_ADDR:MASTER_PORT
#                       and sets TORCHELASTIC_USE_AGENT_STORE=True; every process, rank 0 included, connects
#                       to it and leaves its address there until all WORLD_SIZE have come; then nccl
#                       connects them directly.
#   LOCAL_RANK          the index on its node, 0 .. {last_local_rank}: the GPU it drives, cuda:LOCAL_RANK.
# The single quotes matter: $SLURM_NODEID must be read in each task on its own node, not here (where it is 0).
srun bash -c {command}
"""


def sbatch_script(nodes, gpus_per_node, module="parlab.train", arguments=(), job_name="parlab-train",
                  time_limit="00:30:00"):
    """The text of an sbatch script that runs ``python -m module *arguments`` on ``nodes``
    nodes with ``gpus_per_node`` processes (one per GPU) on each: ``srun`` runs one
    ``torchrun --nnodes $SLURM_NNODES --node-rank $SLURM_NODEID --nproc-per-node
    gpus_per_node`` per node, MASTER_ADDR is the first host of ``$SLURM_JOB_NODELIST`` and
    MASTER_PORT a free port there. ``time_limit`` is SLURM's (hours:minutes:seconds)."""
    nodes = whole_number("nodes", nodes, "a job runs on at least one node: give e.g. 2.")
    gpus_per_node = whole_number("gpus_per_node", gpus_per_node, "give the GPUs of each node, e.g. 4 (one process "
                                 "each).")
    for name, value in (("module", module), ("job_name", job_name), ("time_limit", time_limit)):
        if not isinstance(value, str) or not value or value != "".join(value.split()):
            raise ValueError(f"{name} must be a word without spaces, got {value!r}: e.g. {EXAMPLES[name]!r}.")
    if isinstance(arguments, str):
        raise ValueError(f"arguments must be a list of words, got the string {arguments!r}: pass e.g. "
                         "['--steps=3'] (shlex.split turns a command line into one).")
    # One command for bash -c; its backslash-newlines continue the line there.
    command = " \\\n    ".join([
        f'torchrun --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --nproc-per-node {gpus_per_node}',
        '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"',
        " ".join([f"-m {module}", *map(shlex.quote, map(str, arguments))]),
    ])
    return TEMPLATE.format(nodes=nodes, gpus_per_node=gpus_per_node, world_size=nodes * gpus_per_node,
                           module=module, job_name=job_name, time_limit=time_limit,
                           last_local_rank=gpus_per_node - 1, command=shlex.quote(command))
