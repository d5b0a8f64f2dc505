"""Craigslist bargaining (environments.md 5): the worked example, bots, payloads, guard and kernels."""

from __future__ import annotations

import random
from typing import Any

import pytest

from repertory.envs import load_kernels, make
from repertory.envs.craigslist import (
    FEATURES,
    GOODS_BANKS,
    HOUSING_BANKS,
    ITEMS,
    Craigslist,
    bot,
    customer_bid,
    list_price_of,
    vendor_ask,
)
from repertory.types import SPLITS, Action, Kernel

LINES = [
    "For sale: road bike with a lightweight aluminium frame and a 21-speed drivetrain.",
    "In great condition, with only light signs of use.",
    "Selling because I am moving to another city.",
    "Pickup only; cash or bank transfer.",
]


def bike(price: int = 200, pct: int = 70, target: int = 140, limit: int = 170, **changes: Any) -> Kernel:
    data = {
        "category": "bike",
        "item": "road bike",
        "features": ["a lightweight aluminium frame", "a 21-speed drivetrain"],
        "title": "Road bike with a lightweight aluminium frame",
        "description": list(LINES),
        "list_price": price,
        "target_pct": pct,
        "target": target,
        "limit": limit,
        **changes,
    }
    return Kernel("craigslist/train/000", "craigslist", "train", 0, 0, data)


def started(kernel: Kernel | None = None) -> Craigslist:
    env = make("craigslist")
    assert isinstance(env, Craigslist)
    env.reset(kernel or bike(), 0)
    for role in env.roles:
        env.observe(role)
    return env


def propose(price: Any) -> str:
    return f'<propose>{{"price": {price}}}</propose>'


def says(env: Craigslist, role: str, text: str) -> None:
    assert env.acting_roles() == [role]
    env.step({role: text})


def customer_bot(env: Craigslist) -> str:
    text = bot(env.view("customer"))
    env.step({"customer": text})
    return text


def texts(env: Craigslist, role: str) -> str:
    return "\n".join(m.content for m in env.observe(role))


# -- worked example ---------------------------------------------------------------------------


def test_worked_example():
    env = started()
    says(env, "vendor", "It is a great bike. " + propose(200))
    assert customer_bot(env).endswith(propose(140))
    assert env.standing is not None and env.standing.offer == {"price": 140}
    for role in env.roles:
        env.observe(role)

    says(env, "vendor", 'Be serious. <propose>{"price": "cheap"}</propose>')
    vendor_sees, customer_sees = texts(env, "vendor"), texts(env, "customer")
    assert "[Referee] Your action was not recorded: price must be a number." in vendor_sees
    assert "[Referee]" not in customer_sees
    assert 'vendor: Be serious. <propose>{"price": "cheap"}</propose>' in customer_sees
    assert env.standing.by == "customer" and env.standing.offer == {"price": 140}

    assert customer_bot(env).endswith(propose(150))
    says(env, "vendor", propose(165))
    assert customer_bot(env).endswith(propose(160))
    says(env, "vendor", propose(165))
    assert customer_bot(env) == "That works for me. <accept/>"

    assert env.done and env.end_reason == "deal"
    result = env.result()
    assert result.roles["vendor"].points == 165 and result.roles["vendor"].outcome == pytest.approx(0.825)
    assert result.roles["customer"].points == 35 and result.roles["customer"].outcome == pytest.approx(35 / 60)
    assert result.roles["vendor"].n_invalid == 1 and result.roles["customer"].n_invalid == 0
    assert (result.roles["vendor"].n_turns, result.roles["customer"].n_turns) == (4, 4)


def test_worked_example_accepting_160_instead():
    env = started()
    for text in (propose(200), None, propose('"cheap"'), None, propose(165), None):
        customer_bot(env) if text is None else says(env, "vendor", text)
    assert env.standing.offer == {"price": 160}
    says(env, "vendor", "<accept/>")
    result = env.result()
    assert result.roles["vendor"].outcome == pytest.approx(0.80)
    assert result.roles["customer"].outcome == pytest.approx(40 / 60)
    assert round(result.roles["customer"].outcome, 4) == 0.6667


# -- outcomes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("price", "vendor", "customer"),
    [(140, 0.7, 1.0), (100, 0.5, 1.0), (200, 1.0, 0.0), (260, 1.0, 0.0), (185, 0.925, 0.25)],
)
def test_outcomes_clip(price, vendor, customer):
    env = started()
    says(env, "vendor", propose(price))
    says(env, "customer", "<accept/>")
    result = env.result()
    assert result.roles["vendor"].outcome == pytest.approx(vendor)
    assert result.roles["customer"].outcome == pytest.approx(customer)
    assert result.roles["customer"].points == 200 - price


def test_walkaway_and_limit_score_zero():
    env = started()
    says(env, "vendor", propose(180))
    says(env, "customer", "No thanks. <walkaway/>")
    assert env.done and env.end_reason == "walkaway"
    assert {r: env.result().roles[r].outcome for r in env.roles} == {"vendor": 0.0, "customer": 0.0}

    env = started()
    for i in range(20):
        says(env, env.roles[i % 2], propose(190 - i))
    assert env.done and env.end_reason == "limit" and env.deal is None
    assert env.result().roles["vendor"].outcome == 0.0 and env.result().roles["customer"].outcome == 0.0


def test_reject_clears_the_standing_proposal():
    env = started()
    says(env, "vendor", propose(190))
    says(env, "customer", "<reject/>")
    assert env.standing is None and not env.done
    says(env, "vendor", "<accept/>")
    assert "there is no proposal to accept" in texts(env, "vendor")
    assert env.n_invalid["vendor"] == 1


# -- payloads ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "price"),
    [
        ('{"price": 150}', 150),
        ('{"Prices": 150}', 150),
        ('{" PRICE ": 150}', 150),
        ('{"price": 150.0}', 150),
        ('{"price": 164.5}', 165),
        ('{"price": 164.49}', 164),
        ('{"price": 0.5}', 1),
        ('{"price": 1e3}', 1000),
    ],
)
def test_valid_prices_are_rounded(payload, price):
    env = started()
    assert env.parse("vendor", f"<propose>{payload}</propose>").action == Action("propose", {"price": price})


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        ('{"price": "150"}', "price must be a number"),
        ('{"price": true}', "price must be a number"),
        ('{"price": null}', "price must be a number"),
        ('{"price": [150]}', "price must be a number"),
        ('{"price": 0.49}', "price must be positive (it rounds to 0)"),
        ('{"price": 0}', "price must be positive (it rounds to 0)"),
        ('{"price": -20}', "price must be positive (it rounds to -20)"),
        ('{"price": 1e400}', "price must be a finite number"),
        ('{"price": 1e308}', "price must be at most 10 times the list price"),
        ('{"price": 2001}', "price must be at most 10 times the list price"),
        ('{"price": 1' + "0" * 400 + "}", "price must be at most 10 times the list price"),
        ('{"price": NaN}', "NaN is not allowed in JSON"),
        ("{}", "missing key 'price'"),
        ('{"cost": 150}', "unknown key 'cost' (expected price)"),
        ('{"price": 150, "prices": 160}', "key 'price' appears twice"),
        ('{"price": 150, "tip": 5}', "unknown key 'tip' (expected price)"),
        ("[150]", "the proposal must be a JSON object"),
        ("price 150", "the proposal is not valid JSON (JSONDecodeError)"),
    ],
)
def test_invalid_prices(payload, reason):
    env = started()
    says(env, "vendor", propose(180))
    says(env, "customer", f"Hmm. <propose>{payload}</propose>")
    assert env.standing.by == "vendor" and env.standing.offer == {"price": 180}
    customer_sees, vendor_sees = texts(env, "customer"), texts(env, "vendor")
    assert f"[Referee] Your action was not recorded: {reason}." in customer_sees
    assert f"customer: Hmm. <propose>{payload}</propose>" in vendor_sees and "[Referee]" not in vendor_sees
    assert env.n_invalid == {"vendor": 0, "customer": 1} and env.messages == 2 and not env.done


def test_tag_syntax():
    env = started()
    assert env.parse("vendor", '<PROPOSE>{"price": 150}</Propose>').action == Action("propose", {"price": 150})
    unclosed = env.parse("vendor", '<propose>{"price": 150}')
    assert unclosed.invalid and unclosed.error == "the <propose> tag is not closed with </propose>"
    assert env.parse("vendor", "Hello there, nice bike.").action == Action("message", "Hello there, nice bike.")
    last = env.parse("vendor", f"{propose(150)} or rather {propose(170)}")
    assert last.action == Action("propose", {"price": 170})
    assert env.parse("vendor", "<accept/>").error == "there is no proposal to accept"
    says(env, "vendor", propose(190))
    says(env, "customer", "Let me think.")
    assert env.parse("vendor", "<accept />").error == "you cannot accept your own proposal"
    assert env.parse("vendor", "<reject></reject>").error == "you cannot reject your own proposal"
    assert env.parse("customer", "<Accept>").action == Action("accept")


# -- bots -------------------------------------------------------------------------------------


def test_customer_bot_concedes_from_target_to_limit():
    assert [customer_bid(140, 170, k) for k in range(6)] == [140, 150, 160, 170, 170, 170]
    # rnd of exact thirds: 158 + 34/3 = 169.33 -> 169, 158 + 68/3 = 180.67 -> 181.
    assert [customer_bid(158, 192, k) for k in range(4)] == [158, 169, 181, 192]
    assert customer_bid(1, 2, 1) == 1 and customer_bid(1, 2, 2) == 2  # 4/3 -> 1, 5/3 -> 2


def test_vendor_bot_concedes_from_list_to_four_fifths():
    assert [vendor_ask(200, k) for k in range(5)] == [200, 187, 173, 160, 160]
    # F = rnd(0.8 * 229) = rnd(183.2) = 183; 229 - 46/3 = 213.67 -> 214; 229 - 92/3 = 198.33 -> 198.
    assert [vendor_ask(229, k) for k in range(4)] == [229, 214, 198, 183]
    assert vendor_ask(45, 3) == 36 and vendor_ask(115, 3) == 92


def view(role: str, own_turn: int, standing: dict[str, Any] | None) -> dict[str, Any]:
    private = {"list_price": 200} if role == "vendor" else {"list_price": 200, "target": 140, "limit": 170}
    return {"role": role, "own_turn": own_turn, "standing": standing, **private}


def offer(price: int, own: bool) -> dict[str, Any]:
    return {"by": "x", "offer": {"price": price}, "own": own}


def test_bot_dispatches_by_seat():
    assert bot(view("vendor", 0, None)) == f"How about 200? {propose(200)}"
    assert bot(view("customer", 0, None)) == f"How about 140? {propose(140)}"
    # The customer accepts p <= o_k, never its own proposal.
    assert bot(view("customer", 1, offer(150, False))) == "That works for me. <accept/>"
    assert bot(view("customer", 1, offer(151, False))).endswith(propose(150))
    assert bot(view("customer", 1, offer(100, True))).endswith(propose(150))
    # The vendor accepts p >= v_k.
    assert bot(view("vendor", 1, offer(187, False))) == "That works for me. <accept/>"
    assert bot(view("vendor", 1, offer(186, False))).endswith(propose(187))
    assert bot(view("vendor", 3, offer(160, False))) == "That works for me. <accept/>"
    assert bot(view("vendor", 2, offer(300, True))).endswith(propose(173))


def test_customer_bot_never_walks_away_or_exceeds_its_limit():
    env = started()
    for k in range(10):
        says(env, "vendor", propose(199))
        text = customer_bot(env)
        assert "walkaway" not in text and text.endswith(propose(min(140 + 10 * k, 170)))
    assert env.done and env.end_reason == "limit"


def test_bot_against_bot_on_the_example_kernel():
    env = started()
    while not env.done:
        (role,) = env.acting_roles()
        env.step({role: bot(env.view(role))})
    # vendor 200, 187, 173, 160; customer 140, 150, 160: the customer's 160 meets v_3 = 160.
    assert env.end_reason == "deal" and env.deal is not None and env.deal.offer == {"price": 160}
    assert env.deal.by == "customer" and env.messages == 7


def test_bots_fail_to_meet_when_the_limit_is_below_four_fifths():
    # Target fraction 0.5: the limit rnd(0.75 P) is below the vendor's floor rnd(0.8 P).
    env = started(bike(200, 50, 100, 150))
    while not env.done:
        (role,) = env.acting_roles()
        env.step({role: bot(env.view(role))})
    assert env.end_reason == "limit"


# -- guard ------------------------------------------------------------------------------------


def test_guard_protects_the_customer_limit():
    env = started()
    assert env.guard("customer", f"I can do {propose(170)}") is None
    assert env.guard("customer", f"I can do {propose(170.4)}") is None
    assert env.guard("customer", f"I can do {propose(171)}") == "I can do"
    assert env.guard("customer", f"I can do {propose(170.5)} tops") == "I can do  tops"
    # Once the guard fires, every tag goes: an earlier in-limit proposal must not become the move.
    assert env.guard("customer", f"{propose(150)} or {propose(180)}") == "or"
    assert env.guard("customer", f"{propose(190)} or {propose(180)}") == "or"
    assert env.guard("customer", 'Broken <propose>{"price": "x"}</propose>') is None
    assert env.guard("vendor", propose(20)) is None

    says(env, "vendor", propose(175))
    assert env.guard("customer", "Fine. <accept/>") == "Fine."
    assert env.guard("customer", "<reject/>") is None
    says(env, "customer", propose(150))
    says(env, "vendor", propose(170))
    assert env.guard("customer", "Deal <accept/>") is None


def test_guard_limit_text():
    assert Craigslist.guarded_limit == "the most the customer will pay"


# -- views and prompts ------------------------------------------------------------------------


def test_private_information():
    env = started()
    vendor, customer = env.system_prompt("vendor"), env.system_prompt("customer")
    assert all(line in vendor for line in LINES) and "$200" in vendor
    assert "$140" not in vendor and "$170" not in vendor
    assert LINES[0] in customer and LINES[1] in customer
    assert LINES[2] not in customer and LINES[3] not in customer
    assert "Your target price is $140. The most you may pay is $170" in customer
    assert "<propose>" in customer and "<accept/>" in customer and "<reject/>" in customer
    assert "<walkaway/>" in vendor and "at most 20 messages" in vendor
    assert env.view("vendor")["list_price"] == 200 and "target" not in env.view("vendor")
    assert (env.view("customer")["target"], env.view("customer")["limit"]) == (140, 170)


def test_status_lines_describe_the_deal_from_each_side():
    env = started()
    says(env, "vendor", propose(165))
    assert "Vendor's proposal stands: the price is $165, $35 below the list price." in texts(env, "customer")
    says(env, "customer", propose(210))
    assert "Customer's proposal stands: the price is $210, 105% of the list price." in texts(env, "vendor")
    env.step({"vendor": "Hello"})
    assert "Your proposal stands: the price is $210, $10 above the list price." in texts(env, "customer")


def test_housing_is_a_monthly_rent():
    housing = next(k for k in load_kernels("craigslist", "train") if k.data["category"] == "housing")
    env = started(housing)
    assert housing.data["description"][0].startswith("For rent: ")
    assert "per month" in env.system_prompt("vendor") and "rent out" in env.system_prompt("vendor")
    says(env, "vendor", propose(housing.data["list_price"]))
    assert f"${housing.data['list_price']} per month" in texts(env, "customer")


# -- kernels ----------------------------------------------------------------------------------


class Recorder(random.Random):
    """Logs the public draw calls of the generator."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.calls: list[str] = []

    def choice(self, seq):
        self.calls.append("choice")
        return super().choice(seq)

    def sample(self, population, k, **kwargs):
        self.calls.append("sample")
        return super().sample(population, k, **kwargs)

    def uniform(self, a, b):
        self.calls.append(f"uniform({a}, {b})")
        return super().uniform(a, b)

    def randint(self, a, b):
        self.calls.append("randint")
        return super().randint(a, b)

    def shuffle(self, x):
        self.calls.append("shuffle")
        super().shuffle(x)


def test_generator_draw_order():
    rng = Recorder(7)
    data = Craigslist.generate_kernel(rng)
    assert rng.calls == ["choice", "choice", "sample", "choice", "choice", "choice", "uniform(-1, 1)", "choice"]
    replay = random.Random(7)
    cat = replay.choice(["bike", "car", "electronics", "furniture", "housing", "phone"])
    item = replay.choice(ITEMS[cat])
    f1, f2 = replay.sample(FEATURES[cat], 2)
    bank = HOUSING_BANKS if cat == "housing" else GOODS_BANKS
    lines = [replay.choice(bank[0]), replay.choice(bank[1]), replay.choice(bank[2])]
    medians = {"bike": 229, "car": 4700, "electronics": 88, "furniture": 120, "housing": 2295, "phone": 160}
    raw = medians[cat] * 2 ** replay.uniform(-1, 1)
    pct = replay.choice([50, 70, 90])
    assert (data["category"], data["item"], data["features"]) == (cat, item, [f1, f2])
    assert data["description"][1:] == lines and data["list_price"] == list_price_of(raw)
    assert data["target_pct"] == pct


@pytest.mark.parametrize(
    ("raw", "price"),
    [
        (112.5, 115),  # rnd rounds the half up: 22.5 -> 23
        (112.49999999999999, 110),
        (117.49, 115),
        (2.0, 5),  # at least one step
        (999.99, 1000),  # below 1000 the step is 5
        (1000.0, 1000),
        (1024.9999999999998, 1000),
        (1025.0, 1050),
        (4590.0, 4600),
    ],
)
def test_list_price_rounding(raw, price):
    assert list_price_of(raw) == price


def test_shipped_kernels_follow_the_formulas():
    kernels = [k for split in SPLITS for k in load_kernels("craigslist", split)]
    for k in kernels:
        d = k.data
        assert d["target"] == (d["list_price"] * d["target_pct"] + 50) // 100
        assert d["limit"] == (d["list_price"] + d["target"] + 1) // 2
        assert d["target"] < d["limit"] < d["list_price"]
        assert d["title"] == d["item"][0].upper() + d["item"][1:] + " with " + d["features"][0]
        assert d["description"][0] == (
            f"For {'rent' if d['category'] == 'housing' else 'sale'}: {d['item']} with "
            f"{d['features'][0]} and {d['features'][1]}."
        )
    assert {k.data["category"] for k in kernels} == {"bike", "car", "electronics", "furniture", "housing", "phone"}
    assert {k.data["target_pct"] for k in kernels} == {50, 70, 90}
    assert all(k.data["list_price"] % 50 == 0 for k in kernels if k.data["category"] in ("car", "housing"))


def test_first_kernel_values():
    k = load_kernels("craigslist", "train")[0]
    assert k.id == "craigslist/train/000"
    assert (k.data["category"], k.data["item"], k.data["list_price"], k.data["target_pct"]) == (
        "bike",
        "mountain bike",
        225,
        70,
    )
    assert (k.data["target"], k.data["limit"]) == (158, 192)  # rnd(157.5) = 158, rnd(191.5) = 192


def test_validator_catches_broken_kernels():
    assert Craigslist.validate_kernel(bike().data) == []
    assert Craigslist.validate_kernel({}) != []
    assert Craigslist.validate_kernel({**bike().data, "features": None}) != []
    cases = {
        "limit": bike(limit=171),
        "target": bike(target=141, limit=171),
        "target_pct": bike(pct=60),
        "list_price": bike(price=203, target=142, limit=173),
        "in 115..460": bike(price=500, target=350, limit=425),
        "integers": bike(limit=170.0),
        "category": bike(category="boat"),
        "item": bike(item="minivan"),
        "features": bike(features=["a clean title", "a 21-speed drivetrain"]),
        "title": bike(title="Road bike"),
        "line 1": bike(description=["For rent" + LINES[0][8:], *LINES[1:]]),
        "line 3": bike(description=[*LINES[:2], "The street is quiet at night.", LINES[3]]),
        "four lines": bike(description=LINES[:3]),
    }
    for needle, kernel in cases.items():
        problems = Craigslist.validate_kernel(kernel.data)
        assert problems and any(needle in p for p in problems), (needle, problems)


def test_craigslist_constrained_answers_are_the_price_grid_and_the_bare_actions():
    game = started()  # list price 200
    grid = [f'<propose>{{"price": {p}}}</propose>' for p in range(100, 201, 10)]
    assert game.action_choices("vendor") == [*grid, "<walkaway/>"]  # nothing on the table yet
    game.step({"vendor": grid[-1]})
    # The customer may now answer the vendor's standing proposal.
    assert game.action_choices("customer") == [*grid, "<accept/>", "<reject/>", "<walkaway/>"]
    game.step({"customer": grid[4]})
    assert game.action_choices("vendor") == [*grid, "<accept/>", "<reject/>", "<walkaway/>"]


def test_turn_quality_of_the_worked_example_is_each_proposal_as_the_deal(tmp_path):
    from repertory.agents import ScriptAgent
    from repertory.agents.resolve import make_agent
    from repertory.envs import env_class
    from repertory.rollout import EpisodeSpec, run_episodes

    script = tmp_path / "vendor.txt"
    script.write_text("\n".join([propose(200), propose('"cheap"'), propose(165), propose(165)]) + "\n")
    customer = make_agent("bot", env_class("craigslist"))
    (episode,) = run_episodes([EpisodeSpec("e", "craigslist", bike(), 0, [ScriptAgent(script), customer])])
    assert episode.result.end_reason == "deal"
    quality = Craigslist.turn_quality(episode)
    # The vendor asks 200, 165, 165 of a 200 list price (its invalid turn has none); the customer offers 140, 150,
    # 160 against its target of 140 (outcome (200 - price) / 60), then accepts (no proposal, no quality).
    assert quality == pytest.approx(
        {("p0", 0): 1.0, ("p0", 2): 0.825, ("p0", 3): 0.825, ("p1", 0): 1.0, ("p1", 1): 50 / 60, ("p1", 2): 40 / 60}
    )
    episode.result.end_reason = "walkaway"
    assert Craigslist.turn_quality(episode) == {}
