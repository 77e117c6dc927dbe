"""runtime.device() outside a Cluster: FSDP's meta-device initialisation and a learner's tensors
go to the current CUDA device on a GPU machine (before, always "cpu"), and to the CPU without
CUDA or on a gloo process group."""

import torch
import torch.distributed as dist

from parlab import runtime
from parlab.runtime import context


def test_outside_a_cluster_the_device_is_the_current_cuda_device_when_there_is_one(monkeypatch):
    monkeypatch.setattr(context, "_device_name", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert runtime.device() == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert runtime.device() == torch.device("cpu")  # gloo sends CPU tensors


def test_without_cuda_or_inside_a_cluster_it_is_what_was_set(monkeypatch):
    monkeypatch.setattr(context, "_device_name", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runtime.device() == torch.device("cpu")
    monkeypatch.setattr(context, "_device_name", "cpu")  # what a Cluster's CPU worker sets
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.device() == torch.device("cpu")


def rank_device():
    return str(runtime.device())


def test_a_clusters_ranks_keep_the_placement(cluster2):
    assert cluster2.run(rank_device, timeout=30) == ["cpu", "cpu"]
