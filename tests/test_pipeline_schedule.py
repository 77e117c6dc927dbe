"""Pipeline schedules as data: the notation, the canonical orders written out by hand, the
same orders as torch.distributed.pipelining's own schedules, and the validator's errors."""

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from parlab.pipeline import (
    SCHEDULES,
    Action,
    Schedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    naive,
    one_f_one_b,
    validate,
    zero_bubble_h1,
)

pytestmark = pytest.mark.timeout(30)


# --- the notation ------------------------------------------------------------------------------


def test_action_prints_and_parses_in_torch_notation():
    assert str(Action(1, "B", 3)) == "1B3"
    assert Action.parse("1B3") == Action(1, "B", 3)
    assert Action.parse(" 12W10 ") == Action(12, "W", 10)
    for text in ("1X3", "B3", "1B", "1B3x", "", 13):
        with pytest.raises(ValueError, match="cannot read .* as an action"):
            Action.parse(text)


def test_schedule_places_stage_s_on_rank_s_mod_K_and_reads_text_actions():
    s = interleaved_1f1b(2, 4, 3)
    assert (s.num_ranks, s.num_microbatches, s.stages_per_rank, s.num_stages) == (2, 4, 3, 6)
    assert [s.rank_of(stage) for stage in range(6)] == [0, 1, 0, 1, 0, 1]
    assert s.stages_of(1) == [1, 3, 5]
    assert not s.has_weight_actions and zero_bubble_h1(2, 2).has_weight_actions
    by_hand = Schedule("mine", 2, 1, 1, [["0F0", "0B0"], ["1F0", "1B0"]])
    assert by_hand.actions == ((Action(0, "F", 0), Action(0, "B", 0)), (Action(1, "F", 0), Action(1, "B", 0)))
    assert validate(by_hand) is by_hand


# --- the canonical orders, written out from the algorithms --------------------------------------


def test_one_f_one_b_grid_for_4_ranks_and_8_microbatches():
    # Rank r: K - r - 1 warm-up forwards, (F, B) pairs while forwards remain, the rest of the
    # backwards (cool-down). The last rank alternates from the start.
    assert str(one_f_one_b(4, 8)).splitlines() == [
        "rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ]


def test_gpipe_grid_runs_all_forwards_then_all_backwards():
    assert str(gpipe(2, 3)).splitlines() == [
        "rank 0: 0F0 0F1 0F2 0B0 0B1 0B2",
        "rank 1: 1F0 1F1 1F2 1B0 1B1 1B2",
    ]


def test_naive_is_one_microbatch_there_and_back():
    schedule = naive(3)
    assert schedule.name == "naive" and schedule.num_microbatches == 1
    assert schedule.grid().splitlines() == ["rank 0: 0F0 0B0", "rank 1: 1F0 1B0", "rank 2: 2F0 2B0"]


def test_zero_bubble_h1_defers_weight_gradients_by_the_rank():
    # Rank 1 runs 1F1B's order with W(m - 1) after B(m), then the last W.
    assert str(zero_bubble_h1(2, 3)).splitlines() == [
        "rank 0: 0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2",
        "rank 1: 1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2",
    ]


def test_interleaved_1f1b_sends_rounds_of_K_microbatches_through_each_chunk():
    rows = [row.split(": ")[1].split() for row in str(interleaved_1f1b(2, 4, 2)).splitlines()]
    # Warm-up (v - 1) K + 2 (K - r - 1) = 4 forwards on rank 0, 2 on rank 1; chunk 0 then
    # chunk 1 for micro-batches 0, 1, then 2, 3; backwards go through the chunks in reverse.
    assert rows[0] == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split()
    assert rows[1] == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3".split()


def test_make_schedule_builds_every_named_schedule():
    assert set(SCHEDULES) == {"naive", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}
    assert make_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert make_schedule("interleaved_1f1b", 2, 4, v=2) == interleaved_1f1b(2, 4, 2)
    assert make_schedule("naive", 3, 1).name == "naive"
    for name in SCHEDULES:
        assert make_schedule(name, 2, 1 if name == "naive" else 4).name == name


def test_one_rank_is_a_plain_training_step():
    for name in ("gpipe", "1f1b", "zb_h1"):
        validate(make_schedule(name, 1, 3))
    assert str(one_f_one_b(1, 2)) == "rank 0: 0F0 0B0 0F1 0B1"


# --- the same orders as torch.distributed.pipelining --------------------------------------------


def torch_order(schedule_class, K, M, v=1, single=False):
    """torch's per-rank compute actions ("I", its input-gradient backward, read as our "B").
    The schedules only read sizes and ranks from their stages when they build their order,
    so stand-in stages carry just those."""
    if single:
        built = [schedule_class(SimpleNamespace(num_stages=K), M)] * K
    else:
        built = [schedule_class([SimpleNamespace(num_stages=K * v, group_size=K, group_rank=r, stage_index=r + c * K,
                                                 submod=None) for c in range(v)], M) for r in range(K)]
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    return [[Action(a.stage_index, kinds[a.computation_type.value], a.microbatch_index)
             for a in built[r].pipeline_order[r] if a is not None and a.computation_type.value in kinds]
            for r in range(K)]


@pytest.mark.parametrize("K, M", [(2, 3), (4, 8)])
def test_gpipe_matches_torch(K, M):
    assert [list(row) for row in gpipe(K, M).actions] == torch_order(torch_schedules.ScheduleGPipe, K, M, single=True)


@pytest.mark.parametrize("K, M", [(2, 2), (4, 8), (3, 5)])
def test_one_f_one_b_matches_torch(K, M):
    ours = [list(row) for row in one_f_one_b(K, M).actions]
    # torch's Schedule1F1B order (drawn, not executed) numbers the last rank's forwards from 1
    # to M in torch 2.13; its other ranks are compared as they are. The last rank is checked
    # against torch's zero-bubble order with its W's removed, which is 1F1B's.
    assert ours[:-1] == torch_order(torch_schedules.Schedule1F1B, K, M, single=True)[:-1]
    zero_bubble = torch_order(torch_schedules.ScheduleInterleavedZeroBubble, K, M)
    assert ours == [[a for a in row if a.kind != "W"] for row in zero_bubble]


@pytest.mark.parametrize("K, M, v", [(2, 4, 2), (4, 8, 2), (4, 8, 3), (3, 6, 4), (4, 4, 2)])
def test_interleaved_1f1b_matches_torch(K, M, v):
    ours = [list(row) for row in interleaved_1f1b(K, M, v).actions]
    assert ours == torch_order(torch_schedules.ScheduleInterleaved1F1B, K, M, v)


@pytest.mark.parametrize("K, M", [(2, 3), (4, 8), (4, 4)])
def test_zero_bubble_h1_matches_torch(K, M):
    ours = [list(row) for row in zero_bubble_h1(K, M).actions]
    assert ours == torch_order(torch_schedules.ScheduleInterleavedZeroBubble, K, M)


# --- the validator --------------------------------------------------------------------------------


def schedule(rows, K=2, M=2, v=1):
    return Schedule("hand-made", K, M, v, [row.split() for row in rows])


def test_a_deadlock_names_each_stuck_rank_and_what_it_waits_for():
    # Rank 1 wants micro-batch 1's activation before sending back micro-batch 0's gradient;
    # rank 0 waits for that gradient before forwarding micro-batch 1.
    stuck = schedule(["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"])
    message = r"deadlocks: rank 0 waits at 0B0 for 1B0 \(rank 1\); rank 1 waits at 1F1 for 0F1 \(rank 0\)"
    with pytest.raises(ValueError, match=message):
        validate(stuck)


@pytest.mark.parametrize("rows, K, M, v, message", [
    (["0F0 0B0"], 2, 1, 1, "1 action lists for K = 2 ranks"),
    (["0F0 0B0 0F2 0B2", "1F0 1B0"], 2, 1, 1, "rank 0 has 0F2, outside"),
    (["0F0 0B0 1F0 1B0", ""], 2, 1, 1, "1F0 is on rank 0, but stage 1 lives on rank 1"),
    (["0F0 0F0 0B0", "1F0 1B0"], 2, 1, 1, "0F0 appears twice"),
    (["0F0 0B0", "1F0"], 2, 1, 1, "missing actions 1B0"),
    (["0F0 0B0 0W0", "1F0 1B0"], 2, 1, 1, "missing actions 1W0: every stage needs F, B, W"),
    (["0B0 0F0", "1F0 1B0"], 2, 1, 1, "rank 0 runs 0B0 before 0F0: a stage's backward needs its forward first"),
    (["0F0 0W0 0B0", "1F0 1B0 1W0"], 2, 1, 1, "rank 0 runs 0W0 before 0B0"),
    ([], 0, 1, 1, r"K \(the number of ranks\) must be a whole number >= 1, got 0"),
])
def test_validator_names_the_problem(rows, K, M, v, message):
    with pytest.raises(ValueError, match=message):
        validate(schedule(rows, K, M, v))


@pytest.mark.parametrize("build, message", [
    (lambda: one_f_one_b(4, 2), r"M >= K\); got M = 2 < K = 4"),
    (lambda: zero_bubble_h1(4, 3), r"M >= K\); got M = 3 < K = 4"),
    (lambda: interleaved_1f1b(4, 6, 2), "M must be a multiple of K; got M = 6, K = 4: use M = 8"),
    (lambda: gpipe(0, 4), r"K \(the number of ranks\) must be a whole number >= 1, got 0"),
    (lambda: gpipe(2, 0), r"M \(the number of micro-batches\)"),
    (lambda: gpipe(2.0, 4), "got 2.0"),
    (lambda: interleaved_1f1b(2, 4, 0), r"v \(the number of chunks per rank\)"),
    (lambda: make_schedule("pipedream", 2, 4), "unknown schedule 'pipedream'"),
    (lambda: make_schedule("gpipe", 2, 4, v=2), "v .* applies only to interleaved_1f1b"),
    (lambda: make_schedule("naive", 2, 4), "set M = 1"),
])
def test_generators_reject_impossible_sizes(build, message):
    with pytest.raises(ValueError, match=message):
        build()
