"""What the parent raises when ranks fail or hang: errors that name the ranks and show why."""

import signal


class RankError(RuntimeError):
    """One or more ranks raised an exception (or died) while running a function.

    ``failures`` maps rank -> the remote traceback text; ``stuck`` maps rank -> the Python
    stack of each rank that was still running when the others failed (usually blocked in a
    collective that the failed rank never joined). ``summary``, when given, is the first line
    instead of "rank r failed: <the last line of its traceback>".
    """

    def __init__(self, failures, stuck=None, summary=None):
        self.failures = dict(sorted(failures.items()))
        self.stuck = dict(sorted((stuck or {}).items()))
        super().__init__(_describe(self.failures, self.stuck, summary))

    @property
    def ranks(self):
        return list(self.failures)


class RankTimeout(TimeoutError):
    """Ranks were still running when the call's timeout ran out: a hang, or too short a timeout.

    ``stuck`` maps each rank still running -> its Python stack at the moment of the timeout.
    The workers are replaced, so the next ``run`` starts on a fresh process group.
    """

    def __init__(self, timeout, stuck, finished):
        self.timeout = timeout
        self.stuck = dict(sorted(stuck.items()))
        self.finished = sorted(finished)
        head = (
            f"{_ranks(self.stuck)} still running after {timeout:g} s"
            + (f" ({_ranks(self.finished)} finished)" if self.finished else "")
            + ". A send without a matching recv, or a collective that not every rank calls, "
            "waits forever; the stacks below show where each rank was. "
            "The workers were replaced: the next run starts fresh."
        )
        super().__init__(head + _stacks(self.stuck))

    @property
    def ranks(self):
        return list(self.stuck)


def _ranks(ranks):
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _describe(failures, stuck, summary=None):
    first = next(iter(failures.values())).strip().splitlines()
    head = summary or f"{_ranks(failures)} failed: {first[-1] if first else 'no traceback'}"
    if stuck:
        head += (
            f"\n{_ranks(stuck)} were still running (waiting for the failed ranks?) and were "
            "stopped; the workers were replaced"
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
    (out of memory?)". ``code`` is its exit status (negative: the signal; None: still
    running, though its connection closed); ``when`` says what it was doing."""
    if code is None:
        how, hint = "closed its connection", None
    elif code >= 0:
        how, hint = f"exited with code {code}", None
    else:
        how = f"was killed by {signal.Signals(-code).name}"
        # The kernel's out-of-memory killer ends a process with SIGKILL.
        hint = "(out of memory?)" if -code == signal.SIGKILL else None
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
