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


def synchronise(device):
    """Wait for the GPU's queued work before reading the clock (a no-op on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
