"""Alliance (docs/environments.md 10): a University and a Company settle five project issues, each side
with a private score table and a private minimum acceptable score."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction
from functools import cache
from typing import Any, ClassVar

from repertory.envs.base import Bot, other
from repertory.envs.grammar import Syntax, json_object, json_string
from repertory.envs.negotiation import BotOption, Negotiation, Offer, Standing, aspiration_reply, rnd, tag_text
from repertory.envs.parsing import PayloadError, as_integer, parse_fields

ISSUES = ("A", "B", "C", "D", "E")
ISSUE_NAMES = ("Funding", "Intellectual property", "Duration", "Staffing", "Publication")
OPTION_TEXTS = (
    ("Company pays 80%", "Company pays 65%", "Company pays 50%", "Company pays 35%", "Company pays 20%"),
    (
        "University owns all",
        "joint, University licenses",
        "joint, Company licenses",
        "Company owns with royalties",
        "Company owns all",
    ),
    ("1 year", "2 years", "3 years", "4 years", "5 years"),
    ("University only", "mostly University", "equal mix", "mostly Company", "Company only"),
    ("free", "30-day review", "90-day review", "6-month embargo", "Company approval"),
)
TYPES = ("dist", "dist", "integ", "integ", "compat")
TOTAL = 100
MAX_OPTIONS = 5
FAILED_ACCEPT = "the accepted proposal does not satisfy both parties' requirements"

Table = tuple[tuple[int, ...], ...]
Deal = tuple[int, ...]
"""A deal as the 0-based option index of each issue A..E."""


def label(issue: int, option: int) -> str:
    """The option's label, e.g. ``A2`` for the second option of issue A."""
    return f"{ISSUES[issue]}{option + 1}"


def deal_score(table: Table | list[list[int]], deal: Deal) -> int:
    """One side's score for ``deal``: the sum of its points for the chosen options."""
    return sum(table[i][j] for i, j in enumerate(deal))


def largest_remainder(weights: list[float]) -> list[int]:
    """Integer maxima summing to 100 from the exact quotas 100*u_j/sum(u) (ties to the earlier issue)."""
    exact = [Fraction(u) for u in weights]
    quotas = [TOTAL * u / sum(exact) for u in exact]
    maxima = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda j: (maxima[j] - quotas[j], j))
    for j in by_remainder[: TOTAL - sum(maxima)]:
        maxima[j] += 1
    return maxima


@cache
def deals(u_table: Table, c_table: Table) -> tuple[tuple[Deal, int, int], ...]:
    """Every deal of a kernel with the University's and the Company's scores, in index order."""
    return tuple(
        (d, deal_score(u_table, d), deal_score(c_table, d))
        for d in itertools.product(*(range(len(issue)) for issue in u_table))
    )


def best_deal(u_table: Table, c_table: Table) -> tuple[Deal, int, int]:
    """d*: the deal maximising score_U * score_C, ties to the smallest index tuple."""
    best = None
    for entry in deals(u_table, c_table):
        if best is None or entry[1] * entry[2] > best[1] * best[2]:
            best = entry
    assert best is not None
    return best


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _table(rows: Any) -> Table:
    return tuple(tuple(row) for row in rows)


def offer_of(deal: Deal) -> Offer:
    """The canonical offer (labels keyed by issue) of a deal."""
    return {issue: label(i, j) for i, (issue, j) in enumerate(zip(ISSUES, deal))}


def deal_of(offer: Offer) -> Deal:
    """The index tuple of a canonical offer."""
    return tuple(int(offer[issue][1:]) - 1 for issue in ISSUES)


@cache
def _options(table: Table) -> list[BotOption]:
    return [
        (offer_of(d), deal_score(table, d), 0, d) for d in itertools.product(*(range(len(issue)) for issue in table))
    ]


def bot(view: dict[str, Any]) -> str:
    """Aspiration bot: start 100, floor = own minimum, step = (100 - minimum)/5, in either seat."""
    table, minimum = _table(view["scores"]), Fraction(view["minimum"])

    def standing_value(standing: dict[str, Any]) -> int:
        return deal_score(table, deal_of(standing["offer"]))

    return aspiration_reply(view, _options(table), standing_value, Fraction(TOTAL), (TOTAL - minimum) / 5, minimum)


def _ranked_scores(maximum: int, mids: list[float]) -> list[int]:
    return [maximum, *(rnd(maximum * Fraction(m)) for m in mids), 0]


class Alliance(Negotiation):
    name = "alliance"
    description = (
        "Alliance: a University and a Company settle five project issues; each has private scores and a minimum."
    )
    roles = ("University", "Company")
    role_labels = ("University", "Company")
    default_trained_role = "University"
    bots: ClassVar[dict[str, Bot]] = {"bot": bot}
    guarded_limit = "its minimum acceptable score"

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        n_options = [rng.randint(3, 5) for _ in ISSUES]
        types = list(TYPES)
        rng.shuffle(types)
        u_orders, c_orders = [], []
        for n, kind in zip(n_options, types):
            if kind == "dist":
                u_order, c_order = list(range(n)), list(range(n - 1, -1, -1))
            elif kind == "compat":
                u_order = list(range(n))
                rng.shuffle(u_order)
                c_order = list(u_order)
            else:
                u_order, c_order = list(range(n)), list(range(n))
                rng.shuffle(u_order)
                rng.shuffle(c_order)
            u_orders.append(u_order)
            c_orders.append(c_order)
        scores = {}
        for role, orders in zip(cls.roles, (u_orders, c_orders)):
            maxima = largest_remainder([rng.uniform(0.5, 2.0) for _ in ISSUES])
            table = []
            for n, order, maximum in zip(n_options, orders, maxima):
                mids = sorted((rng.random() for _ in range(n - 2)), reverse=True)
                row = [0] * n
                for option, score in zip(order, _ranked_scores(maximum, mids)):
                    row[option] = score
                table.append(row)
            scores[role] = table
        star, *star_scores = best_deal(_table(scores["University"]), _table(scores["Company"]))
        minimums = {role: math.floor(Fraction(rng.uniform(0.65, 0.85)) * s) for role, s in zip(cls.roles, star_scores)}
        return {
            "n_options": n_options,
            "types": types,
            "orders": {"University": u_orders, "Company": c_orders},
            "scores": scores,
            "best_deal": list(star),
            "minimums": minimums,
        }

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        try:
            return cls._problems(data)
        except (KeyError, TypeError, IndexError):
            return ["a kernel needs n_options, types, orders, scores, best_deal and minimums for both sides"]

    @classmethod
    def _problems(cls, data: dict[str, Any]) -> list[str]:
        n_options, types = data["n_options"], data["types"]
        if len(n_options) != len(ISSUES) or not all(_is_int(n) and 3 <= n <= MAX_OPTIONS for n in n_options):
            return ["n_options must be five integers in 3..5"]
        if not isinstance(types, list) or sorted(types) != sorted(TYPES):
            return [f"types must be a shuffle of {list(TYPES)}"]
        problems = []
        for role in cls.roles:
            table, orders = data["scores"][role], data["orders"][role]
            if len(table) != len(ISSUES) or len(orders) != len(ISSUES):
                problems.append(f"{role} needs a score row and a preference order for each of the five issues")
                continue
            maxima = []
            for issue, n, row, order in zip(ISSUES, n_options, table, orders):
                if len(row) != n or not all(_is_int(x) and x >= 0 for x in row):
                    problems.append(f"{role}'s scores on issue {issue} must be {n} non-negative integers")
                elif not all(_is_int(o) for o in order) or sorted(order) != list(range(n)):
                    problems.append(f"{role}'s order on issue {issue} must rank all {n} options")
                else:
                    ranked = [row[o] for o in order]
                    maxima.append(ranked[0])
                    if ranked != sorted(ranked, reverse=True) or ranked[-1] != 0:
                        problems.append(
                            f"{role}'s scores on issue {issue} must fall from its maximum to 0 along its order"
                        )
                    if not 5 <= ranked[0] <= 50:
                        problems.append(f"{role}'s maximum on issue {issue} must lie in 5..50")
            if len(maxima) == len(ISSUES) and sum(maxima) != TOTAL:
                problems.append(f"{role}'s per-issue maxima must sum to {TOTAL}")
        if problems:
            return problems
        u_orders, c_orders = data["orders"]["University"], data["orders"]["Company"]
        for issue, n, kind, u_order, c_order in zip(ISSUES, n_options, types, u_orders, c_orders):
            if kind == "dist" and (u_order != list(range(n)) or c_order != list(range(n - 1, -1, -1))):
                problems.append(
                    f"issue {issue} is distributive: the Company's order must reverse the University's list order"
                )
            if kind == "compat" and u_order != c_order:
                problems.append(f"issue {issue} is compatible: both sides must share one order")
        u_table, c_table = _table(data["scores"]["University"]), _table(data["scores"]["Company"])
        star, u_star, c_star = best_deal(u_table, c_table)
        if not all(_is_int(i) for i in data["best_deal"]) or data["best_deal"] != list(star):
            problems.append(f"best_deal must be {list(star)}, the deal maximising the product of the scores")
        for role, s in zip(cls.roles, (u_star, c_star)):
            minimum = data["minimums"][role]
            if not _is_int(minimum):
                problems.append(f"{role}'s minimum must be an integer")
            elif not 13 * s // 20 <= minimum <= 17 * s // 20:
                problems.append(f"{role}'s minimum must lie in floor(0.65..0.85 * {s}), the best deal's score")
        return problems

    def table(self, role: str) -> Table:
        """``role``'s private score table, one row per issue in label order."""
        assert self.kernel is not None
        return _table(self.kernel.data["scores"][role])

    def minimum(self, role: str) -> int:
        """``role``'s private minimum acceptable score."""
        assert self.kernel is not None
        return self.kernel.data["minimums"][role]

    @property
    def n_options(self) -> list[int]:
        """How many options each issue A..E has."""
        assert self.kernel is not None
        return self.kernel.data["n_options"]

    def offer_syntax(self, role: str) -> Syntax:
        labels = [[label(i, j) for j in range(n)] for i, n in enumerate(self.n_options)]
        return json_object([(issue, json_string(options)) for issue, options in zip(ISSUES, labels)])

    def parse_offer(self, role: str, payload: str) -> Offer:
        fields = parse_fields(payload, ISSUES, required=True)
        deal = []
        for i, (issue, n) in enumerate(zip(ISSUES, self.n_options)):
            value = fields[issue]
            labels = [label(i, j) for j in range(n)]
            if isinstance(value, str):
                wanted = value.strip().upper()
                if wanted not in labels:
                    raise PayloadError(f"{issue} must be one of {', '.join(labels)} (got {value!r})")
                deal.append(labels.index(wanted))
                continue
            try:
                index = as_integer(value, issue)
            except PayloadError:
                raise PayloadError(f"{issue} must be a label such as {labels[0]} or an option number 1..{n}") from None
            if not 1 <= index <= n:
                raise PayloadError(f"{issue} has options 1..{n} only (got {index})")
            deal.append(index - 1)
        return offer_of(tuple(deal))

    def deal_points(self, role: str, deal: Standing) -> int:
        return deal_score(self.table(role), deal_of(deal.offer))

    def max_points(self, role: str) -> int:
        return TOTAL

    def below_limit(self, role: str, deal: Standing) -> bool:
        return self.deal_points(role, deal) < self.minimum(role)

    def accept_fails(self, deal: Standing) -> str | None:
        if any(self.below_limit(role, deal) for role in self.roles):
            return FAILED_ACCEPT
        return None

    def describe(self, deal: Standing, viewer: str) -> str:
        labels = " ".join(deal.offer[issue] for issue in ISSUES)
        return f"{labels}, worth {self.deal_points(viewer, deal)} points to you"

    def private_view(self, role: str) -> dict[str, Any]:
        return {
            "n_options": list(self.n_options),
            "scores": [list(row) for row in self.table(role)],
            "minimum": self.minimum(role),
        }

    def extra_metrics(self) -> dict[str, float]:
        accepts = sum(1 for _, action in self.log if action is not None and action.tag == "accept")
        product = 0.0
        if self.deal is not None:
            _, u_star, c_star = best_deal(self.table("University"), self.table("Company"))
            deal_product = self.deal_points("University", self.deal) * self.deal_points("Company", self.deal)
            product = deal_product / (u_star * c_star)
        return {"failed_accepts": float(accepts - (self.deal is not None)), "product_vs_best": product}

    def system_prompt(self, role: str) -> str:
        partner = other(self.roles, role)
        lines = []
        for i, (issue, name, n, row) in enumerate(zip(ISSUES, ISSUE_NAMES, self.n_options, self.table(role))):
            options = "; ".join(f"{label(i, j)} {OPTION_TEXTS[i][j]} = {row[j]}" for j in range(n))
            lines.append(f"{issue}. {name}: {options}")
        table = "\n".join(lines)
        example = tag_text("propose", offer_of((1, 0, 2, 1, 0)))
        numbered = tag_text("propose", dict(zip(ISSUES, (2, 1, 3, 2, 1))))
        return (
            f"You represent the {role} in a research alliance between the University and the Company. You and "
            f"the {partner} must agree on one option for each of five issues. Your points for each option:\n"
            f"{table}\n"
            f"A deal's score for you is the sum of your points for its five options (at most {TOTAL}). Your minimum "
            f"acceptable score is {self.minimum(role)}. The {partner} has its own points and its own minimum, and "
            "you do not know them. Your goal is to reach a deal with as high a score for you as you can; without a "
            "deal you score 0.\n"
            f"You take turns writing messages; at most {self.max_messages} messages in total. Actions are tags in "
            "your message; only your last tag counts:\n"
            f"- propose a full deal, one option label (or option number) for each issue A to E, e.g. {example} "
            f"or {numbered}\n"
            f"- accept the {partner}'s standing proposal: <accept/>\n"
            f"- reject the {partner}'s standing proposal: <reject/>\n"
            "- end the negotiation without a deal: <walkaway/>\n"
            "A deal is made when one side accepts the other's standing proposal and the deal reaches both sides' "
            "minimums. If it misses either minimum, no agreement is formed, the proposal is removed and the talks "
            "go on."
        )
