"""Lecture 02, data parallelism: the engine (``engine``: DDP and its four variants), the model
of how much of its communication hides behind backward (``overlap_model``), and the sampler
that gives each rank its shard of the data (``sampler``)."""

from parlab.ddp.engine import DDP, VARIANTS, AllReduceInFlight, Bucket, assign_buckets, trainable_parameters
from parlab.ddp.overlap_model import bucket_overlap, predict_overlap, predict_step
from parlab.ddp.sampler import DistributedSampler

__all__ = ["DDP", "VARIANTS", "AllReduceInFlight", "Bucket", "DistributedSampler", "assign_buckets",
           "bucket_overlap", "predict_overlap", "predict_step", "trainable_parameters"]
