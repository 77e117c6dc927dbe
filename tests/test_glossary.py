"""One meaning per symbol across the lectures: notebooks/GLOSSARY.md holds them, and every
lecture sends its reader there from its first cell."""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
LECTURES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def test_the_glossary_gives_each_symbol_one_row():
    rows = re.findall(r"^\| (\$[^$]+\$|\S[^|]*?) \|", (NOTEBOOKS / "GLOSSARY.md").read_text(), flags=re.M)
    symbols = [row for row in rows if row not in ("symbol",)]
    assert len(symbols) == len(set(symbols)), sorted(s for s in symbols if symbols.count(s) > 1)
    assert {"$N$", "$N_d$", "$K$", "$\\kappa$", "$D$", "$M$", "$\\Psi$"} <= set(symbols)


@pytest.mark.parametrize("lecture", LECTURES, ids=lambda path: path.stem)
def test_every_lecture_links_the_glossary_in_its_first_cell(lecture):
    first = "".join(json.loads(lecture.read_text())["cells"][0]["source"])
    assert "(GLOSSARY.md)" in first, f"{lecture.name}: link notebooks/GLOSSARY.md in the first cell"


def test_the_loss_scale_does_not_take_hybrid_shard_s():
    # Lecture 04 and parlab.zero.fsdp write S for HYBRID_SHARD's shard group; the loss scale
    # of mixed precision (lecture 07) once took the same letter.
    rows = dict(re.findall(r"^\| (\$[^$]+\$) \| ([^|]*) \|", (NOTEBOOKS / "GLOSSARY.md").read_text(), flags=re.M))
    assert "HYBRID_SHARD" in rows["$S$"]
    scale = [symbol for symbol, meaning in rows.items() if meaning.startswith("loss scale")]
    assert scale and scale != ["$S$"]
