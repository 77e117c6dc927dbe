"""`import parlab` reaches every public module lazily and stays light; the runtime imports
nothing above it; one spelling for "this rank's device"."""

import ast
import pathlib
import pkgutil
import subprocess
import sys

import pytest
import torch

import parlab
import parlab.runtime

# The plumbing of the `parlab` command and of pytest; everything else is for learners.
NOT_PUBLIC = {"__main__", "cli"}
PUBLIC = sorted(
    module.name for module in pkgutil.iter_modules(parlab.__path__)
    if module.name not in NOT_PUBLIC and not module.name.startswith("_")
)
RUNTIME = pathlib.Path(parlab.runtime.__file__).parent


def run_python(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_lecture_modules_are_among_the_public_ones():
    lectures = {"collectives", "p2p", "trace", "viz", "ddp", "pipeline", "zero", "memory", "flat", "mesh_training"}
    tools = {"alpha_beta", "widgets", "bench", "course", "runtime"}
    assert lectures | tools <= set(PUBLIC)


@pytest.mark.timeout(120)
def test_every_public_module_is_reachable_from_import_parlab_alone():
    # A fresh interpreter: in this one, other tests have imported the modules already.
    out = run_python(
        "import parlab\n"
        f"for name in {PUBLIC!r}:\n"
        "    module = getattr(parlab, name)\n"
        "    assert module.__name__ == 'parlab.' + name, module\n"
        "    assert name in dir(parlab), name\n"
        "print(parlab.check.__module__)"
    )
    assert out.split() == ["parlab.course.grade"]


@pytest.mark.timeout(60)
def test_import_parlab_does_not_load_torch_or_the_techniques():
    out = run_python("import sys, parlab\nprint(*(m for m in sys.modules if m == 'torch' or m.startswith('parlab')))")
    loaded = out.split()
    assert "torch" not in loaded
    assert all(name.startswith("parlab.runtime") or name == "parlab" for name in loaded), loaded


@pytest.mark.timeout(60)
def test_private_modules_are_not_offered():
    assert (pathlib.Path(parlab.__file__).parent / "_checks.py").is_file()  # exists, and is private
    assert "_checks" not in PUBLIC
    out = run_python(
        "import parlab\n"
        "print(*(name for name in dir(parlab) if name.startswith('_')))\n"
        "try:\n    parlab._checks\nexcept AttributeError:\n    print('AttributeError')"
    )
    *private, reached = out.split()
    assert "_checks" not in private and reached == "AttributeError", out


def test_unknown_attributes_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'zeroo'"):
        parlab.zeroo  # noqa: B018


def test_the_runtime_imports_nothing_above_it():
    # The one exception: the workers record and the parent assembles trace events, and
    # parlab.trace imports nothing of parlab.
    allowed = ("parlab.runtime", "parlab.trace")
    for path in RUNTIME.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                # `from parlab import trace` names the module parlab.trace
                names = [node.module if node.module != "parlab" else f"parlab.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith("parlab") or name.startswith(allowed), f"{path.name} imports {name}"


def test_one_spelling_for_this_ranks_device(cluster2):
    assert parlab.device is parlab.runtime.device
    assert cluster2.run(parlab.device) == [torch.device("cpu")] * 2
