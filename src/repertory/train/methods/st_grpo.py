"""ST-GRPO (``method.kind: st-grpo``; docs/algorithms.md 6.6): each logged conversation is one GRPO sample with
reward G_0, its advantage centred within its kernel's (and seat's) group and given to every agent turn."""

from __future__ import annotations

import math

from repertory.algos import offline
from repertory.config import STGRPOConfig
from repertory.store.turns import LoggedTurn
from repertory.train.batch import single_turn_batch
from repertory.train.methods.base import RoundContext, RoundMethod, register_method
from repertory.train.turns import Conversation, conversation_of, conversations, first_return, group_key
from repertory.types import Episode


@register_method(STGRPOConfig)
class STGRPO(RoundMethod):
    """Whole conversations as GRPO samples, grouped by kernel."""

    config: STGRPOConfig

    def improve(
        self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        convos, gamma = conversations(turns), self.config.gamma
        by_kernel: dict[str, list[Conversation]] = {}
        for key, convo in convos.items():
            by_kernel.setdefault(group_key(convo[0]), []).append(key)
        advantage: dict[Conversation, float] = {}
        for members in by_kernel.values():
            returns = [first_return(convos[e], gamma) for e in members]
            for key, a in zip(members, offline.candidate_advantages(returns)):
                advantage[key] = a
        flat = [t for convo in convos.values() for t in convo]
        batch, adv = single_turn_batch(
            [t.prompt_ids for t in flat],
            [t.response_ids for t in flat],
            [advantage[conversation_of(t)] for t in flat],
            [ctx.grammar(t) for t in flat],
        )
        ctx.backend.offload()
        mismatch = ctx.learner.score(batch)
        batch.assign(adv)
        mini = max(1, math.ceil(len(batch.sequences) / self.config.batch_size))
        metrics = {**mismatch, **ctx.learner.update(batch, f"st-grpo/{round_index}", self.config.epochs, mini)}
        metrics["st-grpo/groups"] = float(sum(len(m) >= 2 for m in by_kernel.values()))
        return metrics
