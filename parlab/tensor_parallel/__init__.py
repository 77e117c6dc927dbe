"""Tensor and sequence parallelism (lecture 07), from scratch on parlab's collectives.

- ``operators``: f and g, the conjugate autograd operators, and sequence parallelism's
  all-gather / reduce-scatter pair;
- ``layers``: column- and row-parallel linear layers, the vocabulary-parallel embedding and
  the parallel cross-entropy;
- ``model``: the small GPT (``parlab.gpt``) split Megatron's way, with or without sequence
  parallelism;
- ``grid``: data parallel x tensor parallel on a 2-D grid of ranks;
- ``activations``: the bytes autograd saves per layer, measured, and Korthikanti et al.'s formulas.
"""

from parlab.tensor_parallel.layers import (
                                           ColumnParallelLinear,
                                           RowParallelLinear,
                                           VocabParallelEmbedding,
                                           parallel_cross_entropy,
)
from parlab.tensor_parallel.model import ParallelGPT
from parlab.tensor_parallel.operators import (
                                           copy_to_parallel,
                                           f,
                                           g,
                                           gather_sequence,
                                           reduce_from_parallel,
                                           scatter_sequence,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallel_cross_entropy",
           "ParallelGPT", "copy_to_parallel", "reduce_from_parallel", "gather_sequence", "scatter_sequence", "f", "g"]
