"""What this machine can do and what this process used: the hardware limit benchmarks compare against."""

from __future__ import annotations

import resource
import time


def matmul_flops(seconds: float = 1.0, n: int = 1024) -> float:
    """Sustained float32 matmul FLOP/s of this machine (square ``n`` x ``n`` products)."""
    import torch  # only benchmarks measure the limit; the rest of this module is for light callers too

    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start)


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
