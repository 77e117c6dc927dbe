"""Graded: the merge of partial attention results, ring attention's forward and the zig-zag
split (``context_parallel.py``).

``merge_partial`` is compared with attention over all the keys computed in float64, within
the rounding band of ``parlab.numerics`` (twice what the same merge in float32 differs from
it, plus 16 roundings of the largest value), once as it comes and once with every lse 200
larger (the same attention with every score shifted: exp overflows float32 there). A wrong
merge is compared with the classic wrong ones (the outputs averaged, weights exp(lse_a)
without "- lse", weights that do not sum to 1, lse the max or the sum) to name it.

``ring_attention_forward`` runs on 4 ranks, on the cp groups of a ``parlab.Mesh``: two
groups of cp = 2 (ranks {0, 1} and {2, 3}) and one of cp = 4, causal and not. Each rank's output is compared with its
positions of torch's scaled_dot_product_attention on the whole sequence, within a band
measured in the same run: the yardstick is one process computing each rank's blocks in the
ring's order merged by log-sum-exp, written here apart from any learner's or parlab's code.
A wrong output is compared with the same computation under the classic wrong plans (only
the own block, the mask on every block, blocks above the diagonal merged, the ring's
direction reversed) to name it. The trace counts the K/V blocks passed: cp - 1 per rank.

``zigzag_indices`` is compared with ``parlab.context_parallel.zigzag_indices``; a wrong
answer names the chunks it holds (the contiguous split, a wrong tail chunk).
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.context_parallel import attention_block, contiguous_indices, zigzag_indices
from parlab.numerics import max_abs_difference, rounding_band

RUN_TIMEOUT_S = 10
B, A, S, HEAD = 2, 2, 16, 8  # b, a, s, h/a: s splits into 2 cp chunks for cp = 2 and 4
CP = [2, 4]  # on the 4-rank cluster: two groups of 2, one group of 4
SHIFT = 200.0  # added to every lse: exp(lse) overflows float32 beyond 88.7


def cp_ids(cp):
    return f"cp = {cp}" + (" (two groups)" if cp < 4 else "")


# --- merge_partial --------------------------------------------------------------------------


@pytest.mark.task("merge_partial")
class TestMergePartial:
    @pytest.mark.points(1)
    def test_merges_two_sets_of_keys_into_attention_over_all(self, impl):
        check_merge(impl.merge_partial, shift=0.0)

    @pytest.mark.points(1)
    def test_large_scores_do_not_overflow(self, impl):
        check_merge(impl.merge_partial, shift=SHIFT)


def merge_inputs(shift):
    """(out_a, lse_a, out_b, lse_b) of 5 queries over keys 0..6 and 7..15 (float32, every lse
    + ``shift``), and the result over all 16 keys in float64 (out, lse + shift)."""
    q, k, v = (torch.randn(B, A, n, HEAD, generator=torch.Generator().manual_seed(seed))
               for seed, n in ((1, 5), (2, S), (3, S)))
    q = q * 2  # lse_a and lse_b apart by a few units: averaging the outputs is far off
    (out_a, lse_a), (out_b, lse_b) = attention_block(q, k[:, :, :7], v[:, :, :7]), attention_block(
        q, k[:, :, 7:], v[:, :, 7:])
    out, lse = attention_block(q.double(), k.double(), v.double())
    return (out_a, lse_a + shift, out_b, lse_b + shift), {"out": out, "lse": lse + shift}


def float32_merge(out_a, lse_a, out_b, lse_b):
    """The merge in float32, written apart from the learner's: the band's yardstick."""
    lse = torch.logaddexp(lse_a, lse_b)
    return {"out": (lse_a - lse).exp()[..., None] * out_a + (lse_b - lse).exp()[..., None] * out_b, "lse": lse}


def check_merge(merge_partial, shift):
    inputs, expected = merge_inputs(shift)
    band = rounding_band(expected, [float32_merge(*inputs)])[0]
    got = merge_partial(*(x.clone() for x in inputs))
    assert isinstance(got, tuple) and len(got) == 2, "return a tuple (out, lse)"
    got = {"out": got[0], "lse": got[1]}
    where = f"lse_a and lse_b around {shift:g}" if shift else "5 queries, keys split 7 + 9"
    for name in ("out", "lse"):
        assert tuple(got[name].shape) == tuple(expected[name].shape), (
            f"{where}: {name} has shape {tuple(got[name].shape)}, expected {tuple(expected[name].shape)}")
    if shift and not all(torch.isfinite(got[name]).all() for name in got):
        assert False, (f"{where}: the result holds inf or nan: exp({shift:g}) overflows float32 (its largest "
                       "value is 3.4e38, exp(88.7)); subtract the max m = max(lse_a, lse_b) before exponentiating, "
                       "lse = m + log(exp(lse_a - m) + exp(lse_b - m))")
    for name in ("lse", "out"):
        difference = max_abs_difference(got[name], expected[name])
        if difference > band:
            mistake = likely_merge_mistake(name, got[name], inputs)
            assert False, (f"{where}: {name} differs from attention over all the keys by {difference:.2e} "
                           f"(band {band:.2e}){': ' + mistake if mistake else ''}")


def likely_merge_mistake(name, got, inputs):
    """The classic wrong merge that gives ``got`` (the merged ``name``), in words, or None."""
    out_a, lse_a, out_b, lse_b = (x.double() for x in inputs)
    lse, m = torch.logaddexp(lse_a, lse_b), torch.maximum(lse_a, lse_b)

    def weighted(w_a, w_b):
        return w_a[..., None] * out_a + w_b[..., None] * out_b

    candidates = {
        "lse": [("the merged lse is the max of the two; it is log(exp(lse_a) + exp(lse_b))", m),
                ("the merged lse is lse_a + lse_b; it is log(exp(lse_a) + exp(lse_b))", lse_a + lse_b)],
        "out": [("the two outputs are averaged: weight each by its share of the normaliser, exp(lse_a - lse)",
                 (out_a + out_b) / 2),
                ("the weights are exp(lse_a) and exp(lse_b); divide by the total, exp(lse_a - lse) with lse the "
                 "merged lse", weighted(lse_a.exp(), lse_b.exp())),
                ("the weights exp(lse_a - m) and exp(lse_b - m) do not sum to 1; use exp(lse_a - lse) and "
                 "exp(lse_b - lse), lse the merged lse", weighted((lse_a - m).exp(), (lse_b - m).exp())),
                ("the weights are swapped: out_a's weight is exp(lse_a - lse)",
                 weighted((lse_b - lse).exp(), (lse_a - lse).exp()))],
    }[name]
    close = [words for words, wrong in candidates
             if torch.isfinite(wrong).all() and torch.allclose(got.double(), wrong, rtol=1e-4, atol=1e-5)]
    return close[0] if close else None


# --- ring_attention_forward -----------------------------------------------------------------


@pytest.mark.task("ring_attention_forward")
class TestRingAttentionForward:
    @pytest.mark.points(1)
    @pytest.mark.parametrize("cp", CP, ids=cp_ids)
    def test_matches_sdpa_on_the_whole_sequence(self, cluster4, impl, cp):
        check_ring(cluster4, impl, cp, causal=False)

    @pytest.mark.points(1)
    @pytest.mark.parametrize("cp", CP, ids=cp_ids)
    def test_causal_matches_sdpa_on_the_whole_sequence(self, cluster4, impl, cp):
        check_ring(cluster4, impl, cp, causal=True)

    @pytest.mark.points(1)
    def test_passes_cp_minus_one_blocks(self, cluster4, impl):
        cp = 4
        timeline = cluster4.trace(ring_on_rank, impl.ring_attention_forward, cp, False, timeout=RUN_TIMEOUT_S)
        block_bytes = 2 * B * A * (S // cp) * HEAD * 4  # K and V of s/cp positions, float32
        for rank in range(cp):
            sent = [event.nbytes for name in ("send", "isend") for event in timeline.select(rank=rank, name=name)]
            if sent == [block_bytes] * (cp - 1):
                continue
            why = "pass each block with pass_kv, whose messages the grader counts"
            if sent and all(nbytes == block_bytes for nbytes in sent) and len(sent) > cp - 1:
                why = ("after cp - 1 passes every rank has seen every block; one more pass only brings back the "
                       "rank's own block")
            elif sent and all(nbytes == block_bytes for nbytes in sent):
                why = "every rank must see every block: cp - 1 passes, whether or not it merges the block"
            assert False, (f"cp = {cp}: rank {rank} sent {len(sent)} messages, {sum(sent)} bytes; ring attention "
                           f"passes cp - 1 = {cp - 1} K/V blocks of {block_bytes} bytes: {why}")


def inputs():
    """q, k, v of the whole sequence, (b, a, s, h/a) each."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(B, A, S, HEAD, generator=generator) for _ in range(3)]


def ring_on_rank(ring_attention_forward, cp, causal):
    """(this rank's place r in its group of cp ranks, its output): the cp groups of a mesh
    (consecutive ranks), each rank given its positions under the contiguous split."""
    with parlab.Mesh(dp=dist.get_world_size() // cp, cp=cp) as mesh:
        r = mesh.coordinate("cp")
        q, k, v = (x.chunk(cp, dim=2)[r].contiguous() for x in inputs())
        return r, ring_attention_forward(q, k, v, group=mesh.group("cp"), causal=causal)


def causal_plan(r, src):
    """What rank r computes with rank src's block under the contiguous split, causal."""
    return "masked" if src == r else "all" if src < r else None


PLANS = {
    False: lambda r, src, cp: "all",
    True: lambda r, src, cp: causal_plan(r, src),
}
WRONG_PLANS = {  # causal -> [(the mistake in words, the plan it follows)]
    False: [("only this rank's own block is attended: pass K/V round the ring cp - 1 times and merge each block",
             lambda r, src, cp: "all" if src == r else None),
            ("causal=False, but the own block is masked: no mask without causal",
             lambda r, src, cp: "masked" if src == r else "all")],
    True: [("only this rank's own block is attended: pass K/V round the ring cp - 1 times and merge each block",
            lambda r, src, cp: "masked" if src == r else None),
           ("no causal mask at all: mask the own (diagonal) block, skip the blocks of later ranks",
            lambda r, src, cp: "all"),
           ("the causal mask is applied to every block; only the own block (the diagonal) is masked, the blocks "
            "of earlier ranks are visible whole", lambda r, src, cp: "masked" if src <= r else None),
           ("the blocks of later ranks (src > r) are merged; they lie above the diagonal: skip them",
            lambda r, src, cp: "masked" if src == r else "all"),
           ("after i passes the block held is rank r - i's (mod cp), not rank r + i's",
            lambda r, src, cp: causal_plan(r, (2 * r - src) % cp))],
}


def blockwise(cp, plan):
    """The ranks' outputs (a list, group rank order) computed in one process: rank r's queries
    against the blocks of ranks r, r - 1, ... (the ring's order) as ``plan(r, src, cp)`` says
    ("all", "masked" or None: skipped), merged by log-sum-exp, in float32."""
    q, k, v = (x.chunk(cp, dim=2) for x in inputs())
    n = S // cp
    outs = []
    for r in range(cp):
        out = lse = None
        for src in [(r - i) % cp for i in range(cp)]:
            how = plan(r, src, cp)
            if how is None:
                continue
            scores = q[r] @ k[src].transpose(-2, -1) / HEAD**0.5  # (b, a, n, n)
            if how == "masked":
                scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            block_lse = torch.logsumexp(scores, -1)
            block_out = torch.softmax(scores, -1) @ v[src]
            if out is None:
                out, lse = block_out, block_lse
                continue
            merged = torch.logaddexp(lse, block_lse)
            out = (lse - merged).exp()[..., None] * out + (block_lse - merged).exp()[..., None] * block_out
            lse = merged
        outs.append(out)
    return outs


@functools.cache
def expected_shards(cp, causal):
    """(SDPA's output on the whole sequence cut into the cp ranks' positions, the band)."""
    q, k, v = inputs()
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    band = rounding_band(sdpa, [torch.cat(blockwise(cp, PLANS[causal]), dim=2)])[0]
    return list(sdpa.chunk(cp, dim=2)), band


def check_ring(cluster, impl, cp, causal):
    shards, band = expected_shards(cp, causal)
    results = cluster.run(ring_on_rank, impl.ring_attention_forward, cp, causal, timeout=RUN_TIMEOUT_S)
    wrong = []
    for rank, (r, out) in enumerate(results):
        where = f"cp = {cp}{', causal' if causal else ''}: rank {rank} (rank {r} of its group)"
        assert torch.is_tensor(out) and tuple(out.shape) == tuple(shards[r].shape), (
            f"{where}: returned {tuple(out.shape) if torch.is_tensor(out) else type(out).__name__}, expected "
            f"this rank's positions of the output, {tuple(shards[r].shape)}")
        difference = max_abs_difference(out, shards[r])
        if difference > band:
            wrong.append((rank, r, out, where, difference))
    if not wrong:
        return
    rank, r, out, where, difference = wrong[0]
    if all(rank != r for rank, r, *_ in wrong):
        mistake = ("the first group's ranks are right, the others are not: take r and cp from the group, "
                   "dist.get_rank(group), not from the world")
    else:
        mistake = next((words for words, plan in WRONG_PLANS[causal]
                        if max_abs_difference(out, blockwise(cp, plan)[r]) <= band), None)
    if mistake is None and not merge_is_right(impl.merge_partial):
        mistake = "merge_partial is wrong (see its own task's reasons), and the ring merges with it"
    assert False, (f"{where}: the output differs from scaled_dot_product_attention's by {difference:.2e} "
                   f"(band {band:.2e}){': ' + mistake if mistake else ''}")


def merge_is_right(merge_partial):
    inputs, expected = merge_inputs(0.0)
    band = rounding_band(expected, [float32_merge(*inputs)])[0]
    try:
        out, lse = merge_partial(*inputs)
        return max_abs_difference({"out": out, "lse": lse}, expected) <= band
    except Exception:
        return False


# --- zigzag_indices -------------------------------------------------------------------------

SPLIT_CASES = [(8, 2), (16, 2), (8, 4), (24, 4), (12, 3)]  # (s, cp)


@pytest.mark.task("zigzag_indices")
class TestZigzagIndices:
    @pytest.mark.points(1)
    def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r(self, impl):
        for s, cp in SPLIT_CASES:
            for rank in range(cp):
                got = positions(impl.zigzag_indices(s, cp, rank))
                expected = zigzag_indices(s, cp, rank).tolist()
                assert got == expected, (f"s = {s}, cp = {cp}: rank {rank} holds {got}, expected {expected}: "
                                         f"{zigzag_mistake(got, s, cp, rank)}")

    @pytest.mark.points(1)
    def test_every_position_once_and_the_same_causal_work(self, impl):
        for s, cp in SPLIT_CASES:
            held = [positions(impl.zigzag_indices(s, cp, rank)) for rank in range(cp)]
            everything = sorted(p for rank in held for p in rank)
            assert everything == list(range(s)), (
                f"s = {s}, cp = {cp}: the ranks together hold {everything}, expected every position 0 .. {s - 1} once")
            # causal: query p attends to p + 1 keys
            work = [sum(p + 1 for p in rank) for rank in held]
            assert len(set(work)) == 1, (
                f"s = {s}, cp = {cp}: under causal attention the ranks attend to {work} (query, key) pairs; the "
                f"zig-zag split gives each the same: {zigzag_mistake(held[-1], s, cp, cp - 1)}")


def positions(indices):
    """A learner's indices as a list of ints (a tensor, or anything torch.as_tensor takes)."""
    return torch.as_tensor(indices).reshape(-1).tolist()


def zigzag_mistake(got, s, cp, rank):
    """What is wrong with rank ``rank``'s positions ``got``, in words."""
    if got == contiguous_indices(s, cp, rank).tolist():
        return ("that is the contiguous split, whose causal work grows with the rank; cut the sequence into 2 cp "
                f"chunks and give rank r chunks r and 2 cp - 1 - r (here {rank} and {2 * cp - 1 - rank})")
    if sorted(got) == zigzag_indices(s, cp, rank).tolist():
        return "the right positions, in another order: return them increasing, chunk r first"
    n = s // (2 * cp)
    chunks = sorted({p // n for p in got})
    if rank in chunks and len(chunks) == 2 and len(got) == 2 * n:
        tail = chunks[1] if chunks[0] == rank else chunks[0]
        return f"the tail chunk is chunk {tail}, expected chunk 2 cp - 1 - r = {2 * cp - 1 - rank}"
    return (f"rank {rank} must hold the {2 * n} positions of chunks {rank} and {2 * cp - 1 - rank} "
            f"(chunks of s/(2 cp) = {n} positions)")
