"""One spelling per concept in the engines' signatures: an optimizer class is ``optimizer_class``
and its options ``**optimizer_kwargs`` everywhere (torch's ZeroRedundancyOptimizer spells the
class so), and FSDP's units speak torch FSDP2's words, ``unshard`` and ``reshard``."""

import inspect

import pytest
import torch

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
