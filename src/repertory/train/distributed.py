"""Data-parallel training over processes: ``repertory train --gpus N`` (or any launcher that sets the
``torch.distributed`` environment: ``torchrun``, ``accelerate launch``).

Every process holds the whole policy, built from the same config and seed. Each plays a contiguous shard
of the iteration's episodes and the processes exchange them, so every process holds the whole batch, in
order; each then computes the loss of its share of each mini-batch's micro-batches, and the gradients are
summed across processes before the optimiser step. Because the loss weights are taken over the whole
mini-batch, the sum is the single-process gradient, and every process takes the same step. Process 0 alone
writes the run directory (episodes, metrics, checkpoints, report) and runs the held-out evaluation.
GPUs use NCCL, one device per process; CPU processes use Gloo (how the tests run it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def initialise() -> None:
    """Join the process group the launcher describes (``WORLD_SIZE`` > 1); nothing in a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Whether this process writes the run directory."""
    return rank() == 0


def gather(value: Any) -> list[Any]:
    """Every process's ``value``, in rank order."""
    if world_size() == 1:
        return [value]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, value)
    return out


def broadcast(value: Any) -> Any:
    """Process 0's ``value``, in every process."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def sum_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the processes (a process with no micro-batch contributes zeros).
    A sharded parameter's gradient FSDP already reduced, as the mean: it is scaled back to the sum."""
    if world_size() == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in parameters:
        if isinstance(p, DTensor):
            if p.grad is not None:
                p.grad.mul_(world_size())
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():  # one all-reduce per dtype and device
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_values(values: dict[str, float]) -> dict[str, float]:
    """Sum per-process statistics (the shares of a step's loss) over the processes."""
    if world_size() == 1:
        return values
    keys = sorted(values)
    total = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        total = total.cuda()
    dist.all_reduce(total)
    return dict(zip(keys, total.tolist()))


def relaunch(argv: list[str], processes: int) -> None:
    """Replace this process with ``processes`` copies of ``repertory ARGV`` (its ``--gpus`` option removed)
    under torch's launcher."""
    keep, skip = [], False
    for arg in argv:
        if skip or arg == "--gpus" or arg.startswith("--gpus="):
            skip = arg == "--gpus"
            continue
        keep.append(arg)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    os.execv(sys.executable, [*launcher, "-m", "repertory", *keep])
