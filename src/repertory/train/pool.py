"""The opponent pool of ``rollout.opponent: pool`` (docs/algorithms.md 7.5): LoRA snapshots of the live adapter."""

from __future__ import annotations

import os
import random
from typing import Any

from peft import get_peft_model_state_dict
from safetensors.torch import save_file

from repertory.agents import Agent
from repertory.agents.lm import LIVE_ADAPTER, LMAgent
from repertory.agents.resolve import snapshot_agent
from repertory.config import PoolConfig
from repertory.models.checkpoints import load_adapter
from repertory.runs import RunDir
from repertory.train import distributed
from repertory.types import Episode, RepertoryError, derive


class OpponentPool:
    """Snapshots of the live adapter (docs/algorithms.md 7.5), kept as files in the run directory and loaded
    as named adapters into the policy model for the iterations that serve them (``snapshot@K`` agents)."""

    def __init__(self, peft: Any, run_dir: RunDir, config: PoolConfig, seed: int, live: LMAgent):
        """``live`` plays the matches no snapshot is drawn for; each ``snapshot@K`` is its adapter of ``peft``."""
        if peft is None:
            raise RepertoryError("rollout.opponent 'pool' serves LoRA snapshots; set model.lora.enabled: true")
        self.peft, self.config, self.seed = peft, config, seed
        self.live = live
        self.run_dir = run_dir
        self.loaded: dict[int, LMAgent] = {}

    def snapshots(self) -> list[int]:
        """Iterations whose snapshot is on disk, oldest first."""
        return self.run_dir.snapshots()

    def before_rollout(self, iteration: int) -> None:
        """Snapshot the live adapter when ``iteration`` is due (every ``snapshot_every``); data-parallel, process 0
        writes it and every process waits for the file."""
        if iteration % self.config.snapshot_every == 0:
            if distributed.is_main():
                self.take(iteration)
            distributed.barrier()

    def metrics(self, episodes: list[Episode]) -> dict[str, float]:
        """How many snapshots exist, and the share of the iteration's matches a snapshot played."""
        matches = sum(any(s.policy_id.startswith("snapshot@") for s in ep.seats) for ep in episodes)
        return {"pool/snapshots": len(self.snapshots()), "pool/snapshot_matches": matches / len(episodes)}

    def take(self, iteration: int) -> None:
        """Save the live adapter as snapshot ``iteration`` (atomically; rewriting it is harmless)."""
        final = self.run_dir.snapshot(iteration)
        final.parent.mkdir(parents=True, exist_ok=True)
        tensors = get_peft_model_state_dict(self.peft, adapter_name=LIVE_ADAPTER)
        tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, final)

    def load(self, snap: int) -> str:
        """Load snapshot ``snap`` as an adapter of the policy model; returns the adapter's name."""
        return load_adapter(self.peft, f"snapshot-{snap}", self.run_dir.snapshot(snap), LIVE_ADAPTER)

    def serve(self, iteration: int) -> list[LMAgent]:
        """The snapshots served this iteration (a random subset of at most ``max_served``), loaded as adapters of
        the live policy's model."""
        available = [i for i in self.snapshots() if i <= iteration]
        rng = random.Random(derive(self.seed, iteration, "opponent", "served"))
        served = sorted(rng.sample(available, min(self.config.max_served, len(available))))
        peft = self.peft
        for old in [i for i in self.loaded if i not in served]:
            peft.delete_adapter(self.loaded.pop(old).adapter)
        for snap in served:
            if snap not in self.loaded:
                self.loaded[snap] = snapshot_agent(self.live, f"snapshot@{snap}", self.load(snap))
        return [self.loaded[i] for i in served]

    def draw(self, served: list[LMAgent], iteration: int, match: int) -> Agent:
        """Match ``match``'s opponent: a random served snapshot with probability p_snapshot, else the live policy."""
        rng = random.Random(derive(self.seed, iteration, match, "opponent"))
        if served and rng.random() < self.config.p_snapshot:
            return served[rng.randrange(len(served))]
        return self.live
