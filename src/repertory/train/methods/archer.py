"""ArCHer and ArCHer-LC (``method.kind: archer | archer-lc``; docs/algorithms.md 6.4, 6.5): a TD critic over a
replay buffer of every round's logged transitions, then an actor pass over the round's states with fresh samples.
The critic (double Q and V heads on last-token features of a copy of the initial model: frozen for archer, with
its own LoRA for archer-lc), its soft-updated target and its optimiser are this method's state."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from repertory.algos import offline
from repertory.config import AlgoConfig, ArcherConfig, ArcherLCConfig
from repertory.models import LoadedModel
from repertory.models.packing import token_batches
from repertory.store.turns import LoggedTurn
from repertory.train.heads import ArcherCritic, LastTokenFeatures
from repertory.train.learner import Learner
from repertory.train.methods.base import RoundContext, RoundMethod, chunks, register_method
from repertory.train.turns import conversations
from repertory.types import Episode, derive

CRITIC_FILE, OPTIMIZER_FILE = "archer.safetensors", "archer_optimizer.pt"


@dataclass
class Transition:
    """(s_t, a_t, r_t, s_{t+1}, d_t) of one logged agent turn; s' is the agent's next prompt (with the reply)."""

    state: list[int]
    action: list[int]
    reward: float
    next_state: list[int] | None

    @property
    def done(self) -> bool:
        return self.next_state is None


def transitions(turns: list[LoggedTurn], gamma: float) -> list[Transition]:
    """ArCHer's transitions of logged turns: r_t = G_t - gamma G_{t+1} (0 before the last agent turn and R on it
    where the reward is terminal), done on the conversation's last turn."""
    out = []
    for convo in conversations(turns).values():
        for turn, following in zip(convo, [*convo[1:], None]):
            if following is None:
                out.append(Transition(turn.prompt_ids, turn.response_ids, turn.ret, None))
            else:
                reward = turn.ret - gamma ** (following.t - turn.t) * following.ret
                out.append(Transition(turn.prompt_ids, turn.response_ids, reward, following.prompt_ids))
    return out


@register_method(ArcherConfig)
class Archer(RoundMethod):
    """A critic pass over the replay buffer of every round's transitions (two in round 0), then an actor pass over
    this round's states with fresh samples a_pi and A = min Q - min V."""

    config: ArcherConfig

    def __init__(self, config: Any, seed: int, initial: LoadedModel, device: str | None):
        super().__init__(config, seed, initial, device)
        pad = initial.tokenizer.pad_token_id if initial.tokenizer.pad_token_id is not None else 0
        lora = config.lora if isinstance(config, ArcherLCConfig) else None
        features = LastTokenFeatures(copy.deepcopy(initial.model), lora, seed, pad, "archer")
        self.critic = ArcherCritic(features, seed)
        self.optimizer = torch.optim.AdamW(self.critic.parameters_to_train(), lr=config.lr)

    def save(self, directory: Path) -> None:
        save_file(self.critic.state(), str(directory / CRITIC_FILE))
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        if (directory / CRITIC_FILE).is_file():
            self.critic.load(load_file(str(directory / CRITIC_FILE)))
            self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=True))

    def improve(
        self, ctx: RoundContext, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        self.critic.cache.clear()  # features of last round's fresh samples will not be asked for again
        all_turns, all_episodes = ctx.history(round_index, turns, episodes)
        buffer = transitions(all_turns, self.config.gamma)
        by_state = {(tuple(t.prompt_ids)): t for t in all_turns}
        metrics: dict[str, float] = {"archer/buffer": float(len(buffer))}
        losses = []
        for critic_pass in range(2 if round_index == 0 else 1):
            order = list(range(len(buffer)))
            random.Random(derive(self.seed, round_index, critic_pass, "archer-critic")).shuffle(order)
            for chunk in chunks(order, self.config.batch_size):
                batch = [buffer[i] for i in chunk]
                states = [by_state[tuple(x.state)] for x in batch]
                generations = ctx.sample(
                    states, all_episodes, 1, (round_index, critic_pass, "archer-critic")
                ).generations
                losses.append(self.critic_step(batch, [g.response_ids for g in generations], ctx.algo))
        metrics["loss/critic"] = sum(losses) / len(losses)
        actor_losses, advantages = [], []
        order = list(range(len(turns)))
        random.Random(derive(self.seed, round_index, "archer-actor")).shuffle(order)
        for chunk in chunks(order, self.config.batch_size):
            states = [turns[i] for i in chunk]
            candidates = ctx.sample(states, episodes, 1, (round_index, "archer-actor"))
            loss, adv = self.actor_step(
                ctx.learner,
                [x.prompt_ids for x in states],
                [g.response_ids for g in candidates.generations],
                candidates.grammars,
            )
            ctx.publish()  # the next states' fresh samples come from the updated policy
            actor_losses.append(loss)
            advantages += adv
        metrics["loss/actor"] = sum(actor_losses) / len(actor_losses)
        metrics["archer/advantage"] = sum(advantages) / len(advantages)
        return metrics

    def critic_step(self, batch: list[Transition], sampled: list[list[int]], algo: AlgoConfig) -> float:
        """One critic update (6.4): y_Qi = r + gamma (1 - d) Vbar_i(s'), y_Vi = Qbar_i(s, a_pi), the sum of the
        four mean squared errors, then the soft update of the target. Returns the loss."""
        critic, gamma = self.critic, self.config.gamma
        with torch.no_grad():
            h_s_bar = critic.encode([x.state for x in batch], target=True)
            following = [i for i, x in enumerate(batch) if not x.done]
            v_bar = torch.zeros(2, len(batch), device=h_s_bar.device)
            if following:
                h_next = critic.encode([batch[i].next_state for i in following], target=True)
                v_bar[:, following] = torch.stack(critic.target.values(h_next))
            reward = torch.tensor([x.reward for x in batch], device=h_s_bar.device)
            done = torch.tensor([x.done for x in batch], device=h_s_bar.device)
            y_q = [offline.archer_q_target(reward, done, v_bar[i], gamma) for i in range(2)]
            h_sa_pi = critic.encode([x.state + a for x, a in zip(batch, sampled)], target=True)
            y_v = critic.target.qs(h_s_bar, h_sa_pi)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        # Each squared error is a mean over the batch, so micro-batches add up to the batch's gradient.
        lengths = [len(x.state) + len(x.action) for x in batch]
        for micro in token_batches(lengths, algo.micro_batch_tokens):
            h_s = critic.encode([batch[i].state for i in micro])
            h_sa = critic.encode([batch[i].state + batch[i].action for i in micro])
            q, v = critic.heads.qs(h_s, h_sa), critic.heads.values(h_s)
            loss = sum(
                ((q[k] - y_q[k][micro]) ** 2).sum() + ((v[k] - y_v[k][micro]) ** 2).sum() for k in range(2)
            ) / len(batch)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(critic.parameters_to_train(), algo.grad_clip)
        self.optimizer.step()
        critic.soft_update(self.config.tau)
        return total

    def actor_step(
        self, learner: Learner, states: list[list[int]], actions: list[list[int]], grammars: list[str | None]
    ) -> tuple[float, list[float]]:
        """One actor update (6.4): -mean_s [A * sum of log pi(a_pi | s)], A = min(Q1, Q2)(s, a_pi) - min(V1, V2)(s)
        from the online critic, detached, log pi under each action's grammar. Returns the loss and the
        advantages."""
        critic = self.critic
        with torch.no_grad():
            h_s = critic.encode(states)
            q1, q2 = critic.heads.qs(h_s, critic.encode([s + a for s, a in zip(states, actions)]))
            v1, v2 = critic.heads.values(h_s)
        kept = [i for i, a in enumerate(actions) if a]
        if not kept:
            return 0.0, []
        pairs = [(states[i], actions[i]) for i in kept]

        def loss_of(indices: list[int], logps: list[torch.Tensor]) -> torch.Tensor:
            sums = torch.stack([lp.sum() for lp in logps])
            rows = [kept[i] for i in indices]
            loss, _ = offline.archer_actor_loss(q1[rows], q2[rows], v1[rows], v2[rows], sums)
            return loss * (len(indices) / len(kept))

        loss = learner.backward_on(pairs, loss_of, [grammars[i] for i in kept])
        learner.optimizer_step()
        advantages = (torch.minimum(q1, q2) - torch.minimum(v1, v2))[kept].tolist()
        return loss, advantages


@register_method(ArcherLCConfig)
class ArcherLC(Archer):
    """ArCHer with a LoRA critic backbone of the Q-function's size."""

    config: ArcherLCConfig  # type: ignore[assignment]
