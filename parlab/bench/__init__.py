"""Measurements on this machine, run as ``parlab bench NAME [--json]``.

Each bench is a module of this package registered in ``parlab.cli.BENCHES``. It provides

- a docstring whose first line is the bench's one-line help,
- ``add_arguments(parser)``: its own options (the command line adds ``--json`` to all),
- ``run(args) -> dict``: measure, and return a JSON-ready dict (times in seconds),
- ``format_report(result) -> str``: the same result as a table for people.

One convention for every comparison: ``ratio`` = parlab's time / the reference's time (torch's
implementation, or a fresh spawn for the runtime), so below 1 parlab is faster. Every table
states it in its header (``ratio_header``) and every JSON result in ``ratio_means``. A bench
that compares something else (bytes held) states that ratio's direction beside it.

The helpers below keep every bench's output looking alike.
"""

import argparse
import json
import math
import sys

from parlab._checks import real_number, whole_number


def positive_int(text):
    """argparse type for a count of ranks or repeats: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def positive_number(text):
    """argparse type for a size or a time: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number above 0 such as 25 or 0.5, got {text!r}")
    return value


def check_arguments(device="cpu", **counts):
    """Refuse bad arguments of a bench function before any rank starts: ``device`` "cpu" or
    "cuda", and each count (or each entry of a list of counts, such as world_sizes) a whole
    number of at least 1."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}: pick where the tensors live.")
    for name, value in counts.items():
        several = isinstance(value, (list, tuple, range))
        if several and not value:
            raise ValueError(f"{name} is empty: give at least one value.")
        for item in value if several else [value]:
            whole_number(f"each of {name}" if several else name, item, "a count of at least 1, e.g. 2.")


def check_seconds(name, seconds):
    """A time argument of a bench function: a finite number of seconds above 0."""
    real_number(name, seconds, "give a time in seconds above 0, e.g. 0.05.", above=True)


def time_ratio(parlab_s, reference_s):
    """parlab's time over the reference's: below 1, parlab is faster (the one ratio convention)."""
    return parlab_s / reference_s


def ratio_header(reference):
    """The line every table's header carries, naming its reference."""
    return f"ratio = time of parlab / time of {reference} (below 1: parlab is faster)"


def percentile(values, q):
    """The nearest-rank ``q``-th percentile (0 < q <= 100): the smallest value that at least
    q percent of ``values`` do not exceed. Needs no interpolation, so it works from one value."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def format_seconds(seconds):
    """A duration in the unit that reads best: ``850 µs``, ``1.23 ms``, ``6.31 s``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def format_table(headers, rows):
    """A plain-text table: the first column left-aligned (the names), the others
    right-aligned (the numbers), columns two spaces apart. Cells are turned into text."""
    lines = [list(map(str, headers))] + [list(map(str, row)) for row in rows]
    widths = [max(len(line[col]) for line in lines) for col in range(len(headers))]
    return "\n".join(
        "  ".join(
            cell.ljust(width) if col == 0 else cell.rjust(width)
            for col, (cell, width) in enumerate(zip(line, widths))
        ).rstrip()
        for line in lines
    )


def to_json(result):
    """The result of a bench as one indented JSON object (what ``--json`` prints)."""
    return json.dumps(result, indent=2)


def progress(bench, message):
    """A progress line on stderr, so that stdout keeps only the table or the JSON."""
    print(f"parlab bench {bench}: {message}", file=sys.stderr, flush=True)


def progress_bar(bench, total, unit="step"):
    """A progress bar for a long bench (``parlab.runtime.progress``): a line on stderr in a
    terminal (stdout keeps only the table or the JSON), a bar in a notebook that leaves one line
    of text behind. Use it as a context manager; ``bar.set_postfix_str(what)`` names the step
    under way, ``bar.update()`` counts it done."""
    from ..runtime.progress import progress_bar as bar

    return bar(total, f"parlab bench {bench}", unit=unit)


# Units of ``parse_link``, as parts of a second and as bytes per second: decimal, as network
# links are quoted (100 MB/s = 1e8 bytes/s). Dividing by 1e6 keeps 200us exactly 200e-6.
PER_SECOND = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}
BANDWIDTH_UNITS = {"B/s": 1.0, "kB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9}
LINK_SYNTAX = ("LATENCY,BANDWIDTH such as 200us,100MB/s "
               "(latency in s, ms, us or ns; bandwidth in B/s, kB/s, MB/s or GB/s)")


def parse_link(text):
    """The emulated link written on a command line, ``"200us,100MB/s"``, as a ``parlab.Link``
    (latency 200e-6 s, bandwidth 100e6 bytes/s). A ValueError says what to write instead."""
    from parlab.runtime.emulation import Link

    parts = str(text).replace(" ", "").split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        latency, rate = _with_unit(parts[0], PER_SECOND), _with_unit(parts[1], BANDWIDTH_UNITS)
        return Link(latency=latency[0] / latency[1], bandwidth=rate[0] * rate[1])
    except ValueError:
        raise ValueError(f"expected a link as {LINK_SYNTAX}, got {text!r}") from None


def link_argument(text):
    """argparse type of ``--link``: ``parse_link``, its complaint shown as argparse's."""
    try:
        return parse_link(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_link(link):
    """A bench function's ``link`` argument: a ``parlab.Link`` to emulate, or None for real time."""
    from parlab.runtime.emulation import Link

    if link is not None and not isinstance(link, Link):
        raise ValueError(f"link must be a parlab.Link or None, got {link!r}: pass e.g. "
                         "parlab.Link(latency=200e-6, bandwidth=100e6), or None to measure in real time.")


def _with_unit(text, units):
    """(the number, its unit's factor) of "200us"; the longest unit first, so that "ms" is not
    read as "s" after a number "200m"."""
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            value = float(text.removesuffix(unit))  # a ValueError for "fast"
            if math.isfinite(value):
                return value, units[unit]
    raise ValueError(text)


def byte_size(text):
    """argparse type: a byte count such as 4096, 1K, 4M or 1G (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    try:
        value = int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except (ValueError, OverflowError):  # OverflowError: "inf"
        value = 0
    if value < 4:
        raise argparse.ArgumentTypeError(f"expected a size of at least 4 bytes such as 4096, 1K or 4M, got {text!r}")
    return value


def format_bytes(nbytes):
    """A byte count as the command line writes it: 1K, 4M, 1.5G (powers of 1024), or 12B."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"


def synchronise(device):
    """Wait for the GPU's queued work before reading the clock (a no-op on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
