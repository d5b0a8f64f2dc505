"""Ultimatum with counter-offers (environments.md 6): worked examples, bots, payloads, guard and kernels."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Any

import pytest

from repertory.envs import load_kernels, make
from repertory.envs.ultimatum import MIN_SHARES, POOLS, STORIES, UNITS, Ultimatum, bot, minimum_of
from repertory.types import SPLITS, Action, Kernel


def kernel(pool: int = 100, min_share: float = 0.4, minimum: int | None = None, **changes: Any) -> Kernel:
    data = {
        "pool": pool,
        "unit": "dollars",
        "story": "the proceeds of a joint yard sale",
        "min_share": min_share,
        "minimum": minimum_of(pool, min_share) if minimum is None else minimum,
        **changes,
    }
    return Kernel("ultimatum/train/000", "ultimatum", "train", 0, 0, data)


def started(k: Kernel | None = None) -> Ultimatum:
    env = make("ultimatum")
    assert isinstance(env, Ultimatum)
    env.reset(k or kernel(), 0)
    for role in env.roles:
        env.observe(role)
    return env


def keep(x: Any) -> str:
    return f'<propose>{{"keep": {x}}}</propose>'


def says(env: Ultimatum, role: str, text: str) -> None:
    assert env.acting_roles() == [role]
    env.step({role: text})


def responder_bot(env: Ultimatum) -> str:
    text = bot(env.view("responder"))
    env.step({"responder": text})
    return text


def texts(env: Ultimatum, role: str) -> str:
    return "\n".join(m.content for m in env.observe(role))


def outcomes(env: Ultimatum) -> dict[str, float]:
    return {r: env.result().roles[r].outcome for r in env.roles}


# -- worked examples --------------------------------------------------------------------------


def test_worked_example_a():
    env = started()
    says(env, "proposer", keep(70))
    assert responder_bot(env).endswith(keep(50))
    says(env, "proposer", keep(58))
    assert responder_bot(env) == "That works for me. <accept/>"
    assert env.done and env.end_reason == "deal"
    result = env.result()
    assert (result.roles["proposer"].points, result.roles["responder"].points) == (58, 42)
    assert outcomes(env) == {"proposer": 1.0, "responder": pytest.approx(0.84)}


def test_worked_example_b():
    env = started()
    for proposer_keep, reply in ((70, keep(50)), (65, keep(50)), (65, "<reject/>")):
        says(env, "proposer", keep(proposer_keep))
        assert responder_bot(env).endswith(reply)
    assert env.done and env.end_reason == "rejected" and env.messages == 6
    assert outcomes(env) == {"proposer": 0.0, "responder": 0.0}
    assert "the pool is destroyed" in texts(env, "proposer")


def test_worked_example_c():
    env = started()
    says(env, "proposer", keep(45))
    assert responder_bot(env) == "That works for me. <accept/>"
    assert outcomes(env) == {"proposer": pytest.approx(0.9), "responder": 1.0}


# -- rules ------------------------------------------------------------------------------------


def test_limit_of_six_messages_destroys_the_pool():
    env = started()
    for i in range(6):
        says(env, env.roles[i % 2], keep(60 - i))
    assert env.done and env.end_reason == "limit" and env.deal is None
    assert outcomes(env) == {"proposer": 0.0, "responder": 0.0}


def test_reject_ends_the_game_from_either_side():
    env = started()
    says(env, "proposer", keep(90))
    says(env, "responder", "<reject/>")
    assert env.done and env.end_reason == "rejected" and env.messages == 2

    env = started()
    says(env, "proposer", keep(60))
    says(env, "responder", keep(80))
    says(env, "proposer", "Not a chance. <REJECT />")
    assert env.done and env.end_reason == "rejected"
    assert outcomes(env) == {"proposer": 0.0, "responder": 0.0}


def test_reject_is_only_valid_against_the_other_sides_proposal():
    env = started()
    assert env.parse("proposer", "<reject/>").error == "there is no proposal to reject"
    says(env, "proposer", keep(60))
    says(env, "responder", "Let me think.")
    says(env, "proposer", "Well? <reject/>")
    assert not env.done and env.n_invalid["proposer"] == 1
    assert "[Referee] Your action was not recorded: you cannot reject your own proposal." in texts(env, "proposer")
    assert env.standing is not None and env.standing.offer == {"keep": 60}


def test_walkaway_is_plain_text():
    env = started()
    says(env, "proposer", keep(60))
    parsed = env.parse("responder", "I am leaving. <walkaway/>")
    assert parsed.action == Action("message", "I am leaving. <walkaway/>") and not parsed.invalid
    says(env, "responder", "I am leaving. <walkaway/>")
    assert not env.done and env.n_invalid["responder"] == 0
    assert env.standing.by == "proposer"
    # A trailing walkaway does not hide an earlier action tag: the accept is still the last one.
    assert env.parse("responder", "<accept/> <walkaway/>").action == Action("accept")


def test_counter_offer_replaces_the_standing_proposal():
    env = started()
    says(env, "proposer", keep(70))
    says(env, "responder", keep(55))
    assert env.standing.by == "responder" and env.standing.offer == {"keep": 55}
    assert "Responder's proposal stands: you get 45 dollars and the responder gets 55 dollars." in texts(
        env, "proposer"
    )
    says(env, "proposer", "<accept/>")
    result = env.result()
    assert (result.roles["proposer"].points, result.roles["responder"].points) == (45, 55)
    assert outcomes(env) == {"proposer": pytest.approx(0.9), "responder": 1.0}


@pytest.mark.parametrize(("x", "proposer", "responder"), [(0, 0.0, 1.0), (100, 1.0, 0.0), (50, 1.0, 1.0)])
def test_outcome_edges(x, proposer, responder):
    env = started()
    says(env, "proposer", keep(x))
    says(env, "responder", "<accept/>")
    assert outcomes(env) == {"proposer": proposer, "responder": responder}


# -- payloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "value"),
    [
        ('{"keep": 60}', 60),
        ('{"Keeps": 60}', 60),
        ('{" KEEP ": 60}', 60),
        ('{"keep": 60.0}', 60),
        ('{"keep": 0}', 0),
        ('{"keep": 100}', 100),
    ],
)
def test_valid_keep(payload, value):
    env = started()
    assert env.parse("proposer", f"<Propose>{payload}</PROPOSE>").action == Action("propose", {"keep": value})


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ('{"keep": 101}', "keep must be between 0 and 100 (the pool)"),
        ('{"keep": -1}', "keep must be between 0 and 100 (the pool)"),
        ('{"keep": 60.5}', "keep must be an integer"),
        ('{"keep": "60"}', "keep must be an integer"),
        ('{"keep": false}', "keep must be an integer"),
        ('{"keep": 1e400}', "keep must be an integer"),
        ("{}", "missing key 'keep'"),
        ('{"share": 40}', "unknown key 'share' (expected keep)"),
        ('{"keep": 60, "give": 40}', "unknown key 'give' (expected keep)"),
        ('{"keep": 60, "keeps": 60}', "key 'keep' appears twice"),
        ('"60"', "the proposal must be a JSON object"),
    ],
)
def test_invalid_keep(payload, reason):
    env = started()
    says(env, "proposer", keep(70))
    says(env, "responder", f"No. <propose>{payload}</propose>")
    responder_sees, proposer_sees = texts(env, "responder"), texts(env, "proposer")
    assert f"[Referee] Your action was not recorded: {reason}." in responder_sees
    assert f"responder: No. <propose>{payload}</propose>" in proposer_sees and "[Referee]" not in proposer_sees
    assert env.standing.by == "proposer" and env.standing.offer == {"keep": 70}
    assert env.n_invalid == {"proposer": 0, "responder": 1} and env.messages == 2


def test_pool_bounds_follow_the_kernel():
    env = started(kernel(10, 0.3))
    assert env.parse("proposer", keep(10)).action == Action("propose", {"keep": 10})
    assert env.parse("proposer", keep(11)).error == "keep must be between 0 and 10 (the pool)"


# -- bots -------------------------------------------------------------------------------------


def view(role: str, own_turn: int, standing: dict[str, Any] | None, last_turn: bool = False, **kw: Any):
    private = {"pool": 100, "minimum": 40} if role == "responder" else {"pool": 100}
    return {"role": role, "own_turn": own_turn, "standing": standing, "last_turn": last_turn, **private, **kw}


def offer(x: int, own: bool) -> dict[str, Any]:
    return {"by": "x", "offer": {"keep": x}, "own": own}


def test_responder_bot():
    assert bot(view("responder", 0, offer(60, False))) == "That works for me. <accept/>"
    assert bot(view("responder", 0, offer(61, False))) == f"I propose to keep 50. {keep(50)}"
    assert bot(view("responder", 2, offer(61, False), True)) == "That is not enough for me. <reject/>"
    assert bot(view("responder", 2, offer(60, False), True)) == "That works for me. <accept/>"
    # Nothing of the proposer's to reject on the last turn: it counters instead of an invalid reject.
    assert bot(view("responder", 2, offer(50, True), True)).endswith(keep(50))
    assert bot(view("responder", 0, None)).endswith(keep(50))
    odd = view("responder", 0, offer(8, False), pool=15, minimum=8)  # ceil(15/2) = 8
    assert bot(odd).endswith(keep(8))


def test_proposer_bot():
    assert bot(view("proposer", 0, None)) == f"I propose to keep 60. {keep(60)}"
    assert bot(view("proposer", 1, offer(60, False))) == "That works for me. <accept/>"
    assert bot(view("proposer", 1, offer(61, False))) == f"I propose to keep 50. {keep(50)}"
    assert bot(view("proposer", 2, offer(40, True))).endswith(keep(50))
    # rnd of exact values: 0.6*10 = 6, 0.4*10 = 4, 0.5*10 = 5; 0.6*1000 = 600.
    assert bot(view("proposer", 0, None, pool=10)).endswith(keep(6))
    assert bot(view("proposer", 1, offer(6, False), pool=10)) == "That works for me. <accept/>"
    assert bot(view("proposer", 1, offer(7, False), pool=10)).endswith(keep(5))
    assert bot(view("proposer", 0, None, pool=1000)).endswith(keep(600))


@pytest.mark.parametrize(("min_share", "messages", "split"), [(0.4, 2, (60, 40)), (0.5, 3, (50, 50))])
def test_bot_against_bot(min_share, messages, split):
    env = started(kernel(100, min_share))
    while not env.done:
        (role,) = env.acting_roles()
        env.step({role: bot(env.view(role))})
    assert env.end_reason == "deal" and env.messages == messages
    result = env.result()
    assert (result.roles["proposer"].points, result.roles["responder"].points) == split


# -- guard ------------------------------------------------------------------------------------


def test_guard_protects_the_responder_minimum():
    env = started()
    assert env.guard("responder", f"I keep {keep(40)}") is None
    assert env.guard("responder", f"I keep {keep(39)}") == "I keep"
    assert env.guard("responder", f"{keep(50)} no, {keep(30)}") == "no,"  # every tag goes
    assert env.guard("responder", "<walkaway/>") is None
    assert env.guard("proposer", keep(100)) is None

    says(env, "proposer", keep(61))
    assert env.guard("responder", "OK <accept/>") == "OK"
    assert env.guard("responder", "<reject/>") is None
    says(env, "responder", keep(50))
    says(env, "proposer", keep(60))
    assert env.guard("responder", "OK <accept/>") is None


def test_guard_limit_text():
    assert Ultimatum.guarded_limit == "the responder's minimum share"


# -- views and prompts ------------------------------------------------------------------------


def test_private_information():
    env = started(kernel(100, 0.3))
    proposer, responder = env.system_prompt("proposer"), env.system_prompt("responder")
    assert "Your private minimum is 30 dollars" in responder
    assert "30" not in proposer and "minimum" in proposer and "you do not know it" in proposer
    for prompt in (proposer, responder):
        assert "100 dollars, the proceeds of a joint yard sale" in prompt
        assert "at most 6 messages" in prompt and "<accept/>" in prompt and "<reject/>" in prompt
        assert "walkaway" not in prompt
    assert '<propose>{"keep": 60}</propose>' in proposer
    assert env.view("proposer")["pool"] == 100 and "minimum" not in env.view("proposer")
    assert env.view("responder")["minimum"] == 30


# -- kernels ----------------------------------------------------------------------------------


class Recorder(random.Random):
    """Logs the public draw calls of the generator."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.calls: list[str] = []

    def choice(self, seq):
        self.calls.append("choice")
        return super().choice(seq)


def test_generator_draw_order():
    rng = Recorder(3)
    data = Ultimatum.generate_kernel(rng)
    assert rng.calls == ["choice"] * 4
    replay = random.Random(3)
    pool = replay.choice([10, 20, 30, 50, 100, 200, 500, 1000])
    unit = replay.choice(["dollars", "euros", "gold coins", "points", "credits"])
    story = replay.choice(STORIES)
    min_share = replay.choice([0.2, 0.3, 0.4, 0.5])
    assert data == {"pool": pool, "unit": unit, "story": story, "min_share": min_share, "minimum": data["minimum"]}
    assert data["minimum"] == math.ceil(Fraction(round(min_share * 10), 10) * pool)


def test_minimum_uses_the_decimal_share():
    # Fraction(0.2) is a hair above 1/5, so ceil(Fraction(0.2) * 10) would be 3, not 2.
    assert math.ceil(Fraction(0.2) * 10) == 3
    assert minimum_of(10, 0.2) == 2
    assert [minimum_of(30, s) for s in MIN_SHARES] == [6, 9, 12, 15]
    assert all(minimum_of(p, s) == p * round(s * 10) // 10 for p in POOLS for s in MIN_SHARES)


def test_shipped_kernels():
    kernels = [k for split in SPLITS for k in load_kernels("ultimatum", split)]
    assert len({(k.data["pool"], k.data["unit"], k.data["story"], k.data["min_share"]) for k in kernels}) == 300
    assert {k.data["pool"] for k in kernels} == set(POOLS)
    assert {k.data["unit"] for k in kernels} == set(UNITS)
    assert {k.data["min_share"] for k in kernels} == set(MIN_SHARES)
    assert all(k.data["minimum"] == minimum_of(k.data["pool"], k.data["min_share"]) for k in kernels)


def test_validator_catches_broken_kernels():
    assert Ultimatum.validate_kernel(kernel().data) == []
    assert Ultimatum.validate_kernel({}) == ["a kernel needs pool, unit, story, min_share and minimum"]
    cases = {
        "pool must be": kernel(pool=40, minimum=16),
        "minimum must be": kernel(minimum=41),
        "min_share must be": kernel(min_share=0.25, minimum=25),
        "unit must be": kernel(unit="yen"),
        "story is not": kernel(story="a lottery win"),
    }
    for needle, k in cases.items():
        problems = Ultimatum.validate_kernel(k.data)
        assert problems and any(needle in p for p in problems), (needle, problems)
    assert Ultimatum.validate_kernel({**kernel().data, "pool": 100.0}) == ["pool must be one of " + str(POOLS)]
    assert Ultimatum.validate_kernel({**kernel().data, "min_share": "0.4"}) == [
        "min_share must be one of " + str(MIN_SHARES)
    ]
    assert Ultimatum.validate_kernel({**kernel().data, "minimum": 40.0}) != []
