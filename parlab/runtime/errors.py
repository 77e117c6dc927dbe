"""What the parent raises when ranks fail or hang: errors that name the ranks and show why."""


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
