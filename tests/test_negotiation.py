"""What all six negotiations share (environments.md 1, 5-10), checked for every one of them.

Arbitrary (hypothesis-drawn) text never breaks a game and ``validate`` agrees with ``step``; empty,
overlong, malformed and out-of-turn actions get their defined consequence; the partner guard
resamples and then strips; the I-GRPO metric is the mean of gamma^(n-1) * outcome; bot-vs-bot deal
rates are what the bots' schedules imply.
Each game's worked example lives in its own ``test_env_<game>.py``; the properties every game shares
(kernels regenerate byte for byte, rewards sum to the outcome, private text stays private, ...) are
checked by ``check_env`` in test_env_checks.py.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from repertory.agents import BotAgent, Request, Response
from repertory.agents.resolve import make_agent
from repertory.cli import main
from repertory.envs import env_class, load_kernels, make
from repertory.envs.checks import check_episode
from repertory.envs.negotiation import Negotiation, Standing, rnd
from repertory.eval import evaluate
from repertory.rollout import EpisodeSpec, run_episodes, schedule

NEGOTIATIONS = ("craigslist", "ultimatum", "deal-or-no-deal", "casino", "job-interview", "alliance")


def bot_episodes(env: str, n: int = 100, split: str = "heldout", seed: int = 0):
    bot = make_agent("bot", env_class(env))
    return run_episodes(schedule(env, [bot, bot], n, seed, split))


def fresh(env: str, index: int = 0) -> Negotiation:
    game = make(env)
    assert isinstance(game, Negotiation)
    game.reset(load_kernels(env, "train")[index], episode_seed=7)
    return game


def bot_move(game: Negotiation) -> str:
    role = game.acting_roles()[0]
    return game.bots["bot"](game.view(role))


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_episodes_are_deterministic_under_a_seed(env):
    first = [ep.summary() for ep in bot_episodes(env, 6, "train", seed=3)]
    second = [ep.summary() for ep in bot_episodes(env, 6, "train", seed=3)]
    assert first == second


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_accept_or_reject_with_nothing_on_the_table_is_an_invalid_plain_message(env):
    game = fresh(env)
    opener, partner = game.roles
    game.observe(opener), game.observe(partner)
    assert game.validate(opener, "Fine. <accept/>")[0] is False
    result = game.step({opener: "Fine. <accept/>"})
    assert result.parsed[opener].invalid and result.parsed[opener].action.tag == "message"
    assert game.n_invalid[opener] == 1 and game.messages == 1 and not game.done
    seen_by_partner = game.observe(partner)[-1].content
    assert seen_by_partner.startswith(f"{opener}: Fine. <accept/>") and "[Referee]" not in seen_by_partner
    assert "[Referee] Your action was not recorded: there is no proposal to accept." in game.observe(opener)[-1].content


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_own_proposal_cannot_be_accepted_and_the_last_tag_counts(env):
    game = fresh(env)
    opener, partner = game.roles
    proposal = bot_move(game)
    assert "<propose>" in proposal
    game.step({opener: proposal})
    standing = game.standing
    game.step({partner: "Let me think."})
    assert game.validate(opener, "<accept/>") == (False, "you cannot accept your own proposal")
    result = game.step({opener: f"<accept/> no wait: {proposal} then <accept/>"})
    assert result.parsed[opener].invalid and game.standing == standing and not game.done


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_empty_unclosed_and_overlong_messages(env):
    game = fresh(env)
    opener, partner = game.roles
    game.observe(partner)
    result = game.step({opener: ""})
    assert not result.parsed[opener].invalid and game.messages == 1
    assert f"{opener} sent an empty message." in game.observe(partner)[-1].content
    unclosed = '<propose>{"x": 1}'
    assert game.validate(partner, unclosed) == (False, "the <propose> tag is not closed with </propose>")
    game.step({partner: "a" * 5000 + bot_move(game)})
    delivered = game.observe(opener)[-1].content
    assert f"{partner}: " + "a" * 2000 in delivered and "a" * 2001 not in delivered
    assert game.standing is None, "the tag after the 2000-character cut must not count"


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_after_closure_nothing_more_is_accepted(env):
    game = fresh(env)
    game.step({game.roles[0]: "<walkaway/>" if "walkaway" in game.empty_tags else "x"})
    while not game.done:
        game.step({game.acting_roles()[0]: "nothing to add"})
    assert game.validate(game.roles[1], "<accept/>") == (False, "the episode is over")
    with pytest.raises(RuntimeError):
        game.step({game.roles[1]: "<accept/>"})


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_message_limit_ends_without_a_deal(env):
    game = fresh(env)
    rewards = {}
    while not game.done:
        rewards = game.step({game.acting_roles()[0]: "Hello there."}).rewards
    assert game.messages == game.max_messages and game.end_reason == "limit"
    assert rewards == {r: 0.0 for r in game.roles}
    assert {r: game.result().roles[r].outcome for r in game.roles} == rewards


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    env=st.sampled_from(NEGOTIATIONS),
    texts=st.lists(
        st.one_of(
            st.text(max_size=80),
            st.sampled_from(["<accept/>", "<reject/>", "<walkaway/>", "<ACCEPT>", "<propose>", "</propose>"]),
            st.builds(lambda a, b: f"<propose>{a}</propose>{b}", st.text(max_size=40), st.text(max_size=10)),
            st.builds(lambda k, v: f'<propose>{{"{k}": {v}}}</propose>', st.text(max_size=8), st.integers(-5, 60)),
        ),
        min_size=1,
        max_size=24,
    ),
)
def test_arbitrary_text_never_breaks_a_game_and_validate_agrees_with_step(env, texts):
    """check_env's per-episode checks on hypothesis-drawn messages, then plain ones up to the limit."""
    script = iter(texts)

    def policy(game, role):
        return next(script, "Let us keep talking.")

    cls = env_class(env)
    played = check_episode(cls, load_kernels(env, "train")[3], 7, policy, max_steps=cls.max_messages)
    # One terminal reward per role, equal to its outcome.
    *early, last = [step.rewards for step in played.steps]
    assert not any(early) and last == {role: rr.outcome for role, rr in played.result.roles.items()}


def _craigslist_meets(game: Negotiation) -> bool:
    """The customer's concessions end at its limit and the vendor's at rnd(0.8 list): a deal happens
    exactly when the limit reaches the vendor's floor (never with a target of 50%: limit 75%)."""
    data = game.kernel.data
    return data["limit"] >= rnd(Fraction(4, 5) * data["list_price"])


def _division_meets_both_floors(game: Negotiation) -> bool:
    """Both aspiration bots fall to 6 after three turns and then propose their cheapest division worth
    6, so they agree exactly when some division is worth at least 6 to each."""
    counts = game.kernel.data["counts"]
    shares = itertools.product(*(range(c + 1) for c in counts))
    deals = [Standing("A", dict(zip(("books", "hats", "balls"), share))) for share in shares]
    return any(game.deal_points("A", d) >= 6 and game.deal_points("B", d) >= 6 for d in deals)


DEAL_RULES = {
    "craigslist": _craigslist_meets,
    "deal-or-no-deal": _division_meets_both_floors,
    # The responder counters at half the pool, which the proposer's fallback of half always meets.
    "ultimatum": lambda game: True,
    # Each camper walks away on its last turn unless it accepts, so no CaSiNo game times out; and
    # with floors of 18 of 36 a deal is always found before that.
    "casino": lambda game: True,
}
# Job Interview and Alliance bots each propose their own cheapest acceptable contract, which need not
# be acceptable to the other side even when a mutually acceptable one exists; these counts over the
# 100 held-out kernels are pinned to catch any change in the bots or the referee.
DEAL_COUNTS = {"job-interview": 95, "alliance": 78}


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_bot_versus_bot_deal_rates(env):
    episodes = bot_episodes(env)
    assert all(ep.result.roles[r].n_invalid == 0 for ep in episodes for r in ep.result.roles)
    deals = [ep.result.end_reason == "deal" for ep in episodes]
    if env in DEAL_COUNTS:
        assert sum(deals) == DEAL_COUNTS[env]
        return
    for ep, deal in zip(episodes, deals):
        game = make(env)
        game.reset(ep.kernel, ep.episode_seed)
        assert deal == DEAL_RULES[env](game), ep.kernel.id


class ScriptedByAttempt:
    """A partner whose answer depends on the guard's attempt number, to drive the partner guard."""

    name = "attempts"
    policy_id = "base"

    def __init__(self, answers: list[str]):
        self.answers = answers
        self.attempts: list[int] = []

    def act(self, requests: list[Request]) -> list[Response]:
        self.attempts.extend(r.attempt for r in requests)
        return [Response(self.answers[min(r.attempt, len(self.answers) - 1)]) for r in requests]


def guarded_craigslist(answers: list[str], guarded: bool = True):
    """One Craigslist message pair: the vendor bot opens at the list price (above the customer's
    limit), then the scripted customer answers; returns the customer's turn and the partner."""
    cls = env_class("craigslist")
    kernel = load_kernels("craigslist", "heldout")[0]
    vendor, customer = BotAgent("bot", cls.bots["bot"]), ScriptedByAttempt(answers)
    spec = EpisodeSpec("guard/0", "craigslist", kernel, 1, [vendor, customer], guarded=[False, guarded])
    episode = run_episodes([spec])[0]
    return episode, episode.trajectory("p1")[0], customer


def test_guard_resamples_a_partner_that_breaks_its_limit_and_keeps_a_good_answer():
    limit = load_kernels("craigslist", "heldout")[0].data["limit"]
    ok = f'Meet me at {limit}. <propose>{{"price": {limit}}}</propose>'
    episode, turn, customer = guarded_craigslist(
        ["Deal. <accept/>", f'<propose>{{"price": {limit + 1}}}</propose>', ok]
    )
    assert customer.attempts[:3] == [0, 1, 2]
    assert turn.text == ok and turn.action.value == {"price": limit}
    assert episode.metrics["guard/resampled"] >= 2 and episode.metrics["guard/stripped"] == 0


def test_guard_deletes_the_offending_tag_after_two_resamples():
    episode, turn, customer = guarded_craigslist(["Deal then. <accept/>"])
    assert customer.attempts[:3] == [0, 1, 2]
    assert turn.text == "Deal then." and turn.action.tag == "message" and turn.finish == "guarded"
    assert turn.response_ids == [] and episode.metrics["guard/stripped"] >= 1


def test_unguarded_seats_are_never_resampled():
    episode, turn, customer = guarded_craigslist(["Deal. <accept/>"], guarded=False)
    assert set(customer.attempts) == {0} and episode.result.end_reason == "deal"
    assert "guard/resampled" not in episode.metrics


def test_expected_discounted_return_is_the_mean_of_gamma_to_the_turns_before_the_last():
    bot = make_agent("bot", env_class("deal-or-no-deal"))
    result = evaluate("deal-or-no-deal", bot, 12, seed=4, opponent=bot, gamma=0.9)
    assert result.agent == "bot" and result.episodes == 12
    assert all(ep.seats[0].agent == "bot" for ep in result.played)
    assert set(result.outcome) == {"A"}, "negotiations evaluate the agent in the trained seat only"
    values = [0.9 ** (ep.result.roles["A"].n_turns - 1) * ep.result.roles["A"].outcome for ep in result.played]
    assert result.discounted[0] == pytest.approx(sum(values) / 12)
    assert result.discounted[0] < result.overall[0]


@pytest.mark.parametrize("env", NEGOTIATIONS)
def test_cli_play_with_bots_in_both_seats(env, capsys):
    main(["play", env, "--agents", "bot,bot", "--episodes", "2", "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2


def craigslist_facing_the_list_price() -> Negotiation:
    """Craigslist train kernel 0 (list 225, the customer's limit 192) after the vendor asks 225."""
    game = fresh("craigslist")
    assert (game.kernel.data["list_price"], game.kernel.data["limit"]) == (225, 192)
    game.step({"vendor": f'<propose>{{"price": {game.kernel.data["list_price"]}}}</propose>'})
    return game


@pytest.mark.parametrize(
    ("text", "sent"),
    [
        ('<acc<thi<propose>{"price": 200}</propose>nk>x</think>ept/>', ""),
        ('I will not <walkaway/> yet. <propose>{"price": 200}</propose>', "I will not  yet."),
        ("I could <reject/> this, but fine: <accept/>", "I could  this, but fine:"),
        ('<propose>{"price": 1}</propose> or rather <propose>{"price": 200}</propose>', "or rather"),
    ],
)
def test_a_guarded_answer_goes_out_as_a_plain_message(text, sent):
    game = craigslist_facing_the_list_price()
    assert game.guard("customer", text) == sent
    assert game.parse("customer", sent).action.tag == "message"


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "<accept/>",
                "<reject/>",
                "<walkaway/>",
                "<think>",
                "</think>",
                "<acc",
                "ept/>",
                '<propose>{"price": 200}</propose>',
                '<propose>{"price": 1}</propose>',
                "x ",
            ]
        ),
        max_size=10,
    )
)
def test_the_guard_never_raises_and_never_lets_a_limit_break_through(parts):
    game = craigslist_facing_the_list_price()
    text = "".join(parts)
    sent = game.guard("customer", text)
    final = game.parse("customer", text if sent is None else sent).action
    if sent is not None:
        assert final.tag == "message"
    deal = game._deal_of("customer", final)
    assert deal is None or not game.below_limit("customer", deal)


# constrained answers: the proposal grid


def test_ultimatum_grid_keeps_tenths_of_the_pool_and_has_no_walkaway():
    game = fresh("ultimatum")
    pool = game.kernel.data["pool"]
    assert game.action_choices("proposer") == [f'<propose>{{"keep": {pool * k // 10}}}</propose>' for k in range(11)]
    game.step({"proposer": f'<propose>{{"keep": {pool}}}</propose>'})
    assert game.action_choices("responder")[-2:] == ["<accept/>", "<reject/>"]


@pytest.mark.parametrize(("env", "size"), [("deal-or-no-deal", None), ("casino", 64)])
def test_item_games_offer_every_split(env, size):
    game = fresh(env)
    counts = game.kernel.data.get("counts", [3, 3, 3])
    expected = size or math.prod(c + 1 for c in counts)
    proposals = [c for c in game.action_choices(game.roles[0]) if c.startswith("<propose>")]
    assert len(proposals) == len(set(proposals)) == expected


@pytest.mark.parametrize("env", ["job-interview", "alliance"])
def test_games_without_a_grid_stay_free_text_when_constrained(env):
    game = fresh(env)
    assert game.action_choices(game.roles[0]) is None


@pytest.mark.parametrize("env", ["craigslist", "ultimatum", "deal-or-no-deal", "casino"])
def test_random_grid_play_against_the_bot_is_valid_and_graded(env):
    """Every listed answer is valid when it is listed, and a policy that picks among them at random closes
    deals at many different outcomes: a constrained small model starts mid-range, not at a floor."""
    cls = env_class(env)
    rng = random.Random(0)
    outcomes = []
    trained = cls.default_trained_role

    def policy(game, role):
        return rng.choice(game.action_choices(role)) if role == trained else game.bots["bot"](game.view(role))

    for kernel in load_kernels(env, "train")[:30]:
        played = check_episode(cls, kernel, 7, policy, max_steps=cls.max_messages)
        assert played.result.roles[trained].n_invalid == 0
        outcomes.append(played.result.roles[trained].outcome)
    assert len(set(outcomes)) >= 4 and 0.1 < statistics.mean(outcomes) < 0.9
