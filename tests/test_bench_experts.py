"""parlab bench experts: the structure of its result, the bytes it traced equal to their
formulas (the MoE's all-to-alls from the router's counts, the dense layer's two ring
all-reduces), and its shares, ratios and predictions made from what it measured; never its
speed. Bad arguments are refused."""

import json
import statistics

import pytest

from parlab import Link, cli
from parlab.alpha_beta import cost_model
from parlab.bench import ratio_header
from parlab.bench.experts import LAYERS, REFERENCE, bench_experts

H, E, K, T = 16, 4, 2, 16
LINK = Link(latency=20e-6, bandwidth=1e9)


@pytest.mark.timeout(240)
def test_command_line_json_measures_both_layers_at_each_ep_and_the_bytes_equal_the_formulas(capsys):
    argv = ["bench", "experts", "--json", "--ep", "2", "4", "--steps", "2", "--hidden", str(H), "--experts", str(E),
            "--k", str(K), "--tokens", str(T), "--capacity-factor", "1.0", "--link", "20us,1GB/s"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["bench"] == "experts" and result["steps"] == 2 and result["ratio_means"] == ratio_header(REFERENCE)
    assert result["config"] == {"h": H, "E": E, "k": K, "T": T, "capacity_factor": 1.0}
    assert result["link"] == {"latency": LINK.latency, "bandwidth": LINK.bandwidth}
    assert [(row["ep"], row["layer"]) for row in result["rows"]] == [(N, layer) for N in (2, 4) for layer in LAYERS]
    for moe, dense in zip(result["rows"][::2], result["rows"][1::2]):
        N = moe["ep"]
        for row in (moe, dense):
            assert len(row["seconds"]) == len(row["comm_s"]) == 2
            assert row["median_s"] == statistics.median(row["seconds"])
            assert row["comm_share"] == pytest.approx(row["comm_median_s"] / row["median_s"])
            assert row["measured_over_predicted"] == pytest.approx(row["comm_median_s"] / row["predicted_comm_s"])
            assert row["sent_bytes"] == row["formula_bytes"] and len(row["sent_bytes"]) == N
        assert moe["ratio"] == pytest.approx(moe["median_s"] / dense["median_s"])
        # the dense layer: two ring all-reduces of the (N T, h) activation, and their model
        D = N * T * H * 4
        assert dense["sent_bytes"] == [2 * 2 * (N - 1) * D // N] * N
        assert dense["predicted_comm_s"] == pytest.approx(2 * cost_model("ring", D, N, LINK.latency,
                                                                         1 / LINK.bandwidth))
        # the MoE: at most every kept row leaves twice and comes back twice, plus the counts
        counts = (N - 1) * (E // N) * 8
        assert all(counts < sent <= counts + 4 * T * K * H * 4 for sent in moe["sent_bytes"])
        assert moe["predicted_comm_s"] >= 5 * (N - 1) * LINK.latency


def test_bad_arguments_say_what_to_change():
    with pytest.raises(ValueError, match="E = 6 experts do not split over ep = 4 ranks"):
        bench_experts(LINK, [4], E=6)
    with pytest.raises(ValueError, match="the dense layer's k x 4h = 4 features do not split over t = 8"):
        bench_experts(LINK, [8], h=1, E=8, k=1)
    with pytest.raises(ValueError, match="pass one, e.g. parlab.Link"):
        bench_experts(None)
