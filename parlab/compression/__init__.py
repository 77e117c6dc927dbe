"""Gradient compression (lecture 05): compressors C(x) with exact wire bytes
(``compressors``), PowerSGD (``powersgd``), how compressed gradients travel on parlab's
collectives (``communication``), what that costs in bytes and seconds (``costs``) and DDP
communication hooks for parlab's and torch's DDP (``hooks``)."""

from parlab.compression.compressors import (
    BF16,
    FP8,
    FP16,
    QSGD,
    Compressor,
    ErrorFeedback,
    Identity,
    RandK,
    ScaledSign,
    SignSGD,
    TernGrad,
    TopK,
)
from parlab.compression.costs import topk_pays
from parlab.compression.hooks import parlab_hook, torch_hook
from parlab.compression.powersgd import PowerSGD, orthogonalize

__all__ = ["BF16", "FP8", "FP16", "QSGD", "Compressor", "ErrorFeedback", "Identity", "PowerSGD", "RandK", "ScaledSign",
           "SignSGD", "TernGrad", "TopK", "orthogonalize", "parlab_hook", "topk_pays", "torch_hook"]
