"""``parlab doctor``: is this machine ready for the lectures?

One line per check, marked ``OK``, ``PROBLEM`` (with what to do about it) or ``INFO`` (fine
either way, such as having no GPU). The exit code is 1 if any check found a problem, else 0.
Each check is a small function returning ``(status, message)``, so it can be called alone.
"""

import functools
import os
import platform
import sys
import time
import warnings

import torch
import torch.distributed as dist

import parlab
from parlab.runtime import placement

OK, PROBLEM, INFO = "OK", "PROBLEM", "INFO"

MINIMUM_PYTHON = (3, 10)
MINIMUM_TORCH = "2.4"
WIDGET_EXTENSION = os.path.join("@jupyter-widgets", "jupyterlab-manager")
SMOKE_TEST_WORLD_SIZE = 2
SMOKE_TEST_TIMEOUT_S = 60.0
OFFICIAL_TORCH = "install the official torch wheel (pip install 'torch>=2.4,<2.14')"


def check_python():
    version = platform.python_version()
    if sys.version_info < MINIMUM_PYTHON:
        needed = ".".join(map(str, MINIMUM_PYTHON))
        return PROBLEM, f"Python {version}: parlab needs {needed} or newer; use a newer one."
    return OK, f"Python {version} ({sys.executable})"


def check_torch():
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    if torch.__version__ < MINIMUM_TORCH:
        return PROBLEM, f"torch {torch.__version__} is older than {MINIMUM_TORCH}; {OFFICIAL_TORCH}."
    return OK, f"torch {torch.__version__} ({build})"


def check_distributed():
    if not dist.is_available():
        return PROBLEM, f"this torch build has no torch.distributed; {OFFICIAL_TORCH}."
    return OK, "torch.distributed is available"


def check_gloo():
    if not (dist.is_available() and dist.is_gloo_available()):
        return PROBLEM, f"the gloo backend is missing, and CPU ranks need it; {OFFICIAL_TORCH}."
    return OK, "gloo backend is available (CPU ranks)"


def check_nccl():
    if dist.is_available() and dist.is_nccl_available():
        return OK, "nccl backend is available (one GPU per rank)"
    if not torch.cuda.is_available():
        return INFO, "nccl backend is not available; it is only needed with CUDA GPUs"
    return PROBLEM, (
        "this machine has CUDA GPUs but torch has no nccl backend, so GPU ranks cannot use it; "
        "install a CUDA build of torch on Linux from pytorch.org, or use backend='gloo'."
    )


def check_gpus():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return INFO, "no CUDA GPU: ranks run on the CPU over gloo, which every lecture supports"
    names = ", ".join(torch.cuda.get_device_name(index) for index in range(count))
    return OK, f"{count} CUDA GPU(s): {names}"


def check_cpus():
    return INFO, f"{os.cpu_count()} CPU cores; ranks beyond that share cores (slower, same results)"


def check_user():
    """parlab runs as any user, but ``jupyter lab`` refuses to start as root."""
    if getattr(os, "geteuid", lambda: None)() != 0:  # Windows has no geteuid, and no root
        return OK, "running as a normal user, so `jupyter lab` starts as it is"
    return INFO, (
        "running as root (in a container, say): `jupyter lab` refuses to start as root; run it as a "
        "normal user, or add --allow-root (jupyter lab --allow-root notebooks/)"
    )


def check_widget_extension(labextension_dirs=None):
    """Look for the ipywidgets JupyterLab extension in ``labextension_dirs`` (default: the
    ``labextensions`` folders of every Jupyter data path)."""
    install = (
        "pip install 'ipywidgets>=8,<9' jupyterlab_widgets in the environment that runs "
        "JupyterLab, then restart JupyterLab"
    )
    if labextension_dirs is None:
        try:
            from jupyter_core.paths import jupyter_path
        except ImportError:
            return PROBLEM, f"JupyterLab is not installed, so the notebooks cannot open; {install}."
        labextension_dirs = jupyter_path("labextensions")
    for folder in labextension_dirs:
        if os.path.isdir(os.path.join(folder, WIDGET_EXTENSION)):
            return OK, f"ipywidgets JupyterLab extension found in {folder}"
    return PROBLEM, (
        "the ipywidgets JupyterLab extension (@jupyter-widgets/jupyterlab-manager) is missing, "
        f"so sliders show as plain text; {install}."
    )


def check_all_reduce():
    """A 2-rank all_reduce through ``parlab.launch``: each rank gives rank + 1, all get 3."""
    expected = SMOKE_TEST_WORLD_SIZE * (SMOKE_TEST_WORLD_SIZE + 1) // 2
    start = time.perf_counter()
    try:
        # Ranks sharing a GPU make a warning; here the line itself says where the ranks ran.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            where = placement.resolve(SMOKE_TEST_WORLD_SIZE).describe()
            results = parlab.launch(
                _all_reduce_rank_plus_one, SMOKE_TEST_WORLD_SIZE, timeout=SMOKE_TEST_TIMEOUT_S
            )
    except Exception as exc:
        return PROBLEM, (
            f"{SMOKE_TEST_WORLD_SIZE}-rank all_reduce failed: {_first_line(exc)}. Processes must be "
            "able to open local TCP ports on 127.0.0.1 (check firewall or VPN software); on macOS "
            "try GLOO_SOCKET_IFNAME=lo0."
        )
    elapsed = time.perf_counter() - start
    if results != [expected] * SMOKE_TEST_WORLD_SIZE:
        return PROBLEM, (
            f"{SMOKE_TEST_WORLD_SIZE}-rank all_reduce gave {results}, expected {expected} on every "
            f"rank: torch.distributed computes wrongly here; {OFFICIAL_TORCH}."
        )
    return OK, (
        f"{SMOKE_TEST_WORLD_SIZE}-rank all_reduce ({where}): every rank got {expected}, "
        f"in {elapsed:.1f} s including start-up"
    )


CHECKS = (
    check_python,
    check_torch,
    check_distributed,
    check_gloo,
    check_nccl,
    check_gpus,
    check_cpus,
    check_user,
    check_widget_extension,
    check_all_reduce,
)


def run(gpu=False):
    """Run every check, printing each line as it completes, then with ``gpu`` the GPU check
    (``parlab.device_check``); return the exit code (0: all passed)."""
    print("parlab doctor: is this machine ready for the parlab lectures?", flush=True)
    problems = 0
    for check in CHECKS:
        try:
            status, message = check()
        except Exception as exc:
            status, message = PROBLEM, f"{check.__name__} could not run: {_first_line(exc)}"
        problems += status == PROBLEM
        print(f"{status:<8} {message}", flush=True)
    print(f"{problems} problem(s); each PROBLEM line says what to do." if problems else "All checks passed.")
    if gpu:
        from parlab import device_check

        print("\nThe GPU check: every engine on the GPU against one process, then each lecture's bench.", flush=True)
        return max(1 if problems else 0, device_check.run("cuda", out=functools.partial(print, flush=True)))
    return 1 if problems else 0


def _all_reduce_rank_plus_one():
    value = torch.tensor([dist.get_rank() + 1.0], device=parlab.runtime.device())
    dist.all_reduce(value)
    return int(value.item())


def _first_line(exc):
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"
