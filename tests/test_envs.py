"""The three round-based environments of environments.md sections 2-4, checked against the spec.

Every worked example is replayed with exact numbers; malformed actions get their defined
consequence; arbitrary (hypothesis-drawn) text never breaks an episode; each role sees only what it
may; kernels follow the spec's draw order; bots behave as specified. The properties every game
shares (validate is pure and agrees with step, rewards sum to the outcome, kernels regenerate byte
for byte, ...) are checked by ``check_env`` in test_env_checks.py.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repertory.agents import BotAgent, ScriptAgent
from repertory.agents.resolve import make_agent
from repertory.envs import env_class, env_names, load_kernels, make
from repertory.envs.checks import check_episode
from repertory.rollout import EpisodeSpec, run_episodes
from repertory.types import SPLITS, Kernel, RepertoryError, derive

ENVS = ("ipd", "split-no-comm", "trust-and-split")
NAMES = ["Alice", "Bob"]
ITEMS = ("hats", "books", "balls")
HANDS = ("rock", "paper", "scissors")
BEATS = {"rock": "scissors", "scissors": "paper", "paper": "rock"}
TOL = 1e-9
MAX_STEPS = {"ipd": 10, "split-no-comm": 10, "trust-and-split": 30}


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def mk_kernel(env: str, data: dict[str, Any], kid: str | None = None, seed: int = 0) -> Kernel:
    return Kernel(id=kid or f"{env}/train/000", env=env, split="train", index=0, seed=seed, data=data)


def ipd_kernel(n_rounds: int = 10, kid: str | None = None, seed: int = 0) -> Kernel:
    return mk_kernel("ipd", {"names": list(NAMES), "n_rounds": n_rounds}, kid, seed)


def vals(h: int, b: int, l: int) -> dict[str, int]:
    return {"hats": h, "books": b, "balls": l}


def snc_kernel(rounds: list[tuple[tuple[int, int, int], tuple[int, int, int]]]) -> Kernel:
    values = [{"Alice": vals(*a), "Bob": vals(*b)} for a, b in rounds]
    return mk_kernel(
        "split-no-comm",
        {"names": list(NAMES), "items": list(ITEMS), "quantity": 10, "values": values},
    )


def tas_kernel(first: str, hands: list[tuple[str, str]]) -> Kernel:
    return mk_kernel(
        "trust-and-split",
        {"names": list(NAMES), "first_speaker": first, "hands": [{"Alice": a, "Bob": b} for a, b in hands]},
    )


def choose(move: str) -> str:
    return f"<choose>{move}</choose>"


def claim(h: int, b: int, l: int) -> str:
    return f'<propose>{{"hats": {h}, "books": {b}, "balls": {l}}}</propose>'


def keep(x: Any) -> str:
    return f'<propose>{{"keep": {x}}}</propose>'


Policy = Callable[[Any, str], str]


def bot(env_name: str, name: str) -> Policy:
    fn = env_class(env_name).bots[name]
    return lambda env, role: fn(env.view(role))


def script(texts: list[str]) -> Policy:
    it = iter(texts)
    return lambda env, role: next(it)


class Log:
    """Everything a driven episode produced."""

    def __init__(self) -> None:
        self.rewards: dict[str, list[float]] = {r: [] for r in NAMES}
        self.steps: list[Any] = []
        self.texts: list[dict[str, str]] = []
        self.observations: dict[str, list[Any]] = {r: [] for r in NAMES}


def play(env_name: str, kernel: Kernel, policies: dict[str, Policy], episode_seed: int = 0):
    env = make(env_name)
    env.reset(kernel, episode_seed)
    log = Log()
    while not env.done:
        actions = {}
        for role in env.acting_roles():
            log.observations[role].extend(env.observe(role))
            actions[role] = policies[role](env, role)
        result = env.step(actions)
        log.steps.append(result)
        log.texts.append(actions)
        for role in NAMES:
            log.rewards[role].append(result.rewards.get(role, 0.0))
    for role in NAMES:
        log.observations[role].extend(env.observe(role))
    return env, log


def actions_of(log: Log, role: str) -> list[Any]:
    return [s.parsed[role].action.value for s in log.steps if role in s.parsed]


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


def test_registry_and_seats():
    for name in ENVS:
        assert name in env_names()
        cls = env_class(name)
        assert cls.roles == ("Alice", "Bob")
        assert cls.role_labels == ("player", "player")
        assert cls.default_trained_role == "Alice"
    assert set(env_class("ipd").bots) >= {"always-cooperate", "always-defect", "tit-for-tat", "grim-trigger", "random"}
    assert set(env_class("split-no-comm").bots) >= {"greedy", "welfare-maximizing"}
    assert set(env_class("trust-and-split").bots) >= {"greedy", "honest-cooperative", "reciprocal"}


# ============================================================================================
# Section 2: IPD
# ============================================================================================

ALICE_MOVES = list("AABAAAAAAB")

IPD_WORKED = [
    ("tit-for-tat", "AAABAAAAAA", 31, 26, 0.62),
    ("grim-trigger", "AAABBBBBBB", 12, 37, 0.24),
    ("always-cooperate", "AAAAAAAAAA", 34, 24, 0.68),
    ("always-defect", "BBBBBBBBBB", 2, 42, 0.04),
]
IPD_PAYOFF = {("A", "A"): (3, 3), ("A", "B"): (0, 5), ("B", "A"): (5, 0), ("B", "B"): (1, 1)}


@pytest.mark.parametrize("bob,bob_moves,alice_pts,bob_pts,alice_outcome", IPD_WORKED)
def test_ipd_worked_example(bob, bob_moves, alice_pts, bob_pts, alice_outcome):
    env, log = play(
        "ipd",
        ipd_kernel(),
        {"Alice": script([choose(m) for m in ALICE_MOVES]), "Bob": bot("ipd", bob)},
    )
    assert "".join(actions_of(log, "Bob")) == bob_moves
    assert "".join(actions_of(log, "Alice")) == "".join(ALICE_MOVES)
    res = env.result()
    assert res.roles["Alice"].points == alice_pts
    assert res.roles["Bob"].points == bob_pts
    assert res.roles["Alice"].outcome == pytest.approx(alice_outcome, abs=1e-12)
    assert res.roles["Bob"].outcome == pytest.approx(bob_pts / 50, abs=1e-12)
    assert res.roles["Alice"].n_turns == res.roles["Bob"].n_turns == 10
    assert res.roles["Alice"].n_invalid == res.roles["Bob"].n_invalid == 0
    assert res.end_reason
    # per-round rewards are points_round / 50 and sum to the outcome
    expected = [IPD_PAYOFF[(a, b)] for a, b in zip(ALICE_MOVES, bob_moves)]
    assert log.rewards["Alice"] == pytest.approx([p[0] / 50 for p in expected], abs=1e-12)
    assert log.rewards["Bob"] == pytest.approx([p[1] / 50 for p in expected], abs=1e-12)
    for role in NAMES:
        assert sum(log.rewards[role]) == pytest.approx(res.roles[role].outcome, abs=TOL)


def test_ipd_worked_example_via_rollout(tmp_path):
    path = tmp_path / "alice.txt"
    path.write_text("\n".join(f"I pick {choose(m)}" for m in ALICE_MOVES) + "\n", encoding="utf-8")
    alice = ScriptAgent(path)
    specs = [
        EpisodeSpec(f"ep{i}", "ipd", ipd_kernel(), 7, [alice, make_agent(bob, env_class("ipd"))])
        for i, (bob, *_rest) in enumerate(IPD_WORKED)
    ]
    episodes = run_episodes(specs)
    assert len(episodes) == 4
    for ep, (bob, bob_moves, alice_pts, bob_pts, alice_outcome) in zip(episodes, IPD_WORKED):
        assert ep.seat("p1").agent == bob
        assert "".join(t.action.value for t in ep.trajectory("p1")) == bob_moves
        assert ep.result.roles["Alice"].points == alice_pts
        assert ep.result.roles["Bob"].points == bob_pts
        assert ep.result.roles["Alice"].outcome == pytest.approx(alice_outcome, abs=1e-12)
        for seat, name in (("p0", "Alice"), ("p1", "Bob")):
            assert len(ep.trajectory(seat)) == 10
            assert ep.total_reward(seat) == pytest.approx(ep.result.roles[name].outcome, abs=TOL)


def test_ipd_no_tag_counts_as_defect_and_one_invalid():
    env, log = play(
        "ipd",
        ipd_kernel(),
        {"Alice": script(["I choose A"] + [choose("A")] * 9), "Bob": bot("ipd", "always-cooperate")},
    )
    assert actions_of(log, "Alice")[0] == "B"
    assert log.steps[0].parsed["Alice"].invalid
    res = env.result()
    assert res.roles["Alice"].n_invalid == 1
    assert res.roles["Bob"].n_invalid == 0
    assert res.roles["Alice"].points == 5 + 9 * 3
    assert res.roles["Bob"].points == 0 + 9 * 3


def test_ipd_tit_for_tat_vs_always_defect():
    env, log = play("ipd", ipd_kernel(), {"Alice": bot("ipd", "tit-for-tat"), "Bob": bot("ipd", "always-defect")})
    assert "".join(actions_of(log, "Alice")) == "ABBBBBBBBB"
    res = env.result()
    assert res.roles["Alice"].points == 9
    assert res.roles["Bob"].points == 14
    assert res.roles["Alice"].outcome == pytest.approx(9 / 50)
    assert res.roles["Bob"].outcome == pytest.approx(14 / 50)


def test_ipd_m1_cooperation_metrics():
    # algorithms.md 8.4 M1: A = CCDCC, B = CDDCC.
    env, log = play(
        "ipd",
        ipd_kernel(n_rounds=5),
        {"Alice": script([choose(m) for m in "AABAA"]), "Bob": script([choose(m) for m in "ABBAA"])},
    )
    res = env.result()
    assert res.roles["Alice"].points == 10
    assert res.roles["Bob"].points == 15
    m = env.metrics()
    assert m["cooperation_rate/Alice"] == pytest.approx(0.8)
    assert m["cooperation_rate/Bob"] == pytest.approx(0.6)
    assert m["mutual_cooperation_rate"] == pytest.approx(0.6)
    assert m["collective_payoff"] == pytest.approx(25)
    assert m["collective_payoff_per_round"] == pytest.approx(5.0)
    assert m["collective_payoff_normalized"] == pytest.approx(25 / 30, abs=1e-4)


def test_ipd_worked_example_metrics_tit_for_tat():
    env, _ = play(
        "ipd", ipd_kernel(), {"Alice": script([choose(m) for m in ALICE_MOVES]), "Bob": bot("ipd", "tit-for-tat")}
    )
    m = env.metrics()
    assert m["cooperation_rate/Alice"] == pytest.approx(0.8)
    assert m["cooperation_rate/Bob"] == pytest.approx(0.9)
    assert m["mutual_cooperation_rate"] == pytest.approx(0.7)
    assert m["collective_payoff"] == pytest.approx(57)
    assert m["collective_payoff_per_round"] == pytest.approx(5.7)
    assert m["collective_payoff_normalized"] == pytest.approx(57 / 60)


def test_ipd_feedback_line():
    env = make("ipd")
    env.reset(ipd_kernel(), 0)
    env.observe("Alice")
    env.observe("Bob")
    env.step({"Alice": choose("A"), "Bob": choose("B")})
    env.step({"Alice": choose("B"), "Bob": choose("B")})
    alice = "\n".join(m.content for m in env.observe("Alice"))
    bob = "\n".join(m.content for m in env.observe("Bob"))
    assert "Round 1: you chose A, the other player chose B. You scored 0; your total is 0." in alice
    assert "Round 2: you chose B, the other player chose B. You scored 1; your total is 1." in alice
    assert "Round 1: you chose B, the other player chose A. You scored 5; your total is 5." in bob
    assert "Round 2: you chose B, the other player chose B. You scored 1; your total is 6." in bob


IPD_PARSE_CASES = [
    # (text, recorded move, invalid)
    (choose("A"), "A", False),
    (choose("B"), "B", False),
    ("<choose>a</choose>", "A", False),  # payload case-insensitive
    ("<CHOOSE> b </CHOOSE>", "B", False),
    ("I choose A", "B", True),  # missing tag
    ("", "B", True),
    ("<choose>A", "B", True),  # unclosed content tag
    ("<choose>A</choose", "B", True),
    ("<choose/>", "B", True),
    ("<choose>C</choose>", "B", True),  # bad payload
    ("<choose></choose>", "B", True),
    ("<choose>AB</choose>", "B", True),
    ("<choose>B</choose> no, <choose>A</choose>", "A", False),  # last counts
    ("<choose>A</choose> or <choose>C</choose>", "B", True),  # last counts even if invalid
    ("<choose>A</choose> then <choose>", "B", True),
    ("<think><choose>B</choose></think><choose>A</choose>", "A", False),
    ("<choose>A</choose><think>", "A", False),
    ("<think>I pick <choose>A</choose>", "B", True),
    ('<propose>{"hats": 1}</propose> <accept/>', "B", True),  # other-phase tags are plain text
    ("x" * 1982 + choose("A"), "A", False),  # exactly 2000 chars
    ("x" * 1990 + choose("A"), "B", True),  # truncation cuts the closing tag
]


@pytest.mark.parametrize("text,move,invalid", IPD_PARSE_CASES)
def test_ipd_malformed_actions(text, move, invalid):
    env = make("ipd")
    env.reset(ipd_kernel(), 0)
    ok, reason = env.validate("Alice", text)
    assert ok == (not invalid)
    if not ok:
        assert reason
    result = env.step({"Alice": text, "Bob": choose("A")})
    parsed = result.parsed["Alice"]
    assert parsed.action.value == move
    assert parsed.invalid == invalid
    assert env.result().roles["Alice"].n_invalid == int(invalid)
    assert env.result().roles["Alice"].points == (3 if move == "A" else 5)


def test_ipd_grim_and_tft_react_to_recorded_not_written_move():
    # An invalid round-1 text is recorded as B: grim-trigger defects forever, tit-for-tat once.
    texts = ["I choose A"] + [choose("A")] * 9
    _, log = play("ipd", ipd_kernel(), {"Alice": script(list(texts)), "Bob": bot("ipd", "grim-trigger")})
    assert "".join(actions_of(log, "Bob")) == "ABBBBBBBBB"
    _, log = play("ipd", ipd_kernel(), {"Alice": script(list(texts)), "Bob": bot("ipd", "tit-for-tat")})
    assert "".join(actions_of(log, "Bob")) == "ABAAAAAAAA"


def test_ipd_grim_trigger_never_forgives():
    moves = list("ABAAAAAAAA")
    _, log = play("ipd", ipd_kernel(), {"Alice": script([choose(m) for m in moves]), "Bob": bot("ipd", "grim-trigger")})
    assert "".join(actions_of(log, "Bob")) == "AABBBBBBBB"


def test_ipd_tit_for_tat_copies_previous():
    moves = list("BABBAABABA")
    _, log = play("ipd", ipd_kernel(), {"Alice": script([choose(m) for m in moves]), "Bob": bot("ipd", "tit-for-tat")})
    assert "".join(actions_of(log, "Bob")) == "A" + "".join(moves[:-1])


def _random_moves(kid: str, episode_seed: int, seat: int, partner: str = "always-cooperate") -> str:
    policies = {NAMES[seat]: bot("ipd", "random"), NAMES[1 - seat]: bot("ipd", partner)}
    _, log = play("ipd", ipd_kernel(kid=kid), policies, episode_seed=episode_seed)
    return "".join(actions_of(log, NAMES[seat]))


def test_ipd_random_bot_deterministic_and_partner_independent():
    kid = "ipd/heldout/003"
    first = _random_moves(kid, 11, 1)
    assert _random_moves(kid, 11, 1) == first
    assert _random_moves(kid, 11, 1, partner="always-defect") == first
    assert _random_moves(kid, 11, 1, partner="tit-for-tat") == first
    assert set(first) <= {"A", "B"}


def test_ipd_random_bot_depends_on_kernel_seed_and_seat():
    base = _random_moves("ipd/train/000", 1, 1)
    assert any(_random_moves("ipd/train/000", s, 1) != base for s in range(2, 6))
    assert any(_random_moves(f"ipd/train/{i:03d}", 1, 1) != base for i in range(1, 5))
    assert any(_random_moves("ipd/train/000", s, 0) != _random_moves("ipd/train/000", s, 1) for s in range(1, 5))


def test_ipd_random_bot_uses_derived_stream():
    # One draw per round from random.Random(derive(kernel_id, episode_seed, "bot", seat)); A iff < 0.5.
    for kid, seed, seat in [("ipd/train/000", 0, 1), ("ipd/heldout/042", 123456789, 1), ("ipd/train/007", 5, 0)]:
        rng = random.Random(derive(kid, seed, "bot", seat))
        expected = "".join("A" if rng.random() < 0.5 else "B" for _ in range(10))
        assert _random_moves(kid, seed, seat) == expected


def test_ipd_random_bot_plays_about_half_a():
    moves = "".join(_random_moves(f"ipd/train/{i:03d}", i, 1) for i in range(60))
    assert len(moves) == 600
    assert 0.42 <= moves.count("A") / len(moves) <= 0.58


def test_ipd_simultaneous_text_stays_private():
    env, log = play(
        "ipd",
        ipd_kernel(),
        {"Alice": script([f"PINEAPPLE{i} {choose('A')}" for i in range(10)]), "Bob": bot("ipd", "tit-for-tat")},
    )
    bob_seen = "\n".join(m.content for m in log.observations["Bob"])
    assert "PINEAPPLE" not in bob_seen


# ============================================================================================
# Section 3: Split No-Comm
# ============================================================================================

WORKED_SNC = ((10, 1, 1), (1, 10, 1))


def test_snc_worked_example():
    env, log = play(
        "split-no-comm",
        snc_kernel([WORKED_SNC]),
        {"Alice": script([claim(10, 2, 6)]), "Bob": bot("split-no-comm", "welfare-maximizing")},
    )
    assert actions_of(log, "Bob") == [vals(0, 10, 5)]  # tie on balls -> 5
    assert actions_of(log, "Alice") == [vals(10, 2, 6)]
    res = env.result()
    alice, bob = Fraction(3535, 33), Fraction(2900, 33)
    assert res.roles["Alice"].points == pytest.approx(float(alice), abs=1e-9)
    assert res.roles["Bob"].points == pytest.approx(float(bob), abs=1e-9)
    assert res.roles["Alice"].points == pytest.approx(107.1212, abs=1e-4)
    assert res.roles["Bob"].points == pytest.approx(87.8788, abs=1e-4)
    # Z = sum of 10 * own value over items and rounds: 120 for both here
    assert res.roles["Alice"].outcome == pytest.approx(float(alice / 120), abs=1e-12)
    assert res.roles["Alice"].outcome == pytest.approx(0.8927, abs=1e-4)
    assert res.roles["Bob"].outcome == pytest.approx(float(bob / 120), abs=1e-12)
    assert log.rewards["Alice"] == pytest.approx([float(alice / 120)], abs=1e-12)
    m = env.metrics()
    assert m["split_efficiency"] == pytest.approx(195 / 210, abs=1e-12)
    assert m["split_efficiency"] == pytest.approx(0.92857, abs=1e-5)
    assert m["collective_payoff"] == pytest.approx(195, abs=1e-9)


def test_snc_worked_example_in_a_longer_game():
    # The same round followed by nine more identical rounds of greedy vs greedy: Z = 1200.
    env, log = play(
        "split-no-comm",
        snc_kernel([WORKED_SNC] * 10),
        {
            "Alice": script([claim(10, 2, 6)] + [claim(10, 10, 10)] * 9),
            "Bob": script([claim(0, 10, 5)] + [claim(10, 10, 10)] * 9),
        },
    )
    alice = Fraction(3535, 33)
    assert log.rewards["Alice"][0] == pytest.approx(float(alice / 1200), abs=1e-12)
    assert log.rewards["Alice"][1:] == pytest.approx([60 / 1200] * 9, abs=1e-12)
    res = env.result()
    assert res.roles["Alice"].points == pytest.approx(float(alice + 540), abs=1e-9)
    assert sum(log.rewards["Alice"]) == pytest.approx(res.roles["Alice"].outcome, abs=TOL)
    assert sum(log.rewards["Bob"]) == pytest.approx(res.roles["Bob"].outcome, abs=TOL)
    assert env.metrics()["split_efficiency"] == pytest.approx((195 + 9 * 120) / 2100, abs=1e-12)


def test_snc_greedy_vs_greedy():
    env, log = play(
        "split-no-comm",
        snc_kernel([WORKED_SNC] * 10),
        {"Alice": bot("split-no-comm", "greedy"), "Bob": bot("split-no-comm", "greedy")},
    )
    assert actions_of(log, "Alice") == [vals(10, 10, 10)] * 10
    res = env.result()
    assert res.roles["Alice"].points == pytest.approx(600)
    assert res.roles["Bob"].points == pytest.approx(600)
    assert res.roles["Alice"].outcome == pytest.approx(0.5)
    assert log.rewards["Alice"] == pytest.approx([60 / 1200] * 10)
    assert env.metrics()["split_efficiency"] == pytest.approx(0.5714, abs=1e-4)
    assert env.metrics()["split_efficiency"] == pytest.approx(4 / 7, abs=1e-12)


M2 = ((10, 1, 10), (1, 10, 10))


@pytest.mark.parametrize(
    "a_claim,b_claim,a_pts,b_pts,eff",
    [
        ((10, 0, 5), (0, 10, 5), 150, 150, 1.0),
        ((10, 10, 10), (10, 10, 10), 105, 105, 0.7),
        ((10, 0, 10), (0, 10, 0), 200, 100, 1.0),
    ],
)
def test_snc_m2(a_claim, b_claim, a_pts, b_pts, eff):
    env, _ = play(
        "split-no-comm", snc_kernel([M2]), {"Alice": script([claim(*a_claim)]), "Bob": script([claim(*b_claim)])}
    )
    res = env.result()
    assert res.roles["Alice"].points == pytest.approx(a_pts)
    assert res.roles["Bob"].points == pytest.approx(b_pts)
    assert res.roles["Alice"].outcome == pytest.approx(a_pts / 210)
    assert res.roles["Bob"].outcome == pytest.approx(b_pts / 210)
    m = env.metrics()
    assert m["split_efficiency"] == pytest.approx(eff, abs=1e-12)
    assert m["collective_payoff"] == pytest.approx(a_pts + b_pts)
    assert m["collective_payoff_normalized"] == pytest.approx(eff, abs=1e-12)


def test_snc_welfare_bots_on_m2():
    env, log = play(
        "split-no-comm",
        snc_kernel([M2]),
        {"Alice": bot("split-no-comm", "welfare-maximizing"), "Bob": bot("split-no-comm", "welfare-maximizing")},
    )
    assert actions_of(log, "Alice") == [vals(10, 0, 5)]
    assert actions_of(log, "Bob") == [vals(0, 10, 5)]
    assert env.result().roles["Alice"].points == pytest.approx(150)
    assert env.metrics()["split_efficiency"] == pytest.approx(1.0)


def test_snc_leftover_is_lost():
    env, _ = play(
        "split-no-comm", snc_kernel([M2]), {"Alice": script([claim(3, 0, 2)]), "Bob": script([claim(4, 1, 0)])}
    )
    res = env.result()
    assert res.roles["Alice"].points == pytest.approx(3 * 10 + 2 * 10)
    assert res.roles["Bob"].points == pytest.approx(4 * 1 + 1 * 10)


SNC_PARSE_CASES = [
    # (text, claim, invalid)
    (claim(1, 2, 3), (1, 2, 3), False),
    ('<propose>{"Hats": 1, "book": 2, "BALLS": 3}</propose>', (1, 2, 3), False),
    ('<propose>{"hats": 3.0}</propose>', (3, 0, 0), False),  # missing keys mean 0
    ("<propose>{}</propose>", (0, 0, 0), False),
    ('<PROPOSE>{"balls": 10}</Propose>', (0, 0, 10), False),
    ("I claim everything", (0, 0, 0), True),  # missing tag
    ('<propose>{"hats": 10}', (0, 0, 0), True),  # unclosed
    ("<propose>hats=10</propose>", (0, 0, 0), True),  # bad JSON
    ("<propose>[10, 10, 10]</propose>", (0, 0, 0), True),
    ('<propose>{"hats": 3.5}</propose>', (0, 0, 0), True),
    ('<propose>{"hats": true}</propose>', (0, 0, 0), True),
    ('<propose>{"hats": "3"}</propose>', (0, 0, 0), True),
    ('<propose>{"hats": NaN}</propose>', (0, 0, 0), True),
    ('<propose>{"hats": 11, "books": 5}</propose>', (0, 0, 0), True),  # out of range voids the whole claim
    ('<propose>{"hats": -1, "books": 5}</propose>', (0, 0, 0), True),
    ('<propose>{"hats": 5, "shoes": 1}</propose>', (0, 0, 0), True),  # unknown key
    (claim(1, 1, 1) + " sorry " + claim(2, 2, 2), (2, 2, 2), False),  # last counts
    (claim(1, 1, 1) + ' <propose>{"hats": 99}</propose>', (0, 0, 0), True),
    ("<choose>A</choose>", (0, 0, 0), True),
]


@pytest.mark.parametrize("text,expected,invalid", SNC_PARSE_CASES)
def test_snc_malformed_actions(text, expected, invalid):
    env = make("split-no-comm")
    env.reset(snc_kernel([M2]), 0)
    ok, _ = env.validate("Alice", text)
    assert ok == (not invalid)
    result = env.step({"Alice": text, "Bob": claim(10, 10, 10)})
    parsed = result.parsed["Alice"]
    assert parsed.action.value == vals(*expected)
    assert parsed.invalid == invalid
    res = env.result()
    assert res.roles["Alice"].n_invalid == int(invalid)
    assert res.roles["Bob"].n_invalid == 0
    # consequence: Bob (greedy) gets 10 * x_B / (x_A + x_B) of each item
    bob_vals = vals(*M2[1])
    bob_pts = sum(
        Fraction(10 * 10, 10 + e) * bob_vals[i] if e > 0 else Fraction(10 * bob_vals[i])
        for i, e in zip(ITEMS, expected)
    )
    assert res.roles["Bob"].points == pytest.approx(float(bob_pts), abs=1e-9)


def test_snc_simultaneous_text_stays_private():
    env, log = play(
        "split-no-comm",
        snc_kernel([M2, WORKED_SNC]),
        {"Alice": script([f"PINEAPPLE {claim(1, 1, 1)}"] * 2), "Bob": bot("split-no-comm", "greedy")},
    )
    assert "PINEAPPLE" not in "\n".join(m.content for m in log.observations["Bob"])


def test_snc_feedback_shows_both_claims():
    env = make("split-no-comm")
    env.reset(snc_kernel([WORKED_SNC, WORKED_SNC]), 0)
    env.observe("Alice")
    env.step({"Alice": claim(10, 2, 6), "Bob": claim(0, 10, 5)})
    seen = "\n".join(m.content for m in env.observe("Alice"))
    assert "hats 10, books 2, balls 6" in seen and "hats 0, books 10, balls 5" in seen
    assert "1.6667" in seen and "5.4545" in seen and "107.1212" in seen


def test_snc_feedback_shows_both_allocations_and_points():
    env = make("split-no-comm")
    env.reset(snc_kernel([WORKED_SNC, WORKED_SNC]), 0)
    env.observe("Alice")
    env.step({"Alice": claim(10, 2, 6), "Bob": claim(0, 10, 5)})
    seen = "\n".join(m.content for m in env.observe("Alice"))
    assert "8.3333" in seen and "4.5455" in seen  # Bob's allocation of books and balls
    assert "87.8788" in seen  # Bob's points


def _valid_snc_configurations() -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = set()
    for six in itertools.product((1, 10), repeat=6):
        a, b = six[:3], six[3:]
        if a != b and sum(a) == sum(b):
            out.add((a, b))
    return out


def test_snc_twelve_valid_configurations():
    configs = _valid_snc_configurations()
    assert len(configs) == 12
    for a, b in configs:
        assert a.count(10) == b.count(10) and a.count(10) in (1, 2)


# ============================================================================================
# Section 4: Trust-and-Split
# ============================================================================================

TAS_WORKED_HANDS = [("rock", "scissors"), ("paper", "scissors")]


def test_tas_worked_example():
    alice = script(["I have rock, so I take the coins.", keep(10), "I have rock.", keep(10)])
    env, log = play(
        "trust-and-split",
        tas_kernel("Bob", TAS_WORKED_HANDS),
        {"Alice": alice, "Bob": bot("trust-and-split", "honest-cooperative")},
    )
    # order: Bob speaks, Alice replies, keeps; Alice speaks, Bob replies, keeps
    assert [sorted(t) for t in log.texts] == [
        ["Bob"],
        ["Alice"],
        ["Alice", "Bob"],
        ["Alice"],
        ["Bob"],
        ["Alice", "Bob"],
    ]
    assert log.texts[0]["Bob"] == "I have scissors."
    assert log.texts[4]["Bob"].startswith("I have scissors.")
    assert "rock" in log.texts[4]["Bob"]
    assert [log.steps[2].parsed[r].action.value["keep"] for r in NAMES] == [10, 0]
    assert [log.steps[5].parsed[r].action.value["keep"] for r in NAMES] == [10, 0]
    res = env.result()
    assert res.roles["Alice"].points == pytest.approx(110)
    assert res.roles["Bob"].points == pytest.approx(0)
    assert res.roles["Alice"].outcome == pytest.approx(1.0)
    assert res.roles["Bob"].outcome == pytest.approx(0.0)
    # rewards land at the split of each round: points_round / Z with Z = 110
    assert log.rewards["Alice"] == pytest.approx([0, 0, 100 / 110, 0, 0, 10 / 110])
    assert log.rewards["Bob"] == pytest.approx([0] * 6)
    assert res.roles["Alice"].n_turns == res.roles["Bob"].n_turns == 4
    assert res.roles["Alice"].n_invalid == res.roles["Bob"].n_invalid == 0
    # Bob's feedback after round 2: Alice had the lower hand and kept 10.
    last_feedback = log.observations["Bob"][-1].content
    assert "lower" in last_feedback and "10" in last_feedback
    m = env.metrics()
    assert m["collective_payoff"] == pytest.approx(110)
    assert m["collective_payoff_per_round"] == pytest.approx(55)
    assert m["collective_payoff_normalized"] == pytest.approx(110 / 200)
    # honesty: Bob r1 "scissors" true; Alice r1 "rock" true; Alice r2 "rock" false (paper);
    # Bob's r2 reply names two hands and does not count.
    assert m["honesty_rate/Alice"] == pytest.approx(0.5)
    assert m["honesty_rate/Bob"] == pytest.approx(1.0)
    assert m["honesty_rate"] == pytest.approx(2 / 3)


def test_tas_worked_example_via_rollout(tmp_path):
    path = tmp_path / "alice.txt"
    path.write_text(
        "I have rock, so I take the coins.\n" + keep(10) + "\nI have rock.\n" + keep(10) + "\n", encoding="utf-8"
    )
    spec = EpisodeSpec(
        "tas-worked",
        "trust-and-split",
        tas_kernel("Bob", TAS_WORKED_HANDS),
        3,
        [ScriptAgent(path), make_agent("honest-cooperative", env_class("trust-and-split"))],
    )
    (ep,) = run_episodes([spec])
    assert isinstance(spec.agents[1], BotAgent)
    assert ep.result.roles["Alice"].outcome == pytest.approx(1.0)
    assert ep.result.roles["Bob"].outcome == pytest.approx(0.0)
    assert ep.total_reward("p0") == pytest.approx(1.0, abs=TOL)
    assert ep.total_reward("p1") == pytest.approx(0.0, abs=TOL)
    assert [t.action.value for t in ep.trajectory("p1") if t.action.tag == "propose"] == [{"keep": 0}, {"keep": 0}]


def test_tas_over_claim_and_bob_z():
    # Round 2 of the worked kernel: Alice (paper, lower) keeps 6, Bob (scissors, upper) keeps 8.
    env, log = play(
        "trust-and-split",
        tas_kernel("Bob", TAS_WORKED_HANDS),
        {"Alice": script(["hi", keep(0), "hi", keep(6)]), "Bob": script(["hi", keep(0), "hi", keep(8)])},
    )
    res = env.result()
    assert res.roles["Alice"].points == pytest.approx(60 / 14, abs=1e-9)
    assert res.roles["Alice"].points == pytest.approx(4.2857, abs=1e-4)
    assert res.roles["Bob"].points == pytest.approx(800 / 14, abs=1e-9)
    assert res.roles["Bob"].points == pytest.approx(57.143, abs=1e-3)
    # Z = 110 for both
    assert res.roles["Alice"].outcome == pytest.approx(60 / 14 / 110, abs=1e-12)
    assert res.roles["Bob"].outcome == pytest.approx(800 / 14 / 110, abs=1e-12)
    assert log.rewards["Bob"][-1] == pytest.approx(800 / 14 / 110, abs=1e-12)
    feedback = "\n".join(m.content for m in log.observations["Alice"][-1:])
    assert "4.2857" in feedback


def test_tas_m3():
    env, _ = play(
        "trust-and-split",
        tas_kernel("Alice", [("rock", "scissors")]),
        {"Alice": script(["hello", keep(7)]), "Bob": script(["hello", keep(6)])},
    )
    res = env.result()
    assert res.roles["Alice"].points == pytest.approx(700 / 13, abs=1e-9)
    assert res.roles["Alice"].points == pytest.approx(53.8462, abs=1e-4)
    assert res.roles["Bob"].points == pytest.approx(60 / 13, abs=1e-9)
    assert res.roles["Bob"].points == pytest.approx(4.6154, abs=1e-4)
    assert res.roles["Alice"].outcome == pytest.approx(700 / 13 / 100)
    assert res.roles["Bob"].outcome == pytest.approx(60 / 13 / 10)
    assert env.metrics()["collective_payoff"] == pytest.approx(58.4615, abs=1e-4)


def test_tas_under_claim_leftover_lost():
    env, _ = play(
        "trust-and-split",
        tas_kernel("Alice", [("rock", "scissors")]),
        {"Alice": script(["", keep(4)]), "Bob": script(["", keep(3)])},
    )
    assert env.result().roles["Alice"].points == pytest.approx(40)
    assert env.result().roles["Bob"].points == pytest.approx(3)


def test_tas_speaker_alternates():
    env = make("trust-and-split")
    env.reset(tas_kernel("Alice", [("rock", "paper"), ("rock", "paper"), ("rock", "paper")]), 0)
    order = []
    while not env.done:
        acting = env.acting_roles()
        order.append(tuple(acting))
        env.step({r: keep(5) if len(acting) == 2 else "msg" for r in acting})
    assert order == [
        ("Alice",), ("Bob",), ("Alice", "Bob"),
        ("Bob",), ("Alice",), ("Alice", "Bob"),
        ("Alice",), ("Bob",), ("Alice", "Bob"),
    ]  # fmt: skip


TAS_KEEP_CASES = [
    (keep(7), 7, False),
    (keep("7.0"), 7, False),
    ('<propose>{"Keep": 3}</propose>', 3, False),
    ('<propose>{"keeps": 3}</propose>', 3, False),
    ('<propose>{" KEEP ": 10}</propose>', 10, False),
    (keep(0), 0, False),
    ("I keep 7", 0, True),  # missing tag
    ('<propose>{"keep": 7}', 0, True),  # unclosed
    ("<propose>seven</propose>", 0, True),  # bad payload
    ("<propose>{}</propose>", 0, True),  # empty object: keep is required
    (keep(11), 0, True),  # out of range
    (keep(-1), 0, True),
    (keep(3.5), 0, True),
    (keep("true"), 0, True),
    (keep('"3"'), 0, True),
    (keep("NaN"), 0, True),
    ('<propose>{"keep": 5, "give": 5}</propose>', 0, True),  # unknown key
    (keep(9) + " no " + keep(2), 2, False),  # last counts
    (keep(9) + " no " + keep(12), 0, True),
]


@pytest.mark.parametrize("text,expected,invalid", TAS_KEEP_CASES)
def test_tas_malformed_keep(text, expected, invalid):
    env = make("trust-and-split")
    env.reset(tas_kernel("Alice", [("rock", "scissors")]), 0)
    env.step({"Alice": "hello"})
    env.step({"Bob": "hi"})
    ok, _ = env.validate("Alice", text)
    assert ok == (not invalid)
    result = env.step({"Alice": text, "Bob": keep(5)})
    assert result.parsed["Alice"].action.value == {"keep": expected}
    assert result.parsed["Alice"].invalid == invalid
    res = env.result()
    assert res.roles["Alice"].n_invalid == int(invalid)
    assert res.roles["Bob"].n_invalid == 0
    coins_a = Fraction(expected) if expected + 5 <= 10 else Fraction(10 * expected, expected + 5)
    coins_b = Fraction(5) if expected + 5 <= 10 else Fraction(50, expected + 5)
    assert res.roles["Alice"].points == pytest.approx(float(coins_a * 10), abs=1e-9)
    assert res.roles["Bob"].points == pytest.approx(float(coins_b), abs=1e-9)


@pytest.mark.parametrize(
    "text",
    ["", "   ", "<propose>{}</propose>", "<propose>{", "I have rock <accept/>", "<think>plan</think>hi", "x" * 3000],
)
def test_tas_messages_are_never_invalid(text):
    env = make("trust-and-split")
    env.reset(tas_kernel("Alice", [("rock", "scissors")]), 0)
    assert env.validate("Alice", text)[0]
    result = env.step({"Alice": text})
    assert not result.parsed["Alice"].invalid
    assert env.result().roles["Alice"].n_invalid == 0


def test_tas_message_delivery_cleaned_and_truncated_to_500():
    env = make("trust-and-split")
    env.reset(tas_kernel("Alice", [("rock", "scissors")]), 0)
    env.observe("Bob")
    secret = "<think>HIDDENPLAN</think>"
    text = secret + "Q" * 600
    env.step({"Alice": text})
    seen = "\n".join(m.content for m in env.observe("Bob"))
    assert "HIDDENPLAN" not in seen
    assert "Q" * 500 in seen
    assert "Q" * 501 not in seen
    # tags are delivered verbatim
    env.step({"Bob": 'I have <b>scissors</b> <propose>{"keep": 1}</propose>'})
    seen = "\n".join(m.content for m in env.observe("Alice"))
    assert '<propose>{"keep": 1}</propose>' in seen


def test_tas_keep_text_stays_private():
    env, log = play(
        "trust-and-split",
        tas_kernel("Alice", [("rock", "scissors"), ("paper", "scissors")]),
        {
            "Alice": script(["m1", f"PINEAPPLE {keep(5)}", "m2", f"PINEAPPLE {keep(5)}"]),
            "Bob": bot("trust-and-split", "greedy"),
        },
    )
    assert "PINEAPPLE" not in "\n".join(m.content for m in log.observations["Bob"])


def _honest_keep(alice_message: str, bob_hand: str = "scissors", alice_first: bool = True) -> tuple[int, str]:
    """Bob (honest-cooperative) keep after Alice's message in a one-round game."""
    alice_hand = next(h for h in HANDS if h != bob_hand)
    kernel = tas_kernel("Alice" if alice_first else "Bob", [(alice_hand, bob_hand)])
    _, log = play(
        "trust-and-split",
        kernel,
        {"Alice": script([alice_message, keep(0)]), "Bob": bot("trust-and-split", "honest-cooperative")},
    )
    bob_message = next(t["Bob"] for t in log.texts if "Bob" in t and len(t) == 1)
    return log.steps[-1].parsed["Bob"].action.value["keep"], bob_message


@pytest.mark.parametrize(
    "message,expected",
    [
        ("I have rock.", 0),  # rock beats scissors
        ("I have paper.", 10),  # scissors beats paper
        ("I HAVE ROCK!", 0),  # case-insensitive
        ("Rock. rock. ROCK.", 0),  # one distinct word
        ("I have scissors too", 5),  # only the bot's own hand: unknown
        ("I have scissors, not rock", 0),  # own hand ignored, rock claimed
        ("rock or paper?", 5),  # two distinct: unknown
        ("rock, paper, scissors", 5),
        ("", 5),  # unknown claim -> 5
        ("I would rather not say", 5),
        ('<propose>{"keep": 10}</propose>', 5),
    ],
)
def test_honest_cooperative_reads_claims(message, expected):
    kept, reply = _honest_keep(message)
    assert kept == expected
    assert reply.startswith("I have scissors.")


def test_honest_cooperative_first_speaker_message_and_reply_names_claim():
    kept, msg = _honest_keep("I have paper.", bob_hand="rock", alice_first=False)
    assert msg == "I have rock."
    assert kept == 0  # paper beats rock
    kept, reply = _honest_keep("I have paper.", bob_hand="scissors", alice_first=True)
    assert reply.startswith("I have scissors.") and "paper" in reply
    assert kept == 10


def test_tas_greedy_bot():
    env, log = play(
        "trust-and-split",
        tas_kernel("Bob", [("rock", "scissors")]),
        {"Alice": script(["ok", keep(5)]), "Bob": bot("trust-and-split", "greedy")},
    )
    assert log.texts[0]["Bob"] == "I'd like to keep all ten coins this round."
    assert log.steps[-1].parsed["Bob"].action.value == {"keep": 10}
    assert env.result().roles["Alice"].points == pytest.approx(10 * 5 / 15 * 10)


def test_reciprocal_punishes_for_one_round():
    hands = [("paper", "scissors"), ("rock", "scissors"), ("paper", "rock"), ("rock", "scissors")]
    # r1: Alice (lower) claims truthfully and keeps 3 > 0 -> Bob is greedy in r2 only.
    # r2 (Bob first): Alice (upper) keeps 10. r3 (Alice first): Alice (upper) keeps 10.
    # r4 (Bob first): Alice rock (upper), keeps 10.
    alice = script(
        ["I have paper.", keep(3), "I have rock.", keep(10), "I have paper.", keep(10), "I have rock.", keep(10)]
    )
    _, log = play(
        "trust-and-split", tas_kernel("Alice", hands), {"Alice": alice, "Bob": bot("trust-and-split", "reciprocal")}
    )
    bob_keeps = [s.parsed["Bob"].action.value["keep"] for s in log.steps if len(s.parsed) == 2]
    bob_msgs = [t["Bob"] for t in log.texts if list(t) == ["Bob"]]
    assert bob_keeps == [10, 10, 0, 0]
    assert bob_msgs[1] == "I'd like to keep all ten coins this round."
    assert bob_msgs[0].startswith("I have scissors.")
    assert bob_msgs[2].startswith("I have rock.")


def test_reciprocal_forgives_zero_keep_and_upper_hand():
    hands = [("paper", "scissors"), ("rock", "scissors"), ("rock", "scissors")]
    # r1: Alice lower keeps 0 -> no punishment; r2: Alice upper keeps 10 -> no punishment.
    alice = script(["I have paper.", keep(0), "I have rock.", keep(10), "I have rock.", keep(10)])
    _, log = play(
        "trust-and-split", tas_kernel("Alice", hands), {"Alice": alice, "Bob": bot("trust-and-split", "reciprocal")}
    )
    bob_keeps = [s.parsed["Bob"].action.value["keep"] for s in log.steps if len(s.parsed) == 2]
    assert bob_keeps == [10, 0, 0]


def _user_text_without_partner_messages(observations, partner_texts: list[str]) -> str:
    text = "\n".join(m.content for m in observations if m.role != "system")
    for t in sorted(set(partner_texts), key=len, reverse=True):
        if t:
            text = text.replace(t, "")
    return text


@pytest.mark.parametrize("first", ["Alice", "Bob"])
def test_tas_role_sees_only_own_hand(first):
    # Bob always holds scissors; Alice alternates rock/paper. Then the mirror image.
    for viewer, hidden, hands in [
        ("Alice", "scissors", [("rock" if r % 2 else "paper", "scissors") for r in range(10)]),
        ("Bob", "rock", [("rock", "paper" if r % 2 else "scissors") for r in range(10)]),
    ]:
        partner = "Bob" if viewer == "Alice" else "Alice"
        # the partner is honest, so its messages name its hand; the viewer never names hands
        policies = {
            partner: bot("trust-and-split", "honest-cooperative"),
            viewer: lambda env, role: keep(5) if len(env.acting_roles()) == 2 else "hello there",
        }
        env, log = play("trust-and-split", tas_kernel(first, hands), policies)
        partner_texts = [t[partner] for t in log.texts if list(t) == [partner]]
        assert any(hidden in t for t in partner_texts)  # the honest partner did name it
        seen = _user_text_without_partner_messages(log.observations[viewer], partner_texts).lower()
        assert hidden not in seen
        own_hands = {h[0] if viewer == "Alice" else h[1] for h in hands}
        for hand in own_hands:
            assert hand in seen
        # the system prompt holds no per-kernel private information about the partner's hand
        swapped = [
            (a, next(h for h in HANDS if h not in (a, b)))
            if viewer == "Alice"
            else (next(h for h in HANDS if h not in (a, b)), b)
            for a, b in hands
        ]
        env2 = make("trust-and-split")
        env2.reset(tas_kernel(first, swapped), 0)
        assert env2.observe(viewer)[0] == log.observations[viewer][0]
        assert log.observations[viewer][0].role == "system"


# ============================================================================================
# roles that are not acting (validate's purity, kernels and the other properties every game
# shares are checked by check_env in test_env_checks.py)
# ============================================================================================


def test_validate_false_for_non_acting_role_in_tas():
    env = make("trust-and-split")
    env.reset(tas_kernel("Bob", TAS_WORKED_HANDS), 0)
    assert env.acting_roles() == ["Bob"]
    ok, reason = env.validate("Alice", "hello")
    assert not ok and reason
    assert env.validate("Bob", "hello")[0]
    env.step({"Bob": "hi"})
    assert env.acting_roles() == ["Alice"]
    assert not env.validate("Bob", "hello")[0]


def test_step_rejects_wrong_roles_but_not_bad_text():
    env = make("trust-and-split")
    env.reset(tas_kernel("Bob", TAS_WORKED_HANDS), 0)
    with pytest.raises(ValueError):
        env.step({"Alice": "hi"})


# ============================================================================================
# property: arbitrary text never breaks an episode
# ============================================================================================

FRAGMENTS = [
    "<choose>",
    "</choose>",
    "A",
    "B",
    "a",
    "<propose>",
    "</propose>",
    "<PROPOSE>",
    "<accept/>",
    "<think>",
    "</think>",
    "{",
    "}",
    '"hats":',
    '"Books":',
    '"balls":',
    '"keep":',
    '"shoes":',
    ",",
    " ",
    "\n",
    "0",
    "3",
    "5",
    "10",
    "11",
    "-1",
    "3.0",
    "3.5",
    "NaN",
    "true",
    '"3"',
    "rock",
    "paper",
    "scissors",
]

fragment_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=25).map("".join)
valid_ish = st.one_of(
    st.sampled_from("AB").map(choose),
    st.tuples(st.integers(0, 10), st.integers(0, 10), st.integers(0, 10)).map(lambda t: claim(*t)),
    st.integers(-2, 12).map(keep),
)
seat_text = st.one_of(st.text(max_size=60), fragment_text, valid_ish)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(env_name=st.sampled_from(ENVS), index=st.integers(0, 99), episode_seed=st.integers(0, 2**63), data=st.data())
def test_arbitrary_text_never_breaks_an_episode(env_name, index, episode_seed, data):
    """check_env's per-episode checks on hypothesis-drawn text, which hypothesis shrinks on failure."""
    kernel = load_kernels(env_name, data.draw(st.sampled_from(["train", "heldout"])))[index]

    def policy(env, role):
        return data.draw(seat_text)

    check_episode(env_class(env_name), kernel, episode_seed, policy, max_steps=MAX_STEPS[env_name])


# ============================================================================================
# kernels
# ============================================================================================


def test_ipd_kernels_are_all_the_same_game():
    for split in SPLITS:
        for i, k in enumerate(load_kernels("ipd", split)):
            assert k.data == {"names": ["Alice", "Bob"], "n_rounds": 10}
            assert k.seed == derive("repertory", "ipd", split, i)


def test_snc_kernel_rounds_in_valid_configurations():
    configs = _valid_snc_configurations()
    seen = set()
    for split in SPLITS:
        for k in load_kernels("split-no-comm", split):
            assert len(k.data["values"]) == 10
            for r in k.data["values"]:
                a = tuple(r["Alice"][i] for i in ITEMS)
                b = tuple(r["Bob"][i] for i in ITEMS)
                assert (a, b) in configs
                seen.add((a, b))
    assert seen == configs  # 3000 rounds cover all 12


def _spec_snc(rng: random.Random) -> list:
    rounds = []
    for _ in range(10):
        while True:
            six = [rng.choice([1, 10]) for _ in range(6)]
            a, b = six[:3], six[3:]
            if a != b and sum(a) == sum(b):
                break
        rounds.append((tuple(a), tuple(b)))
    return tuple(rounds)


def _spec_tas(rng: random.Random) -> tuple:
    first = rng.choice(["Alice", "Bob"])
    hands = tuple(tuple(rng.sample(["rock", "paper", "scissors"], 2)) for _ in range(10))
    return first, hands


@pytest.mark.parametrize("env_name,draw", [("split-no-comm", _spec_snc), ("trust-and-split", _spec_tas)])
def test_kernels_match_independent_spec_generation(env_name, draw):
    """Re-derive every kernel from the text of environments.md 1.5 and 3/4, retries included."""
    seen: set = set()
    for split in SPLITS:
        for i, k in enumerate(load_kernels(env_name, split)):
            seed, r = derive("repertory", env_name, split, i), 0
            content = draw(random.Random(seed))
            while content in seen:
                r += 1
                seed = derive("repertory", env_name, split, i, "retry", r)
                content = draw(random.Random(seed))
            seen.add(content)
            assert k.seed == seed
            if env_name == "split-no-comm":
                got = [
                    (tuple(v["Alice"][i] for i in ITEMS), tuple(v["Bob"][i] for i in ITEMS)) for v in k.data["values"]
                ]
                assert tuple(got) == content
            else:
                got = (k.data["first_speaker"], tuple((h["Alice"], h["Bob"]) for h in k.data["hands"]))
                assert got == content


def test_reset_rejects_foreign_or_broken_kernel():
    env = make("ipd")
    with pytest.raises(ValueError):
        env.reset(tas_kernel("Alice", [("rock", "paper")]), 0)
    env = make("trust-and-split")
    with pytest.raises(ValueError):
        env.reset(tas_kernel("Alice", [("rock", "rock")]), 0)
    env = make("split-no-comm")
    with pytest.raises(ValueError):
        env.reset(snc_kernel([((10, 1, 1), (10, 1, 1))]), 0)
    with pytest.raises(ValueError):
        env.reset(snc_kernel([((10, 1, 1), (10, 10, 1))]), 0)


# Alice's and Bob's per-round quality in the worked example against tit-for-tat: the points of the move played
# minus those of the other move, against the partner's move (A vs A: 3 - 5; B vs A: 5 - 3; A vs B: 0 - 1).
IPD_QUALITY_ALICE = [-2, -2, 2, -1, -2, -2, -2, -2, -2, 2]
IPD_QUALITY_BOB = [-2, -2, -1, 2, -2, -2, -2, -2, -2, -1]


def _worked_example_vs_tit_for_tat(**options: Any) -> Any:
    alice = script([choose(m) for m in ALICE_MOVES])
    env = make("ipd", **options)
    env.reset(ipd_kernel(), 0)
    rewards: dict[str, list[float]] = {r: [] for r in NAMES}
    tft = env_class("ipd").bots["tit-for-tat"]
    while not env.done:
        result = env.step({"Alice": alice(env, "Alice"), "Bob": tft(env.view("Bob"))})
        for role in NAMES:
            rewards[role].append(result.rewards[role])
    return env, rewards


def test_ipd_reward_at_end_pays_the_whole_score_after_the_last_round():
    env, rewards = _worked_example_vs_tit_for_tat(reward_at_end=True)
    assert rewards["Alice"] == [0.0] * 9 + [pytest.approx(31 / 50, abs=1e-12)]
    assert rewards["Bob"] == [0.0] * 9 + [pytest.approx(26 / 50, abs=1e-12)]
    assert env.result().roles["Alice"].outcome == pytest.approx(0.62, abs=1e-12)
    _, per_round = _worked_example_vs_tit_for_tat()
    assert per_round["Alice"][:3] == pytest.approx([3 / 50, 3 / 50, 5 / 50], abs=1e-12)


@pytest.mark.parametrize("env_name", ["ipd", "split-no-comm", "trust-and-split"])
def test_round_games_at_end_pay_what_their_rounds_sum_to(env_name):
    kernel = load_kernels(env_name, "train")[0]
    bots = env_class(env_name).bots
    first = next(iter(bots))
    env = make(env_name, reward_at_end=True)
    env.reset(kernel, 3)
    paid: dict[str, list[float]] = {}
    while not env.done:
        result = env.step({role: bots[first](env.view(role)) for role in env.acting_roles()})
        for role, reward in result.rewards.items():
            paid.setdefault(role, []).append(reward)
    for role, rewards in paid.items():
        assert rewards[:-1] == [0.0] * (len(rewards) - 1)
        assert rewards[-1] == pytest.approx(env.result().roles[role].outcome, abs=TOL)


def test_reward_at_end_takes_true_or_false_only():
    with pytest.raises(RepertoryError, match="reward_at_end must be true or false"):
        make("ipd", reward_at_end="yes")
    with pytest.raises(RepertoryError, match="its options are reward_at_end"):
        make("ipd", rewards_at_end=True)


def test_ipd_turn_quality_of_the_worked_example(tmp_path):
    path = tmp_path / "alice.txt"
    path.write_text("\n".join(choose(m) for m in ALICE_MOVES) + "\n", encoding="utf-8")
    spec = EpisodeSpec("ep", "ipd", ipd_kernel(), 7, [ScriptAgent(path), make_agent("tit-for-tat", env_class("ipd"))])
    (episode,) = run_episodes([spec])
    quality = env_class("ipd").turn_quality(episode)
    assert [quality[("p0", k)] for k in range(10)] == IPD_QUALITY_ALICE
    assert [quality[("p1", k)] for k in range(10)] == IPD_QUALITY_BOB
    assert env_class("craigslist").turn_quality(episode) == {}
