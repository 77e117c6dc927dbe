"""The project's own promises: conda and pip agree, and CI runs what the README says."""

import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def _requirement(text):
    name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", text.strip()).groups()
    return name.lower(), spec.replace(" ", "")


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip_side = dict(_requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"])
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_side = {}
    for entry in environment["dependencies"]:
        if isinstance(entry, str) and not entry.startswith(("python", "pip")):
            name, spec = _requirement(entry)
            conda_side[CONDA_NAMES.get(name, name)] = spec
    assert conda_side == pip_side
    assert environment["channels"] == ["conda-forge"]
    pip_section = next(e["pip"] for e in environment["dependencies"] if isinstance(e, dict))
    assert pip_section == ['-e ".[dev]"']


def _commands(text):
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_exactly_the_readme_set_up_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    set_up = next(b for b in blocks if "pip install" in b)
    tests = next(b for b in blocks if _commands(b) == ["pytest"])
    ci = _commands((ROOT / ".ci" / "run").read_text())
    ci_work = [c for c in ci if not c.startswith(("set -", "cd ", "rm -rf .venv"))]
    assert ci_work == _commands(set_up) + _commands(tests)


def test_console_script_points_at_the_cli():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"parlab": "parlab.cli:main"}
