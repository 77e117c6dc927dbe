"""What the parent raises when ranks fail or hang: errors that name the ranks and show why."""

import re
import signal


class RankError(RuntimeError):
    """One or more ranks raised an exception (or died) while running a function.

    ``failures`` maps rank -> the remote traceback text (for a rank whose worker died: its
    last output and how it ended); ``dead`` lists those ranks; ``stuck`` maps rank -> the
    Python stack of each rank that was still running when the others failed (usually blocked
    in a collective that the failed rank never joined).

    The first line says what went wrong first: ``summary`` when given; else, when a rank
    received a message longer than its tensor, ``explain_size_mismatch``'s sentence; else the
    last line of a dead rank's failure (the others' are usually its consequence: lost
    connections), or of the lowest failed rank's.
    """

    def __init__(self, failures, stuck=None, summary=None, dead=()):
        self.failures = dict(sorted(failures.items()))
        self.stuck = dict(sorted((stuck or {}).items()))
        self.dead = sorted(dead)
        super().__init__(_describe(self.failures, self.stuck, summary or _heading(self.failures, self.dead)))

    @property
    def ranks(self):
        return list(self.failures)


class RankTimeout(TimeoutError):
    """Ranks were still running when the call's timeout ran out: a hang, or too short a timeout.

    ``stuck`` maps each rank still running -> its Python stack at the moment of the timeout.
    The timeout counts the ranks' own time: ``waited_for_a_cpu`` seconds spent waiting for a
    CPU that other programs held were added to it (``Cluster._collect``).
    Their workers are replaced and the others re-join, so the next ``run`` starts on a fresh
    process group. ``regime`` is the call's ``parlab.runtime.emulation.Regime``: when a stuck
    rank was sleeping in the emulation (its stack ends in the emulation's sleep), the message
    says so and what was declared, instead of blaming an unmatched send or collective.
    """

    def __init__(self, timeout, stuck, finished, regime=None, waited_for_a_cpu=0.0):
        self.timeout = timeout
        self.stuck = dict(sorted(stuck.items()))
        self.finished = sorted(finished)
        busy = f" (and {waited_for_a_cpu:.1f} s waiting for a CPU that other programs held)" * (waited_for_a_cpu >= 0.1)
        head = (
            f"{_ranks(self.stuck)} still running after {timeout:g} s{busy}"
            + (f" ({_ranks(self.finished)} finished)" if self.finished else "")
            + ". "
            + (_sleeping(self.stuck, regime) or "A send without a matching recv, or a collective that not every "
               "rank calls, waits forever; the stacks below show where each rank was. ")
            + "Their workers were replaced and the others re-joined a new process group: the next run starts "
            "fresh."
        )
        super().__init__(head + _stacks(self.stuck))

    @property
    def ranks(self):
        return list(self.stuck)


def emulated_sleeps(stuck):
    """rank -> "link" or "device" for each stuck rank whose stack (a faulthandler dump, most
    recent call first) ends in the emulation's sleep: waiting out a message's declared
    alpha + n beta (called from ``parlab.p2p``) or a declared compute (``emulation.compute``)."""
    found = {}
    for rank, stack in stuck.items():
        for match in _EMULATED_SLEEP.finditer(stack):
            found[rank] = "device" if match["caller"] == "compute" else "link"
    return found


def _sleeping(stuck, regime):
    """What the ranks sleeping in the emulation were doing, with what was declared, or None."""
    sleeping = emulated_sleeps(stuck)
    if not sleeping:
        return None
    network = getattr(regime, "network", None)
    devices = getattr(regime, "devices", None)
    declared = {
        "link": f"the emulated link (declared: {network.describe() if network is not None else 'no link'})",
        "device": "an emulated device's compute (declared by a SleepLayer, ComputeTime or emulation.compute, "
                  f"in seconds; {devices.describe() if devices is not None else 'devices not emulated'})",
    }
    parts = [
        f"{_ranks(ranks)} {'was' if len(ranks) == 1 else 'were'} sleeping in {declared[kind]}"
        for kind in ("link", "device")
        if (ranks := [rank for rank, where in sleeping.items() if where == kind])
    ]
    others = [rank for rank in stuck if rank not in sleeping]
    waiting = f"; {_ranks(others)} waited for them" if others else ""
    return (
        "In the emulation: " + "; ".join(parts) + waiting + ". It sleeps every declared time for real: check that "
        "times are in seconds (200 µs is 200e-6) and bandwidths in bytes per second, or give the call a longer "
        "timeout (run(..., timeout=s)). The stacks below show where each rank was. "
    )


def _ranks(ranks):
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _heading(failures, dead):
    """The first line of a RankError when no summary is given (see RankError)."""
    mismatch = explain_size_mismatch(failures)
    if mismatch:
        return f"{_ranks(failures)} failed: {mismatch}"
    lead = failures[dead[0]] if dead else next(iter(failures.values()))
    lines = lead.strip().splitlines()
    return f"{_ranks(failures)} failed: {lines[-1] if lines else 'no traceback'}"


def _describe(failures, stuck, head):
    if stuck:
        head += (
            f"\n{_ranks(stuck)} were still running (waiting for the failed ranks?) and were "
            "stopped; their workers, and those of ranks that died, were replaced"
        )
    body = "".join(f"\n\n--- rank {r} ---\n{tb.rstrip()}" for r, tb in failures.items())
    return head + body + _stacks(stuck)


def _stacks(stuck):
    return "".join(
        f"\n\n--- rank {r} (still running) ---\n{stack.rstrip() or '(no stack captured)'}"
        for r, stack in stuck.items()
    )


def worker_ended(rank, code, when=None):
    """How a worker ended, in one line: "rank 2's worker was killed by SIGKILL while idle
    (out of memory, or a kill -9?)". ``code`` is its exit status (negative: the signal; None: still
    running, though its connection closed); ``when`` says what it was doing."""
    if code is None:
        how, hint = "closed its connection", None
    elif code >= 0:
        how, hint = f"exited with code {code}", None
    else:
        how = f"was killed by {signal.Signals(-code).name}"
        # The kernel's out-of-memory killer ends a process with SIGKILL, as kill -9 and parlab.failures do.
        hint = "(out of memory, or a kill -9?)" if -code == signal.SIGKILL else None
    return " ".join(filter(None, [f"rank {rank}'s worker", how, when, hint]))


def readable_stack(text):
    """A faulthandler dump of a worker, keeping the threads that run user code, without the
    worker's own plumbing frames."""
    blocks = [block for block in text.strip().split("\n\n") if block]
    kept = [
        "\n".join(line for line in block.splitlines() if not _plumbing(line))
        for block in blocks
        if "in watch" not in block
    ]
    return "\n\n".join(kept)


def _plumbing(line):
    return "parlab/runtime/worker.py" in line or "<frozen runpy>" in line


def explain_size_mismatch(failures):
    """One sentence for a receive that gloo aborted because its message was longer than the
    tensor posted for it, or None when no rank failed that way. ``failures`` maps rank ->
    the text of its failure (``RankError.failures``): the aborted rank's output holds gloo's
    byte counts ("op.preamble.length <= op.nbytes. 24 vs 20") and, from faulthandler (see
    ``parlab.runtime.worker``), the line it was receiving at; the rank that sent the message,
    if it lived on, said what it sent in its ConnectionError.

    The contract with ``parlab.p2p``: that ConnectionError lists the last messages the rank
    sent as "to rank <d>, <n> <dtype> elements (<b> bytes)", separated by "; " (``_LAST_SENT``
    below reads them; ``p2p._connection_lost`` writes them)."""
    for rank, text in failures.items():
        gloo = _GLOO_SIZE_MISMATCH.search(text)
        if gloo is None:
            continue
        sent, expected = int(gloo["sent"]), int(gloo["expected"])
        where = _receiving_line(text)
        found = _sender(failures, rank, sent)
        if found is None:
            return f"rank {rank} received {sent} bytes into a tensor of {expected} bytes{where}: {_SIZE_HINT}"
        sender, numel, dtype = found
        size = sent // numel
        if expected % size:  # not a whole number of the sender's elements: another dtype
            wanted, numel = f"{expected} bytes", f"{numel} {dtype} elements ({sent} bytes)"
        else:
            wanted = f"{expected // size} {dtype} elements"
        return f"rank {rank} expected {wanted} from rank {sender}{where} but rank {sender} sent {numel}: {_SIZE_HINT}"
    return None


def _sender(failures, rank, nbytes):
    """(sender, elements, dtype) of a rank whose ConnectionError says it sent ``nbytes`` to ``rank``."""
    for sender, text in failures.items():
        for message in _LAST_SENT.finditer(text):
            if int(message["dst"]) == rank and int(message["nbytes"]) == nbytes and int(message["numel"]):
                return sender, int(message["numel"]), message["dtype"]
    return None


def _receiving_line(text):
    """Where the aborted rank was receiving, as " (in ring_reduce_scatter, line 59)": the
    caller of parlab.p2p in the faulthandler dump in its output (most recent call first);
    "" when its output holds no dump."""
    frames = list(_FRAME.finditer(text))
    for inner, outer in zip(frames, frames[1:]):
        if _P2P.search(inner["file"]) and not _P2P.search(outer["file"]):
            place = "" if outer["file"].startswith("<") else f"{outer['file'].rsplit('/', 1)[-1]} "
            return f" (in {outer['function']}, {place}line {outer['line']})"
    return ""


_SIZE_HINT = (
    "sender and receiver must agree on every message's size (for chunks, check how chunk "
    "sizes are computed for uneven lengths)"
)
_GLOO_SIZE_MISMATCH = re.compile(r"op\.preamble\.length <= op\.nbytes\. (?P<sent>\d+) vs (?P<expected>\d+)")
_LAST_SENT = re.compile(r"to rank (?P<dst>\d+), (?P<numel>\d+) (?P<dtype>\w+) elements \((?P<nbytes>\d+) bytes\)")
_P2P = re.compile(r"[/\\]parlab[/\\]p2p\.py$")  # not a learner's my_p2p.py
# The emulation's sleep on top of a thread's stack, and the frame that called it.
_EMULATED_SLEEP = re.compile(
    r'most recent call first\):\n\s*File "[^"]*[/\\]parlab[/\\]runtime[/\\]emulation\.py", line \d+ in sleep_until\n'
    r'\s*File "[^"]+", line \d+ in (?P<caller>\w+)'
)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\w+)')
