"""Decode attention (one new query token per row over a long key/value cache) in a small C++ kernel of our own.

A decode step reads the whole cache and does little arithmetic on it, so it is bound by memory bandwidth. On a
2-core CPU, PyTorch's ``scaled_dot_product_attention`` read SmolLM2's cache (12 rows x 2,400 tokens, 9 query over 3
key/value heads; ``repertory bench attention``) at 15-18 GB/s and ``decode_attention.cpp`` at 35-48 GB/s, in a
third to a half of the time: it reads each key/value head once for its group of query heads, never reads a masked
column, splits long rows across the cores and merges the pieces by log-sum-exp. It matches SDPA to float32
rounding (about 2e-7 on outputs of order 1). Keys and values in bfloat16 are taken too (the query in float32, the
sums in float32: half the bytes to read), for a cache kept in bfloat16.

A second op reads a paged cache (:func:`paged_decode_attention`): pages ``[N, Hkv, P, D]`` shared by every row,
each row's columns found through its own block table, so rows join and leave the hf engine's batch without a copy
and without padding (:mod:`repertory.generation.paged`).

The kernel is compiled on first use with the machine's C++ compiler (``$CXX``, else ``c++``) for the machine it
runs on (``-march=native``), into ``<cache>/kernels/`` under a name that hashes the source, torch's version, the
compiler and the CPU, so a cache shared between machines or torch versions never loads a stale build. It is
written beside its final name and renamed into place: processes that build at once each leave a whole file. (One
compiler call rather than ``torch.utils.cpp_extension.load``, which needs ninja, not a dependency of repertory, and
whose lock file, left behind by a build that was killed, makes every later process wait for ever.)
Without a compiler, or if the build fails, one line says so and SDPA runs. ``REPERTORY_DECODE_KERNEL=0`` turns
the kernel off (A/B benchmarks, tests of the fallback).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shlex
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from repertory.models.cache import cache_dir
from repertory.system import cpuinfo_lines

SWITCH = "REPERTORY_DECODE_KERNEL"
"""Set to 0 to run SDPA instead of the kernel."""

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
KV_DTYPES = (torch.float32, torch.bfloat16)  # query float32 either way; sums in float32
# ATen's vector types pick their instruction set from these macros, as in PyTorch's own per-ISA kernels; without
# one they fall back to plain arrays (correct, slower)
_ISA = {"AVX512": "-DCPU_CAPABILITY_AVX512", "AVX2": "-DCPU_CAPABILITY_AVX2"}

log = logging.getLogger(__name__)
_lock = threading.Lock()
_kernel: list[Any] = []  # the one load attempt's result (the op namespace, or None), once made


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    splits: int = 0,
) -> torch.Tensor | None:
    """``query`` [B, Hq, 1, D] over ``key``/``value`` [B, Hkv, T, D] (any strides but a unit one along D) where the
    boolean ``mask`` (broadcastable to [B, 1, 1, T], True: attend; or None) allows, by the kernel: [B, 1, Hq, D].
    None when the call is not one it takes (another device or dtype, several query tokens, gradients, another
    mask) or the kernel is off or unavailable: then the caller runs SDPA. ``splits``: pieces each row's columns
    are cut into (0: as many as keep every core busy)."""
    if not fits(query, key, value, mask):
        return None
    kernel = decode_kernel()
    if kernel is None:
        return None
    return kernel(query, key, value, mask, query.shape[-1] ** -0.5 if scale is None else scale, splits)


def fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the kernel computes this call: one float32 query token on the CPU, float32 or bfloat16 keys and
    values with whole groups of query heads and a unit stride along D, a boolean [B or 1, 1, 1, T] mask or none,
    and no gradient wanted."""
    if query.device.type != "cpu" or query.dim() != 4 or query.shape[2] != 1 or query.dtype != torch.float32:
        return False
    if key.dim() != 4 or key.shape != value.shape or key.dtype not in KV_DTYPES or value.dtype != key.dtype:
        return False
    if key.shape[0] != query.shape[0] or key.shape[3] != query.shape[3] or not key.shape[1]:
        return False
    if query.shape[1] % key.shape[1]:
        return False
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key.device.type != "cpu" or value.device.type != "cpu":
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    return mask is None or (
        mask.dtype == torch.bool
        and mask.device.type == "cpu"
        and mask.dim() == 4
        and mask.shape[1:] == (1, 1, key.shape[2])
        and mask.shape[0] in (1, key.shape[0])
    )


def paged_decode_attention(
    query: torch.Tensor,
    key_pages: torch.Tensor,
    value_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    splits: int = 0,
) -> torch.Tensor:
    """``query`` [B, Hq, 1, D] float32 over pages ``key_pages``/``value_pages`` [N, Hkv, P, D] (float32 or
    bfloat16): row b attends to its first ``lengths[b]`` columns, column t lying in page ``table[b, t // P]`` at
    ``t % P``; unused table entries must still name a page. Returns [B, 1, Hq, D]. The kernel must be available
    (:func:`paged_kernel`)."""
    kernel = paged_kernel()
    if kernel is None:
        raise RuntimeError("the paged decode-attention kernel is unavailable")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return kernel(query, key_pages, value_pages, table, lengths, scale, splits)


def decode_kernel() -> Callable | None:
    """The kernel's op (``torch.ops.repertory.decode_attention``), built and loaded on the first call of the process;
    None when ``REPERTORY_DECODE_KERNEL=0`` or when it could not be built or loaded (said once)."""
    ops = _ops()
    return None if ops is None else ops.decode_attention


def paged_kernel() -> Callable | None:
    """The paged op (``torch.ops.repertory.paged_decode_attention``), or None as for :func:`decode_kernel`."""
    ops = _ops()
    return None if ops is None else ops.paged_decode_attention


def _ops() -> Any:
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    with _lock:
        if not _kernel:
            _kernel.append(_load())
    return _kernel[0]


def _load() -> Any:
    try:
        library = kernel_path()
        if not library.is_file():
            _build(library)
        torch.ops.load_library(str(library))
        return torch.ops.repertory
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("repertory: decode-attention kernel unavailable (%s); using SDPA", _reason(error))
        return None


def _reason(error: Exception) -> str:
    """The error in one short line: a failed compiler's first error line (or its exit status), else the exception's
    first line."""
    if isinstance(error, subprocess.CalledProcessError):
        lines = [line.strip() for line in (error.stderr or "").splitlines() if "error" in line.lower()]
        return (lines[0] if lines else f"{error.cmd[0]} exited with status {error.returncode}")[:200]
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:200]


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "c++")


def _cpu() -> str:
    """What ``-march=native`` compiles for: the CPU's model and features (Linux), else the platform's names."""
    lines = cpuinfo_lines()
    if lines is None:
        return f"{platform.machine()} {platform.processor()}"
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))


def _defines() -> list[str]:
    isa = _ISA.get(torch.backends.cpu.get_cpu_capability())
    return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *([isa] if isa else [])]


def kernel_path() -> Path:
    """Where the build for this source, torch, compiler and CPU lives (whether or not it has been built yet)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, *_compiler(), *FLAGS, *_defines(), platform.machine(), _cpu()):
        digest.update(part.encode() + b"\0")
    return cache_dir() / "kernels" / f"decode_attention-{digest.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    """Compile the kernel into ``target``, atomically (written beside it, then renamed)."""
    from torch.utils.cpp_extension import include_paths, library_paths  # pulls setuptools in: only when building

    target.parent.mkdir(parents=True, exist_ok=True)
    work = str(target.with_name(f".{target.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.so"))
    includes = [f"-isystem{path}" for path in include_paths()]
    libraries = [f"-L{path}" for path in library_paths()]
    sources = [*includes, str(SOURCE), "-o", work, *libraries, "-lc10", "-ltorch_cpu"]
    command = [*_compiler(), *FLAGS, *_defines(), *sources]
    log.info("building the decode-attention kernel once into %s", target)
    try:
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
        os.replace(work, target)
    finally:
        Path(work).unlink(missing_ok=True)
