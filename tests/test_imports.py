"""Imports flow one way: runtime -> trace/p2p/collectives -> techniques -> bench/widgets.

Read from the source (every import, also those inside functions), so a lazy import that
climbs a layer is caught as surely as one at the top of a module."""

import ast
import pathlib

import pytest

import parlab

PACKAGE = pathlib.Path(parlab.__file__).parent


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
# Below the pictures, the benches and the command line: what a lecture explains.
TECHNIQUES = [name for name in MODULES if name.split(".")[1:2] and name.split(".")[1] in {
    "trace", "p2p", "collectives", "flat", "memory", "ddp", "alpha_beta", "pipeline", "zero",
    "background", "emulated", "mixed_precision", "gpt", "tensor_parallel", "async_sgd", "compression", "slurm", "plan",
    "mesh_training", "numerics", "context_parallel", "experts", "units", "fp8", "diloco", "failures"}]
ABOVE_TECHNIQUES = ("parlab.viz", "parlab.widgets", "parlab.bench", "parlab.cli", "parlab.course", "parlab.train")


def imports(name):
    """The parlab modules that module ``name`` imports anywhere in its source; ``parlab``
    itself where it imports the top-level package for one of its attributes."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "parlab")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "parlab":
            for alias in node.names:  # `from parlab import trace` imports the module parlab.trace
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in MODULES else node.module)
    return found


def test_the_graph_is_read_from_the_source():
    assert {"parlab.trace", "parlab.viz", "parlab.zero.fsdp", "parlab.pipeline.executor"} <= set(MODULES)
    assert "parlab.trace" in imports("parlab.viz") and "parlab.runtime" in imports("parlab.zero.fsdp")


def test_the_trace_imports_nothing_of_parlab():
    # The runtime's workers record with it; everything that draws a timeline imports it.
    assert imports("parlab.trace") == set()


@pytest.mark.parametrize("name", TECHNIQUES)
def test_techniques_import_nothing_above_them(name):
    upward = {target for target in imports(name) if target == "parlab" or target.startswith(ABOVE_TECHNIQUES)}
    assert not upward, f"{name} imports {sorted(upward)}"


def test_the_package_has_no_import_cycle():
    graph = {name: imports(name) & set(MODULES) for name in MODULES}
    state, cycles = {}, []

    def visit(name, path):
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("name", TECHNIQUES + [name for name in MODULES if name.startswith("parlab.bench")])
def test_one_spelling_for_this_ranks_device(name):
    """``runtime.device()``, never ``parlab.device()`` (the learner's spelling of the same
    function, which would import the top-level package) or a renamed import of it."""
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "device" and isinstance(node.value, ast.Name):
            assert node.value.id != "parlab", f"{name}: parlab.device (line {node.lineno}); use runtime.device()"
        if isinstance(node, ast.ImportFrom) and node.module == "parlab.runtime":
            assert "device" not in [alias.name for alias in node.names], f"{name} line {node.lineno}"


def test_the_readme_layout_names_every_folder_of_the_package():
    """The README's layout and this test's layers describe the same package: every subpackage
    is named there, and every layer listed here is a folder or module that exists."""
    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    missing = sorted(folder for folder in folders if f"{folder}/" not in layout)
    assert folders and not missing, f"the README's layout does not name {missing}"
    for name in ABOVE_TECHNIQUES:
        assert name in MODULES, name
    assert {name.split(".")[1] for name in TECHNIQUES} <= {name.split(".")[1] for name in MODULES if "." in name}
