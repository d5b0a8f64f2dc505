"""Warm starts: the game's bot in every seat, one mt-sft round imitating it, the run starting from the export,
cached and shared by every run it would be the same for."""

from __future__ import annotations

import json
import re

import pytest
from conftest import tiny_checkpoint

from repertory.agents import LMOptions, Request, Response
from repertory.agents.resolve import make_agent
from repertory.config import WarmStartConfig, load_config
from repertory.envs import env_class
from repertory.envs.ipd import moves_of
from repertory.models import load_tokenizer
from repertory.rollout import run_episodes, schedule
from repertory.store import read_episodes
from repertory.train import start_run, warm_started
from repertory.train.turns import demonstration_turns, read_logs
from repertory.train.warm import ConstrainedBot, WarmPlan
from repertory.types import RepertoryError


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "iterations=1",
            "rollout.env=ipd",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=1",
            "rollout.max_new_tokens=8",
            "eval.episodes=0",
            "warm_start.episodes=2",
            "warm_start.epochs=1",
            *extra,
        ],
    )


def test_the_bot_imitated_and_the_cache_key(tmp_path):
    assert WarmPlan.of(_config(tmp_path)).bot == "always-cooperate"  # ipd's partner is itself: its first bot
    assert WarmPlan.of(_config(tmp_path, "rollout.opponent=tit-for-tat")).bot == "tit-for-tat"
    chosen = _config(tmp_path, "warm_start.bot=always-defect", "rollout.opponent=tit-for-tat")
    assert WarmPlan.of(chosen).bot == "always-defect"
    base = WarmPlan.of(_config(tmp_path)).directory
    # Seeds and methods share a warm start; the model, the bot and the budget do not.
    assert WarmPlan.of(_config(tmp_path, "seed=3", "method.estimator=grpo", "iterations=9")).directory == base
    mt_sft = _config(tmp_path, "method.kind=mt-sft", "rollout.opponent=always-cooperate")
    assert WarmPlan.of(mt_sft).directory == base
    for other in ("warm_start.episodes=3", "warm_start.bot=always-defect", "model.lora.r=4", "rollout.env=ultimatum"):
        assert WarmPlan.of(_config(tmp_path, other)).directory != base, other
    # Self-play imitates every seat of a game with a trained seat; its warm start is cached apart.
    vendor = _config(tmp_path, "rollout.env=craigslist", "rollout.opponent=bot")
    both = _config(tmp_path, "rollout.env=craigslist", "rollout.opponent=self")
    assert WarmPlan.of(vendor).imitation_config().method.log_seats == "trained"
    assert WarmPlan.of(both).imitation_config().method.log_seats == "every"
    assert WarmPlan.of(both).directory != WarmPlan.of(vendor).directory
    assert WarmPlan.of(both).bot == WarmPlan.of(vendor).bot == "bot"
    with pytest.raises(RepertoryError, match="warm_start.bot: 'bot' is no bot of ipd; allowed: always-cooperate, "):
        _config(tmp_path, "warm_start.bot=bot")


def test_a_run_starts_from_its_warm_start_built_once(tmp_path, tokenizer):
    model = f"model.name={tiny_checkpoint(tmp_path / 'tiny', tokenizer, seed=1)}"
    config = _config(tmp_path, "name=first", "warm_start.bot=always-cooperate", model)
    trainer = start_run(config)
    directory = WarmPlan.of(config).directory
    assert trainer.config.model.name == str(directory / "model")  # the run's config.yaml names it
    demos = read_episodes(directory / "demos.parquet")
    assert len(demos) == 2 and {s.policy_id for ep in demos for s in ep.seats} == {"scripted:always-cooperate"}
    built = (directory / "model" / "config.json").stat().st_mtime_ns
    second = start_run(_config(tmp_path, "name=second", "seed=1", "warm_start.bot=always-cooperate", model))
    assert second.config.model.name == trainer.config.model.name  # found in the cache, not rebuilt
    assert (directory / "model" / "config.json").stat().st_mtime_ns == built
    assert warm_started(config) == directory / "model"
    (directory / "model" / "model.safetensors").unlink()  # as a disk that lost the large files would leave it
    with pytest.raises(RepertoryError, match=re.escape(f"has lost its weights; delete {directory} to rebuild it")):
        warm_started(config)


@pytest.mark.slow
def test_the_warm_started_policy_plays_like_the_bot(tmp_path, tokenizer):
    """A tiny model imitating always-defect defects far more often than before (measured: 0.43 -> 0.81)."""
    base = tiny_checkpoint(tmp_path / "tiny", tokenizer, seed=2)
    extra = ("warm_start.bot=always-defect", "warm_start.episodes=8", "warm_start.lr=1e-2", f"model.name={base}")
    warm = warm_started(_config(tmp_path, *extra))
    cls, options = env_class("ipd"), LMOptions(max_new_tokens=8, constrained=True, seed=1)

    def defection(path):
        agent = make_agent(f"model:{path}", cls, options)
        episodes = run_episodes(schedule("ipd", [agent, make_agent("random", cls)], 16, seed=5, split="heldout"))
        moves = [t.action.value for ep in episodes for t in ep.trajectory(ep.seats[0].seat_id)]
        return sum(m == "B" for m in moves) / len(moves)

    before, after = defection(base), defection(warm)
    assert after > before + 0.25, (before, after)


def test_a_constrained_warm_start_demonstrates_the_grid_answer_nearest_the_bots(tmp_path):
    """On Craigslist's price grid (5% steps of the list price) the bots' concessions snap to the nearest step,
    and their games still close where the free-text ones do."""
    games = {}
    for constrained in ("true", "false"):
        config = load_config(
            None, [f"output_dir={tmp_path}", "rollout.env=craigslist", f"rollout.constrained={constrained}"]
        )
        more = config.model_copy(update={"warm_start": WarmStartConfig(episodes=4)})
        WarmPlan.of(more).write_demonstrations(tmp_path / "d")
        games[constrained] = read_episodes(tmp_path / "d")
    on_grid, free = games["true"][1], games["false"][1]  # list price 2000: vendor floor 1600, customer limit 1650
    assert [t.text for t in free.turns][2:5] == [
        'How about 1867? <propose>{"price": 1867}</propose>',
        'How about 1500? <propose>{"price": 1500}</propose>',
        'How about 1733? <propose>{"price": 1733}</propose>',
    ]
    prices = [json.loads(t.text[len("<propose>") : -len("</propose>")])["price"] for t in on_grid.turns[:-1]]
    assert prices == [2000, 1400, 1900, 1500, 1700, 1600] and on_grid.turns[-1].text == "<accept/>"
    assert on_grid.result.roles["vendor"].outcome == free.result.roles["vendor"].outcome == 0.8
    assert [ep.metrics["deal_rate"] for ep in games["true"]] == [0.0, 1.0, 0.0, 1.0]


def test_a_bot_answer_off_the_choices_is_refused_with_the_remedy():
    class Chatty:
        name, policy_id = "chatty", "scripted:chatty"

        def act(self, requests):
            return [Response("Let us talk first.") for _ in requests]

    request = Request("e0", 0, "vendor", [], {}, choices=['<propose>{"price": 10}</propose>', "<accept/>"])
    with pytest.raises(RepertoryError, match="'Let us talk first.', which matches none of the vendor's constrained"):
        ConstrainedBot(Chatty()).act([request])
    assert ConstrainedBot(Chatty()).act([Request("e0", 0, "vendor", [], {})])[0].text == "Let us talk first."


def test_a_partner_shows_how_the_bot_answers_and_only_the_bot_is_imitated(tmp_path, tokenizer):
    """Tit-for-tat against itself cooperates every round; against random it answers defections, in either seat,
    and the imitation learns its turns only."""
    config = _config(tmp_path, "warm_start.bot=tit-for-tat", "warm_start.partner=random", "warm_start.episodes=5")
    alone = _config(tmp_path, "warm_start.bot=tit-for-tat", "warm_start.partner=tit-for-tat", "warm_start.episodes=5")
    plan, lone = WarmPlan.of(config), WarmPlan.of(alone)
    assert plan.line_ups == ((("tit-for-tat", "random"), 3), (("random", "tit-for-tat"), 2))
    assert lone.line_ups == ((("tit-for-tat", "tit-for-tat"), 5),)
    no_partner = _config(tmp_path, "warm_start.bot=tit-for-tat", "warm_start.episodes=5")
    assert lone.directory == WarmPlan.of(no_partner).directory
    assert plan.directory != lone.directory
    assert plan.imitation_config().method.log_agent == "tit-for-tat"
    assert lone.imitation_config().method.log_agent is None

    plan.write_demonstrations(tmp_path / "demos.parquet")
    episodes = read_episodes(tmp_path / "demos.parquet")
    assert [[seat.agent for seat in ep.seats] for ep in episodes] == [["tit-for-tat", "random"]] * 3 + [
        ["random", "tit-for-tat"]
    ] * 2
    turns = demonstration_turns(episodes, env_class("ipd"), tokenizer, 1.0, agent="tit-for-tat")
    assert (
        len(turns) == 5 * 10
        and {t.seat_id for t in turns[:10]} == {"p0"}
        and {t.seat_id for t in turns[-10:]} == {"p1"}
    )
    for ep in episodes:
        bot = [seat.agent for seat in ep.seats].index("tit-for-tat")
        own, theirs = moves_of(ep, bot)
        assert own == "A" + theirs[:-1]  # tit-for-tat: cooperate, then copy the partner's last move
    assert any("B" in moves_of(ep, 0)[0] + moves_of(ep, 1)[0] for ep in episodes)
    with pytest.raises(RepertoryError, match=r"no seat played by 'grim-trigger' \(log_agent\); the agents logged: "):
        read_logs(tmp_path / "demos.parquet", env_class("ipd"), tokenizer, 1.0, agent="grim-trigger")
    with pytest.raises(RepertoryError, match="warm_start.partner: 'bot' is no bot of ipd; allowed: always-coop"):
        _config(tmp_path, "warm_start.partner=bot")
