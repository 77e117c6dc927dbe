"""One spelling per concept (notebooks/GLOSSARY.md, "Words in code"): an optimizer class is
``optimizer_class`` and its options ``**optimizer_kwargs`` everywhere (torch's
ZeroRedundancyOptimizer spells the class so), FSDP's units speak torch FSDP2's words,
``unshard`` and ``reshard``, every name says ``all_reduce``, and sizes come from ``parlab.units``."""

import ast
import inspect
import pathlib
import re

import pytest
import torch

import parlab
from parlab import units
from parlab.ddp import DDP
from parlab.mesh_training import MeshGPT
from parlab.pipeline.grid import PipelineDataParallel
from parlab.tensor_parallel.grid import TensorDataParallel
from parlab.zero import FSDP, ShardedOptimizer, ZeroDP
from parlab.zero.flat_unit import FlatUnit

ENGINES = [DDP, ZeroDP, FSDP, ShardedOptimizer, TensorDataParallel, PipelineDataParallel, MeshGPT]
TAKE_AN_OPTIMIZER = {ZeroDP, FSDP, ShardedOptimizer, TensorDataParallel, MeshGPT}


def names_of_optimizer_parameters(engine):
    """(the named parameters that look like an optimizer class, the var-keyword one or None):
    a name mentioning an optimizer, or a default that is an optimizer class."""
    parameters = inspect.signature(engine).parameters.values()
    classes = [p.name for p in parameters if p.kind is not p.VAR_KEYWORD and (
        "opt" in p.name.lower() or isinstance(p.default, type) and issubclass(p.default, torch.optim.Optimizer))]
    var_keyword = next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)
    return classes, var_keyword


@pytest.mark.parametrize("engine", ENGINES, ids=lambda engine: engine.__name__)
def test_the_optimizer_class_and_its_options_are_spelled_alike(engine):
    classes, var_keyword = names_of_optimizer_parameters(engine)
    if engine in TAKE_AN_OPTIMIZER:
        assert classes == ["optimizer_class"], f"{engine.__name__}{inspect.signature(engine)}"
        assert var_keyword in (None, "optimizer_kwargs"), f"{engine.__name__}{inspect.signature(engine)}"
    else:
        assert classes == [], f"{engine.__name__} takes an optimizer: add it to TAKE_AN_OPTIMIZER"
        assert var_keyword is None or "opt" not in var_keyword, f"{engine.__name__}{inspect.signature(engine)}"


def test_the_engines_that_take_an_optimizer_class_take_its_options_by_keyword():
    # ShardedOptimizer, ZeroDP, FSDP, TensorDataParallel and MeshGPT pass lr=... on to the class
    assert all(names_of_optimizer_parameters(engine)[1] == "optimizer_kwargs" for engine in TAKE_AN_OPTIMIZER)


def test_fsdp_units_unshard_and_reshard_as_torch_fsdp2():
    # torch: FSDPModule.unshard() all-gathers the parameters, reshard() frees them
    assert callable(FlatUnit.unshard) and callable(FlatUnit.reshard)
    assert not any(hasattr(FlatUnit, old) for old in ("gather", "free"))
    assert not any(hasattr(FSDP, old) for old in ("gather", "free", "_gather", "_gathered"))


PACKAGE = pathlib.Path(parlab.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py")) + sorted((PACKAGE.parent / "solutions").glob("*.py"))


def identifiers(path):
    """Every name a file defines or uses: functions, classes, arguments, variables, attributes."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.arg, node.lineno


@pytest.mark.parametrize("path", SOURCES, ids=lambda path: str(path.relative_to(PACKAGE.parent)))
def test_all_reduce_and_the_optimizer_are_spelled_one_way_in_every_name(path):
    old = {"optimizer_cls", "opt_kwargs", "zero_optimizer"}
    found = [(name, line) for name, line in identifiers(path)
             if "allreduce" in name or "ALLREDUCE" in name or name in old]
    assert not found, f"{path.name}: {found}: write all_reduce, optimizer_class, optimizer_kwargs"


def test_sizes_are_named_in_parlab_units_only():
    # MIB is 2**20 and GB 1e9 in one place, so "MB" never means 2**20 in one module and 1e6 in another.
    unit = re.compile(r"^[KMG]I?B$")
    defined = [(path.name, target.id) for path in SOURCES if path.name != "units.py"
               for node in ast.parse(path.read_text()).body if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name) and unit.match(target.id)]
    assert defined == [], f"import these from parlab.units: {defined}"
    assert (units.KIB, units.MIB, units.GIB) == (2**10, 2**20, 2**30)
    assert (units.KB, units.MB, units.GB) == (1e3, 1e6, 1e9)
