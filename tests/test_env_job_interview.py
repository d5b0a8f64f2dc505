"""Job Interview (environments.md 9): the worked example to 1e-9, the aspiration bot against a
brute-force reading of 1.6, payload checks, and kernel generation in the JI draw order."""

from __future__ import annotations

import copy
import json
import random
from fractions import Fraction
from typing import Any

import pytest

from repertory.envs import make
from repertory.envs.job_interview import (
    COMPANIES,
    POSITIONS,
    WORKPLACES,
    JobInterview,
    bot,
    contract_values,
    contracts,
    minmax,
    score,
)
from repertory.envs.negotiation import BotOption, Standing, aspiration_reply
from repertory.types import Kernel, derive

R, W = "recruiter", "worker"
TOL = 1e-9

WORKED: dict[str, Any] = {
    "issues": ["salary", "holidays", "workplace", "company", "position"],
    "workplaces": list(WORKPLACES),
    "companies": list(COMPANIES),
    "positions": list(POSITIONS),
    "weights": {R: [0.30, 0.20, 0.10, 0.15, 0.25], W: [0.35, 0.25, 0.10, 0.10, 0.20]},
    "workplace_values": {R: [1.0, 0.6, 0.0, 0.3], W: [0.5, 1.0, 0.2, 0.0]},
    "company_values": {R: [0.0, 1.0, 0.5, 0.2], W: [1.0, 0.4, 0.0, 0.7]},
    "position_values": {
        R: [[1.0, 0.0, 0.6, 0.3], [0.8, 1.0, 0.0, 0.5], [0.0, 0.4, 1.0, 0.7], [0.5, 1.0, 0.2, 0.0]],
        W: [[0.2, 1.0, 0.0, 0.5], [1.0, 0.3, 0.0, 0.6], [0.6, 0.0, 1.0, 0.4], [0.0, 0.7, 1.0, 0.9]],
    },
}


def fresh(data: dict[str, Any] | None = None) -> JobInterview:
    env = make("job-interview")
    assert isinstance(env, JobInterview)
    env.reset(Kernel("job-interview/train/000", "job-interview", "train", 0, 0, copy.deepcopy(data or WORKED)), 0)
    return env


def contract(s: Any, h: Any, wp: Any, co: Any, pos: Any) -> dict[str, Any]:
    return {"salary": s, "holidays": h, "workplace": wp, "company": co, "position": pos}


def propose(*terms: Any) -> str:
    return f"<propose>{json.dumps(contract(*terms))}</propose>"


def scores(env: JobInterview) -> tuple[float, float]:
    assert env.standing is not None
    return env.deal_points(R, env.standing), env.deal_points(W, env.standing)


# -- the worked example ----------------------------------------------------------------------------


def test_worked_example() -> None:
    env = fresh()
    env.step({R: propose(32, 2, "Tokyo", "Brightloom", "Manager")})
    assert scores(env) == pytest.approx((0.88, 0.29), abs=TOL)
    env.step({W: propose(45, 5, "Seoul", "Brightloom", "Engineer")})
    assert scores(env) == pytest.approx((0.51, 983 / 1200), abs=TOL)
    assert round(scores(env)[1], 10) == 0.8191666667
    env.step({R: propose(38, 3, "Tokyo", "Brightloom", "Engineer")})
    assert scores(env) == pytest.approx((0.72, 0.5625), abs=TOL)
    env.step({W: "<accept/>"})
    assert env.done and env.end_reason == "deal"
    result = env.result()
    assert result.roles[R].outcome == pytest.approx(0.72, abs=TOL)
    assert result.roles[W].outcome == pytest.approx(0.5625, abs=TOL)
    assert result.roles[R].points == pytest.approx(0.72, abs=TOL)
    assert (result.roles[R].n_turns, result.roles[W].n_turns) == (2, 2)


def test_scores_are_float64_left_to_right() -> None:
    env = fresh()
    env.step({R: propose(45, 5, "Seoul", "Brightloom", "Engineer")})
    expected = 0.35 * (45 - 20) / 30 + 0.25 * (5 - 2) / 4 + 0.10 * 1.0 + 0.10 * 0.4 + 0.20 * 1.0
    assert env.deal_points(W, env.standing) == expected
    env.step({W: "<accept/>"})
    assert env.result().roles[W].points == expected and env.outcome(W) == expected


def test_walkaway_and_timeout_score_zero() -> None:
    env = fresh()
    env.step({R: propose(45, 5, "Seoul", "Brightloom", "Engineer")})
    env.step({W: "<walkaway/>"})
    assert env.end_reason == "walkaway"
    assert [env.result().roles[r].outcome for r in (R, W)] == [0.0, 0.0]
    env = fresh()
    for _ in range(20):
        env.step({env.acting_roles()[0]: "Hello."})
    assert env.end_reason == "limit"
    assert [env.result().roles[r].points for r in (R, W)] == [0.0, 0.0]


# -- the bot -------------------------------------------------------------------------------------------


def brute_force(view: dict[str, Any]) -> str:
    """1.6 read literally: every contract scored with score(), handed to aspiration_reply."""
    recruiter = view["role"] == R
    options: list[BotOption] = []
    for offer, (s, h, wp, co, pos) in contracts():
        value = score(
            recruiter,
            view["weights"],
            view["workplace_values"][wp],
            view["company_values"][co],
            view["position_values"][co][pos],
            s,
            h,
        )
        options.append((offer, value, 0, (s, h, wp, co, pos)))

    def standing_value(standing: dict[str, Any]) -> float:
        return next(v for o, v, _, _ in options if o == standing["offer"])

    return aspiration_reply(view, options, standing_value, Fraction("0.90"), Fraction("0.08"), Fraction("0.50"))


def test_contract_values_match_score_bit_for_bit() -> None:
    env = fresh()
    assert len(contracts()) == 9920
    assert [enc for _, enc in contracts()] == sorted(enc for _, enc in contracts())
    for role in (R, W):
        view = env.view(role)
        frozen = (
            role == R,
            tuple(view["weights"]),
            tuple(view["workplace_values"]),
            tuple(view["company_values"]),
            tuple(map(tuple, view["position_values"])),
        )
        values = contract_values(*frozen)
        for (offer, _), value in zip(contracts(), values):
            assert value == env.deal_points(role, Standing(R, offer))


def test_bot_matches_brute_force_aspiration_over_all_contracts() -> None:
    env = fresh()
    replies = []
    for _ in range(16):
        (role,) = env.acting_roles()
        view = env.view(role)
        reply = bot(view)
        assert reply == brute_force(view)
        replies.append(reply)
        env.step({role: reply})
        if env.done:
            break
    first = json.loads(replies[0].split("<propose>")[1].split("</propose>")[0])
    assert env.deal_points(R, Standing(R, first)) >= 0.9
    assert env.done and env.end_reason == "deal" and env.messages == 11
    assert (env.outcome(R), env.outcome(W)) == pytest.approx((0.575, 0.58), abs=TOL)


def test_bot_worker_first_proposal_is_the_cheapest_at_0_90() -> None:
    env = fresh()
    env.step({R: propose(32, 2, "Tokyo", "Brightloom", "Manager")})
    reply = bot(env.view(W))
    offer = json.loads(reply.split("<propose>")[1].split("</propose>")[0])
    value = env.deal_points(W, Standing(W, offer))
    assert value >= 0.9
    all_values = [env.deal_points(W, Standing(W, o)) for o, _ in contracts()]
    assert value == min(v for v in all_values if v >= Fraction("0.9"))


def test_bot_accepts_when_the_standing_offer_reaches_its_aspiration() -> None:
    env = fresh()
    env.step({R: propose(50, 6, "Seoul", "Altavia", "Manager")})  # worth exactly 1.0 to the worker
    assert bot(env.view(W)) == "That works for me. <accept/>"
    env = fresh()
    env.step({R: propose(38, 3, "Tokyo", "Brightloom", "Engineer")})  # 0.5625 < 0.90
    assert "<propose>" in bot(env.view(W))


def test_bot_never_walks_away() -> None:
    env = fresh()
    for _ in range(9):
        env.step({R: "No."})
        env.step({W: bot(env.view(W))})
    env.step({R: propose(20, 2, "Sydney", "Kestrel", "Engineer")})
    view = env.view(W)
    assert view["last_turn"] and "<propose>" in bot(view)


# -- payloads -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ({"salary": 30, "holidays": 3, "workplace": "Tokyo", "company": "Kestrel"}, "missing key 'position'"),
        ({**contract(30, 3, "Tokyo", "Kestrel", "Sales"), "bonus": 5}, "unknown key 'bonus'"),
        (contract(19, 3, "Tokyo", "Kestrel", "Sales"), "salary must be between 20 and 50"),
        (contract(51, 3, "Tokyo", "Kestrel", "Sales"), "salary must be between 20 and 50"),
        (contract(30, 7, "Tokyo", "Kestrel", "Sales"), "holidays must be between 2 and 6"),
        (contract(30, 1, "Tokyo", "Kestrel", "Sales"), "holidays must be between 2 and 6"),
        (contract(30.5, 3, "Tokyo", "Kestrel", "Sales"), "salary must be an integer"),
        (contract("30", 3, "Tokyo", "Kestrel", "Sales"), "salary must be an integer"),
        (contract(30, 3, "Paris", "Kestrel", "Sales"), "workplace must be one of Tokyo, Seoul, Beijing, Sydney"),
        (contract(30, 3, 0, "Kestrel", "Sales"), "workplace must be one of"),
        (contract(30, 3, "Tokyo", "Google", "Sales"), "company must be one of Altavia, Brightloom, Kestrel, Solvane"),
        (contract(30, 3, "Tokyo", "Kestrel", "CEO"), "position must be one of Engineer, Manager, Designer, Sales"),
    ],
)
def test_invalid_payload_is_a_plain_message(payload: dict[str, Any], reason: str) -> None:
    env = fresh()
    env.step({R: propose(32, 2, "Tokyo", "Brightloom", "Manager")})
    env.observe(R)
    env.observe(W)
    text = f"Counter-offer: <propose>{json.dumps(payload)}</propose>"
    assert env.validate(W, text)[0] is False
    env.step({W: text})
    assert env.standing == Standing(R, contract(32, 2, "Tokyo", "Brightloom", "Manager"))
    assert env.n_invalid[W] == 1 and env.messages == 2
    to_w = "\n".join(m.content for m in env.observe(W))
    to_r = "\n".join(m.content for m in env.observe(R))
    assert f"[Referee] Your action was not recorded: {reason}" in to_w
    assert f"worker: {text}" in to_r and "[Referee]" not in to_r


def test_payload_normalisation() -> None:
    env = fresh()
    text = (
        '<propose>{"Salary": 30.0, " HOLIDAY ": 4, "workplaces": " tokyo ", "Company": "KESTREL", "position": "sales"}'
    )
    env.step({R: text + "</propose>"})
    assert env.n_invalid[R] == 0
    assert env.standing == Standing(R, contract(30, 4, "Tokyo", "Kestrel", "Sales"))
    assert env.describe(env.standing, R) == (
        "salary 30 thousand per year, 4 holidays per week, Tokyo, Kestrel, Sales (score 0.65 for you)"
    )


def test_no_partner_guard() -> None:
    env = fresh()
    env.step({R: propose(20, 2, "Sydney", "Kestrel", "Manager")})  # worth 0 to the worker
    assert env.guard(W, "<accept/>") is None


# -- prompts and kernels -------------------------------------------------------------------------------


def test_prompt_holds_only_own_tables() -> None:
    env = fresh()
    prompt = env.system_prompt(W)
    assert "- salary: 0.35 x (salary - 20) / 30" in prompt
    assert "- holidays: 0.25 x (holidays - 2) / 4" in prompt
    assert "Tokyo 0.5, Seoul 1, Beijing 0.2, Sydney 0" in prompt
    assert "at Solvane: Engineer 0, Manager 0.7, Designer 1, Sales 0.9" in prompt
    assert "0.3 x (50 - salary)" not in prompt and "Tokyo 1, Seoul 0.6" not in prompt
    assert "- salary: 0.3 x (50 - salary) / 30" in env.system_prompt(R)
    assert env.private_view(W)["weights"] == WORKED["weights"][W]


def test_minmax() -> None:
    assert minmax([2.0, 4.0, 3.0, 6.0]) == [0.0, 0.5, 0.25, 1.0]
    assert minmax([0.3, 0.3, 0.3, 0.3]) == [0.5] * 4


def test_generate_kernel_follows_the_ji_draw_order() -> None:
    seed = derive("repertory", "job-interview", "train", 5)
    data = JobInterview.generate_kernel(random.Random(seed))
    rng = random.Random(seed)
    for role in (R, W):
        w = [rng.random() for _ in range(5)]
        total = w[0] + w[1] + w[2] + w[3] + w[4]
        assert data["weights"][role] == [0.1 + 0.5 * x / total for x in w]
        assert data["workplace_values"][role] == minmax([rng.random() for _ in range(4)])
        assert data["company_values"][role] == minmax([rng.random() for _ in range(4)])
        base = minmax([rng.random() for _ in range(4)])
        for row in data["position_values"][role]:
            assert row == minmax([b + rng.uniform(0, 0.5) for b in base])
    assert rng.getstate() == _after_draws(seed, 66)
    assert JobInterview.validate_kernel(data) == []


def _after_draws(seed: int, n: int) -> object:
    rng = random.Random(seed)
    for _ in range(n):
        rng.random()
    return rng.getstate()


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def mutate(d: dict[str, Any]) -> None:
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (_set(("weights", R), [0.3, 0.2, 0.1, 0.15, 0.3]), "recruiter's weights must sum to 1"),
        (_set(("weights", W), [0.05, 0.35, 0.2, 0.2, 0.2]), "worker's weights must lie in [0.1, 0.6]"),
        (_set(("weights", W), [0.35, 0.25, 0.1, 0.3]), "worker's weights must be a list of 5 numbers"),
        (_set(("weights", R, 0), True), "recruiter's weights must lie"),
        (_set(("workplace_values", R), [0.9, 0.6, 0.0, 0.3]), "recruiter's workplace values must be min-max"),
        (_set(("company_values", W, 0), 1.5), "worker's company values must hold numbers in [0, 1]"),
        (_set(("position_values", W, 3), [0.0, 1.0]), "worker's position values at Solvane must be a list of 4"),
        (_set(("position_values", R), [[0.0, 1.0, 0.5, 0.5]]), "recruiter's position values need one row"),
        (_set(("companies",), ["Google", "Brightloom", "Kestrel", "Solvane"]), "companies must be"),
        (_set(("weights",), {R: WORKED["weights"][R]}), "a kernel needs"),
        (_set(("company_values", R), None), "recruiter's company values must be a list"),
    ],
)
def test_validate_kernel_catches_problems(mutate: Any, problem: str) -> None:
    data = copy.deepcopy(WORKED)
    assert JobInterview.validate_kernel(data) == []
    mutate(data)
    problems = JobInterview.validate_kernel(data)
    assert any(p.startswith(problem) for p in problems), problems


def test_validate_kernel_accepts_flat_tables() -> None:
    data = copy.deepcopy(WORKED)
    data["company_values"][W] = [0.5] * 4
    assert JobInterview.validate_kernel(data) == []
