"""Alliance (environments.md 10): worked example, bot, payloads, guard, kernel generation."""

from __future__ import annotations

import copy
import itertools
import math
import random
from fractions import Fraction

import pytest

from repertory.envs import load_kernels, make
from repertory.envs.alliance import (
    FAILED_ACCEPT,
    Alliance,
    _ranked_scores,
    best_deal,
    bot,
    deals,
    largest_remainder,
)
from repertory.types import SPLITS, Kernel, derive

U_SCORES = [[30, 18, 0], [0, 12, 20], [25, 20, 10, 0], [0, 15, 5], [10, 6, 0]]
C_SCORES = [[0, 14, 25], [0, 10, 20], [0, 15, 30, 20], [10, 5, 0], [0, 8, 15]]
EXAMPLE = {
    "n_options": [3, 3, 4, 3, 3],
    "types": ["dist", "compat", "integ", "integ", "dist"],
    "orders": {
        "University": [[0, 1, 2], [2, 1, 0], [0, 1, 2, 3], [1, 2, 0], [0, 1, 2]],
        "Company": [[2, 1, 0], [2, 1, 0], [2, 3, 1, 0], [0, 1, 2], [2, 1, 0]],
    },
    "scores": {"University": U_SCORES, "Company": C_SCORES},
    "best_deal": [1, 2, 2, 1, 1],
    "minimums": {"University": 55, "Company": 50},
}
NOTICE = f"[Referee] No agreement was formed: {FAILED_ACCEPT}."


def propose(a: str, b: str, c: str, d: str, e: str) -> str:
    return f'<propose>{{"A": "{a}", "B": "{b}", "C": "{c}", "D": "{d}", "E": "{e}"}}</propose>'


def example_env(data: dict | None = None) -> Alliance:
    env = make("alliance")
    assert isinstance(env, Alliance)
    env.reset(Kernel("alliance/test/000", "alliance", "test", 0, 0, data or EXAMPLE), 0)
    for role in env.roles:
        env.observe(role)
    return env


def tables(data: dict) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(tuple(row) for row in data["scores"][r]) for r in ("University", "Company"))


# -- the worked example --------------------------------------------------------------------------


def test_example_kernel_is_valid_with_324_deals_64_feasible():
    assert Alliance.validate_kernel(EXAMPLE) == []
    for role in ("University", "Company"):
        assert sum(max(row) for row in EXAMPLE["scores"][role]) == 100
    all_deals = deals(*tables(EXAMPLE))
    assert len(all_deals) == 324
    assert sum(u >= 55 and c >= 50 for _, u, c in all_deals) == 64
    assert best_deal(*tables(EXAMPLE)) == ((1, 2, 2, 1, 1), 69, 77)


def test_worked_example_transcript():
    env = example_env()
    env.step({"University": "Here is my plan. " + propose("A1", "B3", "C1", "D2", "E1")})
    assert env.standing is not None and env.standing.by == "University"
    assert (env.deal_points("University", env.standing), env.deal_points("Company", env.standing)) == (100, 25)
    assert "A1 B3 C1 D2 E1, worth 25 points to you" in env.observe("Company")[-1].content

    env.step({"Company": "<accept/>"})
    assert not env.done and env.standing is None
    for role in env.roles:
        assert NOTICE in env.observe(role)[-1].content
    assert env.n_invalid == {"University": 0, "Company": 0}

    env.step({"University": propose("A2", "B3", "C2", "D2", "E2")})
    assert (env.deal_points("University", env.standing), env.deal_points("Company", env.standing)) == (79, 62)
    env.step({"Company": "That works. <accept/>"})
    assert env.done and env.end_reason == "deal"
    result = env.result()
    assert (result.roles["University"].points, result.roles["University"].outcome) == (79.0, 0.79)
    assert (result.roles["Company"].points, result.roles["Company"].outcome) == (62.0, 0.62)
    assert result.roles["Company"].n_invalid == 0
    metrics = env.metrics()
    assert metrics["failed_accepts"] == 1.0
    assert metrics["product_vs_best"] == pytest.approx(79 * 62 / (69 * 77))


def test_failed_accept_then_no_accept_possible():
    env = example_env()
    env.step({"University": propose("A1", "B3", "C1", "D2", "E1")})
    env.step({"Company": "<accept/>"})
    env.step({"University": "Let us keep talking."})
    assert env.validate("Company", "<accept/>") == (False, "there is no proposal to accept")


def test_limit_and_walkaway_score_zero():
    env = example_env()
    for _ in range(20):
        env.step({env.speaker(): "Still thinking."})
    assert env.done and env.end_reason == "limit"
    assert [env.result().roles[r].outcome for r in env.roles] == [0.0, 0.0]
    env = example_env()
    env.step({"University": propose("A2", "B3", "C2", "D2", "E2")})
    env.step({"Company": "<walkaway/>"})
    assert env.end_reason == "walkaway"
    assert [env.result().roles[r].points for r in env.roles] == [0.0, 0.0]


# -- the bot -------------------------------------------------------------------------------------


def test_bot_vs_bot_on_the_example():
    env = example_env()
    said = []
    while not env.done:
        role = env.acting_roles()[0]
        text = bot(env.view(role))
        assert env.validate(role, text) == (True, "")
        said.append(text)
        env.step({role: text})
    # University aspirations 100, 91, 82, 73, 64; Company 100, 90, 80, 70.
    assert said == [
        "How about this? " + propose("A1", "B3", "C1", "D2", "E1"),
        "How about this? " + propose("A3", "B3", "C3", "D1", "E3"),
        "How about this? " + propose("A1", "B3", "C2", "D2", "E2"),
        "How about this? " + propose("A3", "B2", "C3", "D1", "E3"),
        "How about this? " + propose("A1", "B2", "C1", "D2", "E3"),
        "How about this? " + propose("A3", "B1", "C3", "D1", "E3"),
        "How about this? " + propose("A1", "B2", "C1", "D1", "E2"),
        "How about this? " + propose("A1", "B3", "C3", "D2", "E3"),
        "That works for me. <accept/>",
    ]
    assert [env.result().roles[r].points for r in env.roles] == [75.0, 70.0]


def test_bot_floor_and_never_accepts_below_minimum():
    env = example_env()
    env.step({"University": propose("A2", "B3", "C2", "D3", "E1")})
    view = env.view("Company")
    assert env.deal_points("Company", env.standing) == 49
    for k in range(12):
        view["own_turn"] = k
        assert "<accept/>" not in bot(view)
    # At the floor (k >= 5) the Company asks for the cheapest deal worth at least its minimum 50.
    view["own_turn"] = 7
    assert bot(view) == "How about this? " + propose("A1", "B1", "C3", "D2", "E3")
    env.step({"Company": "No."})
    env.step({"University": propose("A1", "B3", "C2", "D3", "E3")})
    view = env.view("Company")
    view["own_turn"] = 5
    assert env.deal_points("Company", env.standing) == 50
    assert bot(view) == "That works for me. <accept/>"
    view["own_turn"] = 4
    assert "<propose>" in bot(view)


# -- proposal payloads ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        '{"A": "A2", "B": "B3", "C": "C2", "D": "D2", "E": "E2"}',
        '{"a": " a2 ", "b": "b3", "c": "C2", "d": "d2", "e": "e2"}',
        '{"A": 2, "B": 3, "C": 2, "D": 2, "E": 2}',
        '{"A": 2.0, "B": "B3", "C": 2, "D": "D2", "E": 2.0}',
        '{" E ": "E2", "D": "D2", "C": "C2", "B": "B3", "A": "A2"}',
    ],
)
def test_payload_forms_accepted(payload):
    env = example_env()
    env.step({"University": f"<propose>{payload}</propose>"})
    assert env.standing is not None
    assert env.standing.offer == {"A": "A2", "B": "B3", "C": "C2", "D": "D2", "E": "E2"}
    assert env.n_invalid["University"] == 0


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ('{"A": "A2", "B": "B3", "C": "C2", "D": "D2"}', "missing key 'E'"),
        (
            '{"A": "A2", "B": "B3", "C": "C2", "D": "D2", "E": "E2", "F": "F1"}',
            "unknown key 'F' (expected A, B, C, D, E)",
        ),
        ('{"A": "A2", "a": "A1", "B": "B3", "C": "C2", "D": "D2", "E": "E2"}', "key 'A' appears twice"),
        ('{"A": "A4", "B": "B3", "C": "C2", "D": "D2", "E": "E2"}', "A must be one of A1, A2, A3 (got 'A4')"),
        ('{"A": "B1", "B": "B3", "C": "C2", "D": "D2", "E": "E2"}', "A must be one of A1, A2, A3 (got 'B1')"),
        ('{"A": "2", "B": "B3", "C": "C2", "D": "D2", "E": "E2"}', "A must be one of A1, A2, A3 (got '2')"),
        ('{"A": 4, "B": "B3", "C": "C2", "D": "D2", "E": "E2"}', "A has options 1..3 only (got 4)"),
        ('{"A": 0, "B": "B3", "C": "C2", "D": "D2", "E": "E2"}', "A has options 1..3 only (got 0)"),
        ('{"A": "A2", "B": "B3", "C": 5, "D": "D2", "E": "E2"}', "C has options 1..4 only (got 5)"),
        (
            '{"A": 1.5, "B": "B3", "C": "C2", "D": "D2", "E": "E2"}',
            "A must be a label such as A1 or an option number 1..3",
        ),
        (
            '{"A": true, "B": "B3", "C": "C2", "D": "D2", "E": "E2"}',
            "A must be a label such as A1 or an option number 1..3",
        ),
        (
            '{"A": null, "B": "B3", "C": "C2", "D": "D2", "E": "E2"}',
            "A must be a label such as A1 or an option number 1..3",
        ),
        ('["A2", "B3", "C2", "D2", "E2"]', "the proposal must be a JSON object"),
    ],
)
def test_bad_payload_is_an_invalid_plain_message(payload, reason):
    env = example_env()
    env.step({"University": propose("A1", "B3", "C1", "D2", "E1")})
    env.observe("University")
    env.observe("Company")
    text = f"Counter-offer: <propose>{payload}</propose>"
    assert env.validate("Company", text) == (False, reason)
    env.step({"Company": text})
    assert env.n_invalid == {"University": 0, "Company": 1}
    assert env.standing is not None and env.standing.by == "University"
    assert env.standing.offer == {"A": "A1", "B": "B3", "C": "C1", "D": "D2", "E": "E1"}
    assert env.observe("Company")[-1].content == f"[Referee] Your action was not recorded: {reason}."
    to_university = env.observe("University")[-1].content
    assert to_university.startswith(f"Company: {text}\n") and "[Referee]" not in to_university
    assert env.messages == 2


def test_unclosed_propose_is_invalid():
    env = example_env()
    env.step({"University": '<propose>{"A": "A1"'})
    assert env.n_invalid["University"] == 1 and env.standing is None


# -- the partner guard ---------------------------------------------------------------------------


def test_guard():
    env = example_env()
    good = propose("A2", "B3", "C2", "D2", "E2")  # U 79, C 62
    assert env.guard("University", good) is None
    assert env.guard("University", "Plain talk.") is None
    env.step({"University": propose("A1", "B3", "C1", "D2", "E1")})  # U 100, C 25
    assert env.guard("Company", "Fine by me. <accept/>") == "Fine by me."
    assert env.guard("Company", "Let us talk. <reject/>") is None
    # Company's 49 < 50 is guarded; 50 is fine.
    low, edge = propose("A2", "B3", "C2", "D3", "E1"), propose("A1", "B3", "C2", "D3", "E3")
    assert env.guard("Company", f"Try {low}") == "Try"
    assert env.guard("Company", f"Try {edge}") is None
    assert env.guard("Company", f"First {edge} then {low}") == "First  then"  # every tag goes
    assert env.guard("Company", f"First {low} then {edge}") is None


# -- prompts, views ------------------------------------------------------------------------------


def test_prompts_show_only_own_table_and_minimum():
    env = example_env()
    university, company = env.system_prompt("University"), env.system_prompt("Company")
    assert "A. Funding: A1 Company pays 80% = 30; A2 Company pays 65% = 18; A3 Company pays 50% = 0" in university
    assert "C4 4 years = 0" in university and "C5" not in university
    assert "Your minimum acceptable score is 55." in university
    assert "Your minimum acceptable score is 50." in company
    assert "A1 Company pays 80% = 0" in company
    assert "at most 20 messages" in university
    assert '<propose>{"A": "A2", "B": "B1", "C": "C3", "D": "D2", "E": "E1"}</propose>' in university
    for tag in ("<accept/>", "<reject/>", "<walkaway/>"):
        assert tag in university
    assert env.view("Company")["scores"] == C_SCORES and env.view("Company")["minimum"] == 50


# -- kernels -------------------------------------------------------------------------------------


def test_largest_remainder_exact_with_ties_to_earlier_issue():
    assert largest_remainder([1.0] * 5) == [20] * 5
    assert largest_remainder([1.0, 1.0, 1.0, 1.0, 2.0]) == [17, 17, 17, 16, 33]
    assert largest_remainder([0.5, 0.5, 0.5, 0.5, 2.0]) == [13, 13, 12, 12, 50]
    assert sum(largest_remainder([0.7, 1.3, 0.9, 1.9, 0.51])) == 100


def test_mid_scores_round_exactly():
    # 5 * 0.3 is 1.5 in floats, but the float 0.3 is just below 3/10, so rnd gives 1.
    assert 5 * 0.3 == 1.5
    assert _ranked_scores(5, [0.3]) == [5, 1, 0]
    assert _ranked_scores(25, [0.5, 0.02]) == [25, 13, 1, 0]


def independent_kernel(rng: random.Random) -> dict:
    """environments.md 10's draw order, written out step by step."""
    n = [rng.randint(3, 5) for _ in range(5)]
    types = ["dist", "dist", "integ", "integ", "compat"]
    rng.shuffle(types)
    orders = {"University": [], "Company": []}
    for j in range(5):
        if types[j] == "dist":
            u, c = list(range(n[j])), list(reversed(range(n[j])))
        elif types[j] == "compat":
            u = list(range(n[j]))
            rng.shuffle(u)
            c = u[:]
        else:
            u, c = list(range(n[j])), list(range(n[j]))
            rng.shuffle(u)
            rng.shuffle(c)
        orders["University"].append(u)
        orders["Company"].append(c)
    scores = {}
    for role in ("University", "Company"):
        w = [Fraction(rng.uniform(0.5, 2.0)) for _ in range(5)]
        q = [100 * x / sum(w) for x in w]
        m = [math.floor(x) for x in q]
        extra = sorted(range(5), key=lambda j: (-(q[j] - m[j]), j))[: 100 - sum(m)]
        m = [m[j] + (j in extra) for j in range(5)]
        rows = []
        for j in range(5):
            mids = sorted([rng.random() for _ in range(n[j] - 2)], reverse=True)
            ranked = [m[j]] + [math.floor(m[j] * Fraction(x) + Fraction(1, 2)) for x in mids] + [0]
            row = [0] * n[j]
            for option, s in zip(orders[role][j], ranked):
                row[option] = s
            rows.append(row)
        scores[role] = rows
    best, best_key = None, None
    for d in itertools.product(*(range(k) for k in n)):
        su = sum(scores["University"][i][o] for i, o in enumerate(d))
        sc = sum(scores["Company"][i][o] for i, o in enumerate(d))
        if best_key is None or su * sc > best_key:
            best, best_key, star = d, su * sc, (su, sc)
    minimums = {r: math.floor(Fraction(rng.uniform(0.65, 0.85)) * s) for r, s in zip(("University", "Company"), star)}
    return {
        "n_options": n,
        "types": types,
        "orders": orders,
        "scores": scores,
        "best_deal": list(best),
        "minimums": minimums,
    }


@pytest.mark.parametrize("index", [0, 1, 2, 57, 99])
def test_generation_follows_the_spec_draw_order(index):
    seed = derive("repertory", "alliance", "train", index)
    assert Alliance.generate_kernel(random.Random(seed)) == independent_kernel(random.Random(seed))


def test_shipped_kernels_structure_and_feasible_share():
    kernels = [k for split in SPLITS for k in load_kernels("alliance", split)]
    shares = []
    for kernel in kernels:
        data = kernel.data
        for j, kind in enumerate(data["types"]):
            u, c = data["scores"]["University"][j], data["scores"]["Company"][j]
            if kind == "dist":
                assert u[0] == max(u) and u[-1] == 0 and c[0] == 0 and c[-1] == max(c)
            assert u.count(0) >= 1 and c.count(0) >= 1
        all_deals = deals(*tables(data))
        mins = data["minimums"]
        shares.append(sum(a >= mins["University"] and b >= mins["Company"] for _, a, b in all_deals) / len(all_deals))
        _, su, sc = best_deal(*tables(data))
        assert mins["University"] <= su and mins["Company"] <= sc
    # environments.md 10: about 9% of deals are feasible on average (informative).
    assert 0.07 < sum(shares) / len(shares) < 0.11


def test_best_deal_ties_go_to_smallest_index_tuple():
    table = ((0, 1, 1),) * 5
    assert best_deal(table, table) == ((1, 1, 1, 1, 1), 5, 5)


def mutated(path: tuple, value) -> dict:
    data = copy.deepcopy(EXAMPLE)
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (mutated(("scores", "University", 0, 0), 31), "University's per-issue maxima must sum to 100"),
        (mutated(("scores", "Company", 3), [10, 5, 1]), "Company's scores on issue D must fall from its maximum to 0"),
        (mutated(("scores", "Company", 3, 1), -5), "Company's scores on issue D must be 3 non-negative integers"),
        (mutated(("scores", "Company", 3, 1), 5.0), "Company's scores on issue D must be 3 non-negative integers"),
        (mutated(("orders", "University", 0), [0, 2, 1]), "University's scores on issue A must fall"),
        (mutated(("orders", "Company", 4), [2, 2, 1]), "Company's order on issue E must rank all 3 options"),
        (mutated(("n_options", 0), 6), "n_options must be five integers in 3..5"),
        (mutated(("n_options", 0), 3.0), "n_options must be five integers in 3..5"),
        (mutated(("orders", "University", 0), [0, True, 2]), "University's order on issue A must rank all 3 options"),
        (mutated(("best_deal",), [True, 2, 2, True, True]), "best_deal must be [1, 2, 2, 1, 1]"),
        (mutated(("types",), ["dist", "dist", "dist", "integ", "compat"]), "types must be a shuffle"),
        (mutated(("types",), ["integ", "compat", "dist", "integ", "dist"]), "issue C is distributive"),
        (mutated(("types",), ["dist", "integ", "compat", "integ", "dist"]), "issue C is compatible"),
        (mutated(("best_deal",), [1, 2, 2, 1, 0]), "best_deal must be [1, 2, 2, 1, 1]"),
        (mutated(("minimums", "University"), 59), "University's minimum must lie in floor(0.65..0.85 * 69)"),
        (mutated(("minimums", "Company"), 49), "Company's minimum must lie in floor(0.65..0.85 * 77)"),
        (mutated(("minimums", "Company"), "50"), "Company's minimum must be an integer"),
        (mutated(("scores",), None), "a kernel needs"),
        (mutated(("orders", "Company"), [[0]]), "Company needs a score row and a preference order"),
        ({"types": []}, "a kernel needs"),
        (None, "a kernel needs"),
    ],
)
def test_validator_catches(data, problem):
    problems = Alliance.validate_kernel(data)
    assert any(p.startswith(problem) for p in problems), problems


def test_validator_maxima_range():
    data = copy.deepcopy(EXAMPLE)
    data["scores"]["University"][0] = [51, 18, 0]
    data["scores"]["University"][2] = [4, 3, 1, 0]
    problems = Alliance.validate_kernel(data)
    assert "University's maximum on issue A must lie in 5..50" in problems
    assert "University's maximum on issue C must lie in 5..50" in problems
