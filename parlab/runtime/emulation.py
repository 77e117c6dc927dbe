"""Emulated time: links with a latency and a bandwidth, devices with declared compute time.

A laptop's ranks share a few cores and talk over loopback: loopback has no bandwidth limit
but a large cost per message, and "independent devices" contend for the same cores, so the
bandwidth-bound world of the lectures never shows by itself. In the emulated regime,

    parlab.Cluster(4, link=parlab.Link(latency=200e-6, bandwidth=100e6))
    parlab.Cluster(8, devices=parlab.Devices(slowdown={2: 3.0}))

time is shaped while the data still moves through real gloo:

- **links** (the alpha-beta model, full duplex). Every message that parlab's point-to-point
  layer (``parlab.p2p``, and so every parlab collective, DDP, pipeline and ZeRO engine)
  sends from rank s to rank d occupies s's outgoing port and d's incoming port for
  alpha + n beta seconds (alpha = ``latency``, 1/beta = ``bandwidth``, n bytes):

      ready   = max(time the send is called, when s's outgoing port is free)
      arrival = max(ready, when d's incoming port is free) + alpha + n beta

  The sender's port is busy until ready + alpha + n beta (a blocking send returns then);
  the receiver's ``recv`` returns at ``arrival``. So a rank's sends queue one after another
  on its link, and so do the messages arriving at one rank (a root receiving from N - 1
  ranks takes N - 1 message times), as the alpha-beta model assumes. ``Nodes`` gives ranks
  on one node a fast link and ranks on different nodes a slow one, each with its own ports.
- **devices**. ``compute(seconds)`` (and ``Compute``, a layer whose forward and backward
  take declared times) sleeps instead of computing, so eight "devices" on two cores do not
  contend; ``Devices`` makes chosen ranks slower and injects stragglers.

Declared values past plausible bounds (``MAX_LATENCY_S`` and the others below) are refused
with a ValueError: the emulation sleeps every declared time for real, so a value in the wrong
unit would otherwise only show as a call that times out.

Sleeping releases the CPU. The worker asks the kernel for a timer slack of 1 µs (Linux), so
a rank wakes within microseconds of its deadline when a core is free.
Correctness never depends on the regime: only when things happen changes.
"""

import math
import numbers
import random
import time
from dataclasses import dataclass, field

# What can be declared. The emulation sleeps every declared time for real, so a value in the
# wrong unit does not fail by itself: Link(latency=200, ...) (200 µs meant) makes every
# message sleep 200 s, and the call waits out its timeout. Past these bounds a value is no
# network or device a lesson models, and almost surely a unit slip; they are refused.
MAX_LATENCY_S = 1.0  # per message; a latency above it is one in µs or ms given as seconds
MIN_BANDWIDTH = 1e3  # bytes per second; below it a 1 MB gradient takes over 16 minutes
# Per call of a declared compute (a layer's forward, one gradient): lessons declare
# milliseconds, and ten seconds a call already makes one step take minutes.
MAX_COMPUTE_S = 10.0
MAX_FACTOR = 100.0  # how many times slower a rank or a straggling step may be


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _factor(name, value, fix, least):
    """``value`` as a float, if it is a factor of declared time from ``least`` to MAX_FACTOR, never 0."""
    if not _is_real(value) or not least <= value <= MAX_FACTOR or value == 0:
        bound = f"at least {least:g}" if least else "above 0"
        raise ValueError(f"{name} is how many times its declared time a compute takes, {bound} and at most "
                         f"{MAX_FACTOR:g}, got {value!r}: {fix}")
    return float(value)


def declared_seconds(name, seconds):
    """``seconds``, if it is a compute time a device can declare: 0 to MAX_COMPUTE_S seconds
    (``SleepLayer``, ``ComputeTime`` and ``compute`` check their times with it)."""
    if not _is_real(seconds) or not 0 <= seconds <= MAX_COMPUTE_S:
        slip = f" ({seconds:g} ms is {seconds:g}e-3)" if _is_real(seconds) and seconds > MAX_COMPUTE_S else ""
        raise ValueError(f"{name} must be a number of seconds >= 0 and at most {MAX_COMPUTE_S:g} (the emulation "
                         f"sleeps it for real), got {seconds!r}: give each in seconds, e.g. 0.01 for 10 ms{slip}.")
    return seconds


@dataclass(frozen=True)
class Link:
    """A link with ``latency`` seconds per message (alpha) and ``bandwidth`` bytes per second
    (1/beta): a message of n bytes takes ``latency + n / bandwidth`` seconds."""

    latency: float
    bandwidth: float

    def __post_init__(self):
        latency, bandwidth = self.latency, self.bandwidth
        if not _is_real(latency) or not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"Link latency must be a number of seconds >= 0, got {latency!r}; e.g. latency=200e-6 "
                             "for 200 µs.")
        if latency > MAX_LATENCY_S:
            raise ValueError(f"Link latency is in seconds, at most {MAX_LATENCY_S:g} s per message, got {latency!r}: "
                             f"{latency:g} µs is latency={latency:g}e-6 (and {latency:g} ms is {latency:g}e-3).")
        if not _is_real(bandwidth) or not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"Link bandwidth must be a positive number of bytes per second, got {bandwidth!r}; e.g. "
                             "bandwidth=100e6 for 100 MB/s.")
        if bandwidth < MIN_BANDWIDTH:
            raise ValueError(f"Link bandwidth is in bytes per second, at least {_rate(MIN_BANDWIDTH)}, got "
                             f"{bandwidth!r}: {bandwidth:g} MB/s is bandwidth={bandwidth:g}e6 (and {bandwidth:g} GB/s "
                             f"is {bandwidth:g}e9).")

    def time(self, nbytes):
        """Seconds one message of ``nbytes`` takes: alpha + n beta."""
        return self.latency + nbytes / self.bandwidth

    def describe(self):
        return f"{_seconds(self.latency)} + bytes / ({_rate(self.bandwidth)})"


@dataclass(frozen=True)
class Nodes:
    """Ranks grouped into nodes of ``ranks_per_node`` consecutive ranks: messages inside a
    node use the ``inside`` link, messages between nodes the ``between`` link. A rank has a
    separate pair of ports on each (its NVLink and its network card, say)."""

    ranks_per_node: int
    inside: Link
    between: Link

    def __post_init__(self):
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a whole number >= 1, got {self.ranks_per_node!r}.")
        for name in ("inside", "between"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"Nodes({name}=...) must be a parlab.Link, got {getattr(self, name)!r}.")

    def link(self, src, dst):
        """(the Link a message from ``src`` to ``dst`` takes, the name of its ports)."""
        if src // self.ranks_per_node == dst // self.ranks_per_node:
            return self.inside, "inside"
        return self.between, "between"

    def describe(self):
        return (f"nodes of {self.ranks_per_node} ranks; inside {self.inside.describe()}, "
                f"between {self.between.describe()}")


@dataclass(frozen=True)
class Straggler:
    """Steps on which a device runs ``factor`` times slower: every ``every``-th step of each
    rank (steps every - 1, 2 every - 1, ...), or each step with ``probability`` (drawn from
    a generator seeded by (seed, rank), so a run is reproducible)."""

    factor: float
    every: int | None = None
    probability: float | None = None
    seed: int = 0

    def __post_init__(self):
        _factor("Straggler factor", self.factor, "e.g. factor=5 for a step 5x slower.", least=1)
        if (self.every is None) == (self.probability is None):
            raise ValueError("give a Straggler either every=k (one step in k) or probability=p, not both or neither.")
        if self.every is not None and (not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"Straggler every must be a whole number of steps >= 1, got {self.every!r}.")
        if self.probability is not None and not 0 <= self.probability <= 1:
            raise ValueError(f"Straggler probability must lie in [0, 1], got {self.probability!r}.")


@dataclass(frozen=True)
class Devices:
    """Emulated devices: ``slowdown`` maps a rank to how many times slower it computes
    ({2: 3.0}: rank 2 is 3x slower; 0.5: twice as fast); ``straggler`` makes some steps slower
    on ``straggler_ranks`` (default: every rank). A cluster refuses ranks it does not have."""

    slowdown: dict = field(default_factory=dict)
    straggler: Straggler | None = None
    straggler_ranks: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.slowdown, dict):
            raise ValueError(f"slowdown must be a dict rank -> factor, e.g. {{2: 3.0}}; got {self.slowdown!r}.")
        for rank, factor in self.slowdown.items():
            if not _is_rank(rank):
                raise ValueError(f"slowdown keys are ranks (whole numbers >= 0), got {rank!r}.")
            _factor(f"slowdown of rank {rank}", factor, "e.g. {2: 3.0}: rank 2 three times slower.", least=0)
        if self.straggler is not None and not isinstance(self.straggler, Straggler):
            raise ValueError(f"straggler must be a parlab.Straggler, got {self.straggler!r}.")
        if self.straggler_ranks is not None:
            ranks = self.straggler_ranks
            if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__") or not all(map(_is_rank, ranks)):
                raise ValueError(f"straggler_ranks must list ranks (whole numbers >= 0), e.g. (1, 3), got {ranks!r}.")
            object.__setattr__(self, "straggler_ranks", tuple(ranks))

    def check_ranks(self, world_size):
        """Refuse a slowdown or straggler of a rank that a cluster of ``world_size`` ranks lacks."""
        named = [("slowdown", r) for r in self.slowdown] + [("straggler_ranks", r) for r in self.straggler_ranks or ()]
        for what, rank in named:
            if rank >= world_size:
                raise ValueError(f"Devices({what}=...) names rank {rank}, but the cluster has {world_size} ranks "
                                 f"(0 to {world_size - 1}): name one of those ranks, or start a larger cluster.")

    def factor(self, rank, step, draw):
        """How many times its declared time a compute of ``rank`` at ``step`` takes."""
        factor = self.slowdown.get(rank, 1.0)
        s = self.straggler
        if s is not None and (self.straggler_ranks is None or rank in self.straggler_ranks):
            hit = (step + 1) % s.every == 0 if s.every is not None else draw() < s.probability
            factor *= s.factor if hit else 1.0
        return factor

    def describe(self):
        parts = [f"rank {r} {f:g}x slower" for r, f in sorted(self.slowdown.items())]
        s = self.straggler
        if s is not None:
            when = f"one step in {s.every}" if s.every is not None else f"each step with p = {s.probability:g}"
            parts.append(f"{when} {s.factor:g}x slower")
        return ", ".join(parts) or "declared compute times"


def _is_rank(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _seconds(s):
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _rate(bytes_per_s):
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"


@dataclass(frozen=True)
class Regime:
    """How time runs on a cluster: real (both None), or emulated links and/or devices."""

    network: Link | Nodes | None = None
    devices: Devices | None = None

    def __post_init__(self):
        if self.network is not None and not isinstance(self.network, (Link, Nodes)):
            raise ValueError(f"link must be a parlab.Link or parlab.Nodes, got {self.network!r}.")
        if self.devices is not None and not isinstance(self.devices, Devices):
            raise ValueError(f"devices must be a parlab.Devices, got {self.devices!r}.")

    def check_ranks(self, world_size):
        """Refuse devices declared for ranks that a cluster of ``world_size`` ranks lacks."""
        if self.devices is not None:
            self.devices.check_ranks(world_size)

    @property
    def emulated(self):
        return self.network is not None or self.devices is not None

    def describe(self):
        if not self.emulated:
            return "real time"
        parts = []
        if self.network is not None:
            link = self.network.describe() if isinstance(self.network, Nodes) else f"link {self.network.describe()}"
            parts.append(link)
        if self.devices is not None:
            parts.append(f"devices: {self.devices.describe()}")
        return "emulated: " + "; ".join(parts)


REAL = Regime()


# --- on a rank: the state of the current call -------------------------------------------

class _Rank:
    regime = REAL
    rank = 0
    free = {}  # (direction "out"/"in", port name) -> perf_counter seconds when free
    rng = None
    header_group = None  # the process group that carries emulated messages' headers


_here = _Rank()


def begin_call(regime, rank):
    """Set the regime of the call about to run on this rank; every port starts free."""
    _here.regime, _here.rank, _here.free = regime, rank, {}
    devices = regime.devices
    seed = devices.straggler.seed if devices is not None and devices.straggler is not None else 0
    _here.rng = random.Random(seed * 1_000_003 + rank)


def header_group():
    """The process group on which ``parlab.p2p`` sends each emulated message's header (when
    it was ready to leave), apart from the data so that tags never collide."""
    return _here.header_group


def set_header_group(group):
    """Set by the worker: a gloo group over all ranks, or None after the group is rebuilt."""
    _here.header_group = group


def regime():
    """The regime of the call running on this rank (REAL outside a cluster)."""
    return _here.regime


def shapes_links():
    return _here.regime.network is not None


def now():
    return time.perf_counter()


def _link(src, dst):
    network = _here.regime.network
    return network.link(src, dst) if isinstance(network, Nodes) else (network, "link")


def departure(dst, nbytes):
    """Sender's side of a message to ``dst``: (ready, done). ``ready`` is when the message
    can start (this rank's outgoing port free), ``done`` when the port is free again; the
    receiver needs ``ready`` (it travels in a header), the sender returns at ``done``."""
    link, port = _link(_here.rank, dst)
    ready = max(now(), _here.free.get(("out", port), 0.0))
    done = ready + link.time(nbytes)
    _here.free[("out", port)] = done
    return ready, done


def arrival(src, nbytes, ready):
    """Receiver's side: when a message of ``nbytes`` from ``src``, ready to leave at
    ``ready``, has arrived, with this rank's incoming port taking one message at a time."""
    link, port = _link(src, _here.rank)
    start = max(ready, _here.free.get(("in", port), 0.0))
    end = start + link.time(nbytes)
    _here.free[("in", port)] = end
    return end


def sleep_until(deadline):
    """Release the CPU until ``deadline`` (perf_counter seconds)."""
    remaining = deadline - now()
    if remaining > 0:
        time.sleep(remaining)


def compute_factor(step):
    """How many times its declared time this rank's compute at ``step`` takes."""
    devices = _here.regime.devices
    if devices is None:
        return 1.0
    return devices.factor(_here.rank, step, _here.rng.random)


def compute(seconds, step=0):
    """Emulated compute: take ``seconds`` (times this rank's slowdown and straggling at
    ``step``) without using the CPU. Outside an emulated regime it takes ``seconds``."""
    declared_seconds("compute's seconds", seconds)
    sleep_until(now() + seconds * compute_factor(step))


def lower_timer_slack():
    """Ask Linux to wake sleeping threads of this process within 1 µs of their deadline
    (the default slack, 50 µs, would add up over thousands of emulated messages)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass
