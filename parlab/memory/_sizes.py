"""The sentences that refuse a size given to ``parlab.memory``'s formulas."""

from parlab._checks import real_number, whole_number

_SIZES = {  # what each size means, for the sentence that refuses it
    "psi": "the number of parameters, e.g. 7.5e9",
    "largest_layer_psi": "the parameters of the largest layer",
    "kappa": "optimizer-state bytes per parameter, e.g. 12 for mixed-precision Adam",
    "param_bytes": "bytes per parameter, e.g. 2 in fp16",
    "grad_bytes": "bytes per gradient, e.g. 2 in fp16",
    "element_bytes": "bytes per element, e.g. 4 in fp32",
    "latency": "the link's seconds per message (alpha), e.g. 200e-6",
    "buffer_factor": "DeepSpeed's margin on host memory, 1.5 by default",
    "s": "the sequence length", "b": "the micro-batch size", "h": "the hidden size", "a": "the attention heads",
    "layers": "the number of transformer layers",
}


def _check_sizes(**sizes):
    for name, value in sizes.items():
        real_number(name, value, f"give {_SIZES[name]}.")


def _check_ranks(n_d):
    whole_number("n_d (N_d, the data-parallel degree)", n_d, "give the number of data-parallel ranks, e.g. n_d=64.")
