"""The project's own promises: conda and pip agree, and CI runs what the README says."""

import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
CONDA_NAMES = {"pytorch-cpu": "torch"}  # conda-forge name -> PyPI name
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's index of CPU-only wheels


def _requirement(text):
    name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", text.strip()).groups()
    return name.lower(), spec.replace(" ", "")


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_environment_yml_lists_the_lectures_dependencies_with_a_cpu_pytorch():
    project = _project()
    pip_side = dict(_requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["lectures"])
    environment = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_side = {}
    for entry in environment["dependencies"]:
        if isinstance(entry, str) and not entry.startswith(("python", "pip")):
            name, spec = _requirement(entry)
            conda_side[CONDA_NAMES.get(name, name)] = spec
    assert conda_side == pip_side
    assert environment["channels"] == ["conda-forge"]
    pip_section = next(e["pip"] for e in environment["dependencies"] if isinstance(e, dict))
    assert pip_section == ['-e ".[lectures]"']


def test_the_dev_extra_is_the_lectures_extra_and_the_developers_tools():
    extras = _project()["optional-dependencies"]
    lectures = {_requirement(r)[0] for r in extras["lectures"]}
    # what the notebooks import, and what `parlab grade` runs (pytest with a timeout per task)
    assert lectures == {"jupyterlab", "ipywidgets", "matplotlib", "pytest", "pytest-timeout"}
    assert "parlab[lectures]" in extras["dev"]
    developers = {_requirement(r)[0] for r in extras["dev"] if r != "parlab[lectures]"}
    assert not developers & lectures and {"nbval", "ruff", "playwright", "pyyaml"} <= developers


def _commands(text):
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _set_up_blocks():
    readme = (ROOT / "README.md").read_text()
    set_up = readme[readme.index("## Set up\n"):readme.index("\n## ", readme.index("## Set up\n") + 1)]
    return [_commands(block) for block in re.findall(r"```bash\n(.*?)```", set_up, flags=re.S)]


def test_ci_runs_exactly_the_readme_set_up_and_test_commands():
    readme = (ROOT / "README.md").read_text()
    tests = re.search(r"## Tests\n+```bash\n(.*?)```", readme, flags=re.S).group(1)  # the section's first block
    developers = next(b for b in _set_up_blocks() if 'pip install -e ".[dev]"' in b)
    ci = _commands((ROOT / ".ci" / "run").read_text())
    ci_work = [c for c in ci if not c.startswith(("set -", "cd ", "rm -rf .venv"))]
    assert ci_work == developers + _commands(tests)


def test_the_readme_gives_learners_a_lean_cpu_route_first():
    learners, developers = _set_up_blocks()[:2]
    torch_spec = next(spec for name, spec in map(_requirement, _project()["dependencies"]) if name == "torch")
    # torch's CPU build first, in the range pyproject.toml accepts (else the next step would
    # replace it with PyPI's CUDA build), then parlab with the lectures' extra only
    assert learners == ["python3 -m venv .venv", "source .venv/bin/activate",
                        f'pip install "torch{torch_spec}" --index-url {CPU_INDEX}', 'pip install -e ".[lectures]"']
    assert developers[-1] == 'pip install -e ".[dev]"'


def test_console_script_points_at_the_cli():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"parlab": "parlab.cli:main"}
