"""Graded: top-k routing with a capacity, and expert parallelism's dispatch and combine
(``experts.py``).

``route`` is compared with ``parlab.experts.route`` on random logits: the experts chosen and
the gates (no drops), the slots (no drops; a wrong order is compared with the classic wrong
ones: token by token, or each choice counted apart), and the drops at a small capacity,
judged on the learner's own slots and gates so that a wrong order or gate costs its own test
only.

``dispatch_and_combine`` runs on 4 ranks, on the ep groups of a ``parlab.Mesh``: two groups
of ep = 2 and one of ep = 4, each rank with its own number of tokens, some experts chosen by
no token of a rank. The experts are the grader's: expert e maps a row x to (e + 1) x + e, on
integer-valued rows, so every output is exact and says which token and which expert it came
from: a wrong row is named as a token returned to the wrong place, or a row through the wrong
expert. The trace counts the bytes of the all-to-alls: the counts, and each row sent to
another rank and its output sent back, no more.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab.experts import route as reference_route
from parlab.experts import run_experts, traced_all_to_all_bytes
from parlab.runtime.errors import RankTimeout

RUN_TIMEOUT_S = 10
EPS = torch.finfo(torch.float32).eps
EP = [2, 4]  # on the 4-rank cluster: two groups of 2, one group of 4
EXPERTS_PER_RANK, H = 2, 4


def ep_ids(ep):
    return f"ep = {ep}" + (" (two groups)" if ep < 4 else "")


# --- route ----------------------------------------------------------------------------------


def logits_of(T, E, seed=0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed))


def routed(result, T, k, E):
    """The learner's ``Routed`` as a dict, its shapes checked."""
    assert isinstance(result, tuple) and len(result) == 5, (
        "return a Routed(expert, slot, gate, dropped, tokens_per_expert)")
    got = dict(zip(("expert", "slot", "gate", "dropped", "tokens_per_expert"), result))
    for name, shape in (("expert", (T, k)), ("slot", (T, k)), ("gate", (T, k)), ("dropped", (T, k)),
                        ("tokens_per_expert", (E,))):
        assert torch.is_tensor(got[name]) and tuple(got[name].shape) == shape, (
            f"T = {T}, E = {E}, k = {k}: {name} must be a tensor of shape {shape}, got "
            f"{tuple(got[name].shape) if torch.is_tensor(got[name]) else type(got[name]).__name__}")
    return got


@pytest.mark.task("route")
class TestRoute:
    @pytest.mark.points(1)
    def test_chooses_the_k_most_probable_experts_and_their_gates(self, impl):
        for T, E, k in [(10, 4, 1), (10, 4, 2), (12, 6, 3)]:
            logits = logits_of(T, E)
            got, expected = routed(impl.route(logits, k, T * k), T, k, E), reference_route(logits, k, T * k)
            where = f"T = {T}, E = {E}, k = {k}"
            if not torch.equal(got["expert"], expected.expert):
                t = first_wrong_row(got["expert"] != expected.expert)
                why = "the k largest of softmax(logits), most probable first"
                if torch.equal(got["expert"].sort(-1).values, expected.expert.sort(-1).values):
                    why = "the right experts in another order: choice 0 is the most probable (topk's order)"
                assert False, (f"{where}: token {t} chose experts {got['expert'][t].tolist()}, expected "
                               f"{expected.expert[t].tolist()}: {why}")
            if torch.allclose(got["gate"], expected.gate, rtol=0, atol=4 * EPS):
                continue
            t = first_wrong_row(~torch.isclose(got["gate"], expected.gate, rtol=0, atol=4 * EPS))
            why = ""
            chosen = expected.probs.gather(1, expected.expert)
            if k > 1 and torch.allclose(got["gate"], chosen, rtol=0, atol=4 * EPS):
                why = ": the gates are the probabilities themselves; with k > 1 divide the k by their sum"
            elif k == 1 and torch.allclose(got["gate"], torch.ones_like(chosen)):
                why = (": with k = 1 the gate is the chosen probability itself (Switch Transformer); renormalised "
                       "it would always be 1")
            assert False, (f"{where}: token {t}'s gates are {numbers(got['gate'][t])}, expected "
                           f"{numbers(expected.gate[t])}{why}")

    @pytest.mark.points(1)
    def test_serves_every_first_choice_before_any_second_choice(self, impl):
        for T, E, k in [(12, 4, 2), (12, 6, 3)]:
            logits = logits_of(T, E, seed=1)
            got, expected = routed(impl.route(logits, k, T * k), T, k, E), reference_route(logits, k, T * k)
            if torch.equal(got["slot"], expected.slot):
                continue
            t, c = (int(i) for i in (got["slot"] != expected.slot).nonzero()[0])
            why = ("a pair's slot counts the pairs served before it that chose the same expert: all first choices, "
                   "in token order, then all second choices, ...")
            token_by_token = [(token, choice) for token in range(T) for choice in range(k)]
            if torch.equal(got["slot"], slots_served_in(expected.expert, token_by_token)):
                why = ("the slots follow the tokens, each token's choices together; serve every token's first "
                       "choice before any second choice (the outer loop over choices, the inner over tokens)")
            elif torch.equal(got["slot"], slots_per_choice(expected.expert)):
                why = ("each choice's slots start again at 0; a second choice queues behind every first choice of "
                       "the same expert: one counter per expert across all choices")
            assert False, (f"T = {T}, E = {E}, k = {k}: token {t}'s choice {c} (expert {int(expected.expert[t, c])}) "
                           f"has slot {int(got['slot'][t, c])}, expected {int(expected.slot[t, c])}: {why}")

    @pytest.mark.points(1)
    def test_drops_the_pairs_beyond_the_capacity(self, impl):
        for T, E, k, capacity in [(12, 4, 2, 4), (16, 4, 1, 3)]:
            logits = logits_of(T, E, seed=2)
            got, expected = routed(impl.route(logits, k, capacity), T, k, E), reference_route(logits, k, capacity)
            where = f"T = {T}, E = {E}, k = {k}, capacity {capacity}"
            kept = torch.bincount(got["expert"][~got["dropped"]], minlength=E)
            full = (kept > capacity).nonzero()
            assert not len(full), (
                f"{where}: expert {int(full[0])} keeps {int(kept[full[0]])} (token, choice) pairs, more than the "
                f"capacity {capacity}: exceeding the capacity; drop every pair whose slot is >= capacity")
            assert got["dropped"].dtype == torch.bool and torch.equal(got["dropped"], got["slot"] >= capacity), (
                f"{where}: dropped must be True exactly where slot >= capacity (your slots {got['slot'].tolist()}, "
                f"your dropped {got['dropped'].tolist()})")
            assert torch.all(got["gate"][got["dropped"]] == 0), f"{where}: a dropped pair's gate must be 0"
            undropped = routed(impl.route(logits, k, T * k), T, k, E)["gate"]  # your gates when nothing drops
            if not torch.allclose(got["gate"], undropped.masked_fill(got["dropped"], 0), rtol=0, atol=4 * EPS):
                assert False, (f"{where}: the gates of the pairs kept changed when others were dropped: set a "
                               "dropped pair's gate to 0 and leave the token's other gates as they are (not "
                               "renormalised)")
            if not torch.equal(got["tokens_per_expert"], expected.tokens_per_expert):
                why = ("counts every pair that chose the expert, dropped ones included" if torch.equal(
                    got["tokens_per_expert"], kept) else "counts the pairs that chose each expert")
                assert False, (f"{where}: tokens_per_expert is {got['tokens_per_expert'].tolist()}, expected "
                               f"{expected.tokens_per_expert.tolist()}: it {why}")


def first_wrong_row(wrong):
    return int(wrong.nonzero()[0, 0])


def numbers(tensor):
    return "[" + ", ".join(f"{value:.4g}" for value in tensor.tolist()) + "]"


def slots_served_in(expert, pairs):
    """The slots when the (token, choice) ``pairs`` are served in the order listed."""
    slot, served = torch.empty_like(expert), {}
    for token, choice in pairs:
        e = int(expert[token, choice])
        slot[token, choice] = served.get(e, 0)
        served[e] = served.get(e, 0) + 1
    return slot


def slots_per_choice(expert):
    """The slots when each choice's queue at an expert starts again at 0."""
    T, k = expert.shape
    return torch.stack([slots_served_in(expert[:, [c]], [(t, 0) for t in range(T)])[:, 0] for c in range(k)], 1)


# --- dispatch_and_combine -------------------------------------------------------------------


@pytest.mark.task("dispatch_and_combine")
class TestDispatchAndCombine:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("ep", EP, ids=ep_ids)
    def test_every_token_comes_back_through_its_expert_to_its_place(self, cluster4, impl, ep):
        results = on_ranks(cluster4.run, impl.dispatch_and_combine, ep)
        for rank, (tokens, expert_of_token, out) in enumerate(results):
            check_outputs(f"ep = {ep}: rank {rank}", tokens, expert_of_token, out)

    @pytest.mark.points(1)
    def test_sends_the_counts_and_each_row_there_and_back(self, cluster4, impl):
        ep = 4
        timeline = on_ranks(cluster4.trace, impl.dispatch_and_combine, ep)
        sent = traced_all_to_all_bytes(timeline)[0]
        # the rank holding each row's expert, for every rank's rows
        owner = [expert_of_token // EXPERTS_PER_RANK for _, expert_of_token, _ in timeline.results]
        for rank in range(ep):
            counts = (ep - 1) * EXPERTS_PER_RANK * 8  # an (ep, E/ep) long tensor, a row to each other rank
            out = int((owner[rank] != rank).sum())  # its rows for other ranks' experts
            back = sum(int((owner[p] == rank).sum()) for p in range(ep) if p != rank)  # others' rows, returned
            rows = (out + back) * H * 4  # float32
            if sent[rank] == counts + rows:
                continue
            if sent[rank] == 0:
                why = "nothing went through all_to_all (parlab.experts.all_to_all), whose bytes the grader counts"
            elif sent[rank] == rows:
                why = "the counts must go first, an all_to_all of the (ep, E/ep) counts"
            elif sent[rank] > counts + rows:
                why = "each row goes only to the rank holding its expert, once, and its output comes back once"
            else:
                why = "every row whose expert another rank holds must go there, and its output come back"
            assert False, (f"ep = {ep}: rank {rank} sent {sent[rank]} bytes to other ranks, expected {counts + rows}: "
                           f"the counts, {counts} bytes, its {out} rows for other ranks' experts and the outputs of "
                           f"the {back} rows other ranks sent its experts, {rows} bytes: {why}")


def on_ranks(call, dispatch_and_combine, ep):
    """``call(dispatch_on_rank, ...)`` (the cluster's run or trace); a hang fails the test
    naming the ranks stuck in dispatch_and_combine and those that had left it (and wait for
    the others at the grader's barrier)."""
    try:
        return call(dispatch_on_rank, dispatch_and_combine, ep, timeout=RUN_TIMEOUT_S)
    except RankTimeout as exc:
        inside = [rank for rank, stack in exc.stuck.items() if "dispatch_and_combine" in stack]
        left = sorted(set(range(4)) - set(inside))
        pytest.fail(f"timed out after {exc.timeout:g} s (ep = {ep}: ranks {', '.join(map(str, inside))} still "
                    f"waiting in dispatch_and_combine, ranks {', '.join(map(str, left))} had left it): every rank of "
                    "the group must make the same all_to_all calls, with splits that agree", pytrace=False)


def expert_map(e, x):
    """The grader's expert e: (e + 1) x + e, exact on integer-valued rows."""
    return x * (e + 1) + e


def checked_experts(experts, ep, rows, counts):
    """The grader's ``run_experts(rows, counts)`` of one rank: its ``experts`` on the rows
    received, refusing rows and counts that do not agree."""
    if not torch.is_tensor(counts) or tuple(counts.shape) != (ep, len(experts)):
        raise ValueError(f"run_experts takes the counts received, an (ep, E/ep) = {(ep, len(experts))} tensor, got "
                         f"{tuple(counts.shape) if torch.is_tensor(counts) else type(counts).__name__}")
    if int(counts.sum()) != len(rows):
        raise ValueError(f"run_experts got {len(rows)} rows but the counts say {int(counts.sum())}: pass the rows "
                         "received and the counts received")
    return run_experts(experts, rows, counts)


def dispatch_on_rank(dispatch_and_combine, ep):
    """(tokens, expert_of_token, the learner's output) of this rank, in the ep groups of a mesh:
    6 + 3 x rank tokens, integer-valued; odd ranks never choose the last two experts."""
    rank, E = dist.get_rank(), EXPERTS_PER_RANK * ep
    generator = torch.Generator().manual_seed(rank)
    T = 6 + 3 * rank
    tokens = torch.randint(-20, 20, (T, H), generator=generator).float()
    expert_of_token = torch.randint(0, E - 2 if rank % 2 else E, (T,), generator=generator)
    mesh = parlab.Mesh(dp=dist.get_world_size() // ep, ep=ep)
    first = mesh.coordinate("ep") * EXPERTS_PER_RANK
    experts = [functools.partial(expert_map, e) for e in range(first, first + EXPERTS_PER_RANK)]
    mine = functools.partial(checked_experts, experts, ep)
    out = dispatch_and_combine(tokens.clone(), expert_of_token.clone(), E, mine, group=mesh.group("ep"))
    # Every rank done with the groups before any destroys them: a rank that leaves early must
    # leave the others waiting (a hang the grader names), not cut their connections.
    dist.barrier()
    mesh.close()
    return tokens, expert_of_token, out


def check_outputs(where, tokens, expert_of_token, out):
    """Assert row t of ``out`` is token t through its expert; name a misplaced row or a wrong expert."""
    expected = expert_map(expert_of_token[:, None].float(), tokens)  # (T, h)
    assert torch.is_tensor(out) and tuple(out.shape) == tuple(expected.shape), (
        f"{where}: returned {tuple(out.shape) if torch.is_tensor(out) else type(out).__name__}, expected its "
        f"tokens' outputs, {tuple(expected.shape)}")
    wrong = [t for t in range(len(tokens)) if not torch.equal(out[t], expected[t])]
    if not wrong:
        return
    misplaced = {t: other for t in wrong for other in range(len(tokens)) if torch.equal(out[t], expected[other])}
    if misplaced:
        t, other = next(iter(misplaced.items()))
        assert False, (f"{where}: a token returned to the wrong place: row {t} holds token {other}'s output "
                       f"({len(misplaced)} of {len(tokens)} rows misplaced); the i-th row that comes back belongs "
                       "to the token you sent i-th: put it back at that token's place (out[order] = returned)")
    t = wrong[0]
    through = [e for e in range(EXPERTS_PER_RANK * 4) if torch.equal(out[t], expert_map(e, tokens[t]))]
    if through:
        assert False, (f"{where}: row {t} went through expert {through[0]}, but its expert is "
                       f"{int(expert_of_token[t])}: sort the rows by expert before sending, and send the counts "
                       "per expert")
    assert False, f"{where}: {len(wrong)} of {len(tokens)} rows are wrong, the first row {t}: expected (e + 1) x + e"
