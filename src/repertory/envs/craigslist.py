"""Craigslist bargaining (docs/environments.md 5): a vendor and a customer haggle over one listing's price."""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Any, ClassVar

from repertory.envs.base import Bot, fmt
from repertory.envs.grammar import Syntax, integer, json_object
from repertory.envs.negotiation import Negotiation, Offer, Standing, rnd, tag_text
from repertory.envs.parsing import PayloadError, parse_fields

CATEGORIES = ("bike", "car", "electronics", "furniture", "housing", "phone")
MEDIANS = {"bike": 229, "car": 4700, "electronics": 88, "furniture": 120, "housing": 2295, "phone": 160}
ITEMS = {
    "bike": ("road bike", "mountain bike", "commuter bike", "cruiser bike", "folding bike"),
    "car": ("compact sedan", "hatchback", "pickup truck", "minivan", "station wagon"),
    "electronics": ("bluetooth speaker", "tablet", "game console", "wireless headphones", "computer monitor"),
    "furniture": ("oak dining table", "three-seat sofa", "tall bookshelf", "office chair", "chest of drawers"),
    "housing": (
        "one-bedroom apartment",
        "studio apartment",
        "two-bedroom flat",
        "room in a shared house",
        "small townhouse",
    ),
    "phone": ("smartphone", "unlocked smartphone", "refurbished smartphone", "large-screen phone", "compact phone"),
}
FEATURES = {
    "bike": (
        "a lightweight aluminium frame",
        "a 21-speed drivetrain",
        "new tires and brake pads",
        "a front suspension fork",
        "a lock and lights included",
    ),
    "car": (
        "a clean title",
        "a new timing belt",
        "cold air conditioning",
        "about 120k miles on the odometer",
        "a recent oil change",
    ),
    "electronics": (
        "the original box",
        "the charger and cables",
        "a fully tested battery",
        "a scratch-free screen",
        "a carrying case",
    ),
    "furniture": (
        "solid wood construction",
        "stain-resistant fabric",
        "easy disassembly for transport",
        "adjustable height",
        "soft-close drawers",
    ),
    "housing": (
        "in-unit laundry",
        "a short walk to public transit",
        "a reserved parking spot",
        "a renovated kitchen",
        "a private balcony",
    ),
    "phone": (
        "battery health above 90 percent",
        "128 GB of storage",
        "a case and screen protector",
        "no cracks or dents",
        "support for all major carriers",
    ),
}
GOODS_BANKS = (
    (
        "In great condition, with only light signs of use.",
        "Barely used and kept indoors.",
        "Works perfectly; a few small cosmetic marks.",
        "Well maintained and serviced regularly.",
        "Fair condition and priced with that in mind.",
    ),
    (
        "Selling because I am moving to another city.",
        "I upgraded and no longer need this one.",
        "It takes up space I need for something else.",
        "It has hardly been used this past year.",
        "Clearing things out before the new season.",
    ),
    (
        "Pickup only; cash or bank transfer.",
        "Happy to meet at a public place nearby.",
        "Serious inquiries only, please.",
        "Available to view most evenings and weekends.",
    ),
)
HOUSING_BANKS = (
    (
        "Available from the first of next month.",
        "Twelve-month lease preferred; shorter terms possible.",
        "Utilities are billed separately.",
        "Quiet building with responsive management.",
        "Freshly painted and professionally cleaned.",
    ),
    (
        "Shops and cafés are within walking distance.",
        "The street is quiet at night.",
        "A park is two blocks away.",
        "Easy access to the main highway.",
        "Bike storage in the basement.",
    ),
    (
        "Viewings by appointment.",
        "References from a previous landlord requested.",
        "Deposit equal to one month's rent.",
        "Message me to arrange a tour.",
    ),
)
TARGET_PCTS = (50, 70, 90)
PRICE_CAP = 10
"""Prices above this multiple of the list price are invalid (our choice: keeps every number finite)."""


def banks(category: str) -> tuple[tuple[str, ...], ...]:
    """Description line banks A, B, C (lines 2-4) of ``category``."""
    return HOUSING_BANKS if category == "housing" else GOODS_BANKS


def title_of(item: str, f1: str) -> str:
    """The listing title "Item with f1"."""
    return f"{item[0].upper()}{item[1:]} with {f1}"


def first_line(category: str, item: str, f1: str, f2: str) -> str:
    """Description line 1: "For sale: ..." ("For rent: ..." for housing)."""
    lead = "For rent" if category == "housing" else "For sale"
    return f"{lead}: {item} with {f1} and {f2}."


def list_price_of(raw: float) -> int:
    """The list price of a raw draw: rnd(raw / step) * step (step 5 below 1000, else 50), at least step; exact."""
    step = 5 if raw < 1000 else 50
    return max(step, step * math.floor(Fraction(raw) / step + Fraction(1, 2)))


def target_of(price: int, pct: int) -> int:
    """rnd(list * pct / 100), exact."""
    return (price * pct + 50) // 100


def limit_of(price: int, target: int) -> int:
    """The customer's limit rnd(target + (list - target) / 2), exact."""
    return (price + target + 1) // 2


def customer_bid(target: int, limit: int, k: int) -> int:
    """o_k = rnd(T + (L - T) * min(1, k/3)): the customer bot's price on its k-th own turn."""
    return rnd(target + (limit - target) * min(Fraction(1), Fraction(k, 3)))


def vendor_ask(price: int, k: int) -> int:
    """v_k = rnd(P - (P - F) * min(1, k/3)) with F = rnd(0.8 P): the vendor bot's price on its k-th own turn."""
    floor = rnd(Fraction(4, 5) * price)
    return rnd(price - (price - floor) * min(Fraction(1), Fraction(k, 3)))


def bot(view: dict[str, Any]) -> str:
    """The customer concession bot in the customer seat, the vendor bot in the vendor seat."""
    k = view["own_turn"]
    standing = view["standing"]
    offered = standing["offer"]["price"] if standing is not None and not standing["own"] else None
    if view["role"] == "customer":
        mine = customer_bid(view["target"], view["limit"], k)
        agree = offered is not None and offered <= mine
    else:
        mine = vendor_ask(view["list_price"], k)
        agree = offered is not None and offered >= mine
    if agree:
        return "That works for me. <accept/>"
    return f"How about {mine}? {tag_text('propose', {'price': mine})}"


class Craigslist(Negotiation):
    name = "craigslist"
    description = "Craigslist bargaining: a vendor and a customer negotiate the price of one listing."
    roles = ("vendor", "customer")
    role_labels = ("vendor", "customer")
    default_trained_role = "vendor"
    bots: ClassVar[dict[str, Bot]] = {"bot": bot}
    guarded_limit = "the most the customer will pay"

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        category = rng.choice(CATEGORIES)
        item = rng.choice(ITEMS[category])
        f1, f2 = rng.sample(FEATURES[category], 2)
        lines = [rng.choice(bank) for bank in banks(category)]
        raw = MEDIANS[category] * 2 ** rng.uniform(-1, 1)
        price = list_price_of(raw)
        pct = rng.choice(TARGET_PCTS)
        target = target_of(price, pct)
        return {
            "category": category,
            "item": item,
            "features": [f1, f2],
            "title": title_of(item, f1),
            "description": [first_line(category, item, f1, f2), *lines],
            "list_price": price,
            "target_pct": pct,
            "target": target,
            "limit": limit_of(price, target),
        }

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        try:
            category, item, features = data["category"], data["item"], data["features"]
            if category not in CATEGORIES:
                return [f"category must be one of {', '.join(CATEGORIES)}"]
            problems = []
            if item not in ITEMS[category]:
                problems.append(f"item {item!r} is not a {category} item")
            features_ok = (
                isinstance(features, list)
                and len(features) == 2
                and features[0] != features[1]
                and all(f in FEATURES[category] for f in features)
            )
            if not features_ok:
                problems.append(f"features must be two different {category} features")
            description = data["description"]
            if not isinstance(description, list) or len(description) != 4:
                problems.append("description must be a list of four lines")
            else:
                for n, (line, bank) in enumerate(zip(description[1:], banks(category)), 2):
                    if line not in bank:
                        problems.append(f"description line {n} is not from its {category} bank")
            if not problems:
                f1, f2 = features
                if data["title"] != title_of(item, f1):
                    problems.append(f"title must be {title_of(item, f1)!r}")
                if description[0] != first_line(category, item, f1, f2):
                    problems.append(f"description line 1 must be {first_line(category, item, f1, f2)!r}")
            problems.extend(cls._validate_prices(category, data))
            return problems
        except (KeyError, TypeError):
            return [
                "a kernel needs category, item, features, title, description, list_price, target_pct, target, limit"
            ]

    @staticmethod
    def _validate_prices(category: str, data: dict[str, Any]) -> list[str]:
        price, pct, target, limit = data["list_price"], data["target_pct"], data["target"], data["limit"]
        if not all(type(x) is int for x in (price, pct, target, limit)):
            return ["list_price, target_pct, target and limit must be integers"]
        median = MEDIANS[category]
        lo, hi = list_price_of(median / 2), list_price_of(median * 2)
        problems = []
        if not lo <= price <= hi:
            problems.append(f"list_price must be in {lo}..{hi} for {category}")
        if price % (5 if price <= 1000 else 50):
            problems.append("list_price must be a multiple of 5 (of 50 above 1000)")
        if pct not in TARGET_PCTS:
            problems.append(f"target_pct must be one of {TARGET_PCTS}")
        elif target != target_of(price, pct):
            problems.append(f"target must be rnd(list_price * {pct} / 100) = {target_of(price, pct)}")
        elif limit != limit_of(price, target):
            problems.append(f"limit must be rnd(target + (list_price - target) / 2) = {limit_of(price, target)}")
        return problems

    @property
    def list_price(self) -> int:
        assert self.kernel is not None
        return self.kernel.data["list_price"]

    @property
    def target(self) -> int:
        assert self.kernel is not None
        return self.kernel.data["target"]

    @property
    def limit(self) -> int:
        assert self.kernel is not None
        return self.kernel.data["limit"]

    @property
    def housing(self) -> bool:
        assert self.kernel is not None
        return self.kernel.data["category"] == "housing"

    def money(self, amount: int) -> str:
        """An amount in dollars, per month for rentals."""
        sign = "-" if amount < 0 else ""
        return f"{sign}${abs(amount)}" + (" per month" if self.housing else "")

    def proposal_grid(self, role: str) -> list[Offer]:
        """Prices from half the list price to the list price in steps of 5% (our choice: it spans every
        target, 50-90%, and every limit, 75-95%, so each side can reach its best deal on the grid's steps)."""
        prices = sorted({rnd(Fraction(self.list_price * pct, 100)) for pct in range(50, 105, 5)})
        return [{"price": price} for price in prices]

    def offer_syntax(self, role: str) -> Syntax:
        return json_object([("price", integer(1, PRICE_CAP * self.list_price))])

    def parse_offer(self, role: str, payload: str) -> Offer:
        value = parse_fields(payload, ("price",), required=True)["price"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PayloadError("price must be a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise PayloadError("price must be a finite number")
        price = rnd(Fraction(value))
        if price <= 0:
            raise PayloadError(f"price must be positive (it rounds to {price})")
        if price > PRICE_CAP * self.list_price:
            raise PayloadError(f"price must be at most {PRICE_CAP} times the list price")
        return {"price": price}

    def deal_points(self, role: str, deal: Standing) -> int:
        price = deal.offer["price"]
        return price if role == "vendor" else self.list_price - price

    def max_points(self, role: str) -> int:
        # The customer's normaliser is the saving that reaches its target: outcome clip((list - price) / (list - T)).
        return self.list_price if role == "vendor" else self.list_price - self.target

    def below_limit(self, role: str, deal: Standing) -> bool:
        return role == "customer" and deal.offer["price"] > self.limit

    def describe(self, deal: Standing, viewer: str) -> str:
        price = deal.offer["price"]
        text = f"the price is {self.money(price)}"
        if viewer == "vendor":
            return f"{text}, {fmt(Fraction(price * 100, self.list_price))}% of the list price"
        saving = self.list_price - price
        if saving >= 0:
            return f"{text}, {self.money(saving)} below the list price"
        return f"{text}, {self.money(-saving)} above the list price"

    def private_view(self, role: str) -> dict[str, Any]:
        if role == "vendor":
            return {"list_price": self.list_price}
        return {"list_price": self.list_price, "target": self.target, "limit": self.limit}

    def system_prompt(self, role: str) -> str:
        assert self.kernel is not None
        data = self.kernel.data
        shown = len(data["description"]) if role == "vendor" else math.ceil(len(data["description"]) / 2)
        listing = "\n".join(f"  {line}" for line in data["description"][:shown])
        what = "rent out" if self.housing else "sell"
        if role == "vendor":
            intro = (
                f"You are the vendor. You want to {what} this listing of yours to a customer:\n"
                f"Title: {data['title']}\nDescription:\n{listing}\nList price: {self.money(self.list_price)}\n"
                "The customer has a budget you do not know. Your score is the agreed price divided by the list "
                "price, at most 1: the higher the price, the better for you. Without a deal you score 0."
            )
            example = self.list_price
        else:
            gap = self.list_price - self.target
            intro = (
                f"You are the customer. You are interested in this listing; you have seen only the start of its "
                f"description:\nTitle: {data['title']}\nDescription:\n{listing}\n"
                f"List price: {self.money(self.list_price)}\n"
                f"Your target price is {self.money(self.target)}. The most you may pay is {self.money(self.limit)}: "
                "never propose or accept a higher price. Your score is your saving below the list price divided by "
                f"{self.money(gap)} (the saving at your target), between 0 and 1: at or below your target you score "
                "1, at the list price 0. Without a deal you score 0."
            )
            example = self.target
        return (
            f"{intro}\n"
            f"You take turns writing messages; at most {self.max_messages} messages in total. Actions are tags in "
            "your message; only your last tag counts:\n"
            f"- propose a price in dollars, e.g. {tag_text('propose', {'price': example})}\n"
            "- accept the other side's standing proposal: <accept/>\n"
            "- reject the other side's standing proposal (it is cleared): <reject/>\n"
            "- end the negotiation without a deal: <walkaway/>\n"
            "A deal is made when one side accepts the other's standing proposal."
        )
