"""A user-written environment plugs into the registry, kernels, engine and store unchanged."""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import play

import repertory.envs as envs
from repertory.envs import Env, make
from repertory.envs.checks import EnvCheckError, check_env
from repertory.envs.kernels import _load
from repertory.envs.parsing import clean, last_tag
from repertory.store import read_episodes, write_episodes
from repertory.types import Action, Parsed, StepResult


class GuessTheNumber(Env):
    """Sequential two-seat game: the guesser has three tries at the keeper's secret (1-10)."""

    name = "guess"
    description = "Guess the keeper's secret number in three tries."
    roles = ("guesser", "keeper")
    role_labels = ("guesser", "keeper")
    default_trained_role = "guesser"
    unique_kernels = False
    bots = {
        "bisect": lambda v: f"<guess>{(v['low'] + v['high']) // 2}</guess>",
        "hint": lambda v: "higher" if v["last"] < v["secret"] else "lower",
    }

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        return {"secret": rng.randint(1, 10)}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        secret = data.get("secret")
        return [] if isinstance(secret, int) and 1 <= secret <= 10 else ["secret must be an integer from 1 to 10"]

    def system_prompt(self, role: str) -> str:
        if role == "keeper":
            return f"Your secret is {self.kernel.data['secret']}. Answer higher or lower."
        return "Guess a number from 1 to 10 with <guess>N</guess>."

    def _start(self) -> None:
        self.tries, self.turn, self.won, self.low, self.high, self.last = 0, "guesser", False, 1, 10, 0

    def acting_roles(self) -> list[str]:
        return [] if self.done else [self.turn]

    @property
    def done(self) -> bool:
        return self.won or self.tries >= 3

    def parse(self, role: str, text: str) -> Parsed:
        if role == "keeper":
            return Parsed(Action("message", clean(text)))
        tag = last_tag(clean(text), content_tags=frozenset({"guess"}))
        if tag is None or tag.malformed or not (tag.payload or "").strip().isdigit():
            return Parsed(None, "no valid <guess>", invalid=True)
        return Parsed(Action("guess", int(tag.payload.strip())))

    def _apply(self, parsed: dict[str, Parsed]) -> StepResult:
        (role,) = parsed
        if role == "keeper":
            self.tell("guesser", f"keeper says: {parsed[role].action.value}")
            self.turn = "guesser"
            return StepResult(parsed)
        self.tries += 1
        guess = parsed[role].action.value if parsed[role].action else 0
        self.last = guess
        self.won = guess == self.kernel.data["secret"]
        if guess < self.kernel.data["secret"]:
            self.low = max(self.low, guess + 1)
        elif guess > self.kernel.data["secret"]:
            self.high = min(self.high, guess - 1)
        self.tell("keeper", f"guesser guessed {guess}")
        self.turn = "keeper"
        rewards = {}
        if self.done:
            self.points["guesser"] = 1 if self.won else 0
            self.end_reason = "guessed" if self.won else "out_of_tries"
            rewards = {r: self.outcome(r) for r in self.roles}
        return StepResult(parsed, rewards)

    def outcome(self, role: str) -> float:
        return float(self.won) if role == "guesser" else float(not self.won)

    def metrics(self) -> dict[str, float]:
        return {"tries": float(self.tries)}

    def view(self, role: str) -> dict[str, Any]:
        return {
            **self._base_view(role),
            "low": self.low,
            "high": self.high,
            "last": self.last,
            "secret": self.kernel.data["secret"] if role == "keeper" else None,
        }


@pytest.fixture
def registered():
    envs.register_env(GuessTheNumber)
    _load.cache_clear()
    yield
    envs._REGISTRY.remove("guess")
    _load.cache_clear()


def test_custom_environment_runs_end_to_end(registered, tmp_path):
    assert isinstance(make("guess"), GuessTheNumber)
    episodes = play("guess", ["bisect", "hint"], episodes=20, seed=1)
    assert all(e.kernel.id.startswith("guess/train/") for e in episodes)
    assert {e.kernel.data["secret"] for e in episodes} >= {5, 4}
    for ep in episodes:
        secret = ep.kernel.data["secret"]
        guesses = [t.action.value for t in ep.trajectory("p0")]
        assert ep.result.end_reason == ("guessed" if guesses[-1] == secret else "out_of_tries")
        # Bisection of 1..10 guesses 5, then 2 or 8, then 1, 3, 6 or 9; 4, 7 and 10 stay unfound.
        tries = {5: 1, 2: 2, 8: 2, 1: 3, 3: 3, 6: 3, 9: 3, 4: 3, 7: 3, 10: 3}[secret]
        won = secret not in (4, 7, 10)
        assert len(guesses) == tries
        assert ep.result.roles["guesser"].outcome == float(won)
        assert ep.total_reward("p0") == float(won)
        assert ep.total_reward("p1") == (0.0 if tries == 1 else float(not won))
    assert read_episodes(write_episodes(tmp_path / "g.parquet", episodes)) == episodes


def test_custom_environment_invalid_guess_counts(registered, tmp_path):
    script = tmp_path / "s.txt"
    script.write_text("I think five\n<guess>5\n<guess>x</guess>\n")
    [ep] = play("guess", [f"script:{script}", "hint"], kernel=0)
    assert ep.result.roles["guesser"].n_invalid == 3
    assert ep.result.end_reason == "out_of_tries"
    assert [t.seat_id for t in ep.turns] == ["p0", "p1", "p0", "p1", "p0"]


def test_custom_environment_passes_check_env():
    # Its bots fit one seat each, so the lineup is given.
    summary = check_env(GuessTheNumber, lineups=[("bisect", "hint")], max_steps=5)
    # 5 kernels of each of the three splits, then 50 fuzzed episodes
    assert (summary.env, summary.kernels, summary.episodes) == ("guess", 300, 15 + 50)
    with pytest.raises(ValueError, match="lineup"):
        check_env(GuessTheNumber, lineups=[("bisect",)])


def test_generator_with_too_few_distinct_kernels_fails_clearly(monkeypatch):
    from repertory.envs.kernels import generate_kernels
    from repertory.types import RepertoryError

    monkeypatch.setattr(GuessTheNumber, "unique_kernels", True)
    with pytest.raises(RepertoryError, match="too few distinct kernels"):
        generate_kernels(GuessTheNumber)


class GuessWithHint(GuessTheNumber):
    """Unique kernels from 250 distinct ones: enough for train and held-out, not for a disjoint validation split."""

    name = "guess-hint"
    unique_kernels = True

    @classmethod
    def generate_kernel(cls, rng: random.Random) -> dict[str, Any]:
        return {"secret": rng.randint(1, 10), "hint": rng.randint(1, 25)}

    @classmethod
    def validate_kernel(cls, data: dict[str, Any]) -> list[str]:
        hint = data.get("hint")
        return super().validate_kernel(data) + ([] if isinstance(hint, int) else ["hint must be an integer"])


def test_a_game_too_small_for_validation_keeps_train_and_heldout_and_says_why():
    from repertory.envs.kernels import kernels_of
    from repertory.types import RepertoryError

    train, heldout = kernels_of(GuessWithHint, "train"), kernels_of(GuessWithHint, "heldout")
    assert len({k.to_json() for k in train + heldout}) == 200  # as before the validation split existed
    with pytest.raises(RepertoryError, match="too few distinct kernels for 100 in each of train, heldout, validation"):
        kernels_of(GuessWithHint, "validation")
    with pytest.raises(EnvCheckError, match="missing_splits"):
        check_env(GuessWithHint, lineups=[("bisect", "hint")], episodes=0, examples=0)


def test_a_game_may_declare_a_split_it_cannot_fill(monkeypatch):
    from repertory.envs.kernels import kernels_of
    from repertory.types import RepertoryError

    monkeypatch.setattr(GuessWithHint, "missing_splits", {"validation": "only 250 distinct games"})
    with pytest.raises(RepertoryError, match="guess-hint has no validation kernels: only 250 distinct games"):
        kernels_of(GuessWithHint, "validation")
    summary = check_env(GuessWithHint, lineups=[("bisect", "hint")], episodes=1, examples=2, max_steps=5)
    assert (summary.kernels, summary.episodes) == (200, 2 + 2)


def test_a_game_written_against_the_former_name_of_iterated_games_still_loads():
    from repertory.envs import IteratedGame, RoundGame
    from repertory.envs.ipd import IteratedPrisonersDilemma

    class Renamed(RoundGame):  # what a user's game imported before the rename
        pass

    assert RoundGame is IteratedGame and issubclass(Renamed, IteratedGame)
    assert issubclass(IteratedPrisonersDilemma, RoundGame)
