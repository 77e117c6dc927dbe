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

Sleeping releases the CPU. The worker asks the kernel for a timer slack of 1 µs (Linux), so
a rank wakes within microseconds of its deadline when a core is free.
Correctness never depends on the regime: only when things happen changes.
"""

import math
import random
import time
from dataclasses import dataclass, field


def _positive_finite(name, value, unit, fix):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of {unit}, got {value!r}; {fix}")
    return float(value)


@dataclass(frozen=True)
class Link:
    """A link with ``latency`` seconds per message (alpha) and ``bandwidth`` bytes per second
    (1/beta): a message of n bytes takes ``latency + n / bandwidth`` seconds."""

    latency: float
    bandwidth: float

    def __post_init__(self):
        if isinstance(self.latency, bool) or not isinstance(self.latency, (int, float)) or not (
            math.isfinite(self.latency) and self.latency >= 0
        ):
            raise ValueError(
                f"Link latency must be a number of seconds >= 0, got {self.latency!r}; e.g. latency=200e-6 for 200 µs."
            )
        _positive_finite("Link bandwidth", self.bandwidth, "bytes per second", "e.g. bandwidth=100e6 for 100 MB/s.")

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
        _positive_finite("Straggler factor", self.factor, "times", "e.g. factor=5 for a step 5x slower.")
        if (self.every is None) == (self.probability is None):
            raise ValueError("give a Straggler either every=k (one step in k) or probability=p, not both or neither.")
        if self.every is not None and (not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"Straggler every must be a whole number of steps >= 1, got {self.every!r}.")
        if self.probability is not None and not 0 <= self.probability <= 1:
            raise ValueError(f"Straggler probability must lie in [0, 1], got {self.probability!r}.")


@dataclass(frozen=True)
class Devices:
    """Emulated devices: ``slowdown`` maps a rank to how many times slower it computes
    ({2: 3.0}: rank 2 is 3x slower); ``straggler`` makes some steps slower on ``ranks``
    (default: every rank)."""

    slowdown: dict = field(default_factory=dict)
    straggler: Straggler | None = None
    straggler_ranks: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.slowdown, dict):
            raise ValueError(f"slowdown must be a dict rank -> factor, e.g. {{2: 3.0}}; got {self.slowdown!r}.")
        for rank, factor in self.slowdown.items():
            if not isinstance(rank, int) or rank < 0:
                raise ValueError(f"slowdown keys are ranks (whole numbers >= 0), got {rank!r}.")
            _positive_finite(f"slowdown of rank {rank}", factor, "times", "e.g. {2: 3.0}: rank 2 three times slower.")
        if self.straggler is not None and not isinstance(self.straggler, Straggler):
            raise ValueError(f"straggler must be a parlab.Straggler, got {self.straggler!r}.")

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
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"compute needs a number of seconds >= 0, got {seconds!r}.")
    sleep_until(now() + seconds * compute_factor(step))


def lower_timer_slack():
    """Ask Linux to wake sleeping threads of this process within 1 µs of their deadline
    (the default slack, 50 µs, would add up over thousands of emulated messages)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in nanoseconds
    except (OSError, AttributeError):
        pass
