"""The README's promises: the runtime example in "Use it" does what its comments say, and the
README and `parlab doctor` give the same advice for running JupyterLab as root."""

import re
from pathlib import Path

import matplotlib
import pytest

from parlab.course import doctor
from parlab.trace import COMM

ROOT = Path(__file__).resolve().parents[1]


def use_it_section():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Use it\n")
    return readme[start : readme.index("\n## ", start + 1)]


def runtime_example():
    blocks = re.findall(r"```python\n(.*?)```", use_it_section(), flags=re.S)
    assert len(blocks) == 1, "the 'Use it' section has one python example"
    return blocks[0]


@pytest.mark.timeout(120)
def test_the_runtime_example_does_what_its_comments_say(capsys):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    code = runtime_example()
    namespace = {"__name__": "__main__"}  # as in a notebook cell: the functions travel by value
    exec(compile(code, "README.md", "exec"), namespace)

    rank_lines = [f"[rank {r}] my sum 6.0" for r in range(4)]
    results = ["[6.0, 6.0, 6.0, 6.0]", "[6.0, 10.0, 14.0, 18.0]", "[24, 24, 24, 24]"]
    assert capsys.readouterr().out.splitlines() == rank_lines + results[:1] + rank_lines + results[1:]
    assert '"[rank r] my sum 6.0"' in code
    assert all(f"# {line}" in code for line in results)  # what the comments say is printed

    # "every rank's sends and recvs": the ring on N ranks takes 2 (N - 1) steps of one each.
    timeline = namespace["timeline"]
    for rank in range(4):
        names = sorted(event.name for event in timeline.select(rank=rank, kind=COMM))
        assert names == ["isend"] * 6 + ["recv"] * 6
        assert all(event.end >= event.start for event in timeline.select(rank=rank))
    # "a Gantt chart, one row per rank"
    (ax,) = plt.gcf().axes
    assert [label.get_text() for label in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    plt.close("all")


def test_readme_and_doctor_say_what_to_do_about_jupyter_as_root(monkeypatch):
    note = " ".join(use_it_section().split())
    assert "As root (in a container, say) `jupyter lab` refuses to start" in note
    monkeypatch.setattr(doctor.os, "geteuid", lambda: 0)
    status, message = doctor.check_user()
    assert status == doctor.INFO
    for advice in ("refuses to start as root", "normal user", "--allow-root"):
        assert advice in message and advice.replace(" as root", "") in note
    monkeypatch.setattr(doctor.os, "geteuid", lambda: 1000)
    assert doctor.check_user()[0] == doctor.OK


def emulation_example():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Real and emulated time\n")
    section = readme[start : readme.index("\n## ", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


@pytest.mark.timeout(120)
def test_the_emulation_example_does_what_its_comments_say(capsys):
    exec(compile(emulation_example(), "README.md (Real and emulated time)", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed == ["[4.0, 4.0, 4.0, 4.0]", "emulated: link 200 µs + bytes / (100 MB/s)", "True"]
