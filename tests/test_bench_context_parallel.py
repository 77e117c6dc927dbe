"""parlab bench context_parallel: the structure of its result, its ratios made from the times
and bytes it measured, the bytes each rank sent (counted in the trace) equal to
``bytes_per_rank``, ring attention's saved bytes equal to its docstring's q, k, v, out and
lse, and its overlap figures made from the trace and the link; never its speed."""

import json

import pytest

from parlab import Link, cli
from parlab.bench import ratio_header
from parlab.bench.context_parallel import ONE_PROCESS, REFERENCE, bench_context_parallel, format_report
from parlab.context_parallel import METHODS

B, H, A, SEQS = 1, 16, 2, [8, 16]  # s a multiple of 2 cp = 4; a a multiple of cp = 2 (Ulysses)


@pytest.mark.timeout(180)
def test_command_line_json_counts_the_bytes_and_makes_the_ratios(capsys):
    argv = ["bench", "context_parallel", "--json", "--world-sizes", "2", "--seqs", *map(str, SEQS), "--batch-size",
            str(B), "--hidden", str(H), "--heads", str(A), "--steps", "2", "--link", "200us,100MB/s"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ratio_means"] == ratio_header(REFERENCE) and result["link"] == {"latency": 2e-4, "bandwidth": 1e8}
    rows = result["rows"]
    assert [(row["cp"], row["s"], row["method"]) for row in rows] == [
        (2, s, method) for s in SEQS for method in (ONE_PROCESS, *METHODS)]
    for s in SEQS:
        one, *methods = [row for row in rows if row["s"] == s]
        assert one["ratio"] == 1.0 and one["memory_ratio"] == 1.0
        for row in methods:
            assert row["ratio"] == pytest.approx(row["seconds_median"] / one["seconds_median"])
            assert row["memory_ratio"] == row["saved_bytes"] / one["saved_bytes"]
            assert len(row["seconds"]) == 2 and all(t > 0 for t in row["seconds"])
            for phase in ("forward", "backward"):  # counted in the trace, not timed
                assert row[f"{phase}_bytes"] == [row[f"{phase}_bytes_formula"]] * 2, (s, row["method"], phase)
            assert row["bytes_equal_formula"]
        ring = next(row for row in methods if row["method"] == "ring")
        assert ring["saved_bytes"] == 4 * (4 * B * s * H // 2 + B * A * s // 2)  # q, k, v, out and lse of s/cp
        overlap = ring["overlap"]
        assert overlap["transfer_s"] == Link(2e-4, 1e8).time(2 * B * (s // 2) * H * 4)  # one K/V block
        assert 0 <= overlap["hidden_fraction"] <= 1 and 0 < overlap["hidden_fraction_model"] <= 1
        assert overlap["exposed_s"] >= 0 and overlap["exposed_s_model"] >= 0
    report = format_report(result)
    assert ratio_header(REFERENCE) in report and "K/V hidden (model)" in report and " =" in report


def test_bad_sizes_say_what_to_change():
    link = Link(1e-4, 1e9)
    with pytest.raises(ValueError, match="emulates a link: pass a parlab.Link"):
        bench_context_parallel(None)
    with pytest.raises(ValueError, match="h = 10 does not split into a = 4 heads"):
        bench_context_parallel(link, h=10, a=4)
    with pytest.raises(ValueError, match=r"cp = 4 needs a multiple of cp heads \(Ulysses; a = 2\)"):
        bench_context_parallel(link, world_sizes=[4], seqs=[16], h=16, a=2)
    with pytest.raises(ValueError, match=r"each s a multiple of 2 cp = 4 \(the zig-zag split; got \[6\]\)"):
        bench_context_parallel(link, world_sizes=[2], seqs=[8, 6], h=16, a=2)
