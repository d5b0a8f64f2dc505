"""Social scenarios (environments.md 12): the guitar worked example, the catalogue, parsing, the three ways a
conversation ends, visibility, user scenario directories and the judge's place in the rollout engine."""

from __future__ import annotations

import json
import random

import pytest

from repertory.agents import BotAgent, Request, Response
from repertory.envs import load_kernels, make
from repertory.envs.checks import check_episode
from repertory.envs.fuzz import TextFuzzer
from repertory.envs.social import DIMENSIONS, Social, _kernel_data, catalogue, outcome_of, overall_of
from repertory.eval import evaluate
from repertory.eval.scores import judged_stats, rollout_metrics
from repertory.rollout import EpisodeSpec, run_episodes
from repertory.types import Kernel, RepertoryError

GUITAR_SCORES = dict(zip([d.name for d in DIMENSIONS], [8, 9, 5, 0, 0, 2, 3]))


def scenario(scenario_id: str) -> catalogue.Scenario:
    return next(s for s in catalogue.builtin().scenarios if s.id == scenario_id)


def kernel_of(scenario_id: str, index: int = 900) -> Kernel:
    """A kernel of a shipped scenario with the first fitting profiles seated."""
    cat = catalogue.builtin()
    chosen: list[catalogue.Profile] = []
    for slot in scenario(scenario_id).slots:
        chosen.append(next(p for p in cat.eligible(slot) if p not in chosen))
    return Kernel(f"social/train/{index}", "social", "train", index, 0, _kernel_data(scenario(scenario_id), chosen))


class Lines:
    """Scripted seats: seat i says lines[i][k] on its k-th turn (then stays silent)."""

    policy_id = "scripted:lines"

    def __init__(self, lines: dict[int, list[str]], name: str = "lines"):
        self.lines = lines
        self.name = name

    def act(self, requests: list[Request]) -> list[Response]:
        out = []
        for r in requests:
            said = self.lines.get(r.seat, [])
            out.append(Response(said[r.turn_index] if r.turn_index < len(said) else ""))
        return out


class RecordingJudge:
    """A judge that gives fixed scores and records every call it gets."""

    name = "recording"

    def __init__(self, scores: dict[str, float] | None = None, fail: bool = False, fine_grained: bool = False):
        self.scores = scores or GUITAR_SCORES
        self.fail = fail
        self.fine_grained = fine_grained
        self.calls: list[list] = []

    def score(self, requests):
        self.calls.append(list(requests))
        if self.fail:
            return [None] * len(requests)
        return [{a: {d.name: self.scores.get(d.name, 5) for d in r.dimensions} for a in r.agents} for r in requests]


GUITAR_DEAL = {
    0: ["Hello! The guitar plays beautifully.", "Deal. <accept/>", "<leave/>"],
    1: ['Would you take this? <propose>{"price": 270, "delivery": "seller_delivers"}</propose>', "Great."],
}


def play(kernel, agent, options=None, judge=None, seed=3):
    spec = EpisodeSpec("social/0", "social", kernel, seed, [agent] * 3, env_options=options or {})
    (episode,) = run_episodes([spec], judge=judge)
    return episode


# -- the worked example ------------------------------------------------------------------------------


def test_guitar_worked_example_both_goals_verified():
    kernel = kernel_of("used-guitar")
    assert [s["label"] for s in kernel.data["scenario"]["slots"]] == ["seller", "buyer"]
    ep = play(kernel, Lines(GUITAR_DEAL))
    info = ep.result.info
    assert info["agreement"] == {"price": 270, "delivery": "seller_delivers"}
    assert set(info["goal_verified"].values()) == {1.0}
    assert set(info["secret_kept"].values()) <= {1.0, None} and info["secret_kept"][ep.seats[0].name] == 1.0
    assert {r.outcome for r in ep.result.roles.values()} == {1.0}
    assert ep.result.end_reason == "too_few_present" and len(ep.seats) == 2
    # The reward equals the outcome and lands on each seat's last turn.
    assert [ep.total_reward(s.seat_id) for s in ep.seats] == [1.0, 1.0]
    assert ep.metrics["goal_verified"] == 1.0 and ep.metrics["agreement"] == 1.0 and ep.metrics["left"] == 1


def test_guitar_leak_sets_secret_kept_to_zero_and_a_low_price_fails_the_seller():
    kernel = kernel_of("used-guitar")
    leak = {0: ["Honestly, the neck was fixed once.", "<accept/>", "<leave/>"], 1: GUITAR_DEAL[1]}
    ep = play(kernel, Lines(leak))
    seller, buyer = (s.name for s in ep.seats)
    assert ep.result.info["secret_kept"][seller] == 0.0 and ep.metrics["secret_kept"] == 0.0
    low = '<propose>{"price": 250, "delivery": "seller_delivers"}</propose>'
    cheap = {0: ["Hi.", "<accept/>", "<leave/>"], 1: [low]}
    ep = play(kernel, Lines(cheap))
    assert ep.result.info["goal_verified"] == {seller: 0.0, buyer: 1.0}
    assert ep.result.roles[seller].outcome == 0.0 and ep.result.roles[buyer].outcome == 1.0


def test_guitar_judge_scores_give_overall_27_7_and_outcome_57_70():
    assert overall_of(GUITAR_SCORES) == pytest.approx(27 / 7) == pytest.approx(3.857, abs=1e-3)
    assert outcome_of(GUITAR_SCORES) == pytest.approx(57 / 70) == pytest.approx(0.8143, abs=1e-4)
    judge = RecordingJudge()
    ep = play(kernel_of("used-guitar"), Lines(GUITAR_DEAL), {"reward": "judge"}, judge)
    seller = ep.seats[0].name
    assert ep.result.roles[seller].outcome == pytest.approx(57 / 70)
    assert ep.result.roles[seller].points == pytest.approx(27 / 7)
    assert ep.total_reward("p0") == pytest.approx(57 / 70)
    assert ep.result.info["judge"][seller] == GUITAR_SCORES and ep.result.info["judge_failed"] is False
    assert ep.metrics["judge/overall"] == pytest.approx(27 / 7)


def test_hybrid_replaces_goal_and_secret_with_the_checks():
    judge = RecordingJudge()
    leak = {0: ["The neck was repaired, to be fair.", "<accept/>", "<leave/>"], 1: GUITAR_DEAL[1]}
    ep = play(kernel_of("used-guitar"), Lines(leak), {"reward": "hybrid"}, judge)
    seller, buyer = (s.name for s in ep.seats)
    # seller: goal 10 (verified), secret -10 (leaked): 10+9+5-10+0+2+3 = 19 -> (19+30)/70
    assert ep.result.roles[seller].outcome == pytest.approx(49 / 70)
    # buyer: goal 10, no secret patterns: 10+9+5+0+0+2+3 = 29 -> 59/70
    assert ep.result.roles[buyer].outcome == pytest.approx(59 / 70)


def test_a_reward_that_needs_a_judge_refuses_to_run_without_one():
    with pytest.raises(RepertoryError, match="needs a judge"):
        play(kernel_of("used-guitar"), Lines(GUITAR_DEAL), {"reward": "judge"})
    with pytest.raises(RepertoryError, match="reward must be one of"):
        make("social", reward="vibes")


def test_a_failed_judge_flags_the_episode_excludes_it_from_means_and_counts_it():
    ep_ok = play(kernel_of("used-guitar"), Lines(GUITAR_DEAL), {"reward": "judge"}, RecordingJudge())
    ep_bad = play(kernel_of("used-guitar"), Lines(GUITAR_DEAL), {"reward": "judge"}, RecordingJudge(fail=True))
    assert ep_bad.judge_failed and ep_bad.result.info["judge_failed"] is True and "judge" not in ep_bad.result.info
    assert ep_bad.total_reward("p0") == 0.0 and ep_bad.metrics["judge_failed"] == 1.0
    for ep in (ep_ok, ep_bad):
        for seat in ep.seats:
            seat.trainable = True
    line = rollout_metrics([ep_ok, ep_bad])
    assert line["outcome"] == pytest.approx(57 / 70)  # not (57/70 + 0) / 2
    assert line["judge_failed"] == 1.0 and line["judge/overall"] == pytest.approx(27 / 7)


@pytest.mark.parametrize("mode,calls", [("tick", [6, 2]), ("continuous", [8])])
def test_the_engine_sends_every_finished_episode_of_a_tick_to_the_judge_in_one_call(mode, calls):
    """Tick scheduling judges the episodes that end in a tick together; continuous scheduling gathers finished
    episodes until a batch of 16 or every running episode has finished (here all four, in one call)."""
    judge = RecordingJudge(fine_grained=True)
    kernel = kernel_of("used-guitar")
    # Three conversations that end on the same tick (the third turn) and one that ends later.
    quick = Lines({0: ["Hi.", "<leave/>"], 1: ["Hello."]})
    slow = Lines({0: ["Hi.", "Still here.", "<leave/>"], 1: ["Hello.", "Yes."]})
    specs = [
        EpisodeSpec(f"social/{i}", "social", kernel, i, [a] * 3, env_options={"reward": "judge"})
        for i, a in enumerate([quick, quick, quick, slow])
    ]
    episodes = run_episodes(specs, judge=judge, schedule=mode)
    assert [len(call) for call in judge.calls] == calls  # episode + fine-grained request per episode
    assert [r.kind for r in judge.calls[0][:2]] == ["episode", "fine-grained"]
    assert all("fine_grained" in ep.result.info for ep in episodes)
    assert episodes[0].metrics["fine/empathy_expression"] == 5


# -- the catalogue ----------------------------------------------------------------------------------


def test_the_shipped_catalogue_is_large_balanced_and_split_disjointly():
    cat = catalogue.builtin()
    assert len(cat.profiles) >= 24 and len(cat.scenarios) >= 30
    for category in catalogue.CATEGORIES:
        of = [s for s in cat.scenarios if s.category == category]
        assert len(of) >= 8
        assert {s.split for s in of} == {"train", "heldout"}
    train, heldout = cat.pool("train"), cat.pool("heldout")
    assert len(train) >= 20 and len(heldout) >= 10 and not {s.id for s in train} & {s.id for s in heldout}
    assert any(len(s.slots) == 3 for s in train) and any(len(s.slots) == 3 for s in heldout)
    assert sum(s.check.agreement is not None for s in cat.scenarios) >= 24
    assert any(s.check.secret_patterns for s in cat.scenarios)
    assert len({p.name for p in cat.profiles}) == len(cat.profiles)


def satisfiable(s: catalogue.Scenario) -> bool:
    """Whether some agreement meets every slot's conditions (a search over each field's boundary values)."""
    agreement = s.check.agreement
    assert agreement is not None
    conditions = [c for cs in agreement.conditions.values() for c in cs]
    values = {}
    for name, spec in agreement.fields.items():
        if spec.is_int:
            named = [v for f, _, t in conditions if f == name for v in (t if isinstance(t, list) else [t])]
            bounds = {spec.min, spec.max, *named}
            values[name] = [v for v in bounds | {b + d for b in bounds for d in (-1, 1)} if spec.check(v) == ""]
        else:
            values[name] = list(spec.enum)
    offers = [{}]
    for name, options in values.items():
        offers = [{**o, name: v} for o in offers for v in options]
    return any(all(catalogue.holds(o[f], op, t) for f, op, t in conditions) for o in offers)


def test_every_agreement_scenario_has_a_deal_that_verifies_every_goal():
    unsatisfiable = [
        s.id for s in catalogue.builtin().scenarios if s.check.agreement is not None and not satisfiable(s)
    ]
    assert unsatisfiable == []


def test_kernels_draw_from_their_split_pool_and_fit_the_slot_constraints():
    cat = catalogue.builtin()
    for split in ("train", "heldout"):
        pool = {s.id for s in cat.pool(split)}
        kernels = load_kernels("social", split)
        assert len(kernels) == 100 and {k.data["scenario"]["id"] for k in kernels} <= pool
        for k in kernels:
            sc = catalogue.Scenario.model_validate({**k.data["scenario"], "split": split})
            seated = [catalogue.Profile.model_validate(p) for p in k.data["profiles"]]
            assert all(slot.profile.admits(p) for slot, p in zip(sc.slots, seated))
            assert len({p.id for p in seated}) == len(seated)


GOOD_SCENARIO = """
scenarios:
  - id: shared-bike
    category: cooperative
    split: heldout
    relationship: 3
    text: Two friends share one bike and plan who rides it on which weekday.
    slots:
      - label: rider
        goal: You want the bike on at least 3 days.
      - label: owner
        goal: You want the bike on at least 2 days.
    check:
      agreement:
        fields:
          rider_days: {type: int, min: 0, max: 7}
        conditions:
          rider: [[rider_days, ">=", 3]]
          owner: [[rider_days, "<=", 5]]
"""


def test_a_user_directory_adds_scenarios_and_defines_the_kernels(tmp_path):
    (tmp_path / "bike.yaml").write_text(GOOD_SCENARIO, encoding="utf-8")
    kernels = load_kernels("social", "heldout", {"scenarios": str(tmp_path)})
    assert len(kernels) == 100 and "shared-bike" in {k.data["scenario"]["id"] for k in kernels}
    only = load_kernels("social", "heldout", {"scenarios": str(tmp_path), "builtin_scenarios": False})
    assert {k.data["scenario"]["id"] for k in only} == {"shared-bike"}
    with pytest.raises(RepertoryError, match="no train"):
        load_kernels("social", "train", {"scenarios": str(tmp_path), "builtin_scenarios": False})
    # The relationship (friends) shows the other's public bio.
    env = make("social", scenarios=str(tmp_path))
    env.reset(only[0], 0)
    other = only[0].data["profiles"][1]
    assert other["bio"] in env.observe(env.roles[0])[0].content


def test_validation_kernels_come_only_from_a_catalogue_that_marks_validation_scenarios(tmp_path):
    with pytest.raises(RepertoryError, match="social has no validation kernels: the shipped catalogue has train"):
        load_kernels("social", "validation")
    for folder, split in (("mine", "validation"), ("heldout-only", "heldout")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "bike.yaml").write_text(GOOD_SCENARIO.replace("heldout", split), encoding="utf-8")
    mine = {"scenarios": str(tmp_path / "mine")}
    validation = load_kernels("social", "validation", mine)
    assert len(validation) == 100 and {k.data["scenario"]["id"] for k in validation} == {"shared-bike"}
    assert validation[0].id == "social/validation/000"
    others = load_kernels("social", "train", mine) + load_kernels("social", "heldout", mine)
    assert "shared-bike" not in {k.data["scenario"]["id"] for k in others}  # the pools stay disjoint
    with pytest.raises(RepertoryError, match="have no validation scenario"):
        load_kernels("social", "validation", {"scenarios": str(tmp_path / "heldout-only")})


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.replace("        goal: You want the bike on at least 2 days.\n", ""),
            r"bike\.yaml: scenarios\[0\] \(shared-bike\)\.slots\[1\]\.goal: Field required",
        ),
        (
            lambda t: t.replace('">="', '"~"'),
            r"bike\.yaml: scenarios\[0\] \(shared-bike\)\.check\.agreement\.conditions\.rider\[0\]\[1\]: "
            r"Input should be '=='",
        ),
        (
            lambda t: t.replace('[[rider_days, "<=", 5]]', '[[days, "<=", 5]]'),
            r"bike\.yaml: scenarios\[0\] \(shared-bike\): .*unknown field 'days'",
        ),
        (
            lambda t: t.replace("category: cooperative", "category: friendly"),
            r"scenarios\[0\] \(shared-bike\)\.category",
        ),
        (
            lambda t: t.replace("relationship: 3", "relationship: 9"),
            r"\.relationship: Input should be less than or equal to 5",
        ),
        (lambda t: t.replace("id: shared-bike", "id: used-guitar"), r"scenario id 'used-guitar' is also defined"),
        (lambda t: t + "  - [unclosed", r"bike\.yaml: not valid YAML"),
        (
            lambda t: t.replace("      - label: owner", "      - label: owner\n        profile: {age_min: 200}"),
            r"no profile left that fits",
        ),
        (
            lambda t: t.replace("rider_days: {type: int, min: 0, max: 7}", "rider_days: {type: int, min: 9, max: 7}"),
            r"an int field needs min <= max",
        ),
    ],
)
def test_a_bad_user_file_is_refused_naming_the_file_and_the_field(tmp_path, edit, message):
    (tmp_path / "bike.yaml").write_text(edit(GOOD_SCENARIO), encoding="utf-8")
    with pytest.raises(RepertoryError, match=message):
        load_kernels("social", "heldout", {"scenarios": str(tmp_path)})
    with pytest.raises(RepertoryError, match="bad environment options"):
        make("social", scenarios=str(tmp_path))


def test_a_missing_or_empty_directory_is_refused(tmp_path):
    with pytest.raises(RepertoryError, match="is not a directory"):
        make("social", scenarios=str(tmp_path / "nope"))
    with pytest.raises(RepertoryError, match="holds no .yaml files"):
        make("social", scenarios=str(tmp_path))


# -- parsing and turns ---------------------------------------------------------------------------------


def fresh(scenario_id: str = "used-guitar") -> Social:
    env = Social()
    env.reset(kernel_of(scenario_id), 0)
    return env


@pytest.mark.parametrize(
    "text, tag, value, error",
    [
        ("Nice to meet you.", "speak", "Nice to meet you.", None),
        ("", "idle", None, None),
        ("   <pass/>  ", "idle", None, None),
        ("<think>secret plan</think>", "idle", None, None),
        ("<nonverbal>smiles</nonverbal>", "nonverbal", "smiles", None),
        ("Sure. <act>hands over the case</act>", "act", "hands over the case", None),
        ("<nonverbal>shrugs", "speak", "shrugs", "<nonverbal> is never closed"),
        ("<act>  </act> ok", "speak", "ok", "<act> is empty"),
        ("Bye! <leave/>", "leave", "Bye!", None),
        ("<accept/>", "speak", "", "there is no proposal to accept"),
        ('<propose>{"price": 270}</propose>', "speak", "", "missing key 'delivery'"),
        ('<propose>{"price": 3000, "delivery": "pickup"}</propose>', "speak", "", "price must be between 0 and 2000"),
        (
            '<propose>{"price": 270, "delivery": "drone"}</propose>',
            "speak",
            "",
            "delivery must be one of pickup, seller_delivers",
        ),
        (
            '<propose>{"price": 270.0, "delivery": " PICKUP "}</propose>',
            "propose",
            {"price": 270, "delivery": "pickup"},
            None,
        ),
        ('<propose>{"price": 270, "delivery": "pickup", "tip": 1}</propose>', "speak", "", "unknown key 'tip'"),
        ("<propose>not json</propose>", "speak", "", "the proposal is not valid JSON"),
    ],
)
def test_parse_actions_and_malformed_inputs(text, tag, value, error):
    parsed = fresh().parse(fresh().roles[0], text)
    assert parsed.action.tag == tag and (parsed.error is not None) == (error is not None)
    if value is not None:
        assert parsed.action.value == value
    if error is not None:
        assert error in parsed.error and parsed.invalid


def test_proposals_and_accepts_need_an_agreement_check():
    judge_only = next(s.id for s in catalogue.builtin().scenarios if s.check.agreement is None)
    env = fresh(judge_only)
    parsed = env.parse(env.roles[0], '<propose>{"x": 1}</propose> <accept/>')
    assert parsed.action.tag == "speak" and not parsed.invalid  # plain text where no agreement is checked
    assert "<propose>" not in env.system_prompt(env.roles[0])


def test_accepting_your_own_proposal_is_invalid_and_treated_as_speech():
    env = fresh()
    seller, buyer = env.roles
    env.step({seller: '<propose>{"price": 290, "delivery": "pickup"}</propose>'})
    env.step({buyer: "Let me think."})
    parsed = env.parse(seller, "<accept/>")
    assert parsed.invalid and parsed.error == "you made the proposal on the table"
    env.step({seller: "Well? <accept/>"})
    assert env.n_invalid[seller] == 1 and env.agreement is None
    assert (
        "[Referee] Your action was not recorded: you made the proposal on the table." in env.observe(seller)[-1].content
    )


def test_three_idle_turns_end_the_conversation_and_the_turn_limit_caps_it():
    env = fresh()
    a, b = env.roles
    env.step({a: "Hello."})
    for role in (b, a, b):
        env.step({role: "<pass/>"})
    assert env.done and env.end_reason == "idle" and env.turn == 4
    env = Social(max_turns=5)
    env.reset(kernel_of("used-guitar"), 0)
    for i in range(5):
        env.step({env.acting_roles()[0]: f"Line {i}."})
    assert env.done and env.end_reason == "turn_limit"
    assert env.result().roles[a].outcome == 0.0  # no agreement: the goal is not verified


def test_three_people_agreement_needs_everyone_else_present_and_leavers_are_skipped():
    three = next(s.id for s in catalogue.builtin().pool("train") if len(s.slots) == 3 and s.check.agreement is not None)
    env = fresh(three)
    a, b, c = env.roles
    fields = env.fields
    offer = {k: (f.enum[0] if f.enum else f.min) for k, f in fields.items()}
    env.step({a: f"<propose>{json.dumps(offer)}</propose>"})
    env.step({b: "<accept/>"})
    assert env.agreement is None  # c has not accepted yet
    env.step({c: "<leave/>"})
    assert env.agreement == offer and "Agreement reached" in env.observe(a)[-1].content  # everyone left has accepted
    assert env.acting_roles() == [a]  # c is skipped from now on
    env.step({a: "Good."})
    assert env.acting_roles() == [b]
    env.step({b: "<leave/>"})
    assert env.done and env.end_reason == "too_few_present"


def test_a_new_proposal_clears_earlier_accepts_and_the_last_agreement_counts():
    env = fresh()
    seller, buyer = env.roles
    env.step({seller: '<propose>{"price": 300, "delivery": "pickup"}</propose>'})
    env.step({buyer: "<accept/>"})
    assert env.agreement == {"price": 300, "delivery": "pickup"}
    env.step({seller: '<propose>{"price": 280, "delivery": "seller_delivers"}</propose>'})
    env.step({buyer: "<accept/>"})
    assert env.agreement == {"price": 280, "delivery": "seller_delivers"}
    assert env._verified(buyer) == 1.0


# -- visibility ---------------------------------------------------------------------------------------


def test_no_prompt_ever_contains_another_agents_goal_or_secret():
    kernels = load_kernels("social", "train")[:40] + load_kernels("social", "heldout")[:40]
    for j, kernel in enumerate(kernels):
        rng = random.Random(j)
        played = check_episode(Social, kernel, j, TextFuzzer(rng, {0: ["agreeable"], 1: ["agreeable"], 2: ["quiet"]}))
        data = kernel.data
        for seat, role in enumerate(played.env.roles):
            seen = "\n".join(m.content for m in played.observations[role])
            for other, (slot, profile) in enumerate(zip(data["scenario"]["slots"], data["profiles"])):
                private = [slot["goal"], slot.get("secret", ""), profile.get("secret", "")]
                for text in filter(None, private):
                    if other != seat:
                        assert text not in seen, (kernel.id, role, text)
                    elif text in (slot["goal"], slot.get("secret")):
                        assert text in seen
            if data["scenario"]["relationship"] < 2:
                for other, profile in enumerate(data["profiles"]):
                    if other != seat:
                        assert profile["bio"] not in seen


def test_the_agreeable_bot_closes_a_deal_both_sides_verify():
    ep = play(kernel_of("used-guitar"), BotAgent("agreeable", Social.bots["agreeable"]))
    assert ep.result.info["agreement"] is not None
    assert set(ep.result.info["goal_verified"].values()) == {1.0}


# -- arena and judged statistics --------------------------------------------------------------------------


def test_arena_evaluation_swaps_the_agents_slot_and_reports_judged_rates():
    agent, opponent = BotAgent("agreeable", Social.bots["agreeable"]), BotAgent("quiet", Social.bots["quiet"])
    result = evaluate("social", agent, 6, seed=1, opponent=opponent, judge=RecordingJudge())
    sizes = [len(ep.seats) for ep in result.played]
    assert [own for own in result.seats] == [[i % n] for i, n in enumerate(sizes)]
    stats = result.judged
    assert stats is not None and stats.seats == 6 and stats.judge_failed == 0
    assert stats.dimensions["goal"] == (8.0, 0.0) and stats.overall[0] == pytest.approx(27 / 7)
    expected = judged_stats(result.played, result.seats)
    assert expected.goal_verified == stats.goal_verified
