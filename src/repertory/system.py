"""What this machine is, what it can do and what this process used: the hardware limit benchmarks compare
against, and the facts a run records about where it ran."""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent


def matmul_flops(
    seconds: float = 1.0,
    n: int = 1024,
    device: str = "cpu",
    product: Callable[[Any, Any], Any] | None = None,
    dtype: Any = None,
) -> float:
    """Sustained matmul FLOP/s of this machine in the precision models run in there: float32 ``n`` x ``n``
    products on the CPU, bfloat16 8192 x 8192 ones on a GPU (``device`` "cuda"); ``dtype`` overrides the
    precision. ``product(a, b)`` is the kernel measured (default ``a @ b``); pass the one the models run, since
    the CPU's kernels differ by vendor."""
    import torch  # only benchmarks measure the limit; the rest of this module is for light callers too

    on_gpu = str(device).startswith("cuda")
    n = 8192 if on_gpu else n
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    product = product or torch.matmul
    for _ in range(2):
        product(a, b)
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        product(a, b)
        count += 1
        if on_gpu and count % 8 == 0:
            sync()
    sync()
    return 2 * n**3 * count / (time.perf_counter() - start)


def memory_bandwidth(seconds: float = 1.0, device: str = "cpu", mib: int | None = None) -> float:
    """Sustained memory read bandwidth in bytes/s: how fast summing a float32 tensor far larger than the caches
    (``mib`` MiB: 256 on the CPU, 1024 on a GPU, ``device`` "cuda") streams it from main or device memory, once
    per sum — what decoding does with the weights and cached keys and values at every step. Writes are not
    measured (a sum writes one number)."""
    import torch

    on_gpu = str(device).startswith("cuda")
    n = (mib or (1024 if on_gpu else 256)) * 2**20 // 4
    data = torch.ones(n, device=device, dtype=torch.float32)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    data.sum()  # first touch and kernel selection out of the timing
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        data.sum()
        count += 1
        if on_gpu and count % 8 == 0:
            sync()
    sync()
    return 4 * n * count / (time.perf_counter() - start)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def source_commit(package: Path = PACKAGE) -> str | None:
    """The git commit of the source that ``package`` runs from, ``+dirty`` where its files differ from it (edited,
    or new and not ignored; edits elsewhere in the checkout, such as notes, change nothing that runs); None unless
    ``package`` is ``src/repertory`` of a git checkout (an installed wheel has no commit, and a virtual environment
    inside some other repository must not report that one's)."""
    try:
        git = ["git", "-C", str(package)]
        top = subprocess.run([*git, "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10)
        if top.returncode or Path(top.stdout.strip()).resolve() / "src" / package.name != package.resolve():
            return None
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        status = subprocess.run(
            [*git, "status", "--porcelain", "--", "."],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def cpuinfo_lines() -> list[str] | None:
    """The lines of ``/proc/cpuinfo``, or None where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None


def _cpu_model() -> str:
    names = [
        line.split(":", 1)[1].strip() for line in cpuinfo_lines() or [] if line.startswith("model name") and ":" in line
    ]
    return names[0] if names else platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """Where this process runs: the software (repertory, its source commit, Python, torch) and the hardware (the
    CPU's model and the vector instructions torch uses on it, cores, torch's threads, the GPU if any). Numbers
    from two machines can differ for that reason alone (``model.precision: auto`` picks bfloat16 products only
    on some CPUs), so each run records this for every stretch it trained."""
    import torch

    from repertory import __version__

    return {
        "repertory": __version__,
        "commit": source_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
