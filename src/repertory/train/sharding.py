"""Sharded training (``model.sharding: fsdp``): the learner's weights, gradients and AdamW moments split over
the data-parallel processes with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Every decoder layer is one FSDP unit; the embeddings, the final norm and the output head form the root unit,
a :class:`Scorer` around the causal LM whose forward is the learner's (decoder, the response positions, the
head), so the root's hooks run before any layer's.

The weights live in two states. Outside the learner's scoring and update they are *gathered*: every process
holds the full parameters, so rollouts, evaluation and the hf engine run unchanged, and each process decodes
as many steps as its own episodes need without any collective. During scoring and the update they are
*sharded*: a layer's weights are all-gathered for its forward and backward and freed after, gradients are
reduce-scattered, and AdamW keeps only its shard of the moments. What grows with the model during the update —
fp32 gradients and two moments, 12 bytes a trained parameter — divides by the process count; sampling needs the
full weights on every device, as in verl's hybrid engine.

Checkpoints: process 0 writes the policy's gathered weights in the usual format (an adapter directory or a
Hugging Face model), so eval, export and serve read them unchanged; every process writes its shard of the
optimiser state as a ``torch.distributed.checkpoint`` directory, which loads onto any process count (the
checkpoint reader re-shards), one process included.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from repertory.train import distributed
from repertory.types import RepertoryError

OPTIMIZER_SHARDS = "optimizer"  # the checkpoint's DCP directory of optimiser shards


class Scorer(nn.Module):
    """A causal LM's learner forward: the hidden states at ``(rows, cols)`` and the head's logits there."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self, inputs: dict[str, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        picked = self.model.get_decoder()(**inputs).last_hidden_state[rows, cols]
        return picked, self.model.get_output_embeddings()(picked)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise RepertoryError(f"model.sharding fsdp shards a decoder's .layers; {type(model).__name__} has none")
    return layers


class Unsharded:
    """A learner whose weights one process holds whole (one process, or data-parallel replicas): the null object of
    :class:`Sharded`, so the learner's step has no sharding branch."""

    active = False

    @contextmanager
    def sharded(self) -> Iterator[None]:
        yield

    def idle_passes(self, micro_batches: int, mine: int) -> int:
        """Passes this process runs besides its own micro-batches: none, each process is on its own."""
        return 0


class Sharded(Unsharded):
    """The FSDP units of one or more :class:`Scorer` roots and the switch between the gathered and the sharded
    state; built sharded."""

    active = True

    def __init__(self, roots: list[Scorer]):
        self.roots = roots
        for root in roots:
            for layer in _decoder_layers(root.model):
                fully_shard(layer)
            fully_shard(root)
            # FSDP initialises its hooks at the root's first forward; generation calls the layers directly, so run
            # the root once now (all processes together: its weights are gathered for it)
            one = torch.zeros((1, 1), dtype=torch.long, device=root.model.get_input_embeddings().weight.device)
            with torch.no_grad():
                root({"input_ids": one}, one[0], one[0])
        self.units = [m for root in roots for m in root.modules() if isinstance(m, FSDPModule)]
        self.shard()

    def gather(self) -> None:
        """Every process holds the full weights until :meth:`shard` (collective)."""
        for unit in self.units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()

    def shard(self) -> None:
        """Free the gathered weights; each unit gathers its own for its forward and backward."""
        for unit in self.units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)

    @contextmanager
    def sharded(self) -> Iterator[None]:
        """The sharded state for the block (the parameters are the optimiser's DTensors), gathered after. An error
        inside leaves them sharded: gathering is collective, and the other processes are not there to join."""
        self.shard()
        yield
        self.gather()

    def idle_passes(self, micro_batches: int, mine: int) -> int:
        """Passes that add nothing, for a process with fewer micro-batches than the others: FSDP gathers and
        reduces each layer with every process, so every process runs as many passes."""
        return -(-micro_batches // distributed.world_size()) - mine


def sharded_parameters(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state(module: nn.Module, trained_only: bool = False) -> dict[str, torch.Tensor]:
    """``module``'s full state (``trained_only``: its trainable parameters') on the CPU of process 0, empty
    elsewhere; collective when sharded."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trained_only)
    return get_model_state_dict(module, options=options)


@torch.no_grad()
def load_full(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy full tensors, named as in ``module``, into its parameters, sharded or not (collective when sharded:
    every process passes the same names in the same order)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise RepertoryError(f"the checkpoint holds weights this model does not have: {unknown[:3]}")
    for name, tensor in tensors.items():
        param = params[name]
        tensor = tensor.to(param.device, param.dtype)
        if isinstance(param, DTensor):
            tensor = distribute_tensor(tensor, param.device_mesh, param.placements)
        param.copy_(tensor)


def save_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every process writes its shard of ``optimizer``'s state (keyed by ``module``'s parameter names)."""
    state = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    with _one_process_is_intended():
        dcp.save(state, checkpoint_id=str(directory))


def check_shards(directory: Path) -> None:
    """Every shard the checkpoint's index names is in ``directory`` (if the optimiser has stepped, so that there is
    one): a process on another machine that wrote into a directory of the same name on its own disk left a
    checkpoint no resume could read."""
    if not directory.is_dir():
        return
    index = dcp.FileSystemReader(str(directory)).read_metadata()
    missing = sorted({info.relative_path for info in index.storage_data.values()})
    missing = [name for name in missing if not (directory / name).is_file()]
    if missing:
        raise RepertoryError(
            f"optimizer shards {missing} are not in {directory}: the processes on other machines wrote them to "
            "their own disks; the run directory must be on a file system every machine mounts at the same path"
        )


def load_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Restore what :func:`save_optimizer` wrote, on any process count."""
    if not directory.is_dir():
        raise RepertoryError(f"{directory.parent} holds no optimizer shards ({directory.name}/ is missing)")
    state = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    with _one_process_is_intended():
        dcp.load(state, checkpoint_id=str(directory))
    set_optimizer_state_dict(module, optimizer, state["optimizer"])


@contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """Without a process group the checkpoint reader and writer warn that they assume one process: they do so
    rightly here (``model.sharding fsdp`` run or resumed in one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
