"""MT-KTO (``method.kind: mt-kto``; docs/algorithms.md 6.2): conversations above their kernel's mean G_0 are
desirable, below undesirable; every agent turn inherits its conversation's label; KTO against the round's
reference, with the mismatched pairs of each batch as the reference point."""

from __future__ import annotations

import random

import torch

from repertory.algos import offline
from repertory.config import MTKTOConfig
from repertory.store.turns import LoggedTurn
from repertory.train.learner import Learner
from repertory.train.methods.base import RoundContext, RoundMethod, chunks, register_method
from repertory.train.turns import conversation_of, conversations, first_return, group_key
from repertory.types import Episode, derive


@register_method(MTKTOConfig)
class MTKTO(RoundMethod):
    """KTO on conversation-level labels."""

    config: MTKTOConfig

    def improve(
        self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        convos = conversations(turns)
        labels = offline.kto_labels(
            [group_key(c[0]) for c in convos.values()], [first_return(c, self.config.gamma) for c in convos.values()]
        )
        label_of = dict(zip(convos, labels))
        samples = [t for e, convo in convos.items() if label_of[e] is not None for t in convo]
        metrics: dict[str, float] = {"kto/desirable": 0.0, "kto/undesirable": 0.0}
        if not samples:
            metrics["kto/skipped"] = 1.0
            return metrics
        desirable = [bool(label_of[conversation_of(t)]) for t in samples]
        n_d, n_u = sum(desirable), len(desirable) - sum(desirable)
        lambda_d, lambda_u = offline.kto_lambdas(n_d, n_u)
        metrics.update({"kto/desirable": float(n_d), "kto/undesirable": float(n_u), "kto/lambda_d": lambda_d})
        metrics["kto/lambda_u"] = lambda_u
        learner = ctx.learner
        grammars = [ctx.grammar(t) for t in samples]
        pairs = [(t.prompt_ids, t.response_ids) for t in samples]
        ref = [float(x.sum()) for x in learner.token_logps(pairs, True, grammars)]
        losses = []
        for epoch in range(self.config.epochs):
            order = list(range(len(samples)))
            random.Random(derive(self.seed, round_index, epoch, "kto")).shuffle(order)
            for chunk in chunks(order, self.config.batch_size):
                mismatched = _mismatched(learner, [samples[i] for i in chunk])
                n = len(chunk)

                def loss_of(indices: list[int], logps: list[torch.Tensor], chunk=chunk, mismatched=mismatched, n=n):
                    device = logps[0].device
                    reference = torch.tensor([ref[chunk[i]] for i in indices], device=device)
                    r = torch.stack([lp.sum() for lp in logps]) - reference
                    mask = torch.tensor([desirable[chunk[i]] for i in indices], device=device)
                    per = offline.kto_loss(r, mismatched.to(device), mask, self.config.beta, lambda_d, lambda_u)
                    return per.sum() / n

                chunk_pairs = [pairs[i] for i in chunk]
                losses.append(learner.backward_on(chunk_pairs, loss_of, [grammars[i] for i in chunk]))
                learner.optimizer_step()
        metrics["loss/kto"] = sum(losses) / len(losses)
        return metrics


def _mismatched(learner: Learner, chunk: list[LoggedTurn]) -> torch.Tensor:
    """Implied rewards of the mismatched pairs (x_i, y_{(i-1) mod n}) whose mean is KTO's reference point;
    a lone sample has none (z0 = 0). They are scored without grammars: a response need not parse at another
    turn's state."""
    if len(chunk) < 2:
        return torch.zeros(1)
    pairs = [(chunk[i].prompt_ids, chunk[i - 1].response_ids) for i in range(len(chunk))]
    policy = learner.token_logps(pairs)
    reference = learner.token_logps(pairs, reference=True)
    return torch.tensor([float(p.sum() - r.sum()) for p, r in zip(policy, reference)])
