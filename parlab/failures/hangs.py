"""Debugging a hang: a collective that not every rank calls, and three ways to find it.

A collective returns when every rank of its group has called it with matching arguments.
One rank calling ``all_reduce`` while another calls ``broadcast`` (or nothing: a rank that
skipped a step, left a loop early, took another branch) blocks both for good: gloo (and
NCCL) only give up at the group's timeout (30 minutes by default for gloo, ``timeout=`` of
``init_process_group`` and ``new_group``). Run on every rank:

    mismatched_collective()            rank 0 all_reduce, the others broadcast: hangs
    missing_collective()               rank 0 all_reduce, the others nothing: hangs
    mismatched_collective(fingerprinted_group())    raises at once, naming both collectives
    unmatched_in_flight_recorder()     each rank's flight recorder after a gloo timeout

1. The runtime's stacks. ``cluster.run(..., timeout=s)`` ends a hang in a ``RankTimeout``
   with each stuck rank's Python stack (faulthandler): the line of the learner's code that
   called the collective is in it, one frame below torch's ``all_reduce`` or ``broadcast``.
2. TORCH_DISTRIBUTED_DEBUG=DETAIL. A group made at the DETAIL debug level is wrapped in a
   ``ProcessGroupWrapper`` (torch 2.13, ``torch/distributed/distributed_c10d.py``,
   ``_new_process_group_helper``: for gloo, NCCL, XCCL and UCC), which before every
   collective all-gathers its "fingerprint" (sequence number, op type, tensor shapes,
   dtypes, devices) over a helper gloo group and raises on every rank when they differ:
   "Detected mismatch between collectives on ranks. Rank 0 is running collective:
   CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, ...), but Rank 1 is running
   collective: CollectiveFingerPrint(..., OpType=BROADCAST, ...)". It costs an extra
   collective per collective: a debugging tool. The environment variable is read when the
   process group is made; ``fingerprinted_group`` sets the level for one ``new_group``
   instead (``dist.set_debug_level``). It cannot catch a missing call: the helper's
   all-gather waits for the absent rank as the collective would.
3. The flight recorder. torch keeps, per process, a ring buffer of the last collectives each
   group ran (``TORCH_FR_BUFFER_SIZE`` entries, default 2000, on when > 0:
   ``torch/csrc/distributed/c10d/FlightRecorder.hpp``), gloo's included in torch 2.13
   (``ProcessGroupGloo.hpp``'s work carries a ``trace_id_`` into it; measured here: gloo's
   entries stay in state "scheduled", so the states say nothing on gloo, but each entry's
   ``collective_seq_id`` and op do). ``torch._C._distributed_c10d._dump_fr_trace()`` returns
   it pickled (``_dump_nccl_trace`` is the NCCL-only older name). Comparing the ranks' last
   sequence numbers shows who entered a collective the others never reached.
"""

import datetime
import pickle

import torch
import torch.distributed as dist

from parlab import p2p


def mismatched_collective(group=None):
    """Rank 0 all-reduces a tensor of 3 ones while the others broadcast one from rank 0:
    on a plain group this waits forever; on ``fingerprinted_group()`` every rank raises."""
    tensor = torch.ones(3)
    if dist.get_rank(group) == 0:
        dist.all_reduce(tensor, group=group)
    else:
        dist.broadcast(tensor, p2p.global_rank(group, 0), group=group)
    return tensor


def missing_collective(group=None):
    """Rank 0 all-reduces; the others return without calling it: rank 0 waits forever."""
    tensor = torch.ones(3)
    if dist.get_rank(group) == 0:
        dist.all_reduce(tensor, group=group)
    return tensor


def fingerprinted_group():
    """A new group of all ranks made at TORCH_DISTRIBUTED_DEBUG=DETAIL (the debug level is
    restored after): its collectives check their fingerprints first. Collective: call on
    every rank."""
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group(backend="gloo")
    finally:
        dist.set_debug_level(previous)


def unmatched_in_flight_recorder(timeout_s=2.0):
    """On a new group with a ``timeout_s`` timeout: every rank all-reduces once, then rank 0
    alone all-reduces again and gloo gives up after ``timeout_s``. Returns (this rank's
    error or None, its flight recorder entries for that group: ``flight_recorder(group)``).
    The lecture compares the ranks' last entries (``first_unmatched``)."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    tensor = torch.ones(3)
    dist.all_reduce(tensor, group=group)
    error = None
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(tensor, group=group)
        except RuntimeError as exc:  # gloo's "Timed out waiting 2000ms for recv operation to complete"
            error = str(exc).splitlines()[0]
    return error, flight_recorder(group)


def flight_recorder(group=None):
    """This process's flight recorder entries for ``group`` (None: all groups), oldest
    first, each {"seq": its collective_seq_id in the group, "op": e.g. "gloo:all_reduce",
    "sizes": the input tensors' shapes, "state", "group": the group's id}."""
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    wanted = None if group is None else group.group_name
    return [{"seq": entry["collective_seq_id"], "op": entry["profiling_name"], "sizes": entry["input_sizes"],
             "state": entry["state"], "group": entry["process_group"][0]}
            for entry in dump.get("entries", []) if wanted is None or entry["process_group"][0] == wanted]


def first_unmatched(entries_per_rank):
    """From each rank's flight recorder entries (rank order, one group): the first
    collective sequence number not every rank reached, as {"seq", "entered": {rank: op},
    "missing": [ranks]}; None when every rank reached the same ones."""
    reached = [{entry["seq"]: entry["op"] for entry in entries} for entries in entries_per_rank]
    for seq in sorted(set().union(*reached)):
        missing = [rank for rank, ops in enumerate(reached) if seq not in ops]
        if missing:
            entered = {rank: ops[seq] for rank, ops in enumerate(reached) if seq in ops}
            return {"seq": seq, "entered": entered, "missing": missing}
    return None
