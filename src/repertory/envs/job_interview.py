"""Job Interview (docs/environments.md 9): a recruiter and a worker negotiate salary, weekly holidays,
workplace, company and position at once; each scores a contract with private weights and tables."""

from __future__ import annotations

import bisect
import copy
import itertools
import random
from array import array
from fractions import Fraction
from functools import cache, lru_cache
from typing import Any, ClassVar

from repertory.envs.base import Bot, fmt, other
from repertory.envs.grammar import Syntax, integer, json_object, json_string
from repertory.envs.negotiation import (
    BotOption,
    Negotiation,
    Offer,
    Standing,
    aspiration,
    aspiration_reply,
    tag_text,
)
from repertory.envs.parsing import PayloadError, as_integer, parse_fields

ISSUES = ("salary", "holidays", "workplace", "company", "position")
WORKPLACES = ("Tokyo", "Seoul", "Beijing", "Sydney")
COMPANIES = ("Altavia", "Brightloom", "Kestrel", "Solvane")
POSITIONS = ("Engineer", "Manager", "Designer", "Sales")
SALARY = (20, 50)
HOLIDAYS = (2, 6)
RECRUITER, WORKER = "recruiter", "worker"
NAMED = {"workplace": WORKPLACES, "company": COMPANIES, "position": POSITIONS}
WEIGHT_RANGE = (0.1, 0.6)
TOL = 1e-9
START, STEP, FLOOR = Fraction("0.90"), Fraction("0.08"), Fraction("0.50")
"""The aspiration bot's parameters (docs/environments.md 9)."""


def minmax(values: list[float]) -> list[float]:
    """docs/environments.md 1.5: (v - min)/(max - min); all entries 0.5 when they are equal."""
    low, high = min(values), max(values)
    if low == high:
        return [0.5 for _ in values]
    return [(v - low) / (high - low) for v in values]


def salary_term(recruiter: bool, weight: float, salary: int) -> float:
    """The salary part of a score: the recruiter prefers low salaries, the worker high ones."""
    return weight * (SALARY[1] - salary) / 30 if recruiter else weight * (salary - SALARY[0]) / 30


def holiday_term(recruiter: bool, weight: float, holidays: int) -> float:
    """The holidays part of a score: the recruiter prefers few holidays, the worker many."""
    return weight * (HOLIDAYS[1] - holidays) / 4 if recruiter else weight * (holidays - HOLIDAYS[0]) / 4


def score(
    recruiter: bool,
    weights: tuple[float, ...] | list[float],
    workplace: float,
    company: float,
    position: float,
    salary: int,
    holidays: int,
) -> float:
    """The JI score of a contract, float64 evaluated left to right as docs/environments.md 9 writes it."""
    w_sal, w_hol, w_wp, w_co, w_pos = weights
    return (
        salary_term(recruiter, w_sal, salary)
        + holiday_term(recruiter, w_hol, holidays)
        + w_wp * workplace
        + w_co * company
        + w_pos * position
    )


@cache
def contracts() -> tuple[tuple[Offer, tuple[int, ...]], ...]:
    """All 9,920 contracts with their canonical encodings (salary, holidays, workplace, company,
    position indices), in encoding order."""
    out = []
    ranges = (range(SALARY[0], SALARY[1] + 1), range(HOLIDAYS[0], HOLIDAYS[1] + 1), range(4), range(4), range(4))
    for s, h, wp, co, pos in itertools.product(*ranges):
        offer = {
            "salary": s,
            "holidays": h,
            "workplace": WORKPLACES[wp],
            "company": COMPANIES[co],
            "position": POSITIONS[pos],
        }
        out.append((offer, (s, h, wp, co, pos)))
    return tuple(out)


def _frozen(view: dict[str, Any]) -> tuple[Any, ...]:
    """The hashable form of a side's private tables, the key of the option cache."""
    return (
        view["role"] == RECRUITER,
        tuple(view["weights"]),
        tuple(view["workplace_values"]),
        tuple(view["company_values"]),
        tuple(tuple(row) for row in view["position_values"]),
    )


def contract_values(
    recruiter: bool,
    weights: tuple[float, ...],
    workplace: tuple[float, ...],
    company: tuple[float, ...],
    position: tuple[tuple[float, ...], ...],
) -> list[float]:
    """One side's score of every contract, in the order of contracts()."""
    w_sal, w_hol, w_wp, w_co, w_pos = weights
    # The five terms are computed once each and added in score()'s order, so every value equals
    # score() bit for bit at a fraction of the cost.
    sal = {s: salary_term(recruiter, w_sal, s) for s in range(SALARY[0], SALARY[1] + 1)}
    hol = {h: holiday_term(recruiter, w_hol, h) for h in range(HOLIDAYS[0], HOLIDAYS[1] + 1)}
    wp_term = [w_wp * v for v in workplace]
    co_term = [w_co * v for v in company]
    pos_term = [[w_pos * v for v in row] for row in position]
    return [sal[s] + hol[h] + wp_term[wp] + co_term[co] + pos_term[co][pos] for _, (s, h, wp, co, pos) in contracts()]


# Flat arrays (about 160 kB a side) instead of 9,920 option tuples: the garbage collector would
# otherwise rescan every cached tuple, which made a run over all kernels several times slower.
# Bounded so that a long run over many custom kernels cannot grow without limit.
@lru_cache(maxsize=1024)
def _ranked(*frozen: Any) -> tuple[array[float], array[int]]:
    """One side's contract scores in the bot's preference order, and the contracts() index of each.

    contracts() is in encoding order and units are always 0, so a stable sort on the score alone
    gives the bot's full key (own value, units, encoding)."""
    values = contract_values(*frozen)
    order = sorted(range(len(values)), key=values.__getitem__)
    return array("d", (values[i] for i in order)), array("l", order)


def contract_score(view: dict[str, Any], offer: Offer) -> float:
    """The score of the canonical ``offer`` for the side whose private view is ``view``."""
    co = COMPANIES.index(offer["company"])
    return score(
        view["role"] == RECRUITER,
        view["weights"],
        view["workplace_values"][WORKPLACES.index(offer["workplace"])],
        view["company_values"][co],
        view["position_values"][co][POSITIONS.index(offer["position"])],
        offer["salary"],
        offer["holidays"],
    )


def bot(view: dict[str, Any]) -> str:
    """Aspiration bot 0.90/0.08/0.50 over all contracts, in either seat."""
    values, order = _ranked(*_frozen(view))
    a_k = aspiration(START, STEP, FLOOR, view["own_turn"])
    # aspiration_reply compares every option's float score with the Fraction a_k (about 20 us each,
    # 0.2 s a turn over 9,920 contracts). Its choice is the first ranked option worth at least a_k,
    # or the first of maximal value when none is; a bisection finds that option and only it is passed.
    i = bisect.bisect_left(values, a_k)
    if i == len(values):
        i = bisect.bisect_left(values, values[-1])
    offer, encoding = contracts()[order[i]]
    choice: BotOption = (offer, values[i], 0, encoding)
    return aspiration_reply(
        view, [choice], lambda standing: contract_score(view, standing["offer"]), START, STEP, FLOOR
    )


def _side(rng: random.Random) -> dict[str, Any]:
    """One side's weights and value tables, drawn in the JI order."""
    draws = [rng.random() for _ in ISSUES]
    # An explicit loop: sum() of floats is compensated since Python 3.12, and 1.5 sums left to right.
    total = 0.0
    for w in draws:
        total += w
    weights = [0.1 + 0.5 * w / total for w in draws]
    workplace = minmax([rng.random() for _ in WORKPLACES])
    company = minmax([rng.random() for _ in COMPANIES])
    base = minmax([rng.random() for _ in POSITIONS])
    position = [minmax([b + rng.uniform(0, 0.5) for b in base]) for _ in COMPANIES]
    return {"weights": weights, "workplace_values": workplace, "company_values": company, "position_values": position}


def _table_problems(name: str, values: object, size: int) -> list[str]:
    """A minmax table: ``size`` numbers in [0, 1], spanning 0..1 exactly, or all 0.5."""
    if not isinstance(values, list) or len(values) != size:
        return [f"{name} must be a list of {size} numbers"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in values):
        return [f"{name} must hold numbers in [0, 1]"]
    if not (min(values) == 0 and max(values) == 1) and any(v != 0.5 for v in values):
        return [f"{name} must be min-max normalised (a 0 and a 1, or all 0.5)"]
    return []


class JobInterview(Negotiation):
    name = "job-interview"
    description = "Job Interview: a recruiter and a worker negotiate salary, holidays, workplace, company and position."
    roles = (RECRUITER, WORKER)
    role_labels = (RECRUITER, WORKER)
    default_trained_role = RECRUITER
    bots: ClassVar[dict[str, Bot]] = {"bot": bot}

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        sides = {role: _side(rng) for role in cls.roles}
        return {
            "issues": list(ISSUES),
            "workplaces": list(WORKPLACES),
            "companies": list(COMPANIES),
            "positions": list(POSITIONS),
            **{field: {role: sides[role][field] for role in cls.roles} for field in sides[RECRUITER]},
        }

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        try:
            names = {
                "issues": ISSUES,
                "workplaces": WORKPLACES,
                "companies": COMPANIES,
                "positions": POSITIONS,
            }
            for field, expected in names.items():
                if data[field] != list(expected):
                    return [f"{field} must be {list(expected)}"]
            problems = []
            for role in cls.roles:
                weights = data["weights"][role]
                if not isinstance(weights, list) or len(weights) != len(ISSUES):
                    problems.append(f"{role}'s weights must be a list of {len(ISSUES)} numbers")
                elif not all(
                    isinstance(w, (int, float)) and not isinstance(w, bool) and WEIGHT_RANGE[0] <= w <= WEIGHT_RANGE[1]
                    for w in weights
                ):
                    problems.append(f"{role}'s weights must lie in [{WEIGHT_RANGE[0]}, {WEIGHT_RANGE[1]}]")
                elif abs(sum(weights) - 1) > TOL:
                    problems.append(f"{role}'s weights must sum to 1")
                problems += _table_problems(f"{role}'s workplace values", data["workplace_values"][role], 4)
                problems += _table_problems(f"{role}'s company values", data["company_values"][role], 4)
                rows = data["position_values"][role]
                if not isinstance(rows, list) or len(rows) != len(COMPANIES):
                    problems.append(f"{role}'s position values need one row per company")
                else:
                    for company, row in zip(COMPANIES, rows):
                        problems += _table_problems(f"{role}'s position values at {company}", row, 4)
            return problems
        except (KeyError, TypeError):
            return ["a kernel needs the option lists and, for both sides, weights and value tables"]

    def tables(self, role: str) -> dict[str, Any]:
        """``role``'s weights and value tables."""
        assert self.kernel is not None
        data = self.kernel.data
        fields = ("weights", "workplace_values", "company_values", "position_values")
        return {field: data[field][role] for field in fields}

    def offer_syntax(self, role: str) -> Syntax:
        numbers = [("salary", integer(*SALARY)), ("holidays", integer(*HOLIDAYS))]
        return json_object(numbers + [(issue, json_string(options)) for issue, options in NAMED.items()])

    def parse_offer(self, role: str, payload: str) -> Offer:
        fields = parse_fields(payload, ISSUES, required=True)
        offer: Offer = {}
        for issue, (low, high) in (("salary", SALARY), ("holidays", HOLIDAYS)):
            n = as_integer(fields[issue], issue)
            if not low <= n <= high:
                raise PayloadError(f"{issue} must be between {low} and {high}")
            offer[issue] = n
        for issue, options in NAMED.items():
            value = fields[issue]
            by_name = {o.lower(): o for o in options}
            if not isinstance(value, str) or value.strip().lower() not in by_name:
                raise PayloadError(f"{issue} must be one of {', '.join(options)}")
            offer[issue] = by_name[value.strip().lower()]
        return offer

    def deal_points(self, role: str, deal: Standing) -> float:
        return contract_score({"role": role, **self.tables(role)}, deal.offer)

    def max_points(self, role: str) -> int:
        return 1

    def describe(self, deal: Standing, viewer: str) -> str:
        o = deal.offer
        return (
            f"salary {o['salary']} thousand per year, {o['holidays']} holidays per week, {o['workplace']}, "
            f"{o['company']}, {o['position']} (score {fmt(self.deal_points(viewer, deal))} for you)"
        )

    def private_view(self, role: str) -> dict[str, Any]:
        return copy.deepcopy(self.tables(role))

    def system_prompt(self, role: str) -> str:
        partner = other(self.roles, role)
        t = self.tables(role)
        w = dict(zip(ISSUES, t["weights"]))
        if role == RECRUITER:
            money = "You pay the salary: a LOWER salary and FEWER holidays are better for you."
            sal, hol = f"{fmt(w['salary'])} x (50 - salary) / 30", f"{fmt(w['holidays'])} x (6 - holidays) / 4"
        else:
            money = "You receive the salary: a HIGHER salary and MORE holidays are better for you."
            sal, hol = f"{fmt(w['salary'])} x (salary - 20) / 30", f"{fmt(w['holidays'])} x (holidays - 2) / 4"

        def table(names: tuple[str, ...], values: list[float]) -> str:
            return ", ".join(f"{n} {fmt(v)}" for n, v in zip(names, values))

        positions = "\n".join(f"  at {c}: {table(POSITIONS, row)}" for c, row in zip(COMPANIES, t["position_values"]))
        example = tag_text(
            "propose", {"salary": 35, "holidays": 4, "workplace": "Tokyo", "company": "Altavia", "position": "Engineer"}
        )
        return (
            f"You are the {role} in a job interview, negotiating a contract with the {partner}. A contract fixes five "
            f"terms: salary ({SALARY[0]} to {SALARY[1]} thousand per year, whole numbers), holidays per week "
            f"({HOLIDAYS[0]} to {HOLIDAYS[1]}), workplace ({', '.join(WORKPLACES)}), company "
            f"({', '.join(COMPANIES)}) and position ({', '.join(POSITIONS)}).\n"
            f"{money} Your private score of a contract (between 0 and 1; the {partner} does not know it, and has "
            "its own) is the sum of five parts:\n"
            f"- salary: {sal}\n"
            f"- holidays: {hol}\n"
            f"- workplace: {fmt(w['workplace'])} x your workplace value ({table(WORKPLACES, t['workplace_values'])})\n"
            f"- company: {fmt(w['company'])} x your company value ({table(COMPANIES, t['company_values'])})\n"
            f"- position: {fmt(w['position'])} x your position value, which depends on the company:\n{positions}\n"
            "Your goal is the highest score you can get; without a deal you score 0.\n"
            f"You take turns writing messages; at most {self.max_messages} messages in total. Actions are tags in "
            "your message; only your last tag counts:\n"
            f"- propose a full contract (all five terms are required), e.g. {example}\n"
            f"- accept the {partner}'s standing proposal: <accept/>\n"
            f"- reject the {partner}'s standing proposal: <reject/>\n"
            "- end the negotiation without a deal: <walkaway/>\n"
            "A deal is made when one side accepts the other's standing proposal."
        )
