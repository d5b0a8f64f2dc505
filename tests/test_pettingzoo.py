"""The PettingZoo AEC wrapper (docs/ecosystem.md, PettingZoo): PettingZoo's own api_test on every environment,
random text ending every game, exact rewards against the native environment, simultaneous moves serialised,
who sees which channel, the judge path and the errors."""

from __future__ import annotations

import importlib
import sys
import warnings
from fractions import Fraction

import pytest
from pettingzoo.test import api_test

from repertory.agents import BotAgent
from repertory.envs import env_class, env_names, load_kernels, make
from repertory.envs.pettingzoo import OBSERVATION_MAX_CHARS, RepertoryAECEnv, aec_env, observation_space
from repertory.envs.werewolf import Werewolf
from repertory.rollout import EpisodeSpec, run_episodes
from repertory.types import JudgeRequest, RepertoryError, Verdict, derive

API_CYCLES = 40
"""Enough for api_test's play test to finish an episode of every game (Trust-and-Split takes the most: 21)."""
PAYOFF = {("A", "A"): (3, 3), ("A", "B"): (0, 5), ("B", "A"): (5, 0), ("B", "B"): (1, 1)}
ALICE = "AABBABABAB"
BOB = "ABABBBAABA"


def choose(move: str) -> str:
    return f"I pick <choose>{move}</choose>"


def play_random(env: RepertoryAECEnv, seed: int) -> tuple[int, dict[str, float], dict[str, dict]]:
    """One episode of sampled actions: (agent steps, each seat's summed rewards, each seat's final info)."""
    env.reset(seed=seed)
    for agent in env.agents:
        env.action_space(agent).seed(seed)
    totals = dict.fromkeys(env.agents, 0.0)
    final: dict[str, dict] = {}
    steps = 0
    for agent in env.agent_iter(10_000):
        obs, reward, terminated, truncated, info = env.last()
        assert env.observation_space(agent).contains(obs)
        totals[agent] += reward
        if terminated:
            final[agent] = info
        env.step(None if terminated or truncated else env.action_space(agent).sample())
        steps += 1
    return steps, totals, final


@pytest.mark.parametrize("name", env_names())
def test_api_test_passes(name):
    env = aec_env(name)
    with warnings.catch_warnings():
        # api_test warns that text is no numpy array and the seat names are not player_0 style; both by design.
        warnings.simplefilter("ignore", UserWarning)
        api_test(env, num_cycles=API_CYCLES, verbose_progress=False)
    assert str(env) == env.metadata["name"] == f"repertory/{name}"
    assert env.metadata["is_parallelizable"] is False


@pytest.mark.parametrize("name", env_names())
def test_random_text_ends_every_game(name):
    env = aec_env(name)
    for seed in (0, 1):
        steps, totals, final = play_random(env, seed)
        n = len(env.possible_agents)
        assert env.agents == [] and set(final) == set(env.possible_agents)
        assert steps <= API_CYCLES * n
        result = env.game.result()
        assert result.end_reason
        for role, info in final.items():
            assert info["end_reason"] == result.end_reason
            assert info["outcome"] == pytest.approx(result.roles[role].outcome)
        assert totals == pytest.approx({r: result.roles[r].outcome for r in totals})


def test_scripted_ipd_gives_the_native_rewards():
    kernel = load_kernels("ipd", "train")[3]
    env = aec_env("ipd", kernel=3)
    env.reset(seed=11)
    assert env.game.kernel == kernel and env.game.episode_seed == derive(11, "episode")
    seen: dict[str, list[float]] = {"Alice": [], "Bob": []}
    moves = {"Alice": iter(ALICE), "Bob": iter(BOB)}
    for agent in env.agent_iter():
        _, reward, terminated, _, info = env.last()
        seen[agent].append(reward)
        assert info["choices"] == (None if terminated else ["<choose>A</choose>", "<choose>B</choose>"])
        env.step(None if terminated else choose(next(moves[agent])))

    native = make("ipd")
    native.reset(kernel, derive(11, "episode"))
    expected: dict[str, list[float]] = {"Alice": [], "Bob": []}
    for a, b in zip(ALICE, BOB):
        rewards = native.step({"Alice": choose(a), "Bob": choose(b)}).rewards
        for role in expected:
            expected[role].append(rewards[role])
    # A seat's reward for round k reaches it with its next turn (or its final dead step).
    assert seen["Alice"][1:] == expected["Alice"] and seen["Bob"][1:] == expected["Bob"]
    assert seen["Alice"][0] == seen["Bob"][0] == 0.0
    points = [PAYOFF[(a, b)] for a, b in zip(ALICE, BOB)]
    assert sum(seen["Alice"]) == pytest.approx(float(Fraction(sum(p for p, _ in points), 50)))
    assert sum(seen["Bob"]) == pytest.approx(float(Fraction(sum(q for _, q in points), 50)))
    assert expected["Alice"][1] == 0.0 and expected["Bob"][1] == pytest.approx(0.1)


def test_simultaneous_moves_wait_for_the_last_seat():
    env = aec_env("ipd", kernel=0)
    env.reset(seed=0)
    assert env.agent_selection == "Alice" and env.infos["Bob"]["acting"]
    bob_before = env.observe("Bob")
    env.step(choose("B"))
    assert env.agent_selection == "Bob"
    assert env.game.round == 1 and env.game.history == []
    assert env.rewards == {"Alice": 0, "Bob": 0}
    assert env.observe("Bob") == bob_before
    assert not env.infos["Alice"]["acting"] and env.infos["Alice"]["choices"] is None
    assert env.infos["Bob"]["acting"]
    env.step(choose("A"))
    assert env.game.round == 2 and env.game.history[0]["moves"] == {"Alice": "B", "Bob": "A"}
    assert env.rewards == {"Alice": pytest.approx(0.1), "Bob": 0.0}
    assert env.agent_selection == "Alice"
    _, reward, *_ = env.last()
    assert reward == pytest.approx(0.1)
    assert "the other player chose B" in env.observe("Bob")


def test_a_wolf_sees_its_team_channel_and_a_villager_does_not():
    env = aec_env("werewolf", kernel=0)
    env.reset(seed=0)
    labels = dict(zip(env.game.roles, env.game.role_labels))
    wolves = [r for r in env.agents if labels[r] == "werewolf"]
    villager, victim = [r for r in env.agents if labels[r] == "villager"]
    first, second = env.agent_selection, next(w for w in wolves if w != env.agent_selection)
    assert first in wolves
    env.step(f"Take the quiet one at midnight. <kill>{victim}</kill>")
    assert env.agent_selection == second
    assert "[team]\n" in env.observe(second) and "Take the quiet one at midnight." in env.observe(second)
    assert "team" in env.infos[second]["channels"]
    team = [m for m in env.infos[second]["new_messages"] if m["channel"] == "team"]
    assert team == [
        {"role": "user", "content": f"{first} (werewolves' channel): Take the quiet one at midnight. "
         f"<kill>{victim}</kill>", "channel": "team"}
    ]  # fmt: skip
    env.step(f"<kill>{victim}</kill>")
    while env.game.phase == "night":
        env.step("<pass/>")
    assert env.game.phase == "discussion"
    wolf_view, villager_view = env.observe(first), env.observe(villager)
    assert (
        f"[team]\n{second} (werewolves' channel): <kill>{victim}</kill>\nThe pack attacks {victim} tonight."
        in wolf_view
    )
    assert f"[public]\nDawn of day 1: {victim} died." in villager_view
    assert "[team]" not in villager_view and "midnight" not in villager_view
    assert env.infos[villager]["channels"] == ["public"]
    assert env.infos[first]["channels"] == ["private", "public", "team"]


def test_werewolf_team_rewards_match_the_native_game():
    bot = Werewolf.bots["heuristic"]
    env = aec_env("werewolf", kernel=0)
    env.reset(seed=2)
    totals = dict.fromkeys(env.agents, 0.0)
    for agent in env.agent_iter():
        _, reward, terminated, _, _ = env.last()
        totals[agent] += reward
        env.step(None if terminated else bot(env.game.view(agent)))

    native = make("werewolf")
    native.reset(load_kernels("werewolf", "train")[0], derive(2, "episode"))
    expected = dict.fromkeys(native.roles, 0.0)
    while not native.done:
        for role, reward in native.step({r: bot(native.view(r)) for r in native.acting_roles()}).rewards.items():
            expected[role] += reward
    assert native.end_reason == env.game.end_reason == "village_win"
    assert totals == pytest.approx(expected)
    # The village wins on day 2; Ben, a villager eliminated that cycle, gets 0.9 (rho^(2 - 2 + 1)).
    assert env.game.eliminated == {"Gus": 1, "Ben": 2, "Jun": 2}
    assert totals == pytest.approx({"Jun": 0.0, "Gus": 0.0, "Dev": 1.0, "Fay": 1.0, "Ben": 0.9, "Lena": 1.0})


@pytest.mark.parametrize("name", ["werewolf", "trust-and-split", "casino"])
def test_infos_hold_the_chat_the_rollout_engine_shows(name):
    cls = env_class(name)
    bot = next(iter(cls.bots.values()))
    kernel = load_kernels(name, "train")[1]
    n = len(cls.seat_names(kernel.data))
    spec = EpisodeSpec("e", name, kernel, derive(5, "episode"), [BotAgent("bot", bot) for _ in range(n)])
    (episode,) = run_episodes([spec])
    # A turn stores what arrived since the seat last spoke; the engine's chat is those and the seat's texts.
    engine: dict[str, list] = {seat.name: [] for seat in episode.seats}
    chats: dict[str, list] = {seat.name: [] for seat in episode.seats}
    for turn in episode.turns:
        seat = episode.seats[int(turn.seat_id[1:])].name
        new = [{"role": m.role, "content": m.content, "channel": m.channel} for m in turn.observation]
        chats[seat] += new
        engine[seat].append((list(chats[seat]), new))
        chats[seat].append({"role": "assistant", "content": turn.text, "channel": ""})

    env = aec_env(name, kernel=1)
    env.reset(seed=5)
    seen: dict[str, list] = {a: [] for a in env.agents}
    for agent in env.agent_iter():
        terminated = env.terminations[agent]
        if not terminated:
            seen[agent].append((env.infos[agent]["messages"], env.infos[agent]["new_messages"]))
        env.step(None if terminated else bot(env.game.view(agent)))
    assert seen == engine
    assert sum(len(turns) for turns in seen.values()) == len(episode.turns) >= 10


def test_observation_is_the_transcript_and_infos_the_chat():
    env = aec_env("craigslist", kernel=0)
    env.reset(seed=0)
    seller, buyer = env.agents
    env.step("Lovely item, hardly used \U0001f600 - make me an offer.")
    obs = env.observe(buyer)
    system = env.infos[buyer]["messages"][0]
    assert system["role"] == "system" and obs.startswith(f"[system]\n{system['content']}\n\n")
    assert "hardly used \ufffd - make me an offer." in obs
    assert any("\U0001f600" in m["content"] for m in env.infos[buyer]["new_messages"])
    assert observation_space().contains(obs) and obs.dtype == observation_space().dtype
    assert "[you]\nLovely item, hardly used \ufffd" in env.observe(seller)
    assert env.infos[buyer]["acting"] and env.infos[buyer]["max_chars"] == 2000
    assert env.observation_space(buyer) is env.observation_space(seller)
    assert env.action_space(buyer) is env.action_space(buyer) and env.action_space(buyer) is not env.action_space(
        seller
    )
    assert env.observation_space(buyer).max_length == OBSERVATION_MAX_CHARS


def test_the_seed_picks_the_kernel_and_episode_seed():
    kernels = load_kernels("werewolf", "heldout")
    env = aec_env("werewolf", "heldout")
    assert env.possible_agents == []  # the seats come with the kernel
    env.reset(seed=42)
    assert env.game.kernel == kernels[derive(42, "kernel") % len(kernels)]
    assert env.agents == env.possible_agents == list(kernels[derive(42, "kernel") % len(kernels)].data["names"])
    assert env.infos[env.agents[0]]["episode_seed"] == derive(42, "episode")
    first = env.observe(env.agents[0])
    env.reset(seed=42)
    assert env.observe(env.agents[0]) == first
    env.reset(seed=42, options={"kernel": "werewolf/heldout/007"})
    assert env.game.kernel == kernels[7]
    fixed = aec_env("ipd", "heldout", kernel="ipd/heldout/005")
    assert fixed.possible_agents == ["Alice", "Bob"]
    fixed.reset(seed=1)
    assert fixed.game.kernel.id == "ipd/heldout/005"


class ScriptedJudge:
    """Gives every agent the same scores on every scale and records what it was asked."""

    fine_grained = False
    scores = {
        "goal": 8,
        "believability": 9,
        "knowledge": 5,
        "secret": 0,
        "social_rules": -1,
        "relationship": 2,
        "financial_and_material_benefits": 1,
    }

    def __init__(self) -> None:
        self.asked: list[JudgeRequest] = []

    def score(self, requests: list[JudgeRequest]) -> list[Verdict | None]:
        self.asked += requests
        return [{a: {d.name: self.scores[d.name] for d in r.dimensions} for a in r.agents} for r in requests]


def test_a_judged_social_episode_ends_with_the_judges_rewards():
    with pytest.raises(RepertoryError, match="needs a judge"):
        aec_env("social", reward="judge")
    judge = ScriptedJudge()
    env = aec_env("social", kernel=2, judge=judge, reward="judge", max_turns=4)
    env.reset(seed=3)
    totals = dict.fromkeys(env.agents, 0.0)
    for agent in env.agent_iter():
        _, reward, terminated, _, _ = env.last()
        totals[agent] += reward
        env.step(None if terminated else "That sounds fair to me.")
    assert [r.kind for r in judge.asked] == ["episode"]
    assert "That sounds fair to me." in judge.asked[0].context
    # (8 + 9 + 5 + 0 - 1 + 2 + 1 + 30) / 70
    assert totals == pytest.approx(dict.fromkeys(totals, 54 / 70))
    assert env.game.result().info["judge"][next(iter(totals))] == ScriptedJudge.scores


def test_render_logs_the_episode():
    env = aec_env("ipd", kernel=0, render_mode="ansi")
    env.reset(seed=0)
    for agent in env.agent_iter():
        env.step(None if env.terminations[agent] else choose("A"))
    log = env.render()
    assert log.startswith("ipd ipd/train/000, episode seed")
    assert log.count("Alice: I pick <choose>A</choose>") == 10
    assert log.endswith("end (rounds_complete): Alice 0.600, Bob 0.600")
    with pytest.warns(UserWarning, match="without specifying any render mode"):
        assert aec_env("ipd").render() is None


def test_bad_input_is_a_clear_error():
    with pytest.raises(RepertoryError, match="unknown environment 'chess'; known: ipd, .*werewolf, social"):
        aec_env("chess")
    with pytest.raises(RepertoryError, match=r"kernel index must be in 0\.\.99 \(got 100\)"):
        aec_env("ipd", kernel=100)
    with pytest.raises(RepertoryError, match="no kernel 'ipd/train/x' in the train split"):
        aec_env("ipd", kernel="ipd/train/x")
    with pytest.raises(RepertoryError, match="unknown split 'dev'"):
        aec_env("ipd", "dev")
    with pytest.raises(RepertoryError, match="render_mode"):
        aec_env("ipd", render_mode="rgb_array")
    env = aec_env("ipd")
    with pytest.raises(RepertoryError, match="reset"):
        env.step("<choose>A</choose>")
    env.reset(seed=0, options={"kernel": 0})
    with pytest.raises(TypeError, match="Alice's action must be its text \\(a str\\), not int"):
        env.step(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not NoneType"):
        env.step(None)
    with pytest.raises(RepertoryError, match="kernel index"):
        env.reset(options={"kernel": -1})
    env.reset(seed=0)
    for _ in env.agent_iter():
        _, _, termination, truncation, _ = env.last()
        env.step(None if termination or truncation else "<choose>A</choose>")
    with pytest.raises(RepertoryError, match="the episode is over and every seat has left; reset"):
        env.step(None)


def test_without_pettingzoo_the_module_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pettingzoo", None)
    monkeypatch.delitem(sys.modules, "repertory.envs.pettingzoo")
    with pytest.raises(RepertoryError, match=r"pip install 'repertory\[pettingzoo\]'"):
        importlib.import_module("repertory.envs.pettingzoo")
