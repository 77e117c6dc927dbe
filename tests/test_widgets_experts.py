"""Lecture 09's router widget without a browser: the routing it draws against
``parlab.experts``' route, expert_capacity, dispatch_order and all_to_all_bytes, the bytes
matrix against the bytes a real dispatch on two ranks sends (traced), the bars and heatmap
against those numbers, the skew's drops, the widget answering its controls, learners'
mistakes refused with a sentence, and the static picture."""

import sys

import matplotlib
import pytest
import torch
from test_widgets_common import shell  # noqa: F401 (a fixture: an IPython shell, as in a notebook)
from test_widgets_context_parallel import static_picture
from test_widgets_pipeline import controls

from parlab.experts import all_to_all_bytes, dispatch_order, expert_capacity, route
from parlab.units import KB
from parlab.widgets.experts import (
    plot_all_to_all,
    plot_expert_load,
    plot_routing,
    router_logits,
    router_readout,
    router_widget,
    routing_numbers,
    skewed_experts,
)

matplotlib.use("Agg")
SETTINGS = [(8, 2, 4, 1.25, 0.0), (8, 1, 2, 1.0, 2.0), (16, 2, 8, 1.0, 3.0), (4, 2, 1, 0.5, 0.0)]  # E k ep cf skew


# --- the plain functions -------------------------------------------------------------------------


def test_the_logits_are_seeded_and_the_skew_lifts_the_first_quarter():
    base, skewed = router_logits(32, 8, 0.0, seed=3), router_logits(32, 8, 1.5, seed=3)
    assert torch.equal(base, router_logits(32, 8, 0.0, seed=3)) and not torch.equal(base, router_logits(32, 8, seed=4))
    assert list(skewed_experts(8)) == [0, 1] and list(skewed_experts(2)) == [0]
    assert torch.allclose(skewed - base, torch.tensor([1.5, 1.5, 0, 0, 0, 0, 0, 0]).expand(32, 8))


@pytest.mark.parametrize("E, k, ep, cf, skew", SETTINGS)
def test_the_numbers_are_the_packages_routing_on_each_rank(E, k, ep, cf, skew):
    numbers = routing_numbers(E, k, ep, cf, skew, T=48, h=16, seed=5)
    capacity = expert_capacity(48, E, k, cf)
    assert numbers["capacity"] == capacity
    held, row_bytes = E // ep, 16 * 4
    for r, routing in enumerate(numbers["routings"]):
        expected = route(router_logits(48, E, skew, seed=5 + r), k, capacity)
        assert torch.equal(routing.expert, expected.expert) and torch.equal(routing.dropped, expected.dropped)
        kept = dispatch_order(expected)[1].tolist()
        assert numbers["kept"][r] == kept and numbers["chose"][r] == expected.tokens_per_expert.tolist()
        assert all(rows <= capacity for rows in kept) and sum(numbers["chose"][r]) == 48 * k
        # dispatch sends rank p the rows of its experts p E/ep .. (p + 1) E/ep - 1
        assert numbers["bytes"][r] == [sum(kept[p * held:(p + 1) * held]) * row_bytes for p in range(ep)]
        elsewhere = sum(numbers["bytes"][r]) - numbers["bytes"][r][r]
        assert numbers["sent"][r] == elsewhere == all_to_all_bytes(expected, r, ep, 16, 4)
    dropped = sum(sum(chose) - sum(kept) for chose, kept in zip(numbers["chose"], numbers["kept"]))
    assert numbers["pairs"] == 48 * k * ep and numbers["dropped"] == dropped


def test_a_capacity_factor_of_E_over_k_drops_nothing_and_skew_makes_drops():
    assert routing_numbers(8, 2, 4, capacity_factor=4.0, skew=3.0)["dropped"] == 0
    drops = [routing_numbers(8, 2, 4, 1.25, skew)["dropped"] for skew in (0.0, 1.0, 2.0, 4.0)]
    assert drops == sorted(drops) and drops[-1] > 4 * drops[0]
    numbers = routing_numbers(8, 2, 4, 1.25, 4.0)
    load = [sum(chose[e] for chose in numbers["chose"]) for e in range(8)]
    assert max(range(8), key=load.__getitem__) in skewed_experts(8)
    assert numbers["tokens_lost"] > 0


def dispatch_on_ranks(E, k, cf, skew, T, h, seed):
    """Each rank routes its router_logits and sends the rows by parlab.experts.dispatch."""
    import torch.distributed as dist

    from parlab import trace
    from parlab.experts import dispatch

    r = dist.get_rank()
    routing = route(router_logits(T, E, skew, seed + r), k, expert_capacity(T, E, k, cf))
    with trace.span("step"):
        dispatch(torch.randn(T, h), routing)


def test_the_matrix_is_what_a_real_dispatch_sends(cluster2):
    timeline = cluster2.trace(dispatch_on_ranks, 8, 2, 1.0, 2.0, 32, 16, 7, timeout=60).window("dispatch", 0)
    numbers = routing_numbers(8, 2, 2, 1.0, 2.0, T=32, h=16, seed=7)
    for r in range(2):
        for p in range(2):
            traced = sum(ev.nbytes for ev in timeline.select(rank=r, name="all_to_all send") if ev.peer == p)
            assert traced == (0 if p == r else numbers["bytes"][r][p]), (r, p)  # a rank's own rows stay
    assert numbers["dropped"] > 0  # the skew made the router uneven


def test_the_bars_stack_the_kept_rows_by_rank_under_the_dropped_ones():
    numbers = routing_numbers(8, 2, 4, 1.0, 2.0)
    ax = plot_expert_load(numbers)
    bars = {patch.get_gid(): patch for patch in ax.patches if patch.get_gid()}
    for e in range(8):
        assert [bars[f"kept-{e}-{r}"].get_height() for r in range(4)] == [numbers["kept"][r][e] for r in range(4)]
        dropped = sum(numbers["chose"][r][e] - numbers["kept"][r][e] for r in range(4))
        assert (bars[f"dropped-{e}"].get_height() if dropped else 0) == dropped
        assert (f"dropped-{e}" in bars) == (dropped > 0)
        if dropped:
            assert bars[f"dropped-{e}"].get_y() == sum(numbers["kept"][r][e] for r in range(4))
            assert f"-{dropped}" in [text.get_text() for text in ax.texts]
    capacity, share = ax.lines
    assert list(capacity.get_ydata()) == [4 * numbers["capacity"]] * 2
    assert list(share.get_ydata()) == [64 * 2 * 4 / 8] * 2
    assert "skewed: 0..1" in ax.get_xlabel()


def test_the_heatmap_writes_each_ranks_bytes_to_each_rank():
    numbers = routing_numbers(8, 2, 4, 1.25, 1.0)
    ax = plot_all_to_all(numbers)
    cells = {(text.get_position()[1], text.get_position()[0]): text.get_text() for text in ax.texts}
    for r in range(4):
        for p in range(4):
            written = f"{numbers['bytes'][r][p] / KB:.1f}" + ("\n(stays)" if r == p else "")
            assert cells[(r, p)] == written
    rows = [label.get_text() for label in ax.get_yticklabels()]
    assert rows == [f"rank {r}\nsends {numbers['sent'][r] / KB:.1f}" for r in range(4)]
    assert ax.images[0].get_array().mask.tolist() == torch.eye(4, dtype=torch.bool).tolist()  # the diagonal: gray


def test_one_rank_sends_nothing():
    numbers = routing_numbers(8, 1, 1)
    assert numbers["sent"] == [0] and numbers["bytes"] == [[sum(numbers["kept"][0]) * 128 * 4]]
    ax = plot_all_to_all(numbers)
    assert ax.images[0].get_clim() == (0, 1.0)


def test_the_figure_puts_the_bars_beside_the_heatmap():
    load, traffic = plot_routing(8, 2, 4, 1.25, 0.5).axes[:2]
    assert load.get_title().startswith("rows per expert: T = 64 tokens on each of ep = 4 ranks, top-2")
    assert traffic.get_title().startswith("dispatch all-to-all")


def test_the_sentence_gives_the_drops_the_busiest_expert_and_the_bytes():
    numbers = routing_numbers(8, 2, 4, 1.25, 2.0)
    load = [sum(chose[e] for chose in numbers["chose"]) for e in range(8)]
    busiest = max(range(8), key=load.__getitem__)
    sentence = router_readout(numbers)
    assert sentence.startswith(f"dropped {numbers['dropped']} of 512 (token, choice) pairs "
                               f"({numbers['dropped'] / 512:.1%}); {numbers['tokens_lost']} tokens lost every choice.")
    assert (f"Busiest expert {busiest}: {load[busiest]} pairs chose it, capacity 4 x 20 = 80: "
            f"load / capacity = {load[busiest] / 80:.2f}.") in sentence
    sent = ", ".join(f"{b / KB:.1f}" for b in numbers["sent"])
    assert sentence.endswith(f"Each rank sends {sent} kB in dispatch (and as much in combine).")


@pytest.mark.parametrize("call, message", [
    (lambda: routing_numbers(E=6, ep=4), "E = 6 experts do not split over ep = 4 ranks: choose E a multiple of 4"),
    (lambda: routing_numbers(E=8, k=9), "k = 9 experts per token, but there are only E = 8 experts"),
    (lambda: routing_numbers(capacity_factor=0), "capacity_factor must be above 0 .*, got 0: choose a slack"),
    (lambda: routing_numbers(skew=-1.0), "skew must be at least 0 .*, got -1.0: give the bias"),
    (lambda: routing_numbers(ep=0), r"ep \(the expert-parallel degree\) must be a whole number >= 1, got 0"),
    (lambda: plot_routing(E=64, ep=4), r"E \(experts\) must be a whole number from 1 to 32, got 64: the bars draw"),
    (lambda: plot_routing(E=16, ep=16), r"ep \(the expert-parallel degree\) must be a whole number from 1 to 8"),
    (lambda: router_widget(skew=5.0), "skew must be a number from 0 to 4, got 5.0: the skew slider"),
    (lambda: router_widget(capacity_factor=8.0), "capacity_factor must be a number from 0.25 to 4, got 8.0"),
    (lambda: router_widget(k=5), r"k \(experts per token\) must be a whole number from 1 to 4, got 5"),
])
def test_bad_input_gets_a_sentence_saying_what_to_change(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- the widget ------------------------------------------------------------------------------------


def test_the_widget_redraws_when_its_controls_change():
    widget = router_widget(E=8, k=2, ep=4, capacity_factor=1.25, skew=0.0)
    found, readout, image = controls(widget), widget.children[-2], widget.children[-1]
    assert image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert readout.value == router_readout(routing_numbers(8, 2, 4, 1.25, 0.0))
    assert list(found["ep"].options) == [1, 2, 4, 8]
    pictures = [image.value]
    for name, value, settings in (("skew", 2.0, (8, 2, 4, 1.25, 2.0)), ("capacity factor", 2.0, (8, 2, 4, 2.0, 2.0)),
                                  ("k (experts per token)", 1, (8, 1, 4, 2.0, 2.0)), ("ep", 2, (8, 1, 2, 2.0, 2.0))):
        found[name].value = value
        assert image.value not in pictures, name
        assert readout.value == router_readout(routing_numbers(*settings)), name
        pictures.append(image.value)
    found["k (experts per token)"].value = 2
    found["capacity factor"].value = 4.0  # E / k: every expert can take every token
    assert readout.value.startswith("dropped 0 of 256 (token, choice) pairs (0.0%)")
    assert "parlab-error" not in widget.children[-3].children[0].value


def test_without_ipywidgets_the_widget_is_the_static_figure(monkeypatch):
    from matplotlib.figure import Figure

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.warns(UserWarning, match="ipywidgets is not installed"):
        figure = router_widget(E=8, k=1, ep=2)
    assert isinstance(figure, Figure) and "ep = 2 ranks, top-1" in figure.axes[0].get_title()


@pytest.mark.usefixtures("shell")
def test_in_a_notebook_the_widget_leaves_a_png_of_its_first_state():
    widget, picture, captions = static_picture(lambda: router_widget(skew=1.0))
    assert picture == widget.children[-1].value
    assert any("top-2 routing to E = 8 experts on ep = 4 ranks, capacity factor 1.25, skew 1" in caption
               for caption in captions)
