"""The planner's context- and expert-parallel axes (lecture 09): memory and step time of a plan
with cp and ep against the formulas of lecture 09's package (bytes_per_rank, the balanced
all-to-all) and by hand, what rejects such a plan, the Mixtral preset's count, the dense
planner unchanged at cp = ep = 1, and the two decisions lecture 08 shows. Pure arithmetic."""

from dataclasses import replace

import pytest

from parlab.context_parallel import bytes_per_rank
from parlab.context_parallel.costs import PHASES
from parlab.experts import balanced_all_to_all_bytes
from parlab.memory import MIXED_ADAM, model_state_bytes, ring_communication_seconds, transformer_activation_bytes
from parlab.plan import (
    Batch,
    Hardware,
    Model,
    Plan,
    format_table,
    plan_label,
    plan_memory,
    plan_table,
    plan_time,
    plans,
)
from parlab.plan.costs import state_parts

SEVENTY_B, MIXTRAL = Model.llama2_70b(), Model.mixtral_8x7b()
LONG = replace(SEVENTY_B, s=32768, name="70B at s = 32k")
NODE, EIGHT_NODES, SIXTY_FOUR_NODES = (Hardware.dgx_a100(nodes) for nodes in (1, 8, 64))


def test_mixtral_is_counted_from_its_published_shape():
    # Jiang et al. 2024, Table 1: 32 layers of dim 4096, SwiGLU experts of 14336, 8 experts, top-2,
    # 32 heads and 8 key/value heads of 128, vocabulary 32000: "47B parameters, 13B active".
    experts = 32 * 8 * 3 * 4096 * 14336
    assert MIXTRAL.expert_psi == experts == 45_097_156_608
    assert MIXTRAL.psi == 46_702_792_704 and (MIXTRAL.E, MIXTRAL.k, MIXTRAL.s) == (8, 2, 32768)
    assert round(MIXTRAL.active_psi / 1e9) == 13 and SEVENTY_B.active_psi == SEVENTY_B.psi


def test_a_dense_model_plans_as_before_and_its_table_has_no_new_columns():
    every = plans(SEVENTY_B, Batch(1024), SIXTY_FOUR_NODES)
    assert {(p.cp, p.ep) for p in every} == {(1, 1)} and len(every) == 4176
    assert every == plans(SEVENTY_B, Batch(1024), SIXTY_FOUR_NODES, cp=(1,), ep=(1,))
    header = format_table(plan_table(every, n=2)).splitlines()[0].split()
    assert "cp" not in header and "context" not in header and "experts" not in header
    assert all(p.time.context == p.time.experts == 0 for p in every if p.time)


def test_with_cp_each_rank_holds_s_over_cp_tokens_and_shards_over_N_d_cp():
    plan = Plan(16, 8, 1, zero=1, b=1, M=8, recompute="selective", cp=4)
    memory = plan_memory(LONG, plan)
    layer = transformer_activation_bytes(32768 // 4, 1, 8192, 64, 1, "selective", 8, sequence_parallel=True)
    every = transformer_activation_bytes(32768 // 4, 1, 8192, 64, 1, None, 8, sequence_parallel=True)
    assert memory.activations == layer * 80 + every - layer
    assert memory.states == model_state_bytes(LONG.psi / 8, 1, 16 * 4, *MIXED_ADAM)
    assert plan.ranks == 512


def ring_attention_seconds(hardware, cp, recompute, M):
    """The context term by hand: 80 layers x M micro-batches of what the block's attention
    does not hide (70B at s = 32k, t = 8, b = 1, 16-bit, across the inter-node link)."""
    block = 2 * (32768 // cp) * (8192 // 8) * 2  # one rank's K and V of its heads
    f = 2 * (32768 // cp) ** 2 * (8192 // 8) / (312e12 * 0.5)  # a causal block's attention, forward
    tau = hardware.inter.time(block)
    forward = (cp - 1) * max(0, tau - f) * (2 if recompute == "full" else 1)
    return 80 * M * (forward + max(0, (2 * cp - 1) * tau - 2 * cp * f))


def test_the_context_term_is_ring_attentions_transfers_not_hidden_by_its_blocks():
    slow = replace(EIGHT_NODES, inter=replace(EIGHT_NODES.inter, bandwidth=EIGHT_NODES.inter.bandwidth / 1e4))
    for cp, recompute in ((2, None), (4, "full"), (8, "selective")):  # t cp >= 16: across nodes
        plan = Plan(64 // cp, 8, 1, zero=1, b=1, M=128 // (64 // cp), recompute=recompute, cp=cp)
        forward, backward = (bytes_per_rank("ring", 1, 32768, 8192 // 8, cp, 2, phase) for phase in PHASES)
        block = 2 * (32768 // cp) * (8192 // 8) * 2
        assert forward == (cp - 1) * block and backward == (2 * cp - 1) * block  # the transfers the term prices
        times = {hardware: plan_time(LONG, Batch(128), hardware, plan) for hardware in (EIGHT_NODES, slow)}
        for hardware, time in times.items():
            assert time.context == pytest.approx(ring_attention_seconds(hardware, cp, recompute, plan.M), rel=1e-12)
        # a block's transfer grows as s/cp, its attention as (s/cp)^2: InfiniBand hides it at cp = 2, not at 8
        assert (times[EIGHT_NODES].context == 0) == (cp == 2)
        assert times[slow].context > 100 * times[slow].compute / 1e4  # on a slow link little is hidden
        assert times[slow].compute == times[EIGHT_NODES].compute


def test_with_ep_the_experts_split_ep_ways_and_their_all_to_alls_are_priced():
    plan = Plan(4, 2, 1, zero=2, b=1, M=16, recompute="selective", ep=4)  # 32 GPUs: 4 nodes
    dense, experts = state_parts(MIXTRAL, plan)
    assert dense == ((MIXTRAL.psi - MIXTRAL.expert_psi) / 2, 4 * 4) and experts == (MIXTRAL.expert_psi / 8, 4)
    memory = plan_memory(MIXTRAL, plan)
    parts = [model_state_bytes(numel, 2, D, *MIXED_ADAM) for numel, D in (dense, experts)]
    assert memory.states == tuple(a + b for a, b in zip(*parts))
    hardware = Hardware.dgx_a100(4)
    time = plan_time(MIXTRAL, Batch(256), hardware, plan)
    tokens = 32768 / 2  # b s / (cp t): a rank's tokens with sequence parallelism
    sent = balanced_all_to_all_bytes(tokens, 2, 4096, 4, 2)
    assert sent == tokens * 2 * 4096 * 2 * 3 / 4
    link = hardware.intra  # t cp ep = 8 ranks: one node
    assert time.experts == pytest.approx(32 * 16 * 4 * (3 * link.latency + sent / link.bandwidth), rel=1e-12)
    # compute counts the parameters a token passes through: k of E experts
    assert time.compute == pytest.approx((6 * MIXTRAL.active_psi * 256 * 32768 + 4 * 256 * 32768**2 * 4096 * 32)
                                         / (32 * 312e12 * 0.5), rel=1e-12)
    # the data axis, not overlapped: dense gradients over N_d ep = 16 ranks, the experts' over N_d = 4,
    # one ring each, reduce-scattered every micro-batch at stage 2 (M + 1 collectives, not 2)
    link = hardware.inter  # the data group spans all 4 nodes
    ring = sum(ring_communication_seconds([-(-int(numel) // D) * D], D, 2, 2, link.latency, link.bandwidth)
               for numel, D in (dense, experts))
    exposed = plan_time(MIXTRAL, Batch(256), hardware, plan, overlapped=())
    assert exposed.data == pytest.approx(ring * (16 + 1) / 2, rel=1e-12) and 0 < time.data < exposed.data


def test_an_axis_that_does_not_fit_is_rejected_with_a_sentence():
    twelve = replace(NODE, gpus_per_node=12)
    sentences = " ".join(" ".join(p.reasons) for p in plans(replace(MIXTRAL, s=4104), Batch(12), twelve,
                                                             cp=(1, 2, 3), ep=(1, 3, 4)))
    assert "cp = 2 does not cut s = 4104 into the 2 cp equal chunks of the zig-zag split" not in sentences
    assert "cp = 3 does not cut s = 4104" not in sentences  # 4104 = 6 x 684
    assert "ep = 3 does not divide the E = 8 experts: each rank holds E / ep of them." in sentences
    assert "B = 12 does not split into N_d ep = 3 x 4 ranks of micro-batches of b = 2." in sentences
    odd = " ".join(" ".join(p.reasons) for p in plans(replace(LONG, s=32770), Batch(8), NODE, cp=(2, 4)))
    assert "cp = 4 does not cut s = 32770 into the 2 cp equal chunks of the zig-zag split." in odd


@pytest.mark.parametrize("call, message", [
    (lambda: plans(SEVENTY_B, Batch(8), NODE, cp=0), r"each cp degree must be a whole number >= 1, got 0"),
    (lambda: plans(SEVENTY_B, Batch(8), NODE, ep=[1, 2]), r"ep must be a tuple of degrees to try, got \[1, 2\]"),
    (lambda: replace(MIXTRAL, k=9), "k = 9 experts per token, but a layer has only E = 8: choose k <= E"),
    (lambda: replace(MIXTRAL, expert_psi=0), "a mixture of experts .E > 1. has expert parameters"),
    (lambda: replace(SEVENTY_B, expert_psi=5), "a dense model .E = 1. has none"),
])
def test_bad_axes_get_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_label_and_a_plan_say_their_axes():
    plan = Plan(8, 2, 1, zero=3, b=1, M=8, recompute="selective", cp=2, ep=4)
    assert plan_label(plan) == "8x2x1 cp2 ep4 Z3 sel"
    assert str(plan).startswith("N_d=8 t=2 K=1 cp=2 ep=4 ZeRO-3")


def test_at_32k_tokens_cp_lets_the_70b_keep_its_activations_instead_of_recomputing():
    without = [p for p in plans(LONG, Batch(128), SIXTY_FOUR_NODES) if not p.rejected]
    assert without and {p.recompute for p in without} == {"full"}  # nothing else fits at t <= 8
    every = plans(LONG, Batch(128), SIXTY_FOUR_NODES, cp=(1, 2, 4, 8))
    best = every[0]
    assert best.cp > 1 and best.recompute == "selective" and best.time.context == 0
    assert best.time.total < without[0].time.total


def test_mixtral_at_4k_tokens_takes_ep_and_at_32k_cp_too():
    short = replace(MIXTRAL, s=4096)
    for nodes in (8, 16, 64):
        hardware = Hardware.dgx_a100(nodes)
        best = plans(short, Batch(256), hardware)[0]
        dense = [p for p in plans(short, Batch(256), hardware, ep=(1,)) if not p.rejected][0]
        assert best.ep > 1 and best.time.total < dense.time.total, nodes
    best = plans(MIXTRAL, Batch(128), EIGHT_NODES, cp=(1, 2, 4, 8))[0]
    assert best.cp > 1 and best.ep > 1
