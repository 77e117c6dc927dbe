"""parlab.context_parallel: attention with the sequence split over cp = 2 and 4 ranks (all-gather
of K/V, ring attention, Ulysses; causal and not; contiguous and zig-zag splits) gives the
outputs and the gradients of q, k, v of torch's scaled_dot_product_attention on the whole
sequence in one process.

The band (``parlab.numerics``) is measured in the same run: the yardstick is the largest
difference from SDPA of the same attention computed in one process the way the ranks
compute it, written apart from the package's code so that a bug there cannot widen the band:
for ring attention and the all-gather method, each rank's queries against each rank's keys
block by block in the ring's order, merged by log-sum-exp, with autograd's gradients
(``blockwise_in_one_process``); for Ulysses, SDPA on each rank's a/cp heads apart.
cp = 2 runs on the cp groups of a parlab.Mesh(dp=2, cp=2) of the 4-rank cluster (ranks {0, 1}
and {2, 3}, each computing alone); cp = 4 on the world. Also: the splits, the load-balance counts, the merge
of partial results, and the sentences a learner's mistakes get."""

import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import parlab
from parlab.context_parallel import (
    ATTENTION,
    METHODS,
    SPLITS,
    all_to_all,
    attention_block,
    block_pairs,
    block_task,
    bytes_per_rank,
    contiguous_indices,
    load_imbalance,
    merge_partial,
    reassembly_order,
    ring_sources,
    sequence_indices,
    shard_sequence,
    unshard_sequence,
    zigzag_indices,
)
from parlab.numerics import assert_equivalent, max_abs_difference, rounding_band
from parlab.runtime.mesh import axis_groups

B, A, S, HEAD = 2, 4, 16, 8  # b, a, s, h/a: s a multiple of 2 cp for cp = 2 and 4, a a multiple of cp
CASES = list(itertools.product(METHODS, (False, True), SPLITS))  # (method, causal, split)


def inputs(seed=0):
    """q, k, v and the gradient of the output, (b, a, s, h/a) each."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, A, S, HEAD, generator=generator) for _ in range(4)]


def reference(q, k, v, grad_out, causal):
    """SDPA on the whole sequence in one process: out and the gradients of q, k, v."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(grad_out)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def blockwise_in_one_process(q, k, v, grad_out, causal, split, cp):
    """The ranks' decomposition in one process, written apart from the package's blocks (a
    bug there must not widen the band): each rank's queries attend to each rank's keys in the
    ring's order, block by block (only the rows and keys the causal mask leaves), merged by
    log-sum-exp; the gradients by autograd."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    outs = []
    for r in range(cp):
        q_r, positions = shard_sequence(q, cp, r, split), sequence_indices(S, cp, r, split)
        out, lse = torch.zeros_like(q_r), torch.full(q_r.shape[:3], float("-inf"))
        for src in ring_sources(r, cp):
            keys = sequence_indices(S, cp, src, split)
            visible = (keys[None, :] <= positions[:, None]) | (not causal)  # (queries, keys) a query sees
            rows, cols = visible.any(1).nonzero()[:, 0], visible.any(0).nonzero()[:, 0]
            if not len(rows):
                continue
            k_src, v_src = (shard_sequence(x, cp, src, split)[:, :, cols] for x in (k, v))
            scores = q_r[:, :, rows] @ k_src.transpose(-2, -1) / HEAD**0.5
            scores = scores.masked_fill(~visible[rows][:, cols], float("-inf"))
            block_out = torch.zeros_like(out).index_copy(2, rows, torch.softmax(scores, -1) @ v_src)
            block_lse = torch.full_like(lse, float("-inf")).index_copy(2, rows, torch.logsumexp(scores, -1))
            merged = torch.logaddexp(lse, block_lse)
            out = (lse - merged).exp()[..., None] * out + (block_lse - merged).exp()[..., None] * block_out
            lse = merged
        outs.append(out)
    out = unshard_sequence(outs, split)
    out.backward(grad_out)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def heads_apart(q, k, v, grad_out, causal, cp):
    """Ulysses' arithmetic in one process: SDPA on each rank's a/cp heads."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = torch.cat([F.scaled_dot_product_attention(*heads, is_causal=causal)
                     for heads in zip(q.chunk(cp, 1), k.chunk(cp, 1), v.chunk(cp, 1))], 1)
    out.backward(grad_out)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


@functools.cache
def decomposed(method, causal, split, cp, seed=0):
    tensors = inputs(seed)
    if method == "ulysses":
        return heads_apart(*tensors, causal, cp)
    return blockwise_in_one_process(*tensors, causal, split, cp)


def attend_on_ranks(cp):
    """Every case on this rank's group of cp ranks (a mesh's "cp" axis, or the world): this
    rank's out, dq, dk, dv shards."""
    group = parlab.Mesh(dp=dist.get_world_size() // cp, cp=cp).group("cp") if cp < dist.get_world_size() else None
    r = dist.get_rank(group)
    results = {}
    for method, causal, split in CASES:
        q, k, v, grad_out = (shard_sequence(x, cp, r, split) for x in inputs())
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        out = ATTENTION[method](q, k, v, causal=causal, split=split, group=group)
        out.backward(grad_out)
        results[method, causal, split] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return results


@functools.cache
def ranks_results(cluster, cp):
    return cluster.run(attend_on_ranks, cp, timeout=120)


def differences(cluster, cp, method):
    """For each case of ``method``: (case, the ranks' result reassembled, SDPA's, the yardstick's)."""
    per_rank = ranks_results(cluster, cp)
    for case in [c for c in CASES if c[0] == method]:
        _, causal, split = case
        for ranks in axis_groups("cp", dp=4 // cp, cp=cp):
            parallel = {name: unshard_sequence([per_rank[r][case][name] for r in ranks], split)
                        for name in ("out", "dq", "dk", "dv")}
            yield case, parallel, reference(*inputs(), causal), decomposed(method, causal, split, cp)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_each_method_gives_sdpa_s_outputs_and_gradients(method, cp, cluster4):
    for (_, causal, split), parallel, ref, one_process in differences(cluster4, cp, method):
        what = f"{method}, cp = {cp}, {'causal' if causal else 'not causal'}, {split}"
        assert_equivalent(parallel, ref, [one_process], what)


@pytest.mark.parametrize("method", METHODS)
def test_the_yardstick_is_rounding_far_below_a_wrong_answer(method):
    """The bands are rounding: far below what a block left out of the softmax misses by."""
    for causal, split in itertools.product((False, True), SPLITS):
        ref = reference(*inputs(), causal)
        band, _, _ = rounding_band(ref, [decomposed(method, causal, split, 4)])
        wrong = reference(*inputs(seed=1), causal)
        assert band < 1e-4 < max_abs_difference(wrong, ref)


def test_merge_partial_of_two_halves_of_the_keys_is_attention_over_all():
    q, k, v, _ = (x.double() for x in inputs())
    halves = [attention_block(q, k[:, :, keys], v[:, :, keys]) for keys in (slice(0, 5), slice(5, S))]
    out, lse = merge_partial(*halves[0], *halves[1])
    whole_out, whole_lse = attention_block(q, k, v)
    assert torch.allclose(out, whole_out, atol=1e-12) and torch.allclose(lse, whole_lse, atol=1e-12)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-12)
    # merging is symmetric, and a huge score (lse 1000) neither overflows nor loses the other side
    big = (halves[0][0], halves[0][1] + 1000.0)
    assert torch.allclose(merge_partial(*big, *halves[1])[0], merge_partial(*halves[1], *big)[0], atol=1e-12)
    assert torch.isfinite(merge_partial(*big, *halves[1])[1]).all()


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_the_splits_are_permutations_that_reassemble(cp):
    s = 4 * cp
    for indices in (contiguous_indices, zigzag_indices):
        held = torch.cat([indices(s, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(s))
    assert torch.equal(contiguous_indices(s, cp, cp - 1), torch.arange(s - 4, s))
    n = s // (2 * cp)
    assert zigzag_indices(s, cp, 0).tolist() == [*range(n), *range(s - n, s)]  # chunks 0 and 2 cp - 1
    x = torch.randn(2, 3, s, 5)
    for split in SPLITS:
        shards = [shard_sequence(x, cp, r, split) for r in range(cp)]
        assert torch.equal(unshard_sequence(shards, split), x)
        held = torch.cat(shards, 2)
        assert torch.equal(held[:, :, reassembly_order(s, cp, split)], x)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_contiguous_causal_work_is_r_plus_1_blocks_and_zigzag_is_balanced(cp):
    assert block_pairs(cp, "contiguous") == [r + 1 for r in range(cp)]
    assert load_imbalance(block_pairs(cp, "contiguous")) == pytest.approx(2 * cp / (cp + 1))
    assert block_pairs(cp, "zigzag") == [(cp + 1) / 2] * cp  # the same total, cp (cp + 1) / 2
    assert load_imbalance(block_pairs(cp, "zigzag")) == 1.0
    assert block_pairs(cp, "zigzag", causal=False) == [cp] * cp


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("split", SPLITS)
def test_the_plan_computes_each_visible_pair_once_and_no_pair_above_the_diagonal(cp, split):
    """Replay the plan on positions: every (query, key) pair with key <= query is computed by
    exactly one block task, and no pair with key > query is, except inside a masked block."""
    s = 4 * cp
    seen = torch.zeros(s, s, dtype=torch.int64)
    for r, src in itertools.product(range(cp), range(cp)):
        task = block_task(r, src, cp, split, causal=True)
        if task is None:
            continue
        queries = sequence_indices(s, cp, r, split)[task.query_rows(s // cp)]
        keys = sequence_indices(s, cp, src, split)[task.key_rows(s // cp)]
        pairs = (keys[None, :] <= queries[:, None]) if task.masked else torch.ones(len(queries), len(keys), dtype=bool)
        assert (keys[None, :] <= queries[:, None])[pairs].all()  # nothing above the diagonal computed
        seen[queries[:, None], keys[None, :]] += pairs.long()
    assert torch.equal(seen, torch.ones(s, s, dtype=torch.int64).tril())


def test_bytes_per_rank_formulas():
    shard = 2 * 16 * 32 // 4 * 4  # b s h / cp elements of 4 bytes
    assert bytes_per_rank("all-gather", 2, 16, 32, 4) == 6 * shard
    assert bytes_per_rank("all-gather", 2, 16, 32, 4, phase="backward") == 6 * shard
    assert bytes_per_rank("ring", 2, 16, 32, 4) == 6 * shard
    assert bytes_per_rank("ring", 2, 16, 32, 4, phase="backward") == 14 * shard
    assert bytes_per_rank("ulysses", 2, 16, 32, 4) == 3 * shard
    assert all(bytes_per_rank(m, 2, 16, 32, 1, phase=p) == 0 for m in METHODS for p in ("forward", "backward"))


def test_learner_mistakes_in_one_process_say_what_to_change():
    with pytest.raises(ValueError, match="cuts s = 10 positions over cp = 4 ranks of equal length: choose s a "
                                         "multiple of 4"):
        shard_sequence(torch.zeros(1, 1, 10, 2), 4, 0)
    with pytest.raises(ValueError, match=r"zigzag split cuts s = 12 positions into 2 cp = 8 chunks .* multiple of 8"):
        zigzag_indices(12, 4, 0)
    with pytest.raises(ValueError, match="split must be 'contiguous' or 'zigzag', got 'zig-zag'"):
        block_pairs(4, "zig-zag")
    with pytest.raises(ValueError, match="method must be one of 'all-gather', 'ring', 'ulysses', got 'flash'"):
        bytes_per_rank("flash", 2, 16, 32, 4)
    with pytest.raises(ValueError, match="rank must be a rank, a whole number from 0 to 3"):
        contiguous_indices(16, 4, 4)


def learner_mistakes():
    """Each mistake on the ranks of a cp = 4 world: the ValueError's sentence."""
    q = torch.zeros(B, A, S // 4, HEAD)
    attempts = {
        "heads": lambda: ATTENTION["ulysses"](*[torch.zeros(B, 6, S // 4, HEAD)] * 3),
        "shapes": lambda: ATTENTION["ring"](q, torch.zeros(B, A, S // 4 + 1, HEAD), q),
        "odd": lambda: ATTENTION["all-gather"](*[torch.zeros(B, A, 3, HEAD)] * 3, split="zigzag"),
        "split": lambda: ATTENTION["ring"](q, q, q, split="head-tail"),
        "layout": lambda: ATTENTION["ring"](*[torch.zeros(B, S // 4, A * HEAD)] * 3),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as error:
            messages[name] = str(error)
    return messages


def all_to_all_like_torch():
    """parlab's all-to-all over p2p moves the same data as gloo's dist.all_to_all_single."""
    x = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6) + 100 * dist.get_rank()
    expected = torch.empty_like(x)
    dist.all_to_all_single(expected, x)  # piece j (rows) to rank j, received pieces stacked as rows
    return torch.equal(all_to_all(x, scatter_dim=0, gather_dim=0), expected)


@pytest.mark.timeout(120)
def test_learner_mistakes_on_the_ranks_say_what_to_change(cluster4):
    for messages in cluster4.run(learner_mistakes, timeout=60):
        assert "a = 6 heads do not split over cp = 4 ranks: choose a multiple of 4 heads" in messages["heads"]
        assert "q, k and v must have one shape and dtype" in messages["shapes"]
        assert "this rank holds 3: choose s a multiple of 2 cp = 8" in messages["odd"]
        assert "split must be 'contiguous' or 'zigzag', got 'head-tail'" in messages["split"]
        assert "must be tensors of shape (b, a, s/cp, h/a)" in messages["layout"]
    assert cluster4.run(all_to_all_like_torch, timeout=60) == [True] * 4


def alone_in_a_group():
    """cp = 1: each rank in a group of its own computes plain attention, and sends nothing."""
    group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    q, k, v, grad_out = inputs(seed=dist.get_rank())
    results = {}
    for method in METHODS:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = ATTENTION[method](*leaves, causal=True, group=group)
        out.backward(grad_out)
        results[method] = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    return results


@pytest.mark.timeout(120)
def test_one_rank_alone_computes_plain_attention_and_sends_nothing(cluster4):
    timeline = cluster4.trace(alone_in_a_group, timeout=60)
    assert timeline.bytes_sent() == [0] * 4
    for rank, results in enumerate(timeline.results):
        ref = reference(*inputs(seed=rank), causal=True)
        for method in METHODS:
            one_process = decomposed(method, True, "contiguous", 1, seed=rank)
            assert_equivalent(results[method], ref, [one_process], f"{method}, cp = 1, rank {rank}")


@pytest.mark.timeout(120)
def test_a_rank_outside_the_group_is_told(cluster4):
    def outside():
        group = dist.new_group([0, 1])
        if dist.get_rank() < 2:
            return None
        q = torch.zeros(B, A, S // 2, HEAD)
        try:
            ATTENTION["ring"](q, q, q, group=group)
        except ValueError as error:
            return str(error)

    messages = cluster4.run(outside, timeout=60)
    assert messages[:2] == [None, None]
    assert all("is not in the group it passed" in m and "mesh.group(\"cp\")" in m for m in messages[2:])
