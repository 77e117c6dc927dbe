"""What the planner is told: the model, the batch and the cluster, each a small frozen
dataclass that refuses a size it cannot plan with (ValueError saying what to change).

Symbols (the glossary's): Psi parameters, L layers, h hidden size, a heads, s sequence
length, V vocabulary; E experts per MoE layer and k of them per token (lecture 09); B global
batch, b micro-batch; alpha and beta of a ``parlab.Link``.

Presets, with what they leave out:

- ``Model.small_gpt()``: parlab's own GPT (``parlab.gpt``), Psi counted from the module;
- ``Model.llama2_7b()``: L = 32, h = 4096, a = 32, s = 4096, V = 32000, Psi = 6,738,415,616
  (LLaMA-2-7B's count, with its SwiGLU MLP of 11008 features);
- ``Model.llama2_70b()``: L = 80, h = 8192, a = 64, s = 4096, V = 32000, Psi = 68,976,648,192
  (LLaMA-2-70B's count). Its grouped-query attention (8 key/value heads) is ignored outside
  Psi: activations and tensor-parallel messages are those of a layers with a full heads;
- ``Model.mixtral_8x7b()``: Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1:
  dim 4096, 32 layers, 32 heads of 128 with 8 key/value heads, hidden_dim 14336, vocab 32000,
  8 experts, top-2, context 32768): every layer's MLP is E = 8 SwiGLU experts of 3 x 4096 x
  14336 weights, 45,097,156,608 expert parameters in all, and Psi = 46,702,792,704 with the
  attention (GQA, counted in Psi only, as for the 70B), routers, norms and untied embeddings;
- ``Hardware.dgx_a100(nodes)``: nodes of 8 A100 80 GB (80 GiB each), 312e12 FLOP/s in bf16,
  NVLink inside a node (5 us + bytes / 300 GB/s, per direction) and one 200 Gb/s InfiniBand
  port per GPU between nodes (10 us + bytes / 25 GB/s): the machines of Narayanan et al.
  2021 (Megatron-LM). The latencies are round figures, not measurements; so are the offload
  figures (``HOST_LINK``: PCIe 4.0 x16, 10 us + bytes / 25 GB/s; ``HOST_UPDATE_RATE``: 1.25e8
  parameters/s per GPU). ``HOST_MEMORY`` is NVIDIA's: the DGX A100 640GB (the one with 80 GB
  GPUs) ships with 2 TB of system memory, 32 DIMMs of 64 GB (the DGX A100 User Guide's
  component table, "1 TB per 16 DIMMs"; the 320GB model has 1 TB). DRAM is sized in binary
  units, so 2 TB is 2 TiB = 2048 GiB.
"""

import numbers
from dataclasses import dataclass

from parlab._checks import real_number, whole_number
from parlab.runtime import Link
from parlab.units import GIB

# Offload (round figures, not measurements): PCIe 4.0 x16 between a GPU and its host, a node's
# CPUs stepping Adam at about 1e9 parameters/s shared by its 8 GPUs.
HOST_LINK = Link(latency=10e-6, bandwidth=25e9)
HOST_UPDATE_RATE = 1.25e8
HOST_MEMORY = 32 * 64 * GIB  # a DGX A100 640GB's 2 TB: 32 DIMMs of 64 GiB (module docstring)


@dataclass(frozen=True)
class Model:
    """A transformer: ``psi`` parameters (Psi) in ``L`` layers of hidden size ``h`` and ``a``
    heads, trained on sequences of ``s`` tokens from a vocabulary of ``V``. A mixture of
    experts (lecture 09) has ``E`` > 1 experts in every layer's MLP, ``k`` of them per token,
    and ``expert_psi`` of its Psi parameters in the experts (all layers, all experts)."""

    name: str
    psi: int
    L: int
    h: int
    a: int
    s: int
    V: int
    E: int = 1
    k: int = 1
    expert_psi: int = 0

    def __post_init__(self):
        whole_number("psi (Psi, the number of parameters)", self.psi,
                     "give the parameters as a count, e.g. 6_738_415_616.")
        for symbol, meaning in (("L", "layers"), ("h", "hidden size"), ("a", "attention heads"),
                                ("s", "sequence length in tokens"), ("V", "vocabulary size")):
            whole_number(f"{symbol} (the {meaning})", getattr(self, symbol), f"give the model's {meaning} as a count.")
        if self.h % self.a:
            raise ValueError(f"h = {self.h} does not split into a = {self.a} heads of h / a features: "
                             "choose h a multiple of a.")
        whole_number("E (experts per MoE layer)", self.E, "give 1 for a dense model, or a layer's experts, e.g. 8.")
        whole_number("k (experts per token)", self.k, "give how many experts each token goes to, e.g. 2.")
        whole_number("expert_psi (the experts' parameters)", self.expert_psi, "give 0 for a dense model, or "
                     "the parameters of all experts of all layers.", minimum=0)
        if self.k > self.E:
            raise ValueError(f"k = {self.k} experts per token, but a layer has only E = {self.E}: choose k <= E.")
        if (self.E > 1) != (self.expert_psi > 0) or self.expert_psi >= self.psi:
            raise ValueError(f"expert_psi = {self.expert_psi:,} with E = {self.E} and Psi = {self.psi:,}: a mixture of "
                             "experts (E > 1) has expert parameters, fewer than Psi; a dense model (E = 1) has none.")

    @property
    def active_psi(self):
        """The parameters one token passes through: the dense ones and k of every E experts."""
        return self.psi - self.expert_psi + self.expert_psi * self.k / self.E

    @classmethod
    def from_module(cls, module, L, h, a, s, V, name=None):
        """The sizes given, with Psi counted from ``module`` (each parameter once, so tied
        weights count once)."""
        from parlab._checks import module as check_module

        check_module("module", module, "pass the torch.nn.Module whose parameters the plan places.")
        psi = sum(p.numel() for p in module.parameters())
        return cls(name or type(module).__name__, psi, L, h, a, s, V)

    @classmethod
    def small_gpt(cls, config=None):
        """parlab's small GPT (``parlab.gpt.GPT``, default ``GPTConfig()``), counted."""
        from parlab.gpt import GPT, GPTConfig

        config = config or GPTConfig()
        return cls.from_module(GPT(config), config.L, config.h, config.a, config.s, config.V, name="small GPT")

    @classmethod
    def llama2_7b(cls):
        return cls("7B (LLaMA-2-like)", 6_738_415_616, L=32, h=4096, a=32, s=4096, V=32000)

    @classmethod
    def llama2_70b(cls):
        return cls("70B (LLaMA-2-like, GQA ignored)", 68_976_648_192, L=80, h=8192, a=64, s=4096, V=32000)

    @classmethod
    def mixtral_8x7b(cls):
        experts = 32 * 8 * 3 * 4096 * 14336  # layers x experts x a SwiGLU MLP's three matrices
        attention = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024)  # q and o; k and v of the 8 key/value heads
        rest = 32 * 8 * 4096 + (2 * 32 + 1) * 4096 + 2 * 32000 * 4096  # routers, norms, embedding and head
        return cls("Mixtral 8x7B (GQA ignored)", experts + attention + rest, L=32, h=4096, a=32, s=32768, V=32000,
                   E=8, k=2, expert_psi=experts)


@dataclass(frozen=True)
class Batch:
    """``B`` samples per optimizer step over all ranks, in micro-batches of ``b`` samples: one
    size, or a tuple of sizes for the planner to try (by default those of 1, 2, 4, 8 up to B).
    Each replica runs M = B / (N_d b) micro-batches, so M is not free once N_d and b are chosen."""

    B: int
    b: int | tuple | None = None

    def __post_init__(self):
        whole_number("B (the global batch)", self.B, "give the samples of one optimizer step, e.g. B=512.")
        if self.b is None:
            object.__setattr__(self, "b", tuple(b for b in (1, 2, 4, 8) if b <= self.B))
        sizes = (self.b,) if isinstance(self.b, numbers.Integral) else self.b
        if not isinstance(sizes, tuple) or not sizes:
            raise ValueError(f"b must be a micro-batch size or a tuple of them, got {self.b!r}: "
                             "e.g. b=1 or b=(1, 2, 4).")
        for size in sizes:
            whole_number("each micro-batch size b", size, "give samples per forward pass as a count, e.g. b=2.")
            if size > self.B:
                raise ValueError(f"a micro-batch of b = {size} is larger than the global batch B = {self.B}: "
                                 "choose b <= B.")

    @property
    def micro_batch_sizes(self):
        return (self.b,) if isinstance(self.b, numbers.Integral) else self.b


@dataclass(frozen=True)
class Hardware:
    """``nodes`` machines of ``gpus_per_node`` GPUs, each with ``memory`` bytes and a peak of
    ``peak_flops`` FLOP/s; ``intra`` is the link between two GPUs of a node, ``inter`` a
    GPU's link to another node (each GPU has its own port, as in ``parlab.Nodes``). For
    offload: ``host`` is a GPU's link to its host's memory, ``host_update_rate`` the
    parameters per second the host's optimizer steps for one GPU, ``host_memory`` a node's.
    The planner's machines: not ``parlab.Cluster``, the processes that run a lecture's ranks."""

    gpus_per_node: int
    nodes: int
    memory: float
    peak_flops: float
    intra: Link
    inter: Link
    name: str = "hardware"
    host: Link = HOST_LINK
    host_update_rate: float = HOST_UPDATE_RATE
    host_memory: float = HOST_MEMORY

    def __post_init__(self):
        whole_number("gpus_per_node", self.gpus_per_node, "give the GPUs of one node as a count, e.g. 8.")
        whole_number("nodes", self.nodes, "give the number of machines as a count, e.g. 4.")
        real_number("memory (bytes per GPU)", self.memory, "give each GPU's memory in bytes, e.g. 80 * 2**30.",
                    above=True)
        real_number("peak_flops", self.peak_flops, "give one GPU's peak FLOP/s, e.g. 312e12.", above=True)
        real_number("host_update_rate", self.host_update_rate, "give the parameters per second the host's optimizer "
                    "steps for one GPU, e.g. 1.25e8.", above=True)
        real_number("host_memory (bytes per node)", self.host_memory, "give a node's host memory in bytes, e.g. "
                    "2**41.", above=True)
        for name in ("intra", "inter", "host"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"Hardware({name}=...) must be a parlab.Link, got {getattr(self, name)!r}: "
                                 "e.g. Link(latency=5e-6, bandwidth=300e9).")

    @property
    def gpus(self):
        return self.gpus_per_node * self.nodes

    def within_node(self, span):
        """Whether every group of ``span`` consecutive ranks (aligned on multiples of span)
        lies inside one node: span divides the GPUs of a node."""
        return self.gpus_per_node % span == 0

    @classmethod
    def dgx_a100(cls, nodes=1):
        return cls(8, nodes, memory=80 * GIB, peak_flops=312e12, intra=Link(latency=5e-6, bandwidth=300e9),
                   inter=Link(latency=10e-6, bandwidth=25e9), name=f"{nodes} x 8 A100 80 GB")
