"""The linter, as part of the test suite: `pytest` (what CI and the README run) fails when
`ruff check` (configured in pyproject.toml) finds a problem, and shows what it found."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    pytest.importorskip("ruff", reason="ruff is a dev dependency: pip install -e '.[dev]'")
    found = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stdout + found.stderr
