"""Batch-online training (docs/algorithms.md 5-6): deployment rounds, and the round methods that improve the
policy offline from what was logged: Iterative GRPO and the baselines that learn from the same logs.

One iteration of a ``trainer: rounds`` run is one deployment round k:

1. deploy pi_k against the partner (``rollout.opponent``) on train kernels, or, in round 0, read the
   logged turns a user brings (``rounds.logs``);
2. store the conversations (``episodes/iter-K.parquet``) and one record per agent turn
   (``rounds/turns-K.parquet``, 5.3) with its Monte-Carlo return G_t;
3. improve the policy offline with the registered round method ``rounds.method``: ``igrpo`` fits the
   Q-function on the round's turns (kernel-split validation, early stopping, warm start) and runs single-turn
   GRPO over the logged states with candidates scored by Q; ``st-grpo``, ``mt-sft``, ``mt-kto`` and ``mt-ppo``
   learn from the logged conversations directly; ``archer`` and ``archer-lc`` live in
   :mod:`repertory.train.archer`. No game is played while improving: the partner's calls and the simulator's
   episodes are counted and must not move;
4. evaluate pi_{k+1} on held-out kernels (the trainer's ``eval`` section; ``eval/discounted_return`` is J).

A new method is one function registered with :func:`register_method`, which names the critic it needs.
"""

from __future__ import annotations

import copy
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from repertory import algos
from repertory.algos import offline
from repertory.config import TrainConfig
from repertory.envs import Env
from repertory.envs.replay import replay
from repertory.eval.scores import rollout_metrics
from repertory.generation import Generation, TokenTrie
from repertory.models import LoadedModel, load_model
from repertory.runs import RunDir
from repertory.store import read_episodes, write_episodes
from repertory.store.turns import LoggedTurn, write_turns
from repertory.train.base import Trainer
from repertory.train.batch import Batch, collect, single_turn_batch
from repertory.train.heads import ArcherCritic, LastTokenFeatures, QFunction, fit_q, q_examples
from repertory.train.turns import (
    Conversation,
    conversation_of,
    conversations,
    first_return,
    group_key,
    kernel_split,
    logged_turns,
    read_logs,
    read_turns,
)
from repertory.types import Episode, RepertoryError, derive

Improve = Callable[["RoundsTrainer", int, list[LoggedTurn], dict[str, Episode], int], dict[str, float]]
"""(trainer, round k, the round's logged turns, its conversations by episode id, epochs) -> metrics."""


@dataclass(frozen=True)
class RoundMethod:
    """A registered round method: how it improves the policy and what it needs. ``critic`` is the module the
    trainer builds for it (the Q-function, or ArCHer's critic on frozen or LoRA features), ``value`` whether the
    learner carries a value model, ``from_logs`` whether round 0 may learn from ``rounds.logs``."""

    name: str
    improve: Improve
    epochs: int
    critic: Literal["q", "archer", "archer-lc"] | None = None
    value: bool = False
    from_logs: bool = True


ROUND_METHODS: dict[str, RoundMethod] = {}


def register_method(
    name: str,
    *,
    epochs: int,
    critic: Literal["q", "archer", "archer-lc"] | None = None,
    value: bool = False,
    from_logs: bool = True,
) -> Callable[[Improve], Improve]:
    """Decorator adding a round method to :data:`ROUND_METHODS` under ``name`` (``rounds.method``); ``epochs``
    is its default ``rounds.epochs``."""

    def decorate(fn: Improve) -> Improve:
        if name in ROUND_METHODS:
            raise RepertoryError(f"round method {name!r} is already registered")
        ROUND_METHODS[name] = RoundMethod(name, fn, epochs, critic, value, from_logs)
        return fn

    return decorate


class _Counting:
    """The partner, counting its calls; it refuses to answer while the policy improves offline."""

    def __init__(self, agent: Any, trainer: RoundsTrainer):
        self.agent, self.trainer, self.calls = agent, trainer, 0
        self.name, self.policy_id = agent.name, agent.policy_id

    def act(self, requests):
        self.trainer._online("the partner was asked")
        self.calls += 1
        return self.agent.act(requests)


def chunks(items: list[int], size: int) -> Iterator[list[int]]:
    """Consecutive slices of ``items`` of at most ``size`` (the optimiser batches of the round methods)."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


class RoundsTrainer(Trainer):
    """Batch-online rounds (see the module docstring); one iteration = one round."""

    def __init__(self, config: TrainConfig, run_dir: RunDir, loaded: LoadedModel | None = None):
        if config.rollout.opponent in ("self", "pool"):
            raise RepertoryError(
                f"trainer rounds deploys the policy against a partner; set rollout.opponent to a bot of "
                f"{config.rollout.env}, base or model:PATH (got {config.rollout.opponent!r})"
            )
        method = ROUND_METHODS[config.rounds.method]
        if config.algo.kl_mode != "loss":
            raise RepertoryError("trainer rounds puts the KL to the reference in the loss; set algo.kl_mode: loss")
        if config.rounds.logs and not method.from_logs:
            raise RepertoryError(f"{method.name} learns from deployed conversations; rounds.logs needs another method")
        loaded = loaded or load_model(config.model.name, config.model.device)
        critic_backbone = None
        if method.critic is not None:
            other = config.rounds.q.model if method.critic == "q" else None
            critic_backbone = (
                copy.deepcopy(loaded.model) if other is None else load_model(other, config.model.device).model
            )
        super().__init__(config, run_dir, loaded)
        self.method = method
        if method.value:
            self.estimator = algos.get_estimator("gae")  # token-level GAE with the critic (6.3, section 3)
        assert self.opponent is not None
        self.partner = _Counting(self.opponent, self)
        self.opponent = self.partner
        pad = self.loaded.tokenizer.pad_token_id if self.loaded.tokenizer.pad_token_id is not None else 0
        self.q: QFunction | None = None
        self.archer: ArcherCritic | None = None
        if method.critic == "q":
            self.q = QFunction(critic_backbone, config.rounds.q, config.seed, pad)
        elif method.critic in ("archer", "archer-lc"):
            lora = config.rounds.q if method.critic == "archer-lc" else None
            self.archer = ArcherCritic(
                LastTokenFeatures(critic_backbone, lora, config.seed, pad, "archer"), config.seed
            )
            self.archer_optimizer = torch.optim.AdamW(self.archer.parameters_to_train(), lr=config.rounds.archer.lr)
        self.simulator_episodes = 0
        self.served_counts: dict[str, float] = {}  # round 0 from a served log: what it held and skipped
        self.discount = config.rounds.gamma
        self.offline = False

    def needs_critic(self) -> bool:
        return ROUND_METHODS[self.config.rounds.method].value

    def estimator_inputs(self, batch: Batch) -> list[algos.TrajectoryInput]:
        """MT-PPO's reward (6.3): the conversation's G_0 on the agent's last turn, nothing before, so that
        maximising it maximises the metric J."""
        inputs = batch.estimator_inputs()
        for traj in inputs:
            g0 = algos.discounted_returns(traj.rewards, self.config.rounds.gamma)[0] if traj.rewards else 0.0
            traj.rewards = [0.0] * (len(traj.rewards) - 1) + [g0] if traj.rewards else []
        return inputs

    # checkpoints: the policy, and the Q-function that the next round warm-starts from

    def save_state(self, directory: Path) -> None:
        super().save_state(directory)
        if self.q is not None:
            save_file(self.q.state(), str(directory / "q.safetensors"))
        if self.archer is not None:
            save_file(self.archer.state(), str(directory / "archer.safetensors"))
            torch.save(self.archer_optimizer.state_dict(), directory / "archer_optimizer.pt")

    def load_state(self, directory: Path) -> None:
        super().load_state(directory)
        if self.q is not None:
            if not (directory / "q.safetensors").is_file():
                raise RepertoryError(f"checkpoint {directory} has no Q-function (q.safetensors) to warm-start from")
            self.q.load(load_file(str(directory / "q.safetensors")))
        if self.archer is not None and (directory / "archer.safetensors").is_file():
            self.archer.load(load_file(str(directory / "archer.safetensors")))
            self.archer_optimizer.load_state_dict(torch.load(directory / "archer_optimizer.pt", weights_only=True))

    # one round

    def _online(self, what: str) -> None:
        if self.offline:
            raise RuntimeError(f"{what} while the policy improves offline (docs/algorithms.md 5.2 forbids it)")

    def evaluate(self, iteration: int) -> dict[str, Any]:
        self._online("a held-out evaluation")
        return super().evaluate(iteration)

    def deploy(self, round_index: int) -> tuple[list[LoggedTurn], list[Episode]]:
        """Round k's data: the user's logs (round 0 with ``rounds.logs``) or a deployment of pi_k."""
        self._online("a deployment")
        rounds = self.config.rounds
        if round_index == 0 and rounds.logs:
            turns, episodes, served = read_logs(rounds.logs, self.env, self.loaded.tokenizer, rounds.gamma)
            if served is not None:
                self.served_counts = {
                    "logs/conversations": float(served.conversations),
                    "logs/skipped_no_outcome": float(served.skipped_no_outcome),
                    "logs/replaced": float(served.replaced),
                    "logs/outcomes_unmatched": float(served.outcomes_unmatched),
                }
            if episodes:  # kept with the run, so later rounds can replay them (ArCHer's buffer)
                write_episodes(self.run_dir.episodes(0), episodes)
            return turns, episodes
        episodes = self.play(self.specs(round_index))
        self.simulator_episodes += len(episodes)
        write_episodes(self.run_dir.episodes(round_index), episodes)
        return logged_turns([ep for ep in episodes if not ep.judge_failed], round_index, rounds.gamma), episodes

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        config, rounds = self.config, self.config.rounds
        line: dict[str, Any] = {"iteration": iteration, "round": iteration}
        if config.eval.episodes and (iteration == 0 or (config.eval.every and iteration % config.eval.every == 0)):
            line.update(self.evaluate(iteration))
        start = time.perf_counter()
        turns, episodes = self.deploy(iteration)
        self.backend.reset_cache()
        if not turns:
            raise RepertoryError(f"round {iteration}: no logged agent turns with tokens to learn from")
        write_turns(self.run_dir.turns(iteration), turns)
        line["time/deploy_s"] = time.perf_counter() - start
        if iteration == 0:
            line.update(self.served_counts)
        if episodes and not (iteration == 0 and rounds.logs):  # a deployment's own outcome, not the logs'
            line.update(rollout_metrics(episodes))
        g0 = [first_return(convo, rounds.gamma) for convo in conversations(turns).values()]
        line["deploy/conversations"] = float(len(conversations(turns)))
        line["deploy/turns"] = float(len(turns))
        if g0:
            line["deploy/return"] = sum(g0) / len(g0)

        start = time.perf_counter()
        partner_calls = self.partner.calls
        if rounds.reference == "round":
            self.learner.freeze_reference()
        self.offline = True
        try:
            line.update(self.improve(iteration, turns, {ep.episode_id: ep for ep in episodes}))
        finally:
            self.offline = False
        if self.partner.calls != partner_calls:
            raise RuntimeError("the improvement step asked the partner")  # 5.2: improvement is offline
        self.sync()
        line["time/train_s"] = time.perf_counter() - start
        return line

    def improve(self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]) -> dict[str, float]:
        """The round's offline policy improvement with the configured method; its metrics."""
        epochs = self.config.rounds.epochs or self.method.epochs
        return self.method.improve(self, round_index, turns, episodes, epochs)

    def history(
        self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> tuple[list[LoggedTurn], dict[str, Episode]]:
        """Every round's logged turns and deployed conversations up to this one (read back from the run)."""
        all_turns, all_episodes = [], {}
        for k in range(round_index):
            if self.run_dir.turns(k).is_file():
                all_turns += read_turns(self.run_dir.turns(k), self.loaded.tokenizer, self.config.rounds.gamma)
            deployed = self.run_dir.episodes(k)
            if deployed.is_file():
                all_episodes.update({ep.episode_id: ep for ep in read_episodes(deployed)})
        return all_turns + turns, {**all_episodes, **episodes}

    def sample(
        self, states: list[LoggedTurn], episodes: dict[str, Episode], n: int, key: tuple
    ) -> tuple[list[Generation], list[tuple[Env, str] | None]]:
        """``n`` fresh responses of the live policy per logged state, sampled as deployed (constrained where the
        deployment was), and each state's replayed referee (None without its conversation)."""
        replayed = [
            replay(episodes[x.episode_id], x.seat_id, x.t) if x.episode_id in episodes else None for x in states
        ]
        prompts = [x.prompt_ids for x in states for _ in range(n)]
        seeds = [derive(self.config.seed, *key, x.episode_id, x.t, c, "sample") for x in states for c in range(n)]
        constraints = [self._constraint(state) for state in replayed for _ in range(n)]
        return self.backend.generate(prompts, self.live.params, seeds, constraints), replayed

    def _constraint(self, state: tuple[Env, str] | None) -> TokenTrie | None:
        """Candidates are sampled as the policy was deployed: constrained to the state's valid actions where
        ``rollout.constrained`` and the action set is finite."""
        if state is None or not self.config.rollout.constrained:
            return None
        env, role = state
        choices = env.action_choices(role)
        return self.backend.constraint(choices) if choices is not None else None


# The round methods (docs/algorithms.md 5.5, 6.1-6.3, 6.6)


@register_method("igrpo", epochs=1, critic="q")
def igrpo(
    trainer: RoundsTrainer, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode], epochs: int
) -> dict[str, float]:
    """Fit Q on the log, then single-turn GRPO over the logged states with Q as the reward (5.4, 5.5)."""
    assert trainer.q is not None
    rounds, algo = trainer.config.rounds, trainer.config.algo
    data = turns if rounds.q.data == "round" else trainer.history(round_index, turns, {})[0]
    q_train, q_val = kernel_split([t.kernel_id for t in data], rounds.q.val_fraction, trainer.config.seed)
    metrics = fit_q(
        trainer.q,
        q_examples([t for t in data if t.kernel_id in q_train]),
        q_examples([t for t in data if t.kernel_id in q_val]),
        rounds.q,
        trainer.config.seed,
        round_index,
        warm=round_index > 0,
        micro_tokens=algo.micro_batch_tokens,
    )
    n = rounds.candidates
    sums: dict[str, float] = {}
    steps = gated = candidates = 0
    rewards_all: list[float] = []
    spreads: list[float] = []
    for epoch in range(epochs):
        order = list(range(len(turns)))
        random.Random(derive(trainer.config.seed, round_index, epoch, "igrpo")).shuffle(order)
        for chunk in chunks(order, rounds.states_per_step):
            states = [turns[i] for i in chunk]
            generations, replayed = trainer.sample(states, episodes, n, (round_index, epoch, "candidate"))
            prompts = [x.prompt_ids for x in states for _ in range(n)]
            rewards = trainer.q.score_groups(
                [list(x.prompt_ids) for x in states],
                [[g.token_ids for g in generations[j * n : (j + 1) * n]] for j in range(len(states))],
                algo.micro_batch_tokens,
            )
            valid = [True] * len(generations)
            for j, state in enumerate(replayed):
                if rounds.format_gate and state is not None:  # users' logs carry no game state to check
                    env, role = state
                    texts = [trainer.backend.decode(g.token_ids) for g in generations[j * n : (j + 1) * n]]
                    valid[j * n : (j + 1) * n] = [env.validate(role, text)[0] for text in texts]
            gated += valid.count(False)
            candidates += len(generations)
            rewards_all += rewards
            groups = [rewards[j * n : (j + 1) * n] for j in range(len(states))]
            spreads += [statistics.stdev(group) if n > 1 else 0.0 for group in groups]
            advantages = [
                a
                for j, group in enumerate(groups)
                for a in offline.candidate_advantages(group, valid[j * n : (j + 1) * n], rounds.scale_advantages)
            ]
            batch, adv = single_turn_batch(prompts, [g.token_ids for g in generations], advantages)
            if not batch.sequences:
                continue
            trainer.backend.offload()
            trainer.learner.score(batch)
            batch.assign(adv)
            stats = trainer.learner.update(batch, f"igrpo/{round_index}/{epoch}/{steps}", 1, 1)
            trainer.sync()  # the next step samples its candidates from the updated policy
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            steps += 1
    metrics.update({key: value / steps for key, value in sums.items()} if steps else {})
    metrics["igrpo/steps"] = float(steps)
    metrics["igrpo/states"] = float(len(turns) * epochs)
    metrics["igrpo/candidate_q"] = sum(rewards_all) / len(rewards_all) if rewards_all else 0.0
    # Advantages divide by this spread: near 0, they amplify the Q-function's noise to unit scale.
    metrics["igrpo/candidate_q_std"] = sum(spreads) / len(spreads) if spreads else 0.0
    metrics["igrpo/gated_rate"] = gated / candidates if candidates else 0.0
    return metrics


@register_method("st-grpo", epochs=2)
def st_grpo(
    trainer: RoundsTrainer, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode], epochs: int
) -> dict[str, float]:
    """ST-GRPO (6.6): each logged conversation is one sample with reward G_0, grouped by kernel (and seat)."""
    convos, gamma = conversations(turns), trainer.config.rounds.gamma
    by_kernel: dict[str, list[Conversation]] = {}
    for key, convo in convos.items():
        by_kernel.setdefault(group_key(convo[0]), []).append(key)
    advantage: dict[Conversation, float] = {}
    for members in by_kernel.values():
        for key, a in zip(members, offline.candidate_advantages([first_return(convos[e], gamma) for e in members])):
            advantage[key] = a
    flat = [t for convo in convos.values() for t in convo]
    batch, adv = single_turn_batch(
        [t.prompt_ids for t in flat], [t.response_ids for t in flat], [advantage[conversation_of(t)] for t in flat]
    )
    trainer.backend.offload()
    mismatch = trainer.learner.score(batch)
    batch.assign(adv)
    mini = max(1, math.ceil(len(batch.sequences) / trainer.config.rounds.batch_size))
    metrics = {**mismatch, **trainer.learner.update(batch, f"st-grpo/{round_index}", epochs, mini)}
    metrics["st-grpo/groups"] = float(sum(len(m) >= 2 for m in by_kernel.values()))
    return metrics


@register_method("mt-sft", epochs=2)
def mt_sft(
    trainer: RoundsTrainer, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode], epochs: int
) -> dict[str, float]:
    """MT-SFT (6.1): token-mean NLL on the agent turns of the conversations at or above the G_0 quantile."""
    convos, gamma = conversations(turns), trainer.config.rounds.gamma
    ids = list(convos)
    cutoff, keep = offline.filtered_bc_keep(
        [first_return(convos[e], gamma) for e in ids], trainer.config.rounds.sft_quantile
    )
    kept = [t for e, k in zip(ids, keep) if k for t in convos[e]]
    metrics = {"sft/cutoff": cutoff, "sft/kept_conversations": float(sum(keep)), "sft/kept_turns": float(len(kept))}
    losses = []
    for epoch in range(epochs):
        order = list(range(len(kept)))
        random.Random(derive(trainer.config.seed, round_index, epoch, "sft")).shuffle(order)
        for chunk in chunks(order, trainer.config.rounds.batch_size):
            pairs = [(kept[i].prompt_ids, kept[i].response_ids) for i in chunk]
            n_tokens = sum(len(r) for _, r in pairs)
            loss = trainer.learner.backward_on(pairs, lambda _, logps, n=n_tokens: -torch.cat(logps).sum() / n)
            trainer.learner.optimizer_step()
            losses.append(loss)
    if losses:
        metrics["loss/sft"] = sum(losses) / len(losses)
    return metrics


@register_method("mt-ppo", epochs=4, value=True, from_logs=False)
def mt_ppo(
    trainer: RoundsTrainer, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode], epochs: int
) -> dict[str, float]:
    """MT-PPO in batch-online mode (6.3): token-level GAE with the critic (warm across rounds) on the round's
    conversations, PPO epochs with the deployed policy as the old one."""
    batch = collect(list(episodes.values()), trainer.config.algo.packing, trainer.config.algo.mask_truncated)
    trainer.backend.offload()
    mismatch = trainer.learner.score(batch)
    metrics = trainer.advantages(batch)
    trainer.write_credit(round_index, batch)
    metrics.update(mismatch)
    metrics.update(trainer.learner.update(batch, f"mt-ppo/{round_index}", epochs))
    return metrics


@register_method("mt-kto", epochs=1)
def mt_kto(
    trainer: RoundsTrainer, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode], epochs: int
) -> dict[str, float]:
    """MT-KTO (6.2): conversations above their kernel's mean G_0 are desirable, below undesirable; every
    agent turn inherits its conversation's label; KTO against the round's reference."""
    rounds = trainer.config.rounds
    convos = conversations(turns)
    labels = offline.kto_labels(
        [group_key(c[0]) for c in convos.values()], [first_return(c, rounds.gamma) for c in convos.values()]
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
    ref = [float(x.sum()) for x in trainer.learner.token_logps([(t.prompt_ids, t.response_ids) for t in samples], True)]
    losses = []
    for epoch in range(epochs):
        order = list(range(len(samples)))
        random.Random(derive(trainer.config.seed, round_index, epoch, "kto")).shuffle(order)
        for chunk in chunks(order, rounds.batch_size):
            mismatched = _kto_mismatched(trainer, [samples[i] for i in chunk])
            n = len(chunk)

            def loss_of(indices: list[int], logps: list[torch.Tensor], chunk=chunk, mismatched=mismatched, n=n):
                device = logps[0].device
                reference = torch.tensor([ref[chunk[i]] for i in indices], device=device)
                r = torch.stack([lp.sum() for lp in logps]) - reference
                mask = torch.tensor([desirable[chunk[i]] for i in indices], device=device)
                per = offline.kto_loss(r, mismatched.to(device), mask, rounds.kto_beta, lambda_d, lambda_u)
                return per.sum() / n

            pairs = [(samples[i].prompt_ids, samples[i].response_ids) for i in chunk]
            losses.append(trainer.learner.backward_on(pairs, loss_of))
            trainer.learner.optimizer_step()
    metrics["loss/kto"] = sum(losses) / len(losses)
    return metrics


def _kto_mismatched(trainer: RoundsTrainer, chunk: list[LoggedTurn]) -> torch.Tensor:
    """Implied rewards of the mismatched pairs (x_i, y_{(i-1) mod n}) whose mean is KTO's reference point;
    a lone sample has none (z0 = 0)."""
    if len(chunk) < 2:
        return torch.zeros(1)
    pairs = [(chunk[i].prompt_ids, chunk[i - 1].response_ids) for i in range(len(chunk))]
    policy = trainer.learner.token_logps(pairs)
    reference = trainer.learner.token_logps(pairs, reference=True)
    return torch.tensor([float(p.sum() - r.sum()) for p, r in zip(policy, reference)])
