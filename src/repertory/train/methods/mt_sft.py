"""MT-SFT (``method.kind: mt-sft``; docs/algorithms.md 6.1): filtered behaviour cloning, the token-mean NLL of the
agent turns of the conversations whose G_0 is at or above the ``quantile`` of the round's."""

from __future__ import annotations

import random

import torch

from repertory.algos import offline
from repertory.config import MTSFTConfig
from repertory.store.turns import LoggedTurn
from repertory.train.methods.base import RoundContext, RoundMethod, chunks, register_method
from repertory.train.turns import conversations, first_return
from repertory.types import Episode, derive


@register_method(MTSFTConfig)
class MTSFT(RoundMethod):
    """Behaviour cloning of the round's best conversations."""

    config: MTSFTConfig

    def improve(
        self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        convos = conversations(turns)
        ids = list(convos)
        returns = [first_return(convos[e], self.config.gamma) for e in ids]
        cutoff, keep = offline.filtered_bc_keep(returns, self.config.quantile)
        kept = [t for e, k in zip(ids, keep) if k for t in convos[e]]
        metrics = {"sft/cutoff": cutoff, "sft/kept_conversations": float(sum(keep)), "sft/kept_turns": float(len(kept))}
        losses = []
        for epoch in range(self.config.epochs):
            order = list(range(len(kept)))
            random.Random(derive(self.seed, round_index, epoch, "sft")).shuffle(order)
            for chunk in chunks(order, self.config.batch_size):
                pairs = [(kept[i].prompt_ids, kept[i].response_ids) for i in chunk]
                n_tokens = sum(len(r) for _, r in pairs)
                grammars = [ctx.grammar(kept[i]) for i in chunk]
                loss = ctx.learner.backward_on(
                    pairs, lambda _, logps, n=n_tokens: -torch.cat(logps).sum() / n, grammars
                )
                ctx.learner.optimizer_step()
                losses.append(loss)
        if losses:
            metrics["loss/sft"] = sum(losses) / len(losses)
        return metrics
