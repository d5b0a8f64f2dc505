"""The method section: every kind has a config and a registered class, a new method is one file, its config and a
test (the worked example of docs/design.md, run here), and configs of the shape before the section still load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from repertory import envs
from repertory.algos import ESTIMATORS
from repertory.algos.losses import POLICY_LOSSES
from repertory.config import (
    METHOD_CONFIGS,
    RoundMethodConfig,
    _rebuild_method_union,
    dump_config,
    load_config,
    register_method_config,
)
from repertory.config.methods import EPOCHS, online_kinds
from repertory.generation import BACKENDS
from repertory.models import load_tokenizer, tiny_model
from repertory.runs import RunDir
from repertory.store.turns import LoggedTurn
from repertory.train import check_names, resume_run, start_run
from repertory.train.batch import single_turn_batch
from repertory.train.methods import METHODS, OnlineMethod, RoundMethod, register_method
from repertory.train.methods.selfplay import raw_spread
from repertory.train.turns import conversation_of, conversations, first_return
from repertory.types import Registry, RepertoryError

OLD = Path(__file__).parent / "data" / "old_configs"  # full config.yaml files written before the method section


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_every_kind_has_a_config_and_a_registered_class():
    assert set(METHOD_CONFIGS) == set(METHODS)
    for kind, cls in METHODS.items():
        rounds = issubclass(METHOD_CONFIGS[kind], RoundMethodConfig)
        assert issubclass(cls, RoundMethod if rounds else OnlineMethod), kind
        assert cls.kind == kind == METHOD_CONFIGS[kind].model_fields["kind"].default


def test_one_registry_class_behind_every_pluggable_kind():
    registries = [(METHODS, "method"), (METHOD_CONFIGS, "method config"), (ESTIMATORS, "estimator")]
    registries += [(POLICY_LOSSES, "policy loss"), (BACKENDS, "generation backend"), (envs._REGISTRY, "environment")]
    assert all(isinstance(r, Registry) and r.what == what for r, what in registries)
    with pytest.raises(RepertoryError, match=r"^unknown policy loss 'nope'; known: ppo, reinforce, tis$"):
        POLICY_LOSSES.remove("nope")
    assert "nope" not in BACKENDS and BACKENDS.get("nope") is None and list(BACKENDS) == ["hf", "vllm"]
    assert online_kinds() == ["selfplay", "adalign"]  # derived from the configs, not listed by hand
    with pytest.raises(RepertoryError, match=r"^method\.kind: unknown method 'loo'; known: adalign, archer, "):
        check_names(load_config(None, ["method.kind=selfplay"]).model_copy(update={"method": LooConfig()}))


def test_a_run_config_holds_only_its_methods_settings():
    igrpo = load_config("igrpo-craigslist").model_dump()
    assert set(igrpo) >= {"method", "algo"} and not {"trainer", "rounds", "critic", "pool"} & set(igrpo)
    assert set(igrpo["method"]) == {*METHOD_CONFIGS["igrpo"].model_fields}
    assert "estimator" not in igrpo["method"] and "estimator" not in igrpo["algo"]
    sft = load_config("igrpo-craigslist", ["method.kind=mt-sft"]).method
    assert sft.model_dump() == {
        "kind": "mt-sft",
        "gamma": 0.95,
        "logs": None,
        "log_seats": "trained",
        "log_agent": None,
        "reference": "round",
        "batch_size": 16,
        "epochs": 2,
        "quantile": 0.9,
    }


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
        ("default", [], 0.0),  # the main job credits each round with its own reward
        ("omar-ipd", [], 0.95),
        ("omar-ipd", ["method.estimator=grpo"], 1.0),
        ("adalign-ipd", [], 0.9),
        ("igrpo-craigslist", [], 0.95),
        ("default", ["method.gamma=0.5"], 0.5),
    ],
)
def test_one_discount_per_turn_with_the_estimators_default(recipe, overrides, expected, tokenizer, tmp_path):
    fixed = ["rollout.env=ipd", "rollout.opponent=always-cooperate", "eval.episodes=0", f"output_dir={tmp_path}"]
    trainer = start_run(load_config(recipe, [*overrides, *fixed]), tiny_model(tokenizer))
    assert trainer.method.gamma == expected  # the held-out J's gamma is the method's


# A new method: its config, its class, and this test (docs/design.md, The method section).


class LooConfig(RoundMethodConfig):
    """Leave-one-out REINFORCE over the round's conversations."""

    kind: Literal["loo"] = "loo"
    epochs: int = Field(1, ge=1, description=EPOCHS)


class Loo(RoundMethod):
    def improve(self, ctx, round_index, turns, episodes):
        convos = conversations(turns)
        g0 = {e: first_return(c, self.config.gamma) for e, c in convos.items()}
        total, n = sum(g0.values()), len(g0)
        advantage = {e: (n * g - total) / max(n - 1, 1) for e, g in g0.items()}
        flat = [t for c in convos.values() for t in c]
        batch, adv = single_turn_batch(
            [t.prompt_ids for t in flat], [t.response_ids for t in flat], [advantage[conversation_of(t)] for t in flat]
        )
        ctx.backend.offload()
        ctx.learner.score(batch)
        batch.assign(adv)
        return ctx.learner.update(batch, f"loo/{round_index}", self.config.epochs, 1)


@pytest.fixture
def loo():
    register_method(LooConfig)(Loo)  # the config joins the method section with it
    yield
    METHODS.remove("loo")
    METHOD_CONFIGS.remove("loo")
    _rebuild_method_union()


def test_a_new_method_is_one_file_its_config_and_a_test(loo, tokenizer, tmp_path):
    config = load_config(
        "igrpo-craigslist",
        [
            "method.kind=loo",
            "rollout.env=ipd",
            "rollout.opponent=always-cooperate",
            f"output_dir={tmp_path}",
        ],
    )
    assert config.method == LooConfig(gamma=0.95) and config.round_based  # igrpo's gamma kept, the rest dropped
    trainer = start_run(config, tiny_model(tokenizer, seed=1))
    assert trainer.run_dir.name.startswith("loo-ipd-")
    captured = {}
    update = trainer.learner.update

    def spy(batch, *args):
        captured["advantages"] = [float(batch.experience[i].advantages[0]) for i in range(len(batch.samples))]
        return update(batch, *args)

    trainer.learner.update = spy
    returns = {"a": 1.0, "b": 0.0, "c": 0.5}  # G_0 of three one-turn conversations
    turns = [LoggedTurn(e, "k", 0, 0, [1, 2, 3], [4, 5], g, g) for e, g in returns.items()]
    metrics = trainer.improve(0, turns, {})
    # A_i = G_i - mean of the others: 1 - 0.25, 0 - 0.75, 0.5 - 0.5.
    assert captured["advantages"] == pytest.approx([0.75, -0.75, 0.0])
    assert "loss/policy" in metrics
    assert Loo.kind == "loo"
    with pytest.raises(RepertoryError, match="method config 'loo' is already registered"):
        register_method_config(LooConfig)
    with pytest.raises(RepertoryError, match="method 'loo' is already registered"):
        register_method(LooConfig)(Loo)


# configs and checkpoints written before the method section


@pytest.mark.parametrize(
    ("recipe", "since"),
    [
        # The default recipe has changed since: 4 iterations, the estimator's discount, evaluated against itself
        # in 8 games.
        ("default", ["iterations=4", "method.gamma=0.95", "eval.opponent=null", "eval.episodes=8"]),
        ("igrpo-craigslist", []),
        ("adalign-ipd", []),
        ("ppo-ipd-vs-cooperator", []),
    ],
)
def test_an_old_run_config_reads_as_the_shipped_recipe(recipe, since):
    # The old file carries every method's settings at their defaults; only the method's own come through, and
    # the discount its estimator read, explicitly (the shipped recipe may leave it to the estimator's default).
    discount = load_config(recipe, since).method.gamma
    expected = dump_config(load_config(recipe, [*since, f"method.gamma={discount}"]))
    assert dump_config(load_config(str(OLD / f"{recipe}.yaml"))) == expected


def test_old_configs_keep_the_discount_their_estimator_read():
    grpo = load_config(str(OLD / "grpo.yaml")).method  # algo.turn_discount 0.8 and algo.gamma_turn 0.5
    assert (grpo.kind, grpo.estimator, grpo.gamma) == ("selfplay", "grpo", 0.8)
    naive = load_config(str(OLD / "naive-trust-and-split.yaml")).method  # algo.round_gamma 0.96
    assert (naive.kind, naive.estimator, naive.gamma, naive.aa_gamma, naive.reward_constant) == (
        "adalign",
        "naive",
        0.96,
        0.96,
        100.0,
    )
    archer = load_config(str(OLD / "archer-lc.yaml")).method  # rounds.q.lora_r 8, rounds.archer.batch_size 4
    assert (archer.kind, archer.lora.r, archer.lora.alpha, archer.batch_size, archer.gamma) == (
        "archer-lc",
        8,
        32.0,
        4,
        0.95,
    )


def test_old_set_keys_are_renamed():
    old = load_config(
        None,
        [
            "trainer=rounds",
            "rounds.method=mt-sft",
            "rounds.sft_quantile=0.5",
            "rounds.gamma=0.9",
            "rounds.logs=x.parquet",
            "rollout.opponent=always-cooperate",
        ],
    )
    new = load_config(
        None,
        [
            "method.kind=mt-sft",
            "method.quantile=0.5",
            "method.gamma=0.9",
            "method.logs=x.parquet",
            "rollout.opponent=always-cooperate",
        ],
    )
    assert old == new
    aa = load_config(None, ["algo.estimator=naive", "algo.round_gamma=0.7", "pool.p_snapshot=0.25"]).method
    assert (aa.kind, aa.estimator, aa.gamma, aa.pool.p_snapshot) == ("adalign", "naive", 0.7, 0.25)
    q = load_config("igrpo-craigslist", ["rounds.q.lora_r=4", "rounds.q.lora_alpha=8"]).method.q.lora
    assert (q.r, q.alpha) == (4, 8.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rounds.candidates=4"], "method.candidates: unknown key; allowed here: gamma_token, lam, estimator"),
        (["pool.p_snapshot=0.5"], "method.pool: unknown key"),
        (["rollout.opponent=pool"], "rollout.opponent pool does not support method kind selfplay: the pool serves"),
        (["trainer=batch"], "trainer: 'batch' names no loop; the trainer key is gone, the loop follows method.kind"),
    ],
)
def test_old_keys_a_method_does_not_have_are_refused_in_one_line(overrides, message):
    with pytest.raises(RepertoryError, match=message):
        load_config(None, overrides)


def test_an_old_checkpoint_resumes_with_its_ema_baselines(tokenizer, tmp_path):
    overrides = [
        f"output_dir={tmp_path}",
        "name=ema",
        "method.estimator=reinforce",
        "rollout.opponent=always-cooperate",
        "rollout.kernels_per_iteration=2",
        "rollout.max_new_tokens=4",
        "iterations=1",
        "eval.episodes=0",
    ]
    trainer = start_run(load_config(None, overrides), tiny_model(tokenizer, seed=2))
    trainer.fit()
    baselines = trainer.method.estimator_state
    assert baselines  # the EMA baselines of reinforce
    checkpoint = RunDir(tmp_path / "ema").complete_checkpoints()[-1]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    (checkpoint / "trainer_state.json").write_text(json.dumps({**state, "estimator_state": baselines}))
    (checkpoint / "method.json").unlink()  # as written before methods kept their own state
    resumed = resume_run(tmp_path / "ema", loaded=tiny_model(tokenizer, seed=2))
    assert resumed.method.estimator_state == baselines and resumed.iteration == 1


@pytest.mark.parametrize(
    ("recipe", "overrides", "line_up"),
    [
        ("omar-ipd", [], "self"),
        ("omar-ipd", ["rollout.opponent=always-defect"], "always-defect"),
        ("default", [], "always-cooperate"),  # the main job's fixed yardstick
        ("adalign-ipd", [], "self"),  # the pool of snapshots: its live policy
        ("omar-ipd", ["rollout.env=craigslist"], "bot"),  # a fixed-seat game trained in self-play meets its partner
        ("omar-ipd", ["rollout.env=craigslist", "eval.opponent=self"], "self"),  # unless told otherwise
    ],
)
def test_the_evaluation_line_up_defaults_to_the_rollout_opponent(recipe, overrides, line_up):
    assert load_config(recipe, overrides).evaluation_opponent == line_up


def test_raw_spread_reports_the_advantages_whitening_hides():
    # tokens 0, 0, 1, -1, 2: mean 0.4, squared deviations sum 5.2, unbiased variance 1.3; two of three turns move
    spread = raw_spread([[0.0, 0.0], [1.0, -1.0], [2.0]])
    assert spread == {"advantage/raw_sd": pytest.approx(1.3**0.5), "advantage/nonzero_share": pytest.approx(2 / 3)}
    assert raw_spread([[0.0], [0.0, 0.0]]) == {"advantage/raw_sd": 0.0, "advantage/nonzero_share": 0.0}
    assert raw_spread([]) == {}  # no trained turns: nothing to average into the run's curve
