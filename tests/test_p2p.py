"""Message sizes in parlab.p2p: gloo aborts a rank that receives a message longer than the
tensor it posted (no Python on that rank can catch it); its peers say what they sent, and
``explain_size_mismatch`` (in the runtime's errors, the RankError's first line) names both
ranks and both sizes. The wording of p2p's ConnectionError is the contract between the two."""

import pytest
import torch
import torch.distributed as dist

import parlab
from parlab import p2p
from parlab.runtime.errors import RankError, explain_size_mismatch

GLOO_ABORT = (
    "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
    "  what():  [enforce fail at gloo/transport/tcp/pair.cc:456] op.preamble.length <= op.nbytes. 24 vs 20. "
    "Received data size doesn't match expected size.\n"
)
# faulthandler's dump of the aborted rank (most recent call first), as each worker writes it.
STACK = (
    "Fatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n"
    '  File "/site/parlab/p2p.py", line 61 in wait\n'
    '  File "/site/parlab/p2p.py", line 84 in wait_all\n'
    '  File "<dynamic-code>", line 59 in ring_reduce_scatter\n'
    '  File "/site/parlab/runtime/worker.py", line 122 in _run_call\n'
)
SENDER = (
    "ConnectionError: rank 1 lost its connections during its wait for its isend to rank 2: another rank's "
    "process ended (see its failure). The last message sizes this rank sent: to rank 0, 3 float32 elements "
    "(12 bytes); to rank 2, 6 float32 elements (24 bytes); to rank 2, 5 float32 elements (20 bytes)."
)


def test_the_hint_names_both_ranks_both_sizes_and_the_line():
    assert explain_size_mismatch({1: SENDER, 2: GLOO_ABORT + STACK}) == (
        "rank 2 expected 5 float32 elements from rank 1 (in ring_reduce_scatter, line 59) but rank 1 sent 6: "
        "sender and receiver must agree on every message's size (for chunks, check how chunk sizes are "
        "computed for uneven lengths)"
    )


def test_without_the_sender_the_hint_gives_the_bytes_gloo_reports():
    assert explain_size_mismatch({2: GLOO_ABORT, 3: "Traceback ...\nValueError: other"}).startswith(
        "rank 2 received 24 bytes into a tensor of 20 bytes: sender and receiver must agree"
    )
    # A sender that sent 24 bytes to another rank is not taken for this one's.
    assert " from rank" not in explain_size_mismatch({2: GLOO_ABORT, 1: SENDER.replace("to rank 2", "to rank 3")})


def test_other_failures_have_no_size_hint():
    assert explain_size_mismatch({0: "Traceback ...\nValueError: bad size", 1: SENDER}) is None


def send_six_receive_five():
    """Rank 0 sends 6 float32 elements where rank 1 posted a receive for 5, then waits for
    an answer that never comes: rank 1's process is gone."""
    if dist.get_rank() == 0:
        p2p.send(torch.arange(6.0), 1)
        p2p.recv(torch.empty(1), 1)
    else:
        p2p.recv(torch.empty(5), 0)


RECEIVING_LINE = send_six_receive_five.__code__.co_firstlineno + 7


@pytest.mark.timeout(120)
def test_a_message_longer_than_its_receive_is_explained_in_the_rank_errors_first_line(monkeypatch):
    # The workers dump their own stacks on a fatal signal: no PYTHONFAULTHANDLER needed.
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    with parlab.Cluster(world_size=2, timeout=60) as cluster:
        with pytest.raises(RankError) as caught:
            cluster.run(send_six_receive_five, timeout=30)
        failures = caught.value.failures
        assert "op.preamble.length <= op.nbytes. 24 vs 20" in failures[1]  # what gloo 2.13 says as it aborts
        assert "ConnectionError: rank 0 lost its connections during its " in failures[0]
        assert "to rank 1, 6 float32 elements (24 bytes)" in failures[0]  # the contract with explain_size_mismatch
        assert caught.value.dead == [1]
        assert str(caught.value).splitlines()[0] == (
            f"ranks 0, 1 failed: rank 1 expected 5 float32 elements from rank 0 (in send_six_receive_five, "
            f"test_p2p.py line {RECEIVING_LINE}) but rank 0 sent 6: sender and receiver must agree on every "
            "message's size (for chunks, check how chunk sizes are computed for uneven lengths)"
        )
        assert cluster.run(dist.get_rank, timeout=60) == [0, 1]  # repaired
