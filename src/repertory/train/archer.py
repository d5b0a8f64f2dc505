"""ArCHer and ArCHer-LC as round methods (docs/algorithms.md 6.4, 6.5): a TD critic over a replay buffer of every
round's logged transitions, then an actor pass over the round's states with fresh samples."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from repertory.algos import offline
from repertory.models.packing import token_batches
from repertory.store.turns import LoggedTurn
from repertory.train.rounds import RoundsTrainer, chunks, register_method
from repertory.train.turns import conversations
from repertory.types import Episode, derive


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


@register_method("archer", epochs=1, critic="archer")
def archer(
    trainer: RoundsTrainer, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode], epochs: int
) -> dict[str, float]:
    """ArCHer (6.4, 6.5): a critic pass over the replay buffer of every round's transitions (two in round 0),
    then an actor pass over this round's states with fresh samples a_pi and A = min Q - min V."""
    assert trainer.archer is not None
    trainer.archer.cache.clear()  # features of last round's fresh samples will not be asked for again
    all_turns, all_episodes = trainer.history(round_index, turns, episodes)
    buffer = transitions(all_turns, trainer.config.rounds.gamma)
    by_state = {(tuple(t.prompt_ids)): t for t in all_turns}
    metrics: dict[str, float] = {"archer/buffer": float(len(buffer))}
    losses = []
    for critic_pass in range(2 if round_index == 0 else 1):
        order = list(range(len(buffer)))
        random.Random(derive(trainer.config.seed, round_index, critic_pass, "archer-critic")).shuffle(order)
        for chunk in chunks(order, trainer.config.rounds.archer.batch_size):
            batch = [buffer[i] for i in chunk]
            states = [by_state[tuple(x.state)] for x in batch]
            generations, _ = trainer.sample(states, all_episodes, 1, (round_index, critic_pass, "archer-critic"))
            losses.append(critic_step(trainer, batch, [g.token_ids for g in generations]))
    metrics["loss/critic"] = sum(losses) / len(losses)
    actor_losses, advantages = [], []
    order = list(range(len(turns)))
    random.Random(derive(trainer.config.seed, round_index, "archer-actor")).shuffle(order)
    for chunk in chunks(order, trainer.config.rounds.archer.batch_size):
        states = [turns[i] for i in chunk]
        generations, _ = trainer.sample(states, episodes, 1, (round_index, "archer-actor"))
        actions = [g.token_ids for g in generations]
        loss, adv = actor_step(trainer, [x.prompt_ids for x in states], actions)
        actor_losses.append(loss)
        advantages += adv
    metrics["loss/actor"] = sum(actor_losses) / len(actor_losses)
    metrics["archer/advantage"] = sum(advantages) / len(advantages)
    return metrics


def critic_step(trainer: RoundsTrainer, batch: list[Transition], sampled: list[list[int]]) -> float:
    """One critic update (6.4): y_Qi = r + gamma (1 - d) Vbar_i(s'), y_Vi = Qbar_i(s, a_pi), the sum of the
    four mean squared errors, then the soft update of the target. Returns the loss."""
    assert trainer.archer is not None
    critic, gamma = trainer.archer, trainer.config.rounds.gamma
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
    trainer.archer_optimizer.zero_grad(set_to_none=True)
    total = 0.0
    # Each squared error is a mean over the batch, so micro-batches add up to the batch's gradient.
    lengths = [len(x.state) + len(x.action) for x in batch]
    for micro in token_batches(lengths, trainer.config.algo.micro_batch_tokens):
        h_s = critic.encode([batch[i].state for i in micro])
        h_sa = critic.encode([batch[i].state + batch[i].action for i in micro])
        q, v = critic.heads.qs(h_s, h_sa), critic.heads.values(h_s)
        loss = sum(
            ((q[k] - y_q[k][micro]) ** 2).sum() + ((v[k] - y_v[k][micro]) ** 2).sum() for k in range(2)
        ) / len(batch)
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(critic.parameters_to_train(), trainer.config.algo.grad_clip)
    trainer.archer_optimizer.step()
    critic.soft_update(trainer.config.rounds.archer.tau)
    return total


def actor_step(trainer: RoundsTrainer, states: list[list[int]], actions: list[list[int]]) -> tuple[float, list[float]]:
    """One actor update (6.4): -mean_s [A * sum of log pi(a_pi | s)], A = min(Q1, Q2)(s, a_pi) - min(V1, V2)(s)
    from the online critic, detached. Returns the loss and the advantages."""
    assert trainer.archer is not None
    critic = trainer.archer
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

    loss = trainer.learner.backward_on(pairs, loss_of)
    trainer.learner.optimizer_step()
    trainer.sync()  # the next states' fresh samples come from the updated policy
    advantages = (torch.minimum(q1, q2) - torch.minimum(v1, v2))[kept].tolist()
    return loss, advantages


register_method("archer-lc", epochs=1, critic="archer-lc")(archer)
