"""Shared fixtures: small helpers to play episodes with named agents."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from repertory.agents.resolve import make_agent
from repertory.cli import main
from repertory.envs import env_class
from repertory.generation import SYNCED, GenerationRequest
from repertory.models import save_checkpoint, tiny_model
from repertory.rollout import run_episodes, schedule
from repertory.types import Episode


def _share_the_cores() -> None:
    """Under pytest-xdist each worker takes its share of the cores: torch's threads, and those of the processes
    its tests start (OMP_NUM_THREADS). Two processes that each spread over every core thrash each other."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


_share_the_cores()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the files with slow tests first, each file's tests in their order: a worker takes a
    whole file at a time (``--dist loadfile``), so a long file handed out last would run while the other worker
    idles. The order is the same on every worker, as xdist requires."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) < 2:
        return
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each group is kept


def play(
    env: str, agents: list[str], episodes: int = 1, seed: int = 0, split: str = "train", kernel: int | None = None
) -> list[Episode]:
    """Play episodes of ``env`` with agent specs in seat order (one agent object per spec)."""
    cls = env_class(env)
    built = {spec: make_agent(spec, cls) for spec in agents}
    return run_episodes(schedule(env, [built[s] for s in agents], episodes, seed, split, kernel))


@pytest.fixture
def play_episodes():
    return play


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run the command line; (exit status, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def tiny_checkpoint(directory: Path, tokenizer: PreTrainedTokenizerBase, seed: int) -> Path:
    """A tiny random model saved as a Hugging Face checkpoint directory (for ``--model`` and ``model.name``)."""
    return save_checkpoint(tiny_model(tokenizer, seed=seed).model, tokenizer, directory)


@pytest.fixture(scope="session")
def compiled_kernels():
    """The decode-attention ops, built once into the default cache and shared by every test (and later runs):
    ``(decode_attention, paged_decode_attention)``; skipped without a C++ compiler."""
    from repertory.models.decode import SWITCH, decode_kernel, paged_kernel

    if shutil.which(shlex.split(os.environ.get("CXX") or "c++")[0]) is None:
        pytest.skip("no C++ compiler: the kernel cannot be built here")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(SWITCH, raising=False)
        ops = decode_kernel(), paged_kernel()
    assert None not in ops, "the kernel failed to build or load (see the logged reason)"
    return ops


def rows(
    prompts: list,
    seeds: list[int],
    constraints: list | None = None,
    cache_keys: list | None = None,
    enough: list | None = None,
    adapters: list | None = None,
) -> list[GenerationRequest]:
    """Generation requests from columns, as the backend tests write their rows (None: the field's default)."""
    n = len(prompts)
    if len(seeds) != n:
        raise ValueError("one seed per prompt")
    columns = [constraints or [None] * n, cache_keys or [None] * n, enough or [None] * n, adapters or [SYNCED] * n]
    return [GenerationRequest(p, s, c, k, e, a) for p, s, c, k, e, a in zip(prompts, seeds, *columns)]
