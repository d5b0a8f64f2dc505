"""Deal or No Deal (environments.md 7): the worked example, the aspiration bot 9/1/6, payload checks,
what each side sees, and kernel generation."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from repertory.envs import load_kernels, make
from repertory.envs.deal_or_no_deal import DealOrNoDeal, bot
from repertory.envs.negotiation import Standing
from repertory.types import SPLITS, Kernel, canonical_json, derive

ITEMS = ("books", "hats", "balls")
EXAMPLE = {"items": list(ITEMS), "counts": [1, 2, 3], "values": {"A": [4, 0, 2], "B": [2, 4, 0]}}


def kernel(counts: list[int] | None = None, a: list[int] | None = None, b: list[int] | None = None) -> Kernel:
    """The worked example's kernel, or one with other counts and values."""
    data = {
        "items": list(ITEMS),
        "counts": counts or EXAMPLE["counts"],
        "values": {"A": a or EXAMPLE["values"]["A"], "B": b or EXAMPLE["values"]["B"]},
    }
    return Kernel("deal-or-no-deal/train/000", "deal-or-no-deal", "train", 0, 0, data)


def fresh(k: Kernel | None = None) -> DealOrNoDeal:
    env = make("deal-or-no-deal")
    assert isinstance(env, DealOrNoDeal)
    env.reset(k or kernel(), 0)
    return env


def propose(books: Any = None, hats: Any = None, balls: Any = None) -> str:
    fields = {k: v for k, v in zip(ITEMS, (books, hats, balls)) if v is not None}
    return f"<propose>{json.dumps(fields)}</propose>"


def share(text: str) -> tuple[int, int, int]:
    offer = json.loads(text.split("<propose>")[1].split("</propose>")[0])
    return offer["books"], offer["hats"], offer["balls"]


def texts(env: DealOrNoDeal, role: str) -> str:
    return "\n".join(m.content for m in env.observe(role))


# -- the worked example ------------------------------------------------------------------------------


def test_worked_example():
    """Counts (1, 2, 3); vA = (4, 0, 2), vB = (2, 4, 0); B is the bot."""
    env = fresh()
    env.step({"A": propose(1, 0, 3)})
    assert env.deal_points("B", env.standing) == 8  # 1: B would get 8
    # 2: a_0 = 9 > 8; the smallest own value of at least 9 is 10, and the tie-break gives the balls to A.
    reply = bot(env.view("B"))
    assert reply == f"How about this? {propose(1, 2, 0)}"
    env.step({"B": reply})
    assert env.deal_points("B", env.standing) == 10
    # 3: only one book exists: invalid, and B's proposal stands.
    env.observe("A")
    assert env.validate("A", propose(2, 0, 3)) == (False, "books must be between 0 and 1 (there are 1)")
    env.step({"A": propose(2, 0, 3)})
    assert env.n_invalid["A"] == 1 and env.standing == Standing("B", {"books": 1, "hats": 2, "balls": 0})
    assert "[Referee] Your action was not recorded: books must be between 0 and 1 (there are 1)." in texts(env, "A")
    # 4: a_1 = 8; B cannot accept its own standing proposal, so it proposes its cheapest division worth 8.
    assert env.validate("B", "<accept/>") == (False, "you cannot accept your own proposal")
    reply = bot(env.view("B"))
    assert reply == f"How about this? {propose(0, 2, 0)}"
    env.step({"B": reply})
    # 5: A accepts.
    env.step({"A": "<accept/>"})
    assert env.done and env.end_reason == "deal" and env.messages == 5
    result = env.result()
    assert (result.roles["A"].points, result.roles["A"].outcome) == (10, 1.0)
    assert (result.roles["B"].points, result.roles["B"].outcome) == (8, 0.8)
    assert (result.roles["A"].n_turns, result.roles["A"].n_invalid) == (3, 1)
    assert (result.roles["B"].n_turns, result.roles["B"].n_invalid) == (2, 0)
    assert "[Referee] Deal: B's proposal was accepted; you get 1 book, 0 hats, 3 balls (worth 10 points to you)." in (
        texts(env, "A")
    )


def test_worked_example_terminal_rewards_are_the_outcomes():
    env = fresh()
    rewards = [env.step({r: t}).rewards for r, t in (("A", propose(1, 0, 3)), ("B", "<accept/>"))]
    assert rewards == [{}, {"A": 1.0, "B": 0.8}]


def test_walkaway_and_limit_score_zero():
    env = fresh()
    env.step({"A": propose(1, 0, 3)})
    env.step({"B": "No deal. <walkaway/>"})
    assert env.done and env.end_reason == "walkaway" and env.deal is None
    assert [env.result().roles[r].outcome for r in env.roles] == [0.0, 0.0]
    env = fresh()
    env.step({"A": propose(1, 0, 3)})
    for _ in range(19):
        env.step({env.acting_roles()[0]: "Hmm."})
    assert env.done and env.end_reason == "limit" and env.messages == 20
    assert [env.result().roles[r].points for r in env.roles] == [0, 0]


@pytest.mark.parametrize(("offer", "a", "b"), [((0, 0, 0), 0, 10), ((1, 2, 3), 10, 0), ((0, 1, 2), 4, 6)])
def test_outcome_is_points_over_ten(offer, a, b):
    env = fresh()
    env.step({"A": propose(*offer)})
    env.step({"B": "<accept/>"})
    assert [env.result().roles[r].outcome for r in env.roles] == [a / 10, b / 10]


# -- the bot -----------------------------------------------------------------------------------------


def test_bot_b_proposals_by_aspiration():
    """a_k = max(6, 9 - k): B's cheapest division worth at least a_k, fewest units kept on ties."""
    env = fresh()
    expected = [((1, 2, 0), 10), ((0, 2, 0), 8), ((0, 2, 0), 8), ((1, 1, 0), 6), ((1, 1, 0), 6)]
    for k, (want, worth) in enumerate(expected):
        env.step({"A": "What would you like?"})
        view = env.view("B")
        assert view["own_turn"] == k
        reply = bot(view)
        assert share(reply) == want
        env.step({"B": reply})
        assert env.deal_points("B", env.standing) == worth


def test_bot_in_seat_a_opens_with_everything_it_values():
    env = fresh()
    assert bot(env.view("A")) == f"How about this? {propose(1, 0, 3)}"


def test_bot_accepts_a_standing_proposal_worth_its_aspiration():
    env = fresh()
    env.step({"A": propose(0, 0, 3)})  # B would get the book and both hats: 10
    assert bot(env.view("B")) == "That works for me. <accept/>"
    env = fresh()
    env.step({"A": propose(1, 0, 3)})  # 8 < 9
    assert "<propose>" in bot(env.view("B"))


def test_bot_never_walks_away():
    env = fresh()
    replies = []
    while not env.done:
        if env.acting_roles() == ["A"]:
            env.step({"A": propose(1, 2, 3)})
        else:
            replies.append(bot(env.view("B")))
            env.step({"B": replies[-1]})
    assert env.end_reason == "limit" and len(replies) == 10
    assert all(r.startswith("How about this? <propose>") for r in replies)


def test_bot_against_bot_on_the_example():
    """A opens at 10; B counters at 10; A, now at a_1 = 8, keeps the book and two balls (8), which
    leaves B the hats and a ball: 8, enough for B's a_1 = 8."""
    env = fresh()
    said = []
    while not env.done:
        role = env.acting_roles()[0]
        said.append(bot(env.view(role)))
        env.step({role: said[-1]})
    assert [share(t) if "<propose>" in t else t for t in said] == [
        (1, 0, 3),
        (1, 2, 0),
        (1, 0, 2),
        "That works for me. <accept/>",
    ]
    assert env.end_reason == "deal" and [env.result().roles[r].points for r in env.roles] == [8, 8]


# -- payloads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "offer"),
    [
        ('{"books": 1, "hats": 2, "balls": 3}', (1, 2, 3)),
        ('{"Books": 1, " HAT ": 2, "ball": 3}', (1, 2, 3)),
        ('{"hats": 1}', (0, 1, 0)),
        ("{}", (0, 0, 0)),
        ('{"books": 1.0, "balls": 3.0}', (1, 0, 3)),
    ],
)
def test_valid_payloads(payload, offer):
    env = fresh()
    parsed = env.parse("A", f"Here: <PROPOSE>{payload}</Propose>")
    assert not parsed.invalid and parsed.action.value == dict(zip(ITEMS, offer))


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ('{"hats": 3}', "hats must be between 0 and 2 (there are 2)"),
        ('{"balls": -1}', "balls must be between 0 and 3 (there are 3)"),
        ('{"books": 0.5}', "books must be an integer"),
        ('{"books": "1"}', "books must be an integer"),
        ('{"books": true}', "books must be an integer"),
        ('{"balls": NaN}', "NaN is not allowed in JSON"),
        ('{"shoes": 1}', "unknown key 'shoes' (expected books, hats, balls)"),
        ('{"book": 1, "Books": 0}', "key 'books' appears twice"),
        ("[1, 2, 3]", "the proposal must be a JSON object"),
        ("{books: 1}", "the proposal is not valid JSON"),
    ],
)
def test_invalid_payload_is_a_plain_message(payload, reason):
    env = fresh()
    env.step({"A": propose(1, 0, 3)})
    env.observe("A"), env.observe("B")
    text = f"Try this. <propose>{payload}</propose>"
    ok, why = env.validate("B", text)
    assert not ok and why.startswith(reason)
    env.step({"B": text})
    assert env.standing == Standing("A", {"books": 1, "hats": 0, "balls": 3})
    assert env.n_invalid["B"] == 1 and env.messages == 2 and not env.done
    to_b, to_a = texts(env, "B"), texts(env, "A")
    assert f"[Referee] Your action was not recorded: {reason}" in to_b
    assert f"B: {text}" in to_a and "[Referee]" not in to_a


def test_tags():
    env = fresh()
    assert env.validate("A", "<accept/>") == (False, "there is no proposal to accept")
    assert env.validate("A", "<reject/>") == (False, "there is no proposal to reject")
    assert env.validate("A", '<propose>{"books": 1}') == (False, "the <propose> tag is not closed with </propose>")
    assert env.validate("A", "Shall we talk first?") == (True, "")
    env.step({"A": f"{propose(1, 0, 3)} or maybe <accept/>"})  # the last tag counts
    assert env.n_invalid["A"] == 1 and env.standing is None
    env.step({"B": f"<accept/> no, {propose(1, 2, 0)}"})
    assert env.standing == Standing("B", {"books": 1, "hats": 2, "balls": 0})
    env.step({"A": "I refuse. <REJECT />"})
    assert env.standing is None and not env.done


# -- what each side sees -----------------------------------------------------------------------------


def test_each_side_sees_only_its_own_values():
    env = fresh()
    prompt_a, prompt_b = env.system_prompt("A"), env.system_prompt("B")
    assert "each book is worth 4, each hat is worth 0, each ball is worth 2 points" in prompt_a
    assert "each book is worth 2, each hat is worth 4, each ball is worth 0 points" in prompt_b
    assert "each hat is worth 4" not in prompt_a and "each book is worth 4" not in prompt_b
    for prompt in (prompt_a, prompt_b):
        assert "divide 1 books, 2 hats, 3 balls" in prompt and "at most 20 messages" in prompt
        assert "you do not know how" in prompt and "<walkaway/>" in prompt
    assert env.view("A")["values"] == [4, 0, 2] and env.view("B")["values"] == [2, 4, 0]
    assert env.view("A")["counts"] == env.view("B")["counts"] == [1, 2, 3]
    env.step({"A": propose(0, 1, 2)})
    assert env.describe(env.standing, "A") == "you get 0 books, 1 hat, 2 balls (worth 4 points to you)"
    assert env.describe(env.standing, "B") == "you get 1 book, 1 hat, 1 ball (worth 6 points to you)"
    assert "A's proposal stands: you get 1 book, 1 hat, 1 ball (worth 6 points to you). Messages left: 19." in (
        texts(env, "B")
    )


# -- kernels -----------------------------------------------------------------------------------------


def spec_kernel(rng: random.Random) -> dict[str, Any]:
    """environments.md 7, read independently of the implementation."""
    while True:
        counts = [rng.randint(1, 4) for _ in range(3)]
        if sum(counts) in (5, 6, 7):
            break
    vectors = sorted(v for v in itertools.product(range(11), repeat=3) if sum(map(int.__mul__, counts, v)) == 10)
    while True:
        a, b = rng.choice(vectors), rng.choice(vectors)
        if all(x or y for x, y in zip(a, b)) and any(x and y for x, y in zip(a, b)):
            return {"items": list(ITEMS), "counts": counts, "values": {"A": list(a), "B": list(b)}}


def test_shipped_kernels_follow_the_spec_draw_order_with_retries():
    seen: set[str] = set()
    for split in SPLITS:  # generated in this order, each redrawing what any earlier split holds
        for i, k in enumerate(load_kernels("deal-or-no-deal", split)):
            seed, r = derive("repertory", "deal-or-no-deal", split, i), 0
            while canonical_json(data := spec_kernel(random.Random(seed))) in seen:
                r += 1
                seed = derive("repertory", "deal-or-no-deal", split, i, "retry", r)
            seen.add(canonical_json(data))
            assert (k.seed, k.data) == (seed, data), k.id


def test_shipped_kernels_keep_the_dataset_rules():
    kernels = [k for split in SPLITS for k in load_kernels("deal-or-no-deal", split)]
    for k in kernels:
        counts, values = k.data["counts"], k.data["values"]
        assert all(1 <= c <= 4 for c in counts) and sum(counts) in (5, 6, 7)
        for v in values.values():
            assert sum(c * x for c, x in zip(counts, v)) == 10
        assert all(a or b for a, b in zip(values["A"], values["B"]))
        assert any(a and b for a, b in zip(values["A"], values["B"]))
    assert {sum(k.data["counts"]) for k in kernels} == {5, 6, 7}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"counts": [1, 1, 1]}, "the item counts must total 5, 6 or 7"),
        ({"counts": [5, 1, 1]}, "counts must be three integers in 1..4"),
        ({"values": {"A": [4, 0, 2], "B": [2, 4, 1]}}, "B's items must be worth 10 in total"),
        ({"values": {"A": [4, 0, -1], "B": [2, 4, 0]}}, "A's values must be three non-negative integers"),
        ({"values": {"A": [10, 0, 0], "B": [0, 5, 0]}}, "some item is worthless to both sides"),
        ({"items": ["hats", "books", "balls"]}, "items must be"),
        ({"values": {"A": [4, 0, 2]}}, "a kernel needs items, counts and values for A and B"),
    ],
)
def test_validator_catches_broken_kernels(change, problem):
    assert DealOrNoDeal.validate_kernel(EXAMPLE) == []
    problems = DealOrNoDeal.validate_kernel({**EXAMPLE, **change})
    assert any(p.startswith(problem) for p in problems), problems
