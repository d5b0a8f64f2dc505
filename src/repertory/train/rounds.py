"""Batch-online training (docs/algorithms.md 5-6): deployment rounds, each followed by an offline improvement of
the policy with a round method (:mod:`repertory.train.methods`: I-GRPO and the baselines that learn from the same
logs).

One iteration of a run with a round method (``method.kind`` igrpo, st-grpo, mt-sft, mt-kto, mt-ppo, archer,
archer-lc) is one deployment round k:

1. deploy pi_k against the partner (``rollout.opponent``) on train kernels, or, in round 0, read the
   logged turns a user brings (``method.logs``);
2. store the conversations (``episodes/iter-K.parquet``) and one record per agent turn
   (``rounds/turns-K.parquet``, 5.3) with its Monte-Carlo return G_t;
3. improve the policy offline with the method, which sees a :class:`~repertory.train.methods.RoundContext`
   (learner, sampler, run directory, seed), never this trainer. No game is played while improving: the
   partner's calls and the simulator's episodes are counted and must not move;
4. evaluate pi_{k+1} on held-out kernels (the trainer's ``eval`` section; ``eval/discounted_return`` is J at
   ``method.gamma``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from repertory.config import TrainConfig
from repertory.envs.grammar import GRAMMAR
from repertory.eval.scores import rollout_metrics
from repertory.models import LoadedModel
from repertory.runs import RunDir
from repertory.store import write_episodes
from repertory.store.turns import LoggedTurn, write_turns
from repertory.train.base import Trainer
from repertory.train.methods import RoundContext, RoundMethod
from repertory.train.turns import check_grammars, conversations, first_return, logged_turns, read_logs
from repertory.types import Episode, RepertoryError


class _Counting:
    """The partner, counting its calls; it refuses to answer while the policy improves offline."""

    def __init__(self, agent: Any, trainer: RoundsTrainer):
        self.agent, self.trainer, self.calls = agent, trainer, 0
        self.name, self.policy_id = agent.name, agent.policy_id

    def act(self, requests):
        self.trainer._online("the partner was asked")
        self.calls += 1
        return self.agent.act(requests)


class RoundsTrainer(Trainer):
    """Batch-online rounds (see the module docstring); one iteration = one round."""

    method: RoundMethod

    def __init__(self, config: TrainConfig, run_dir: RunDir, loaded: LoadedModel | None = None):
        super().__init__(config, run_dir, loaded)
        assert self.lineup.opponent is not None
        self.partner = _Counting(self.lineup.opponent, self)
        self.lineup.opponent = self.partner
        self.simulator_episodes = 0
        self.served_counts: dict[str, float] = {}  # round 0 from a served log: what it held and skipped
        self.offline = False
        self.context = RoundContext(
            learner=self.learner,
            backend=self.backend,
            params=self.lineup.live.params,
            constrained=config.rollout.constrained,
            run_dir=run_dir,
            seed=config.seed,
            algo=config.algo,
            tokenizer=self.learner.tokenizer,
            gamma=self.method.gamma,
            publish=self.publish,
            write_credit=self.write_credit,
        )

    # one round

    def _online(self, what: str) -> None:
        if self.offline:
            raise RuntimeError(f"{what} while the policy improves offline (docs/algorithms.md 5.2 forbids it)")

    def evaluate(self, iteration: int, keep: Path | None = None, validation: bool = False) -> dict[str, Any]:
        self._online("an evaluation")
        return super().evaluate(iteration, keep, validation)

    def deploy(self, round_index: int) -> tuple[list[LoggedTurn], list[Episode]]:
        """Round k's data: the user's logs (round 0 with ``method.logs``) or a deployment of pi_k."""
        self._online("a deployment")
        method = self.method.config
        if round_index == 0 and method.logs:
            every = method.log_seats == "every"
            turns, episodes, served = read_logs(
                method.logs, self.lineup.env, self.learner.tokenizer, method.gamma, every, method.log_agent
            )
            if self.config.rollout.constrained == GRAMMAR:  # the turns are scored under the grammars they name
                check_grammars(turns, self.learner.grammar_masks, str(method.logs))
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
        episodes = self.rollouts.play(self.lineup.specs(round_index))
        self.simulator_episodes += len(episodes)
        write_episodes(self.run_dir.episodes(round_index), episodes)
        return logged_turns([ep for ep in episodes if not ep.judge_failed], round_index, method.gamma), episodes

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        method = self.method.config
        line: dict[str, Any] = {"round": iteration}
        start = time.perf_counter()
        turns, episodes = self.deploy(iteration)
        self.backend.reset_cache()
        if not turns:
            raise RepertoryError(f"round {iteration}: no logged agent turns with tokens to learn from")
        write_turns(self.run_dir.turns(iteration), turns)
        line["time/deploy_s"] = time.perf_counter() - start
        if iteration == 0:
            line.update(self.served_counts)
        if episodes and not (iteration == 0 and method.logs):  # a deployment's own outcome, not the logs'
            line.update(rollout_metrics(episodes))
        g0 = [first_return(convo, method.gamma) for convo in conversations(turns).values()]
        line["deploy/conversations"] = float(len(conversations(turns)))
        line["deploy/turns"] = float(len(turns))
        if g0:
            line["deploy/return"] = sum(g0) / len(g0)

        start = time.perf_counter()
        partner_calls = self.partner.calls
        if method.reference == "round":
            self.learner.freeze_reference()
        self.offline = True
        try:
            line.update(self.improve(iteration, turns, {ep.episode_id: ep for ep in episodes}))
        finally:
            self.offline = False
        if self.partner.calls != partner_calls:
            raise RuntimeError("the improvement step asked the partner")  # 5.2: improvement is offline
        self.publish()
        line["time/train_s"] = time.perf_counter() - start
        return line

    def improve(self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]) -> dict[str, float]:
        """The round's offline policy improvement with the configured method; its metrics."""
        return self.method.improve(self.context, round_index, turns, episodes)
