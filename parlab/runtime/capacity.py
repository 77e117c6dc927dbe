"""How many ranks this machine can hold: what a cluster checks before it starts a process.

Every rank is a whole process. Measured on a 2-core x86-64 Linux machine with torch 2.13
(CPU build), one idle rank (Python, torch imported, a gloo process group joined) holds
220 MiB of resident memory, of which 77 MiB are torch's shared libraries, paid once for
all ranks, and 143 MiB are its own. Starting a rank costs about 1.2 CPU-seconds (4 ranks
start in 2.2 s on 2 cores, 16 in 11 s; 100 took 92 s on a learner's 2-core machine). The
parent holds 5 file descriptors per rank and each rank about one per other rank (gloo
connects every pair).

From these numbers:
- a start is slow (seconds of silence) beyond ``SLOW_START_RANKS_PER_CORE`` ranks per core:
  a progress bar counts the ranks that have started (loaded torch; they join the group
  together at the end);
- beyond ``CROWDED_RANKS_PER_CORE`` ranks per core a warning says that ranks time-share the
  cores (every call waits for ranks the scheduler has put aside);
- more ranks than memory or open files allow cannot work: a ValueError says why and what
  to do, before anything starts.
"""

import os
import warnings

# Private memory of one idle rank, measured (143 MiB) and rounded up.
IDLE_RANK_BYTES = 150 * 2**20
START_CPU_S_PER_RANK = 1.2
# 2 ranks per core keep the usual 4-rank cluster on a 2-core laptop quiet (a 2 s start);
# 3 or more per core take over 3 s, growing linearly, so they show their progress.
SLOW_START_RANKS_PER_CORE = 2
# 4 ranks per core take 5 s to start, and a call with a small all-reduce takes 22 ms with 8
# ranks on 2 cores against 3 ms with 2 (85 ms with 24): lessons about time stop showing
# what they teach.
CROWDED_RANKS_PER_CORE = 4
PARENT_FILES_PER_RANK = 5
# Files every process keeps open besides its ranks' (standard streams, torch, the store).
BASE_OPEN_FILES = 64


def check(world_size, cores=None, available_bytes=None, open_files_limit=None):
    """Refuse (ValueError) or warn about ``world_size`` ranks on this machine; return True if
    the start is expected to be slow enough to show progress. The machine's numbers default
    to this machine's (``os.cpu_count()``, ``available_memory()``, ``soft_open_files_limit()``)."""
    cores = cores or os.cpu_count() or 1
    refuse_impossible(
        world_size,
        available_memory() if available_bytes is None else available_bytes,
        soft_open_files_limit() if open_files_limit is None else open_files_limit,
    )
    message = crowding_warning(world_size, cores)
    if message:
        warnings.warn(message, stacklevel=3)
    return start_is_slow(world_size, cores)


def refuse_impossible(world_size, available_bytes, open_files_limit):
    """A ValueError if ``world_size`` idle ranks need more memory than ``available_bytes`` or
    more open files than ``open_files_limit`` allows (None: unknown, not checked)."""
    needed = world_size * IDLE_RANK_BYTES
    if available_bytes is not None and needed > available_bytes:
        raise ValueError(
            f"world_size={world_size} needs about {_gib(needed)} of memory (each idle rank is a process "
            f"holding about {IDLE_RANK_BYTES // 2**20} MiB: Python, torch and a gloo process group), but only "
            f"{_gib(available_bytes)} is available; use at most {available_bytes // IDLE_RANK_BYTES} ranks, or "
            "free memory first."
        )
    files = BASE_OPEN_FILES + PARENT_FILES_PER_RANK * world_size
    if open_files_limit is not None and files > open_files_limit:
        raise ValueError(
            f"world_size={world_size} needs about {files} open files in this process ({PARENT_FILES_PER_RANK} per "
            f"rank), but the limit is {open_files_limit}; use at most "
            f"{(open_files_limit - BASE_OPEN_FILES) // PARENT_FILES_PER_RANK} ranks, or raise the limit "
            "(`ulimit -n` in the shell that starts Python or Jupyter)."
        )


def crowding_warning(world_size, cores):
    """The warning for ranks crowding ``cores`` cores, or None when they have room."""
    if world_size <= CROWDED_RANKS_PER_CORE * cores:
        return None
    start_s = world_size * START_CPU_S_PER_RANK / cores
    return (
        f"world_size={world_size} on {cores} CPU core(s): the ranks time-share the cores, so starting takes "
        f"about {start_s:.0f} s and every call is slow, with timings that mean little. Up to "
        f"{CROWDED_RANKS_PER_CORE * cores} ranks give the same results faster."
    )


def start_is_slow(world_size, cores):
    """True when starting ``world_size`` ranks on ``cores`` cores takes long enough to show
    progress."""
    return world_size > SLOW_START_RANKS_PER_CORE * cores


def available_memory(meminfo="/proc/meminfo"):
    """Bytes the kernel can give new processes without swapping (MemAvailable), or None
    where there is no ``/proc/meminfo`` (macOS, Windows)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def soft_open_files_limit():
    """This process's limit on open files (RLIMIT_NOFILE, soft), or None where unknown."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def _gib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB"
