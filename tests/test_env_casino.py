"""CaSiNo (environments.md 8): the worked example, the bot's proposals by aspiration, payload
checks, the partner guard on the walk-away value, and kernel generation."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from repertory.envs import make
from repertory.envs.casino import NEED, SPARE, Casino, bot
from repertory.envs.negotiation import Standing
from repertory.types import Kernel, derive

A, B = "Camper A", "Camper B"
ITEMS = ("food", "water", "firewood")


def kernel(a: tuple[str, str, str] = ITEMS, b: tuple[str, str, str] = ("water", "food", "firewood")) -> Kernel:
    """A hand-built kernel: each camper's items from high to low, first reason of each bank."""
    priorities = {A: list(a), B: list(b)}
    reasons = {r: [NEED[p[0]][0], NEED[p[1]][0], SPARE[p[2]][0]] for r, p in priorities.items()}
    data = {"items": list(ITEMS), "priorities": priorities, "reasons": reasons}
    return Kernel("casino/train/000", "casino", "train", 0, 0, data)


def fresh(k: Kernel | None = None) -> Casino:
    env = make("casino")
    assert isinstance(env, Casino)
    env.reset(k or kernel(), 0)
    return env


def propose(food: Any = None, water: Any = None, firewood: Any = None) -> str:
    fields = {k: v for k, v in zip(ITEMS, (food, water, firewood)) if v is not None}
    return f"<propose>{json.dumps(fields)}</propose>"


def share(text: str) -> tuple[int, int, int]:
    offer = json.loads(text.split("<propose>")[1].split("</propose>")[0])
    return offer["food"], offer["water"], offer["firewood"]


def texts(env: Casino, role: str) -> list[str]:
    return [m.content for m in env.observe(role)]


# -- the worked example ----------------------------------------------------------------------------


def test_worked_example_deal() -> None:
    env = fresh()
    env.step({A: propose(3, 0, 2)})
    assert env.standing == Standing(A, {"food": 3, "water": 0, "firewood": 2})
    assert (env.deal_points(A, env.standing), env.deal_points(B, env.standing)) == (21, 18)
    env.step({B: "I need some food too. <reject/>"})
    assert env.standing is None
    env.step({A: propose(2, 0, 3)})
    assert (env.deal_points(A, env.standing), env.deal_points(B, env.standing)) == (19, 19)
    env.step({B: "<accept/>"})
    assert env.done and env.end_reason == "deal"
    result = env.result()
    for role in (A, B):
        assert result.roles[role].points == 19
        assert result.roles[role].outcome == pytest.approx(19 / 36, abs=1e-12)
        assert round(result.roles[role].outcome, 4) == 0.5278
    assert result.roles[A].n_turns == 2 and result.roles[B].n_turns == 2


def test_worked_example_walkaway_gives_five_points_each() -> None:
    env = fresh()
    for text in (propose(3, 0, 2), "I need some food too. <reject/>", propose(2, 0, 3), "<walkaway/>"):
        env.step({env.acting_roles()[0]: text})
    result = env.result()
    assert env.end_reason == "walkaway" and env.deal is None
    for role in (A, B):
        assert result.roles[role].points == 5
        assert result.roles[role].outcome == pytest.approx(5 / 36, abs=1e-12)
        assert round(result.roles[role].outcome, 4) == 0.1389


def test_timeout_gives_zero_to_both() -> None:
    env = fresh()
    env.step({A: propose(2, 0, 3)})
    for _ in range(19):
        env.step({env.acting_roles()[0]: "Let me think about it."})
    assert env.done and env.end_reason == "limit" and env.messages == 20
    result = env.result()
    assert [result.roles[r].points for r in (A, B)] == [0, 0]
    assert [result.roles[r].outcome for r in (A, B)] == [0.0, 0.0]


# -- the bot -------------------------------------------------------------------------------------------


def test_bot_b_proposals_by_aspiration() -> None:
    """environments.md 8: B's own share at aspirations 26, 24, 22, 20, 18 (and the floor after)."""
    env = fresh()
    expected = [(2, 3, 1), (0, 3, 3), (1, 3, 1), (1, 2, 2), (0, 3, 1), (0, 3, 1)]
    for k, want in enumerate(expected):
        env.step({A: "Tell me what you need."})
        view = env.view(B)
        assert view["own_turn"] == k
        reply = bot(view)
        assert reply.startswith("How about this? ") and share(reply) == want
        env.step({B: reply})
        assert env.standing == Standing(B, dict(zip(ITEMS, want)))
        assert env.deal_points(B, env.standing) == max(26 - 2 * k, 18)


def test_bot_in_seat_a_opens_at_26() -> None:
    env = fresh()
    reply = bot(env.view(A))
    assert share(reply) == (3, 2, 1)
    env.step({A: reply})
    assert env.deal_points(A, env.standing) == 26


def test_bot_accepts_a_standing_proposal_worth_its_aspiration() -> None:
    env = fresh()
    env.step({A: propose(3, 0, 1)})  # B gets 3 water, 2 firewood: 21 < 26
    assert share(bot(env.view(B))) == (2, 3, 1)
    env = fresh()
    env.step({A: propose(1, 0, 1)})  # B gets 2 food, 3 water, 2 firewood: 8 + 15 + 6 = 29
    assert bot(env.view(B)) == "That works for me. <accept/>"


def test_bot_walks_away_on_its_last_turn() -> None:
    env = fresh()
    for _ in range(9):
        env.step({A: "Hmm."})
        env.step({B: bot(env.view(B))})
    env.step({A: propose(3, 3, 3)})
    view = env.view(B)
    assert view["last_turn"] and env.messages_left == 1
    assert bot(view).endswith("<walkaway/>")
    env.step({B: bot(view)})
    assert env.end_reason == "walkaway"
    assert [env.result().roles[r].points for r in (A, B)] == [5, 5]


def test_bot_in_seat_a_walks_away_on_message_19() -> None:
    env = fresh()
    for _ in range(9):
        env.step({A: bot(env.view(A))})
        env.step({B: "No."})
    assert env.messages == 18 and env.view(A)["last_turn"]
    env.step({A: bot(env.view(A))})
    assert env.end_reason == "walkaway" and env.messages == 19


# -- payloads -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ('{"food": 4}', "food must be between 0 and 3"),
        ('{"water": -1}', "water must be between 0 and 3"),
        ('{"food": 1.5}', "food must be an integer"),
        ('{"food": "2"}', "food must be an integer"),
        ('{"food": true}', "food must be an integer"),
        ('{"wood": 2}', "unknown key 'wood'"),
        ('{"food": 1, "Foods": 2}', "key 'food' appears twice"),
        ("[1, 2, 3]", "the proposal must be a JSON object"),
        ("{food: 1}", "the proposal is not valid JSON"),
        ('{"food": NaN}', "NaN is not allowed in JSON"),
    ],
)
def test_invalid_payload_is_a_plain_message(payload: str, reason: str) -> None:
    env = fresh()
    env.step({A: propose(3, 0, 2)})
    env.observe(A)
    env.observe(B)
    text = f"Here is my idea. <propose>{payload}</propose>"
    assert env.validate(B, text)[0] is False
    env.step({B: text})
    assert env.standing == Standing(A, {"food": 3, "water": 0, "firewood": 2})
    assert env.n_invalid[B] == 1 and env.messages == 2
    to_b, to_a = "\n".join(texts(env, B)), "\n".join(texts(env, A))
    assert f"[Referee] Your action was not recorded: {reason}" in to_b
    assert f"Camper B: {text}" in to_a and "[Referee]" not in to_a


def test_payload_normalisation_and_defaults() -> None:
    env = fresh()
    env.step({A: '<propose>{" Foods ": 2.0, "WATER": 1}</propose>'})
    assert env.standing == Standing(A, {"food": 2, "water": 1, "firewood": 0})
    assert env.n_invalid[A] == 0
    env.step({B: "<PROPOSE>{}</Propose>"})
    assert env.standing == Standing(B, {"food": 0, "water": 0, "firewood": 0})
    assert env.deal_points(A, env.standing) == 36


def test_illegal_and_malformed_tags() -> None:
    env = fresh()
    assert env.validate(A, "<accept/>") == (False, "there is no proposal to accept")
    assert env.validate(A, '<propose>{"food": 1}') == (False, "the <propose> tag is not closed with </propose>")
    assert env.validate(A, "No tag here.") == (True, "")
    env.step({A: propose(1, 1, 1)})
    env.step({B: "ok"})
    assert env.validate(A, "<accept/>") == (False, "you cannot accept your own proposal")
    env.step({A: f"{propose(3, 3, 3)} actually <accept>"})
    assert env.n_invalid[A] == 1 and env.standing == Standing(A, {"food": 1, "water": 1, "firewood": 1})
    env.step({B: f"<accept/> no wait {propose(0, 3, 0)}"})
    assert not env.done and env.standing == Standing(B, {"food": 0, "water": 3, "firewood": 0})


# -- the partner guard -----------------------------------------------------------------------------------


def test_guard_protects_the_walkaway_value() -> None:
    env = fresh()
    assert env.guarded_limit == "the walk-away value of 5 points"
    # B values water 5, food 4, firewood 3.
    assert env.guard(B, f"Fine: {propose(0, 1, 0)}") is None  # exactly 5
    assert env.guard(B, f"Fine: {propose(0, 0, 1)} for me.") == "Fine:  for me."
    env.step({A: propose(3, 3, 2)})  # B would get one firewood: 3 points
    assert env.guard(B, "Sure. <accept/>") == "Sure."
    assert env.guard(B, "<reject/>") is None
    assert env.guard(B, f"{propose(0, 3, 0)} <accept/>") == ""  # every tag goes, not only the accept
    env.step({B: "<reject/>"})
    env.step({A: propose(3, 2, 3)})  # B would get one water: 5 points
    assert env.guard(B, "Sure. <accept/>") is None


# -- views, prompts, kernels --------------------------------------------------------------------------------


def test_private_view_and_prompt_hold_only_own_information() -> None:
    k = kernel(("food", "water", "firewood"), ("firewood", "water", "food"))
    env = fresh(k)
    assert env.private_view(A) == {"priorities": ["food", "water", "firewood"], "values": [5, 4, 3]}
    assert env.private_view(B) == {"priorities": ["firewood", "water", "food"], "values": [3, 4, 5]}
    prompt_a = env.system_prompt(A)
    assert "high priority: food, 5 points per package. " + NEED["food"][0] in prompt_a
    assert "low priority: firewood, 3 points per package. " + SPARE["firewood"][0] in prompt_a
    assert NEED["firewood"][0] not in prompt_a and SPARE["food"][0] not in prompt_a
    env.step({A: propose(2, 1, 0)})
    assert env.describe(env.standing, A) == "you get 2 food, 1 water, 0 firewood (worth 14 points to you)"
    assert env.describe(env.standing, B) == "you get 1 food, 2 water, 3 firewood (worth 26 points to you)"


def test_generate_kernel_follows_the_draw_order() -> None:
    seed = derive("repertory", "casino", "train", 3)
    rng = random.Random(seed)
    expected: dict[str, Any] = {"items": list(ITEMS), "priorities": {}, "reasons": {}}
    for role in (A, B):
        order = list(ITEMS)
        rng.shuffle(order)
        expected["priorities"][role] = order
        expected["reasons"][role] = [
            rng.choice(NEED[order[0]]),
            rng.choice(NEED[order[1]]),
            rng.choice(SPARE[order[2]]),
        ]
    assert Casino.generate_kernel(random.Random(seed)) == expected
    assert Casino.validate_kernel(expected) == []


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda d: d["priorities"][A].__setitem__(2, "food"), "Camper A's priorities must order"),
        (lambda d: d["reasons"][B].__setitem__(2, NEED["firewood"][0]), "Camper B's low-priority reason"),
        (lambda d: d["reasons"][A].__setitem__(0, SPARE["food"][0]), "Camper A's high-priority reason"),
        (lambda d: d["reasons"][A].pop(), "Camper A needs three reasons"),
        (lambda d: d.__setitem__("items", ["water", "food", "firewood"]), "items must be"),
        (lambda d: d["priorities"].pop(B), "priorities and reasons must be given"),
        (lambda d: d.pop("reasons"), "a kernel needs"),
        (lambda d: d["priorities"].__setitem__(A, 7), "Camper A's priorities must order"),
        (lambda d: d["priorities"].__setitem__(A, [1, "a", None]), "a kernel needs"),
    ],
)
def test_validate_kernel_catches_problems(mutate: Any, problem: str) -> None:
    data = kernel().data
    mutate(data)
    problems = Casino.validate_kernel(data)
    assert any(p.startswith(problem) for p in problems), problems
