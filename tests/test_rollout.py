"""Rollout engine: one batched call per agent per tick, isolated episodes, exact records."""

from __future__ import annotations

import pytest
from conftest import play

from repertory.agents import BotAgent, Request, Response
from repertory.envs import env_class, load_kernels
from repertory.rollout import EpisodeSpec, run_episodes, schedule
from repertory.types import RepertoryError


class Counting:
    """Wraps a bot and records the size and content of every batched call."""

    def __init__(self, env: str, bot: str):
        self._inner = BotAgent(bot, env_class(env).bots[bot])
        self.name = bot
        self.policy_id = f"scripted:{bot}"
        self.calls: list[list[Request]] = []

    def act(self, requests: list[Request]) -> list[Response]:
        self.calls.append(list(requests))
        return self._inner.act(requests)


def test_self_play_serves_all_seats_of_all_episodes_in_one_call_per_tick():
    agent = Counting("ipd", "tit-for-tat")
    episodes = run_episodes(schedule("ipd", [agent, agent], episodes=6, seed=0))
    assert len(agent.calls) == 10
    assert all(len(batch) == 12 for batch in agent.calls)
    assert {(r.episode_id, r.seat) for r in agent.calls[0]} == {(e.episode_id, s) for e in episodes for s in (0, 1)}


def test_two_agents_get_one_call_each_per_tick():
    a, b = Counting("trust-and-split", "greedy"), Counting("trust-and-split", "honest-cooperative")
    run_episodes(schedule("trust-and-split", [a, b], episodes=5, seed=2))
    # 10 rounds x (message, reply, keep): every tick both agents act across the 5 episodes
    # (who speaks first varies by kernel, so a tick may hold speakers and repliers at once).
    assert len(a.calls) == len(b.calls) == 30
    assert sum(len(c) for c in a.calls) == 5 * 20 and sum(len(c) for c in b.calls) == 5 * 20


def test_concurrency_limit_refills_and_keeps_spec_order():
    agent = Counting("ipd", "random")
    specs = schedule("ipd", [agent, agent], episodes=5, seed=9)
    episodes = run_episodes(specs, max_concurrent=2)
    assert [e.episode_id for e in episodes] == [s.episode_id for s in specs]
    assert max(len(batch) for batch in agent.calls) == 4
    assert len(agent.calls) == 30  # 3 waves of 10 ticks
    assert episodes == run_episodes(schedule("ipd", [agent, agent], episodes=5, seed=9), max_concurrent=64)


def test_on_episode_callback_sees_each_finished_episode():
    seen = []
    episodes = run_episodes(
        schedule("ipd", [BotAgent("x", lambda v: "<choose>A</choose>")] * 2, 3, 0), on_episode=seen.append
    )
    assert sorted(e.episode_id for e in seen) == sorted(e.episode_id for e in episodes)


def test_requests_carry_the_exact_chat_and_turns_rebuild_it():
    agent = Counting("trust-and-split", "honest-cooperative")
    [episode] = run_episodes(schedule("trust-and-split", [agent, agent], episodes=1, seed=1))
    requests = [r for batch in agent.calls for r in batch]
    by_seat: dict[int, list[Request]] = {0: [], 1: []}
    for r in requests:
        by_seat[r.seat].append(r)
    for seat, reqs in by_seat.items():
        for k, request in enumerate(reqs):
            assert episode.prompt_messages(f"p{seat}", k) == request.messages
        assert reqs[0].messages[0].role == "system"
        assert [m.role for m in reqs[1].messages[:3]] == ["system", "user", "assistant"]


def test_turn_records_rewards_and_ids():
    [ep] = play("ipd", ["tit-for-tat", "always-defect"])
    alice = ep.trajectory("p0")
    assert [t.turn_index for t in alice] == list(range(10))
    assert [t.global_step for t in alice] == list(range(10))
    assert [t.game_round for t in alice] == list(range(1, 11))
    assert [t.action.value for t in alice] == ["A"] + ["B"] * 9
    assert [round(t.reward * 50) for t in alice] == [0] + [1] * 9
    assert ep.total_reward("p0") == pytest.approx(ep.result.roles["Alice"].outcome) == pytest.approx(0.18)
    assert [s.seat_id for s in ep.seats] == ["p0", "p1"]
    assert [s.policy_id for s in ep.seats] == ["scripted:tit-for-tat", "scripted:always-defect"]
    assert ep.final_observations["p1"][0].content.startswith("Round 10: you chose B, the other player chose B.")


def test_episodes_never_share_environment_state():
    # The same kernel and seed played twice in one batch gives two identical, independent episodes.
    kernel = load_kernels("ipd", "train")[0]
    agent = BotAgent("random", env_class("ipd").bots["random"])
    specs = [EpisodeSpec(f"e{i}", "ipd", kernel, 42, [agent, agent]) for i in range(2)]
    a, b = run_episodes(specs)
    assert [t.text for t in a.turns] == [t.text for t in b.turns]
    assert a.result == b.result


def test_schedule_draws_kernels_without_replacement_and_is_seeded():
    agent = BotAgent("x", lambda v: "")
    specs = schedule("ipd", [agent, agent], episodes=150, seed=4)
    first_pass = [s.kernel.index for s in specs[:100]]
    assert sorted(first_pass) == list(range(100))
    assert len({s.episode_seed for s in specs}) == 150
    again = schedule("ipd", [agent, agent], episodes=150, seed=4)
    assert [(s.kernel.id, s.episode_seed) for s in specs] == [(s.kernel.id, s.episode_seed) for s in again]
    other = schedule("ipd", [agent, agent], episodes=150, seed=5)
    assert [s.kernel.id for s in specs] != [s.kernel.id for s in other]
    assert {s.kernel.id for s in schedule("ipd", [agent, agent], 3, 0, "heldout", kernel_index=7)} == {
        "ipd/heldout/007"
    }


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"episodes": 0}, "at least 1"),
        ({"episodes": 1, "kernel_index": 100}, "kernel index must be in 0..99"),
        ({"episodes": 1, "split": "dev"}, "unknown split"),
    ],
)
def test_schedule_rejects_bad_input(kwargs, message):
    agent = BotAgent("x", lambda v: "")
    with pytest.raises(RepertoryError, match=message):
        schedule("ipd", [agent, agent], seed=0, **kwargs)


def test_wrong_number_of_agents_is_a_clear_error():
    agent = BotAgent("x", lambda v: "")
    with pytest.raises(RepertoryError, match="needs 2 agents"):
        schedule("ipd", [agent], episodes=1, seed=0)


def test_agent_answering_too_few_requests_is_caught():
    class Lazy:
        name, policy_id = "lazy", "scripted:lazy"

        def act(self, requests):
            return [Response("<choose>A</choose>")]

    with pytest.raises(RuntimeError, match="answered 1 of 4"):
        run_episodes(schedule("ipd", [Lazy()] * 2, episodes=2, seed=0))
