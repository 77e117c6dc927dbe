"""An elastic restart under torchrun: a worker dies on the first attempt, torchrun starts the
job again, and the second attempt resumes from the last checkpoint.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m parlab.failures.elastic \\
        --steps 12 --interval 4 --kill-rank 1 --kill-step 6 --directory ckpt --out final.pt

torchrun's agent watches its workers; when one exits with an error (here: SIGKILL at step
``--kill-step``), it stops the others and, while restarts are left (``--max-restarts``),
starts every worker again with the next TORCHELASTIC_RESTART_COUNT (0 on the first attempt,
1 on the first restart; torch 2.13, ``torch/distributed/elastic/agent/server/api.py``). Each
attempt runs the same script: it reads the step of the last complete checkpoint (0: none) and
trains from there (``parlab.failures.resume.train``); only attempt 0 injects the failure. Rank
0 saves {"parameters", "attempt", "resumed_from"} to ``--out`` at the end.

Measured with torch 2.13 and ``--standalone``: the agent's key-value store outlives an attempt,
and a restarted worker that joins the default group by env:// can read the addresses the
dead attempt's workers left there ("Gloo connectFullMesh failed ... Connection refused"; one
restart in two failed so). ``join_attempt`` therefore joins through torch's env://
rendezvous with the attempt's own key prefix (``dist.PrefixStore``).
"""

import argparse
import os

import torch
import torch.distributed as dist

from parlab.failures.injection import Faults
from parlab.failures.resume import checkpoint_path, latest_checkpoint, train
from parlab.runtime.launch import launch, under_torchrun


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m parlab.failures.elastic", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4, help="I, steps between checkpoints")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=6)
    parser.add_argument("--directory", required=True, help="where checkpoints go (every rank must see it)")
    parser.add_argument("--out", required=True, help="rank 0 saves the final parameters here (torch.save)")
    args = parser.parse_args(argv)
    if not under_torchrun():
        raise ValueError("run this module under torchrun (torchrun --nproc-per-node 2 --max-restarts 1 -m "
                         "parlab.failures.elastic ...): the restart is torchrun's.")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    faults = Faults(kill={args.kill_rank: args.kill_step}) if attempt == 0 else None
    join_attempt(attempt)
    start = latest_checkpoint(args.directory)
    resume_from = checkpoint_path(args.directory, start) if start else None
    results = launch(train, 0, args.steps, args.interval, args.directory, start=start, resume_from=resume_from,
                     faults=faults)
    if int(os.environ["RANK"]) == 0:
        torch.save({"parameters": results[0], "attempt": attempt, "resumed_from": start}, args.out)
    dist.destroy_process_group()


def join_attempt(attempt):
    """Join the default gloo group of this attempt: env://'s store, its keys under "attempt{n}/"."""
    store, rank, world_size = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank,
                            world_size=world_size)


if __name__ == "__main__":
    main()
