"""``check_env``, the conformance suite environment authors run: every registered environment passes
it, a six-seat game where a different subset of seats acts in each phase passes it, and each kind of
broken environment is reported under its property with a reproducer."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest

from repertory.envs import Env, checks, env_class, env_names, load_kernels
from repertory.envs.base import other
from repertory.envs.checks import PROPERTIES, EnvCheckError, check_env, check_episode, check_kernels
from repertory.envs.deal_or_no_deal import DealOrNoDeal
from repertory.envs.ipd import IteratedPrisonersDilemma
from repertory.envs.kernels import generate_kernels
from repertory.envs.negotiation import Negotiation, Standing
from repertory.envs.parsing import PayloadError, clean, last_tag
from repertory.envs.trust_and_split import TrustAndSplit
from repertory.envs.ultimatum import Ultimatum
from repertory.types import SPLITS, Action, Kernel, Parsed, StepResult, derive

ROUND_GAME_STEPS = {
    "ipd": 10,
    "split-no-comm": 10,
    "trust-and-split": 30,
    "werewolf": 5 * (2 + 1 + 6 + 1),
    "social": 20,
}


def max_steps(name: str) -> int:
    """The longest episode each game's rules allow (a new game that is no negotiation adds its bound above)."""
    cls = env_class(name)
    return cls.max_messages if issubclass(cls, Negotiation) else ROUND_GAME_STEPS[name]


@pytest.mark.parametrize("env_name", env_names())
def test_every_registered_environment_passes_check_env(env_name):
    summary = check_env(env_class(env_name), max_steps=max_steps(env_name))
    bots = len(env_class(env_name).bots)
    lineups = 1 if bots == 1 else 4
    # 5 kernels of each split per bot lineup (social has no validation split), then 50 fuzzed episodes.
    splits = 2 if env_name == "social" else 3
    assert (summary.env, summary.kernels, summary.episodes) == (env_name, 100 * splits, lineups * 5 * splits + 50)


# -- a six-seat game: a few seats talk in turn, then a different subset votes at once -------------------

NAMES = ("Ava", "Ben", "Cleo", "Dev", "Eli", "Fay")
WORDS = ("swordfish", "lighthouse", "marmalade", "thunderclap", "quasar", "wildflower")


def _vote_bot(pick: int):
    return lambda view: f"<vote>{view['candidates'][pick]}</vote>" if view["phase"] == "vote" else "Hello."


class Ballot(Env):
    """Two cycles: the kernel's three speakers talk in turn (everyone hears them), then its four voters
    vote at once for another seat; a voter scores 1/2 per cycle in which it backed the plurality."""

    name = "ballot"
    description = "A six-seat toy game with a talking phase and a simultaneous vote."
    roles = NAMES
    role_labels = ("voter",) * 6
    default_trained_role = "Ava"
    bots = {"first": _vote_bot(0), "last": _vote_bot(-1)}

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        return {
            "speakers": rng.sample(NAMES, 3),
            "voters": rng.sample(NAMES, 4),
            "mottos": {n: f"my motto is {rng.choice(WORDS)}-{rng.randint(0, 99)}" for n in NAMES},
        }

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        problems = []
        for key, size in (("speakers", 3), ("voters", 4)):
            seats = data.get(key)
            if not isinstance(seats, list) or len(seats) != size or not set(seats) <= set(NAMES):
                problems.append(f"{key} must be {size} seats")
        mottos = data.get("mottos")
        if not isinstance(mottos, dict) or sorted(mottos) != sorted(NAMES):
            problems.append("every seat needs a motto")
        return problems

    def system_prompt(self, role: str) -> str:
        return f"You are {role}. Your secret motto: {self.kernel.data['mottos'][role]}.\nVote with <vote>NAME</vote>."

    def _start(self) -> None:
        self.cycle, self.phase, self.turn = 1, "talk", 0

    def acting_roles(self) -> list[str]:
        if self.done:
            return []
        data = self.kernel.data
        return [data["speakers"][self.turn]] if self.phase == "talk" else list(data["voters"])

    @property
    def done(self) -> bool:
        return self.cycle > 2

    def parse(self, role: str, text: str) -> Parsed:
        if self.phase == "talk":
            return Parsed(Action("message", clean(text)))
        tag = last_tag(clean(text), content_tags=frozenset({"vote"}))
        name = (tag.payload or "").strip().title() if tag and not tag.malformed else ""
        if name not in NAMES or name == role:
            return Parsed(Action("vote", None), "no vote for another seat; abstained", invalid=True)
        return Parsed(Action("vote", name))

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        if self.phase == "talk":
            ((author, result),) = parsed.items()
            for role in self.roles:
                if role != author:
                    self.tell(role, f"{author}: {result.action.value}")
            self.turn += 1
            if self.turn == 3:
                self.phase, self.turn = "vote", 0
            return StepResult(parsed)
        votes = {r: p.action.value for r, p in parsed.items() if p.action.value}
        tally = {n: list(votes.values()).count(n) for n in set(votes.values())}
        top = [n for n, c in tally.items() if c == max(tally.values(), default=0)]
        winner = top[0] if len(top) == 1 else None
        rewards = {r: 0.5 if winner and votes.get(r) == winner else 0.0 for r in self.roles}
        for role, reward in rewards.items():
            self.points[role] += Fraction(reward)
        for role in self.roles:
            self.tell(role, self._announce(votes, winner, role))
        self.cycle, self.phase = self.cycle + 1, "talk"
        self.end_reason = "cycles_complete" if self.done else ""
        return StepResult(parsed, rewards)

    def _announce(self, votes: dict[str, str], winner: str | None, role: str) -> str:
        return f"Votes: {json.dumps(votes, sort_keys=True)}. Chosen: {winner or 'nobody'}."

    def outcome(self, role: str) -> float:
        return float(self.points[role])

    def metrics(self) -> dict[str, float]:
        return {"cycles": float(min(self.cycle - 1, 2))}

    def view(self, role: str) -> dict[str, Any]:
        return {
            **self._base_view(role),
            "phase": self.phase,
            "candidates": [n for n in NAMES if n != role],
            "motto": self.kernel.data["mottos"][role],
        }


def test_a_six_seat_game_with_acting_subsets_passes():
    summary = check_env(Ballot, max_steps=8)
    assert summary.episodes == 4 * 15 + 50 and summary.steps == summary.episodes * 8  # 5 kernels of 3 splits


# -- broken environments ----------------------------------------------------------------------------------


class ValidateCounts(IteratedPrisonersDilemma):
    """validate keeps a tally: it changes the state."""

    def validate(self, role: str, text: str) -> tuple[bool, str]:
        self.validated = getattr(self, "validated", 0) + 1
        return super().validate(role, text)


class ValidateSaysYes(IteratedPrisonersDilemma):
    def validate(self, role: str, text: str) -> tuple[bool, str]:
        return (True, "") if role in self.acting_roles() else super().validate(role, text)


class EmptyShareCrash(DealOrNoDeal):
    """Its status line divides by the items the proposer keeps: proposing to keep nothing crashes step."""

    def describe(self, deal: Standing, viewer: str) -> str:
        return f"{super().describe(deal, viewer)}; {10 / sum(deal.offer.values()):.1f} points per item kept"


class NaiveJson(DealOrNoDeal):
    """Parses proposals with a bare json.loads: malformed JSON makes step raise."""

    def parse_offer(self, role: str, payload: str) -> dict[str, int]:
        offer = json.loads(payload)
        if not isinstance(offer, dict) or set(offer) - {"books", "hats", "balls"}:
            raise PayloadError("bad proposal")
        return {item: offer.get(item, 0) for item in ("books", "hats", "balls")}


class ShowsKeeps(TrustAndSplit):
    """Tells each player the other's private keep text."""

    def step(self, actions: dict[str, str]) -> StepResult:
        if self.phase == "keep":
            for role, text in actions.items():
                self.tell(other(self.roles, role), f"{role} wrote: {text}")
        return super().step(actions)


class ForwardsPrompt(DealOrNoDeal):
    """Opens by showing B what A was told."""

    def _start(self) -> None:
        super()._start()
        self.tell("B", "For reference, A's briefing:\n" + self.system_prompt("A"))


class AnnouncesMottos(Ballot):
    def _announce(self, votes: dict[str, str], winner: str | None, role: str) -> str:
        mottos = self.kernel.data["mottos"]
        said = f" {winner} says {mottos[winner]}." if winner else ""
        return super()._announce(votes, winner, role) + said


class PromptFollowsTheRound(IteratedPrisonersDilemma):
    """Its system prompt changes as the game goes on, so the opening message no longer matches it."""

    def system_prompt(self, role: str) -> str:
        return f"{super().system_prompt(role)}\nThis is round {getattr(self, 'round', 1)}."


class QuietEnd(Ballot):
    """Rewards only the voters who backed the winner."""

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        result = super()._apply(parsed)
        result.rewards = {r: x for r, x in result.rewards.items() if x}
        return result


class DoubleOutcome(IteratedPrisonersDilemma):
    def outcome(self, role: str) -> float:
        return min(1.0, 2 * super().outcome(role))


class MiscountsTurns(Ballot):
    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        if self.phase == "vote":
            self.n_turns[self.roles[0]] += 1
        return super()._apply(parsed)


class NoEndReason(Ballot):
    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        result = super()._apply(parsed)
        self.end_reason = ""
        return result


class SloppyBot(IteratedPrisonersDilemma):
    bots = {"lazy": lambda view: "I choose A"}


class CrashingBot(DealOrNoDeal):
    bots = {"bot": lambda view: view["no such field"]}


class NineRounds(IteratedPrisonersDilemma):
    """Generates kernels unlike the shipped ipd files."""

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        return {"names": list(cls.roles), "n_rounds": 9}


class TrustingValidator(Ballot):
    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        return []


class OneKernel(Ballot):
    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        return {"speakers": list(NAMES[:3]), "voters": list(NAMES[2:]), "mottos": {n: "my motto is one" for n in NAMES}}


class NeverEnds(Ballot):
    @property
    def done(self) -> bool:
        return False

    def acting_roles(self) -> list[str]:
        return [NAMES[0]]


class NobodyActs(Ballot):
    def acting_roles(self) -> list[str]:
        return [] if self.phase == "vote" else super().acting_roles()


class StepAfterEnd(Ballot):
    def step(self, actions: dict[str, str]) -> StepResult:
        return StepResult({}) if self.done else super().step(actions)


class NoisyFeedback(IteratedPrisonersDilemma):
    """Draws from the global random generator: replays differ."""

    def _start_round(self) -> None:
        super()._start_round()
        self.tell(self.roles[0], f"Luck of the round: {random.random()}")


class MutatingView(IteratedPrisonersDilemma):
    def view(self, role: str) -> dict[str, Any]:
        self.views = getattr(self, "views", 0) + 1
        return super().view(role)


class BadChoices(IteratedPrisonersDilemma):
    def action_choices(self, role: str) -> list[str] | None:
        return ["<choose>A</choose>", "<choose>C</choose>"]


BROKEN = [
    (ValidateCounts, "validate-pure", "env.validated"),
    (ValidateSaysYes, "validate-agrees", "said True but step counted the text as invalid"),
    (NaiveJson, "never-raises", "raised"),
    (EmptyShareCrash, "never-raises", "ZeroDivisionError"),
    (ShowsKeeps, "privacy", "simultaneous-phase text"),
    (ForwardsPrompt, "privacy", "A's system prompt reached B"),
    (AnnouncesMottos, "privacy", "my motto is"),
    (PromptFollowsTheRound, "prompts", "not its system prompt"),
    (DoubleOutcome, "rewards-sum", "add up to"),
    (QuietEnd, "rewards-sum", "not every role"),
    (MiscountsTurns, "accounting", "n_turns"),
    (NoEndReason, "accounting", "end_reason"),
    (SloppyBot, "bots-valid", "I choose A"),
    (CrashingBot, "bots-valid", "KeyError"),
    (NineRounds, "kernels", "does not regenerate byte for byte"),
    (TrustingValidator, "kernels", "validate_kernel finds no problem"),
    (OneKernel, "kernels", "too few distinct kernels"),
    (NeverEnds, "termination", "not over after 20 steps"),
    (NobodyActs, "accounting", "acting_roles() is []"),
    (StepAfterEnd, "termination", "did not raise RuntimeError"),
    (NoisyFeedback, "determinism", "observations"),
    (MutatingView, "view-pure", "env.views"),
    (BadChoices, "action-choices", "<choose>C</choose>"),
]


@pytest.mark.parametrize(("broken", "prop", "detail"), BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_check_env_reports_each_broken_environment(broken, prop, detail):
    with pytest.raises(EnvCheckError) as caught:
        check_env(broken, max_steps=30 if issubclass(broken, TrustAndSplit) else 20)
    error = caught.value
    assert error.property == prop and prop in PROPERTIES, str(error)
    assert str(error).startswith(f"{broken.name}: {prop}: ") and detail in str(error), str(error)
    assert error.env == broken.name


def _first_draws(env: type[Env], n: int = 100) -> dict[str, list[Kernel]]:
    """generate_kernels without the uniqueness retries."""
    seeds = {split: [derive("repertory", env.name, split, i) for i in range(n)] for split in SPLITS}
    return {
        split: [
            Kernel(f"{env.name}/{split}/{i:03d}", env.name, split, i, s, env.generate_kernel(random.Random(s)))
            for i, s in enumerate(seeds[split])
        ]
        for split in SPLITS
    }


def _needless_retry(env: type[Env], n: int = 100) -> dict[str, list[Kernel]]:
    """generate_kernels, but the first kernel is redrawn although its first draw is new."""
    out = generate_kernels(env, n)
    seed = derive("repertory", env.name, "train", 0, "retry", 1)
    out["train"][0] = Kernel(out["train"][0].id, env.name, "train", 0, seed, env.generate_kernel(random.Random(seed)))
    return out


@pytest.mark.parametrize(
    ("generator", "detail"),
    [(_first_draws, "have the same content"), (_needless_retry, "took retry 1, but draw 0 was already new")],
)
def test_kernel_seeds_are_rederived_without_trusting_generate_kernels(monkeypatch, generator, detail):
    monkeypatch.setattr(checks.kernels, "generate_kernels", generator)
    monkeypatch.setattr(checks.kernels, "shipped_file", lambda name, split: Path("/nonexistent") / f"{split}.jsonl")
    with pytest.raises(EnvCheckError, match=detail):
        check_kernels(Ultimatum)


def test_a_failure_names_a_reproducing_kernel_seed_and_texts():
    with pytest.raises(EnvCheckError) as caught:
        check_env(EmptyShareCrash, episodes=0)
    error = caught.value
    assert f"kernel {error.kernel_id}, episode_seed {error.episode_seed}" in str(error)
    split = error.kernel_id.split("/")[1]
    kernel = next(k for k in load_kernels("deal-or-no-deal", split) if k.id == error.kernel_id)
    env = EmptyShareCrash()
    env.reset(kernel, error.episode_seed)
    *before, failing = error.history
    for texts in before:
        env.step(texts)
    with pytest.raises(ZeroDivisionError):
        env.step(failing)


def test_check_episode_takes_the_texts_from_any_policy():
    kernel = load_kernels("ipd", "train")[0]
    played = check_episode(IteratedPrisonersDilemma, kernel, 3, lambda env, role: "<choose>a</choose>")
    assert len(played.texts) == 10 and played.result.roles["Alice"].points == 30
    with pytest.raises(EnvCheckError, match="validate-pure"):
        check_episode(ValidateCounts, kernel, 3, lambda env, role: "B")
