"""Pipeline schedules as data: which rank runs which forward and backward, in which order.

A schedule is one list of actions per rank, in torch.distributed.pipelining's notation
``{stage}{F|B|W}{microbatch}``: ``1B3`` is the backward of stage 1 for micro-batch 3. The
generators below write the schedules of the lecture, ``validate`` checks any schedule
(complete, on the right ranks, free of deadlock), and the simulator, the executor and the
plots all read the same lists.

    naive(K)                     model parallelism: one micro-batch through K stages and back
    gpipe(K, M)                  all M forwards, then all M backwards
    one_f_one_b(K, M)            PipeDream-Flush: warm-up, one forward one backward, cool-down
    interleaved_1f1b(K, M, v)    Megatron: v model chunks per rank, bubble divided by v
    zero_bubble_h1(K, M)         1F1B with the backward split into B (input) and W (weights)

Symbols (notebooks/GLOSSARY.md): K ranks, M micro-batches, v stages (model chunks) per rank,
so K v stages in all (Narayanan et al. 2021 write p, m and v; GPipe writes K and M). Stage s
lives on rank s mod K (the "loop" placement of torch's interleaved schedules).

Dependencies (the communication semantics shared with the simulator and the executor):
F(s, m) needs F(s - 1, m) (stage 0 reads the input); B(s, m) needs F(s, m) and the gradient
of B(s + 1, m) (the last stage's loss is computed inside its F); W(s, m) needs B(s, m).
"""

import re
from dataclasses import dataclass, replace
from typing import NamedTuple

from parlab._checks import whole_number

KINDS = ("F", "B", "W")
_ACTION_TEXT = re.compile(r"(\d+)([FBW])(\d+)")


class Action(NamedTuple):
    """One unit of work: ``kind`` ("F" forward, "B" backward, "W" weight gradient) of global
    stage ``stage`` on micro-batch ``microbatch``. ``str(Action(1, "B", 3)) == "1B3"``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self):
        return f"{self.stage}{self.kind}{self.microbatch}"

    @staticmethod
    def parse(text):
        """``Action.parse("1B3") == Action(1, "B", 3)``; ValueError on anything else."""
        match = _ACTION_TEXT.fullmatch(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"cannot read {text!r} as an action: write {{stage}}{{F|B|W}}{{micro-batch}}, e.g. '1B3'.")
        return Action(int(match[1]), match[2], int(match[3]))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists: ``actions[r]`` is what rank r runs, in order. Actions may be
    given as ``Action`` or as text ("0F1"). Building a Schedule checks nothing; ``validate``
    does (the generators return validated schedules)."""

    name: str
    num_ranks: int  # K
    num_microbatches: int  # M
    stages_per_rank: int  # v
    actions: tuple

    def __post_init__(self):
        rows = tuple(tuple(a if isinstance(a, Action) else Action.parse(a) for a in row) for row in self.actions)
        object.__setattr__(self, "actions", rows)

    @property
    def num_stages(self):
        """K v: every rank's v chunks."""
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage):
        return stage % self.num_ranks

    def stages_of(self, rank):
        return list(range(rank, self.num_stages, self.num_ranks))

    @property
    def has_weight_actions(self):
        return any(a.kind == "W" for row in self.actions for a in row)

    def grid(self):
        """One line per rank, ``rank r: `` then its actions in execution order (not time:
        the simulator places them in time)."""
        width = max((len(str(a)) for row in self.actions for a in row), default=1)
        label = len(f"rank {len(self.actions) - 1}")
        return "\n".join(
            f"{f'rank {r}':<{label}}: " + " ".join(f"{str(a):<{width}}" for a in row).rstrip()
            for r, row in enumerate(self.actions)
        )

    def __str__(self):
        return self.grid()


def naive(K):
    """Model parallelism without micro-batching (M = 1): rank r runs F of stage r, waits for
    the gradient, runs B. Only one rank works at a time: bubble (K - 1) / K."""
    return replace(gpipe(K, 1), name="naive")


def gpipe(K, M):
    """GPipe (fill, then drain): rank r runs F(r, 0..M-1), then B(r, 0..M-1). The backwards
    go in micro-batch order 0..M-1, as torch's ScheduleGPipe runs them. Every rank holds
    the activations of all M micro-batches before its first backward."""
    check_sizes(K, M)
    rows = [[Action(r, "F", m) for m in range(M)] + [Action(r, "B", m) for m in range(M)] for r in range(K)]
    return validate(Schedule("gpipe", K, M, 1, rows))


def one_f_one_b(K, M):
    """1F1B (PipeDream-Flush; Narayanan et al. 2021, section 2.2.1): rank r runs K - r - 1
    warm-up forwards, then alternates one forward and one backward (F, B pairs) until its
    forwards are done, then the remaining K - r - 1 backwards (cool-down). Same bubble as
    GPipe, but rank r holds at most K - r micro-batches of activations instead of M. Needs
    M >= K."""
    _check_warmup("1F1B", K, M)
    rows = [_one_forward_one_backward([Action(r, "F", m) for m in range(M)], [Action(r, "B", m) for m in range(M)],
                                      K - r - 1) for r in range(K)]
    return validate(Schedule("1f1b", K, M, 1, rows))


def interleaved_1f1b(K, M, v):
    """Interleaved 1F1B (Megatron-LM, as torch's ScheduleInterleaved1F1B): each rank holds v
    stages (chunks) r, r + K, ..., and forwards micro-batches in rounds of K: micro-batches
    0..K-1 through its first chunk, the same K through its second chunk, ..., then the next
    K micro-batches. Backwards go through the chunks in reverse. Warm-up on rank r:
    (v - 1) K + 2 (K - r - 1) forwards, then F, B pairs, then the cool-down backwards.
    With chunk times t / v the bubble fraction is (K - 1) / (v M + K - 1). Needs M to be a
    multiple of K."""
    check_sizes(K, M, v)
    if M % K:
        raise ValueError(
            f"interleaved 1F1B sends micro-batches through the chunks in rounds of K, so M must be a multiple "
            f"of K; got M = {M}, K = {K}: use M = {K * (M // K + 1)}."
        )
    rows = []
    for r in range(K):
        forwards = [Action(_chunk(i, K, v) * K + r, "F", _round_microbatch(i, K, v)) for i in range(v * M)]
        backwards = [Action((v - 1 - _chunk(i, K, v)) * K + r, "B", _round_microbatch(i, K, v)) for i in range(v * M)]
        warmup = min((v - 1) * K + 2 * (K - r - 1), v * M)
        rows.append(_one_forward_one_backward(forwards, backwards, warmup))
    return validate(Schedule("interleaved_1f1b", K, M, v, rows))


def zero_bubble_h1(K, M):
    """ZB-H1 (Qi et al., zero-bubble pipeline parallelism; torch's ScheduleInterleavedZeroBubble
    with one stage per rank): 1F1B with each backward split into B (gradient of the input,
    on the critical path: the previous rank waits for it) and W (gradient of the weights,
    needed only by the optimizer). Rank r defers its W's by r backwards: W(m - r) follows
    B(m), the last r W's close the step, filling the cool-down idle time of the late ranks.
    The F/B order is that of 1F1B; a micro-batch's activations are held until its W, so rank r
    holds up to K - r + r = K micro-batches: every rank as many as 1F1B's rank 0, the peak of
    1F1B (the paper's "no more memory than 1F1B"). Each rank's idle time drops from
    (K - 1)(t_f + t_b + t_w) to (K - 1)(t_f + t_b - t_w) when t_w <= t_f and t_w <= t_b
    (Qi et al. 2023, section 2.1). Needs M >= K."""
    _check_warmup("ZB-H1", K, M)
    flush = one_f_one_b(K, M)
    rows = []
    for r, row in enumerate(flush.actions):
        split = []
        for action in row:
            split.append(action)
            if action.kind == "B" and action.microbatch >= r:
                split.append(Action(r, "W", action.microbatch - r))
        rows.append(split + [Action(r, "W", m) for m in range(M - r, M)])
    return validate(Schedule("zb_h1", K, M, 1, rows))


SCHEDULES = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zero_bubble_h1,
}


def make_schedule(name, K, M, v=1):
    """The schedule ``name`` (a key of ``SCHEDULES``) for K ranks and M micro-batches; v
    chunks per rank for "interleaved_1f1b" only. "naive" has no micro-batching: M = 1."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}.")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(K, M, v)
    if v != 1:
        raise ValueError(f"v (chunks per rank) applies only to interleaved_1f1b; {name} has one stage per rank: "
                         f"set v = 1.")
    if name == "naive":
        if M != 1:
            raise ValueError(f"naive pipelining runs the batch as one micro-batch: set M = 1 (got M = {M}).")
        return naive(K)
    return SCHEDULES[name](K, M)


def dependencies(schedule, action):
    """The actions whose results ``action`` consumes (module docstring)."""
    s, kind, m = action
    if kind == "F":
        return [Action(s - 1, "F", m)] if s > 0 else []
    if kind == "B":
        gradient = [Action(s + 1, "B", m)] if s < schedule.num_stages - 1 else []
        return [Action(s, "F", m)] + gradient
    return [Action(s, "B", m)]


def validate(schedule):
    """Check ``schedule`` and return it; raise ValueError naming the first problem found:
    sizes, the number of rank lists, actions out of range or on the wrong rank, every
    (stage, kind, micro-batch) exactly once (W for all or none), B after its F and W after
    its B on each rank, and freedom from deadlock (``dependency_order``)."""
    if not isinstance(schedule, Schedule):
        raise ValueError(f"validate checks a Schedule, got {type(schedule).__name__}: build one with a generator "
                         f"such as one_f_one_b(K, M), or Schedule(name, K, M, v, actions).")
    K, M, v = schedule.num_ranks, schedule.num_microbatches, schedule.stages_per_rank
    check_sizes(K, M, v)
    if len(schedule.actions) != K:
        raise ValueError(f"the schedule has {len(schedule.actions)} action lists for K = {K} ranks: give one per rank.")
    seen = set()
    for r, row in enumerate(schedule.actions):
        for action in row:
            if not (0 <= action.stage < schedule.num_stages and 0 <= action.microbatch < M):
                raise ValueError(f"rank {r} has {action}, outside stages 0..{schedule.num_stages - 1} and "
                                 f"micro-batches 0..{M - 1}.")
            if schedule.rank_of(action.stage) != r:
                raise ValueError(f"{action} is on rank {r}, but stage {action.stage} lives on rank "
                                 f"{schedule.rank_of(action.stage)} (stage mod K): move it there.")
            if action in seen:
                raise ValueError(f"{action} appears twice: each action runs exactly once.")
            seen.add(action)
    kinds = KINDS if schedule.has_weight_actions else KINDS[:2]
    missing = [Action(s, k, m) for s in range(schedule.num_stages) for k in kinds for m in range(M)
               if Action(s, k, m) not in seen]
    if missing:
        raise ValueError(f"missing actions {' '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}: "
                         f"every stage needs {', '.join(kinds)} for each of the M = {M} micro-batches.")
    for r, row in enumerate(schedule.actions):
        position = {action: i for i, action in enumerate(row)}
        for action in row:
            earlier = {"F": None, "B": "F", "W": "B"}[action.kind]
            needed = Action(action.stage, earlier, action.microbatch) if earlier else None
            if needed and position[needed] > position[action]:
                raise ValueError(f"rank {r} runs {action} before {needed}: a stage's {_KIND_NAMES[action.kind]} "
                                 f"needs its {_KIND_NAMES[earlier]} first.")
    dependency_order(schedule)
    return schedule


def dependency_order(schedule):
    """All actions in an order in which they can run: each rank follows its list, and an
    action runs once everything it depends on has run. Raises ValueError if the ranks get
    stuck (a deadlock), naming each stuck rank, its next action and what that waits for."""
    done, order = set(), []
    position = [0] * schedule.num_ranks
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(schedule.actions):
            while position[r] < len(row) and all(d in done for d in dependencies(schedule, row[position[r]])):
                done.add(row[position[r]])
                order.append(row[position[r]])
                position[r] += 1
                progress = True
    stuck = []
    for r, row in enumerate(schedule.actions):
        if position[r] < len(row):
            action = row[position[r]]
            waits = [f"{d} (rank {schedule.rank_of(d.stage)})" for d in dependencies(schedule, action) if d not in done]
            stuck.append(f"rank {r} waits at {action} for {', '.join(waits)}")
    if stuck:
        raise ValueError(f"the schedule deadlocks: {'; '.join(stuck)}. Reorder the actions so that every input is "
                         f"produced before it is needed.")
    return order


_KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}


def _one_forward_one_backward(forwards, backwards, warmup):
    """``warmup`` forwards, then (F, B) pairs while forwards remain, then the rest of the backwards."""
    steady = len(forwards) - warmup
    row = list(forwards[:warmup])
    for i in range(steady):
        row += [forwards[warmup + i], backwards[i]]
    return row + list(backwards[steady:])


def _chunk(i, K, v):
    """Which of a rank's v chunks its i-th forward uses: rounds of K micro-batches per chunk."""
    return (i // K) % v


def _round_microbatch(i, K, v):
    """The micro-batch of a rank's i-th forward: round i // (K v) covers micro-batches K round .. K round + K - 1."""
    return (i // (K * v)) * K + i % K


def check_sizes(K, M, v=1):
    """K ranks, M micro-batches and v chunks per rank must be whole numbers >= 1 (ValueError)."""
    for symbol, value, meaning in (("K", K, "ranks"), ("M", M, "micro-batches"), ("v", v, "chunks per rank")):
        whole_number(f"{symbol} (the number of {meaning})", value, f"give {symbol} as a count, such as {symbol} = 2.")


def _check_warmup(name, K, M):
    check_sizes(K, M)
    if M < K:
        raise ValueError(f"{name} needs at least as many micro-batches as ranks to fill its warm-up (M >= K); got "
                         f"M = {M} < K = {K}: raise M or use gpipe.")
