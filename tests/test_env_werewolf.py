"""Werewolf (environments.md 11): the worked example, ties, rewards, visibility, bots and six-seat rollouts."""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import replace

import pytest

from repertory import algos
from repertory.agents import BotAgent, Request, Response, ScriptAgent
from repertory.envs import env_class, load_kernels, make
from repertory.envs.checks import check_episode
from repertory.envs.fuzz import TextFuzzer
from repertory.envs.werewolf import Werewolf
from repertory.eval import concurrent_games
from repertory.eval.scores import rollout_metrics
from repertory.rollout import EpisodeSpec, agent_seats, run_episodes, schedule
from repertory.train.batch import collect
from repertory.types import SPLITS, Kernel, derive

NAMES = ["Ava", "Ben", "Cleo", "Dev", "Eli", "Fay"]
ROLES = ["villager", "werewolf", "seer", "witch", "werewolf", "villager"]
EXAMPLE = Kernel("werewolf/train/900", "werewolf", "train", 900, 0, {"names": NAMES, "roles": ROLES})
SCRIPTS = {
    "Ava": ["unused"],
    "Ben": ["<kill>Ava</kill>", "Cleo is lying.", "<vote>Cleo</vote>"],
    "Cleo": ["<inspect>Ben</inspect>", "Ben is a werewolf.", "<vote>Ben</vote>", "<inspect>Eli</inspect>",
             "Eli is a werewolf too.", "<vote>Eli</vote>"],
    "Dev": ["<pass/>", "I trust Cleo.", "<vote>Ben</vote>", "<save>Cleo</save>", "Agreed.", "<vote>Eli</vote>"],
    "Eli": ["<KILL> ava </KILL>", "Cleo is the wolf.", "<vote>Cleo</vote>", "<kill>Cleo</kill>", "Not me.",
            "<vote>Cleo</vote>"],
    "Fay": ["Hmm.", "<vote>Ben</vote>", "Eli then.", "<vote>Eli</vote>"],
}  # fmt: skip


def play_example(tmp_path, kernel=EXAMPLE, scripts=SCRIPTS):
    agents = []
    for name in kernel.data["names"]:
        path = tmp_path / f"{name}.txt"
        path.write_text("\n".join(scripts[name]) + "\n", encoding="utf-8")
        agents.append(ScriptAgent(path))
    (episode,) = run_episodes([EpisodeSpec("ww/0", "werewolf", kernel, 7, agents)])
    return episode


def seen(episode, name, channel=None):
    """Everything a seat was shown, optionally on one channel."""
    seat = next(s.seat_id for s in episode.seats if s.name == name)
    messages = [m for t in episode.trajectory(seat) for m in t.observation] + episode.final_observations[seat]
    return "\n".join(m.content for m in messages if channel is None or m.channel == channel)


def test_worked_example_events_and_rewards(tmp_path):
    ep = play_example(tmp_path)
    outcomes = {name: r.outcome for name, r in ep.result.roles.items()}
    assert outcomes == pytest.approx({"Ava": 0.81, "Ben": 0, "Cleo": 1, "Dev": 1, "Eli": 0, "Fay": 1})
    # Points are the team result W; the outcome discounts it for seats eliminated early.
    assert {n: r.points for n, r in ep.result.roles.items()} == {n: int(n not in ("Ben", "Eli")) for n in NAMES}
    assert ep.result.end_reason == "village_win"
    assert ep.result.info["winner"] == "village" and ep.result.info["cycles"] == 2
    assert ep.result.info["eliminated"] == {"Ava": 1, "Ben": 1, "Eli": 2}
    assert [s.role for s in ep.seats] == ROLES and [s.name for s in ep.seats] == NAMES
    assert {n: r.n_turns for n, r in ep.result.roles.items()} == {
        "Ava": 0, "Ben": 3, "Cleo": 6, "Dev": 6, "Eli": 6, "Fay": 4,
    }  # fmt: skip
    assert all(r.n_invalid == 0 for r in ep.result.roles.values())
    fay = seen(ep, "Fay", "public")
    assert "Dawn of day 1: Ava died." in fay and "Dawn of day 2: No one died." in fay
    assert "Ben is eliminated with 3 of 5 votes." in fay and "Eli is eliminated with 3 of 4 votes." in fay
    assert "Votes of day 1: Ben → Cleo, Cleo → Ben, Dev → Ben, Eli → Cleo, Fay → Ben." in fay
    # Day 2's discussion starts at Cleo because seat 1 (Ben) is dead; day 1's at Ben (seat 0 is dead).
    day = {c: [ep.seats[int(t.seat_id[1:])].name for t in ep.turns if t.action.tag == "message" and t.game_round == c]
           for c in (1, 2)}  # fmt: skip
    assert day == {1: ["Ben", "Cleo", "Dev", "Eli", "Fay"], 2: ["Cleo", "Dev", "Eli", "Fay"]}
    assert "Ben is a werewolf." in seen(ep, "Cleo", "private") and "Eli is a werewolf." in seen(ep, "Cleo", "private")
    assert "The werewolves attacked Ava." in seen(ep, "Dev", "private")
    assert "The werewolves attacked Cleo." in seen(ep, "Dev", "private")
    assert "Ben (werewolves' channel): <kill>Ava</kill>" in seen(ep, "Eli", "team")
    # Each seat's terminal reward is its outcome and lands on its last turn.
    for seat in ep.seats[1:]:
        assert ep.total_reward(seat.seat_id) == pytest.approx(ep.result.roles[seat.name].outcome)
    assert ep.metrics == pytest.approx(
        {"village_win": 1, "wolves_win": 0, "draw": 0, "cycles": 2, "seer_found": 1, "wolf_survival": 0,
         "vote_accuracy": 6 / 6}
    )  # fmt: skip


def test_tie_between_wolves_is_drawn_with_the_seeded_choice():
    env = make("werewolf")
    drawn = set()
    for episode_seed in range(12):
        env.reset(EXAMPLE, episode_seed)
        env.step({"Ben": "<kill>Ava</kill>"})
        env.step({"Eli": "<kill>Fay</kill>"})
        expected = random.Random(derive(EXAMPLE.id, episode_seed, "kill", 1)).choice(["Ava", "Fay"])
        assert env.attacked == expected
        assert f"The werewolves attacked {expected}." in env.observe("Dev")[-1].content
        drawn.add(env.attacked)
    assert drawn == {"Ava", "Fay"}


def test_no_valid_kill_attacks_nobody_and_counts_invalid():
    env = make("werewolf")
    env.reset(EXAMPLE, 0)
    env.step({"Ben": "<kill>Ben</kill>"})  # a wolf is no legal victim
    result = env.step({"Eli": "<kill>Ava"})  # never closed
    assert env.attacked is None and env.n_invalid == {**dict.fromkeys(NAMES, 0), "Ben": 1, "Eli": 1}
    assert "not closed" in result.parsed["Eli"].error
    env.step({"Cleo": "<inspect>Ben</inspect>", "Dev": "<poison>Fay</poison>"})
    assert env.eliminated == {"Fay": 1} and not env.poison_left


def test_elimination_discount_by_hand(tmp_path):
    # Ava dies in night 1 of a game the village wins in cycle 2: W * rho^(2 - 1 + 1).
    for rho, ava in ((0.5, 0.25), (1.0, 1.0)):
        env = Werewolf(elimination_discount=rho)
        env.reset(EXAMPLE, 7)
        for texts in example_steps():
            env.step(texts)
        assert env.result().roles["Ava"].outcome == pytest.approx(ava)
        assert env.result().roles["Fay"].outcome == 1.0
    with pytest.raises(ValueError, match="discount"):
        Werewolf(elimination_discount=0.0)


def example_steps():
    """The worked example as the raw texts of each step."""
    return [
        {"Ben": "<kill>Ava</kill>"},
        {"Eli": "<kill>Ava</kill>"},
        {"Cleo": "<inspect>Ben</inspect>", "Dev": "<pass/>"},
        *({n: "hi"} for n in ("Ben", "Cleo", "Dev", "Eli", "Fay")),
        {"Ben": "<vote>Cleo</vote>", "Cleo": "<vote>Ben</vote>", "Dev": "<vote>Ben</vote>", "Eli": "<vote>Cleo</vote>",
         "Fay": "<vote>Ben</vote>"},
        {"Eli": "<kill>Cleo</kill>"},
        {"Cleo": "<inspect>Eli</inspect>", "Dev": "<save>Cleo</save>"},
        *({n: "hi"} for n in ("Cleo", "Dev", "Eli", "Fay")),
        {"Cleo": "<vote>Eli</vote>", "Dev": "<vote>Eli</vote>", "Eli": "<vote>Cleo</vote>", "Fay": "<vote>Eli</vote>"},
    ]  # fmt: skip


def test_wolves_win_at_parity_and_draw_after_five_cycles():
    env = make("werewolf")
    env.reset(EXAMPLE, 0)
    env.step({"Ben": "<kill>Ava</kill>"})
    env.step({"Eli": "<kill>Ava</kill>"})
    env.step({"Cleo": "<inspect>Ben</inspect>", "Dev": "<poison>Fay</poison>"})  # 2 wolves vs Cleo, Dev
    assert env.done and env.winner == "wolves" and env.result().end_reason == "wolves_win"
    assert env.result().roles["Ben"].outcome == 1.0 and env.result().roles["Ava"].outcome == 0.0
    env.reset(EXAMPLE, 0)
    for cycle in range(1, 6):
        assert env.game_round == cycle
        while env.phase != "vote":
            env.step({r: "<pass/>" for r in env.acting_roles()})
        env.step({r: "<pass/>" for r in env.acting_roles()})
    assert env.done and env.winner == "draw" and all(r.outcome == 0 for r in env.result().roles.values())
    # Wolves and the seer may not pass: every such night move counted invalid; witch and votes may.
    assert env.n_invalid["Ben"] == env.n_invalid["Eli"] == env.n_invalid["Cleo"] == 5
    assert env.n_invalid["Dev"] == 0


def test_constrained_choices_are_the_legal_moves():
    env = make("werewolf")
    env.reset(EXAMPLE, 0)
    assert env.action_choices("Ben") == [f"<kill>{n}</kill>" for n in ("Ava", "Cleo", "Dev", "Fay")]
    env.step({"Ben": "<kill>Ava</kill>"})
    env.step({"Eli": "<kill>Ava</kill>"})
    assert env.action_choices("Cleo") == [f"<inspect>{n}</inspect>" for n in NAMES if n != "Cleo"]
    assert env.action_choices("Dev") == [
        "<save>Ava</save>", *(f"<poison>{n}</poison>" for n in NAMES if n != "Dev"), "<pass/>",
    ]  # fmt: skip
    env.step({"Cleo": "<inspect>Ben</inspect>", "Dev": "<pass/>"})
    assert env.action_choices("Ben") is None  # discussion is free text
    for _ in range(5):
        env.step({env.acting_roles()[0]: "<vote>Ben</vote> is ignored here"})
    assert env.action_choices("Fay") == [f"<vote>{n}</vote>" for n in ("Ben", "Cleo", "Dev", "Eli")] + ["<pass/>"]
    for choice in env.action_choices("Fay"):
        assert env.validate("Fay", choice) == (True, "")
    assert env.validate("Ava", "<vote>Ben</vote>") == (False, "Ava is not to act now")


WOLF_LINE = re.compile(r"^\w+ \(werewolves' channel\):", re.MULTILINE)
VERDICT = re.compile(r"^\w+ is (not )?a werewolf\.$", re.MULTILINE)
WITCH_NEWS = re.compile(r"The werewolves attacked")
REQUEST = re.compile(r"your turn|Whom do you inspect|Write <save>| vote: write")


@pytest.mark.parametrize("lineup", ["random-legal", "heuristic", "fuzz"])
def test_visibility_over_many_random_games(lineup):
    kernels = load_kernels("werewolf", "train") + load_kernels("werewolf", "heldout")
    cls = env_class("werewolf")
    for game in range(40):
        rng = random.Random(derive("visibility", lineup, game))
        kernel = rng.choice(kernels)
        fuzz = TextFuzzer(rng)
        marks: dict[str, list[str]] = {}

        def policy(env, role, fuzz=fuzz, rng=rng, marks=marks):
            assert role in env.alive, f"dead seat {role} was asked to act"
            text = fuzz(env, role) if lineup == "fuzz" else env.bots[lineup](env.view(role))
            if env.phase == "wolves":  # the pack's night talk carries a marker the village must never see
                marks.setdefault(role, []).append(mark := f"zqwolf{rng.getrandbits(32)}")
                text = f"{mark} {text}"
            return text

        played = check_episode(cls, kernel, rng.getrandbits(63), policy, max_steps=50, bots_valid=lineup != "fuzz")
        env = played.env
        for name in env.roles:
            text = "\n".join(m.content for m in played.observations[name])
            private = "\n".join(m.content for m in played.observations[name] if m.channel != "public")
            if env.team_of[name] == "village":
                assert not any(m in text for ms in marks.values() for m in ms)
                assert not WOLF_LINE.search(text)
                assert all(m.channel != "team" for m in played.observations[name])
            if env.role_name(name) != "seer":
                assert not VERDICT.search(private)
            if env.role_name(name) != "witch":
                assert not WITCH_NEWS.search(private)
            if name in env.eliminated:
                # After its death notice a seat is told only public news: no more requests to act.
                after = "\n".join(m.content for m in played.observations[name]).split("You are dead", 1)[1]
                assert not REQUEST.search(after)


def village_wins(village: str, wolves: str) -> int:
    """Village wins over the 100 held-out kernels, ``village`` bots against ``wolves`` bots."""
    bots = {name: BotAgent(name, Werewolf.bots[name]) for name in Werewolf.bots}
    specs = []
    for i, kernel in enumerate(load_kernels("werewolf", "heldout")):
        teams = Werewolf.seat_teams(kernel.data)
        agents = [bots[village] if teams[s] == "village" else bots[wolves] for s in range(6)]
        specs.append(EpisodeSpec(f"ww/{i}", "werewolf", kernel, i, agents))
    return sum(ep.result.info["winner"] == "village" for ep in run_episodes(specs))


def test_a_heuristic_village_wins_far_more_often_than_a_random_one():
    # A seer who names the wolf she found and a witch who saves the first victim: 36 wins against 11.
    assert village_wins("heuristic", "random-legal") == 36
    assert village_wins("random-legal", "random-legal") == 11


class Counting:
    """Writes legal moves (the heuristic bot) with fake token ids, recording every batched call."""

    name = "counting"
    policy_id = "live"

    def __init__(self):
        self.calls: list[list[Request]] = []

    def act(self, requests: list[Request]) -> list[Response]:
        self.calls.append(list(requests))
        move = Werewolf.bots["heuristic"]
        return [Response(move(r.view), prompt_ids=[1, 2], response_ids=[3], logp_sample=[-0.5]) for r in requests]


def test_six_seat_self_play_is_one_call_per_tick_for_all_games():
    agent = Counting()
    episodes = run_episodes(schedule("werewolf", [agent] * 6, episodes=8, seed=3))
    ticks = max(t.global_step for ep in episodes for t in ep.turns) + 1
    assert len(agent.calls) == ticks
    assert sum(len(batch) for batch in agent.calls) == sum(len(ep.turns) for ep in episodes)
    per_game = Counter()
    for batch in agent.calls:
        rows = Counter(r.episode_id for r in batch)
        per_game.update(rows.values())
        assert all(1 <= n <= 6 for n in rows.values())
    assert per_game[6] > 0 and per_game[1] > 0 and per_game[2] > 0  # a first-day vote, a speaker, seer + witch
    assert agent.calls[0][0].choices is not None  # night moves carry their legal choices


def test_advantages_per_seat_read_only_their_own_rewards():
    agent = Counting()
    specs = schedule("werewolf", [agent] * 6, episodes=4, seed=1, kernel_index=5)
    for spec in specs:
        spec.trainable = [True] * 6
    episodes = run_episodes(specs)
    batch = collect(episodes)
    inputs = batch.estimator_inputs()
    for ref, traj in zip(batch.trajectories, inputs):
        seat = ref.episode.seat(ref.seat_id)
        assert traj.role == seat.role
        assert sum(traj.rewards) == pytest.approx(ref.episode.result.roles[seat.name].outcome)
    params = algos.TurnParams()
    for name in ("grpo", "rloo", "reinforce"):
        base = algos.get_estimator(name).fn(inputs, params, {}).advantages
        for k, target in enumerate(inputs):
            bumped = list(inputs)
            bumped[k] = replace(target, rewards=[r + 5.0 for r in target.rewards])
            moved = algos.get_estimator(name).fn(bumped, params, {}).advantages
            changed = {j for j in range(len(inputs)) if moved[j] != base[j]}
            # A seat's reward reaches only the seats its group holds: the same role on the same kernel.
            assert changed <= {j for j, t in enumerate(inputs) if t.role == target.role}, name
    values = [[[0.1] * n for n in t.lengths] for t in inputs]
    with_values = [replace(t, values=v) for t, v in zip(inputs, values)]
    base = algos.get_estimator("omar").fn(with_values, algos.TurnParams(), {}).advantages
    bumped = list(with_values)
    bumped[0] = replace(bumped[0], rewards=[r + 5.0 for r in bumped[0].rewards])
    moved = algos.get_estimator("omar").fn(bumped, algos.TurnParams(), {}).advantages
    assert [j for j in range(len(inputs)) if moved[j] != base[j]] == [0]


def test_team_seats_follow_the_kernels_deal():
    kernel = load_kernels("werewolf", "heldout")[0]
    teams = Werewolf.seat_teams(kernel.data)
    assert agent_seats(Werewolf, kernel, 0) == [s for s in range(6) if teams[s] == "village"]
    assert agent_seats(Werewolf, kernel, 1) == [s for s in range(6) if teams[s] == "wolves"]
    assert len(agent_seats(Werewolf, kernel, 1)) == 2


def test_kernels_are_valid_deals():
    for kernel in [k for split in SPLITS for k in load_kernels("werewolf", split)]:
        assert sorted(kernel.data["roles"]) == sorted(ROLES) and len(set(kernel.data["names"])) == 6
    assert Werewolf.validate_kernel({"names": NAMES, "roles": ROLES[:-1] + ["seer"]})
    assert Werewolf.validate_kernel({"names": ["Ava"] * 6, "roles": ROLES})
    assert Werewolf.validate_kernel({"names": "Ava", "roles": None})


def test_training_metrics_report_the_trained_teams_record():
    bots = {name: BotAgent(name, Werewolf.bots[name]) for name in Werewolf.bots}
    specs = []
    for i, kernel in enumerate(load_kernels("werewolf", "train")[:12]):
        live = agent_seats(Werewolf, kernel, i)  # village in even games, wolves in odd ones
        agents = [bots["heuristic"] if s in live else bots["random-legal"] for s in range(6)]
        specs.append(EpisodeSpec(f"ww/{i}", "werewolf", kernel, i, agents, trainable=[s in live for s in range(6)]))
    episodes = run_episodes(specs)
    line = rollout_metrics(episodes)
    for team, parity in (("village", 0), ("wolves", 1)):
        games = [ep for i, ep in enumerate(episodes) if i % 2 == parity]
        assert line[f"team/{team}/games"] == 6
        assert line[f"team/{team}/win_rate"] == sum(ep.result.info["winner"] == team for ep in games) / 6
    assert set(line) >= {"outcome/villager", "outcome/seer", "outcome/witch", "outcome/werewolf", "env/vote_accuracy"}


def test_evaluations_run_as_many_seats_at_once_whatever_the_game():
    assert concurrent_games(Werewolf) == 21 and concurrent_games(env_class("ipd")) == 64
