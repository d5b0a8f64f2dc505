"""One LoRA adapter per role or team (model.adapters): routing, per-row adapters in one forward pass (sampling
and the learner), isolation of each role's update, checkpoints that resume exactly, export and evaluation."""

import dataclasses
import json

import httpx
import pytest
import torch
from conftest import rows
from safetensors.torch import load_file

from repertory.agents import LMOptions, Request
from repertory.agents.resolve import trained_policy
from repertory.config import LoraConfig, load_config
from repertory.envs import env_class, load_kernels
from repertory.envs.roles import RoleAdapters
from repertory.generation import SamplingParams, make_backend
from repertory.models import LoadedModel, load_model, load_tokenizer, tiny_model
from repertory.models.adapters import BASE_ROW, per_row_adapters
from repertory.models.checkpoints import export_policy
from repertory.runs import RunDir
from repertory.serve import ServeOptions
from repertory.serve.app import ServerThread, load_served_policy
from repertory.store.served import ServedLog
from repertory.train import TIMING_PREFIXES, resume_run, start_run
from repertory.train.batch import collect
from repertory.train.heads import with_lora
from repertory.types import Message, RepertoryError

ROLE_ADAPTERS = ["role-proposer", "role-responder"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_role_adapters_name_one_adapter_per_role_or_team_and_route_each_seat():
    ultimatum = RoleAdapters.of("ultimatum", "per_role")
    assert ultimatum.names == {"proposer": "role-proposer", "responder": "role-responder"}
    assert ultimatum.adapter("responder", "") == "role-responder"
    assert RoleAdapters.of("ultimatum", "shared") is None
    teams = RoleAdapters.of("werewolf", "per_team")
    assert teams.adapters == ["team-village", "team-wolves"]
    game = env_class("werewolf")
    kernel = load_kernels("werewolf", "train", {})[0]
    labels, sides = game.seat_labels(kernel.data), game.seat_teams(kernel.data)
    for seat in range(len(labels)):
        assert teams.of_seat(game, kernel.data, seat) == f"team-{sides[seat]}"
    roles = RoleAdapters.of("werewolf", "per_role")
    assert set(roles.names) == set(game.role_labels) and len(roles.adapters) == len(set(game.role_labels))
    assert RoleAdapters.of("craigslist", "per_role").adapters == ["role-vendor", "role-customer"]
    with pytest.raises(RepertoryError, match="fewer than two roles"):
        RoleAdapters.of("ipd", "per_role")  # both seats are 'player'
    with pytest.raises(RepertoryError, match="fewer than two teams"):
        RoleAdapters.of("ultimatum", "per_team")
    with pytest.raises(RepertoryError, match="has role 'judge', which has no adapter"):
        ultimatum.adapter("judge", "")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.env=ipd"], "fewer than two roles"),
        (["model.lora.enabled=false"], "full fine-tuning"),
        (["rollout.workers=2"], "rollout.workers"),
        (["rollout.max_staleness=1"], "rollout.max_staleness"),
        (["method.kind=mt-sft", "method.logs=x.parquet"], "round method"),
    ],
)
def test_the_config_refuses_what_per_role_adapters_do_not_support(overrides, message):
    with pytest.raises(RepertoryError, match=message):
        load_config(None, ["rollout.env=ultimatum", "model.adapters=per_role", *overrides])


def test_the_config_accepts_per_role_and_per_team_where_the_game_has_them():
    assert load_config(None, ["rollout.env=ultimatum", "model.adapters=per_role"]).model.adapters == "per_role"
    assert load_config(None, ["rollout.env=werewolf", "model.adapters=per_team"]).model.adapters == "per_team"
    with pytest.raises(RepertoryError, match="model.adapters"):
        load_config(None, ["model.adapters=per_seat"])


def _two_adapters(tokenizer) -> tuple[LoadedModel, torch.nn.Module]:
    """A tiny model with two LoRA adapters whose B matrices are random (so each changes the output)."""
    loaded = tiny_model(tokenizer, seed=3)
    peft = with_lora(loaded.model, LoraConfig(r=4, alpha=8.0), seed=5, names=["first", "second"])
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for key, param in peft.named_parameters():
            if ".lora_B." in key:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return LoadedModel(loaded.model, tokenizer, "tiny", peft), peft


def test_one_forward_pass_with_an_adapter_per_row_equals_each_adapter_alone(tokenizer):
    loaded, peft = _two_adapters(tokenizer)
    ids = torch.randint(0, 500, (4, 9), generator=torch.Generator().manual_seed(0))
    names = ["first", "second", BASE_ROW, "first"]
    with torch.no_grad(), per_row_adapters(peft, names):
        mixed = loaded.model(input_ids=ids).logits
    alone = []
    with torch.no_grad():
        for row, name in enumerate(names):
            if name == BASE_ROW:
                with peft.disable_adapter():
                    alone.append(loaded.model(input_ids=ids[row : row + 1]).logits[0])
            else:
                peft.set_adapter(name)
                alone.append(loaded.model(input_ids=ids[row : row + 1]).logits[0])
    for row in range(4):
        torch.testing.assert_close(mixed[row], alone[row], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(mixed[0], mixed[1], atol=1e-3)  # the adapters differ, so the test can fail
    with pytest.raises(ValueError, match="unknown adapters"):
        with per_row_adapters(peft, ["first", "third"]):
            pass


def test_a_gradient_through_one_row_reaches_only_its_own_adapter(tokenizer):
    loaded, peft = _two_adapters(tokenizer)
    for key, param in peft.named_parameters():
        assert param.requires_grad == (".lora_" in key), key  # every adapter trains, the base is frozen
    ids = torch.randint(0, 500, (2, 6), generator=torch.Generator().manual_seed(1))
    with per_row_adapters(peft, ["first", "second"]):
        logits = loaded.model(input_ids=ids).logits
    logits[0].sum().backward()  # row 0 only: adapter first
    grads = {key: param.grad for key, param in peft.named_parameters() if ".lora_" in key}
    assert all(g is not None and g.abs().sum() > 0 for k, g in grads.items() if ".lora_B.first." in k)
    assert all(g is None or not g.any() for k, g in grads.items() if ".second." in k)


def test_the_hf_backend_samples_mixed_adapters_in_one_call_as_each_alone(tokenizer):
    loaded, _ = _two_adapters(tokenizer)
    backend = make_backend("hf", loaded)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 4], [8, 9]]
    adapters = ["first", "second", None, "second"]
    params = SamplingParams(1.0, 1.0, 6)
    mixed = backend.generate(rows(prompts, [11, 12, 13, 14], adapters=adapters), params)
    passes = backend.stats.forward_passes
    alone = [
        backend.generate(rows([p], [s], adapters=[a]), params)[0]
        for p, s, a in zip(prompts, [11, 12, 13, 14], adapters)
    ]
    assert backend.stats.forward_passes - passes > passes  # the mixed call shared its passes across rows
    for x, y in zip(mixed, alone):
        assert x.response_ids == y.response_ids
        assert x.logp_sample == pytest.approx(y.logp_sample, abs=1e-4)


def _config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "iterations=2",
            "rollout.env=ultimatum",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=2",
            "rollout.episodes_per_kernel=2",
            "model.adapters=per_role",
            "model.lora.r=4",
            "eval.episodes=2",
            "algo.lr=1e-2",
            *extra,
        ],
    )


def _adapters(checkpoint) -> dict[str, dict[str, torch.Tensor]]:
    return {a: load_file(str(checkpoint / "policy" / a / "adapter_model.safetensors")) for a in ROLE_ADAPTERS}


def test_an_update_on_one_roles_turns_leaves_the_other_roles_adapter_unchanged(tmp_path, tokenizer):
    trainer = start_run(_config(tmp_path, "isolated", "rollout.opponent=bot"), tiny_model(tokenizer, seed=2))
    learner = trainer.learner
    assert learner.adapters == ROLE_ADAPTERS
    specs = [s for s in trainer.lineup.specs(0) if s.trainable == [True, False]]  # the live policy proposes
    assert specs and all(s.agents[0] is trainer.lineup.live for s in specs)
    batch = collect(trainer.rollouts.play(specs), roles=trainer.lineup.live.roles)
    assert {s.adapter for s in batch.samples} == {"role-proposer"}  # recorded at collection: the learner reads it
    before = {k: p.detach().clone() for k, p in learner.peft.named_parameters() if ".lora_" in k}
    learner.score(batch)
    batch.assign({i: torch.full((s.n_tokens,), 1.0 - 2 * (i % 2)) for i, s in enumerate(batch.samples) if s.trained})
    learner.update(batch, 0)
    after = dict(learner.peft.named_parameters())
    moved = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert moved and all(".role-proposer." in k for k in moved)
    assert any(".lora_B.role-proposer." in k for k in moved)


def test_a_role_whose_turns_all_have_zero_advantage_is_not_stepped_by_the_other_roles_update(tmp_path, tokenizer):
    trainer = start_run(_config(tmp_path, "flat-role", "algo.mini_batches=1"), tiny_model(tokenizer, seed=2))
    learner = trainer.learner
    played = trainer.rollouts.play(trainer.lineup.specs(0))  # self-play: both roles' turns
    with pytest.raises(ValueError, match=r"collected with them: collect\(..., roles\)"):
        learner.score(collect(played))
    batch = collect(played, roles=trainer.lineup.live.roles)
    seat = {i: batch.trajectories[s.trajectory].seat_index for i, s in enumerate(batch.samples)}
    assert set(seat.values()) == {0, 1}
    assert {(seat[i], s.adapter) for i, s in enumerate(batch.samples)} == {(0, "role-proposer"), (1, "role-responder")}
    before = {k: p.detach().clone() for k, p in learner.peft.named_parameters() if ".lora_" in k}
    learner.score(batch)
    # the responder's turns carry no advantage: only the KL term's float noise reaches its adapter
    advantage = {
        i: torch.full((s.n_tokens,), 1.0 - 2 * (i % 2) if seat[i] == 0 else 0.0)
        for i, s in enumerate(batch.samples)
        if s.trained
    }
    batch.assign(advantage)
    learner.update(batch, 0)
    after = dict(learner.peft.named_parameters())
    moved = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert moved and all(".role-proposer." in k for k in moved)


def test_a_per_role_run_trains_every_role_resumes_exactly_and_exports_a_model_per_role(tmp_path, tokenizer):
    straight = start_run(_config(tmp_path, "straight", "model.precision=float32"), tiny_model(tokenizer, seed=2))
    run_dir = straight.fit()
    checkpoint = RunDir(run_dir).complete_checkpoints()[-1]
    trained = _adapters(checkpoint)
    for adapter in ROLE_ADAPTERS:  # self-play: both roles learned from their own seats
        assert any(v.any() for k, v in trained[adapter].items() if "lora_B" in k), adapter
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "eval/outcome" in lines[0] and "final/outcome" in lines[-1]
    # the learner reads every seat through the adapter that sampled it: its log-probs are the sampler's
    assert all(line["offpolicy/max_gap"] <= 1e-4 for line in lines)

    class Stop(Exception):
        pass

    def stop(line):
        raise Stop

    interrupted = start_run(_config(tmp_path, "interrupted", "model.precision=float32"), tiny_model(tokenizer, seed=2))
    with pytest.raises(Stop):
        interrupted.fit(stop)
    resumed = resume_run(interrupted.run_dir, loaded=tiny_model(tokenizer, seed=2))
    assert resumed.iteration == 1
    resumed_dir = resumed.fit()
    again = [json.loads(x) for x in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(TIMING_PREFIXES)} for r in rows]  # noqa: E731
    assert strip(again) == strip(lines)
    other = _adapters(RunDir(resumed_dir).complete_checkpoints()[-1])
    for adapter in ROLE_ADAPTERS:
        assert all(torch.equal(trained[adapter][k], other[adapter][k]) for k in trained[adapter])


def test_a_per_role_checkpoint_plays_exports_and_serves_one_role(tmp_path, tokenizer, monkeypatch):
    trainer = start_run(_config(tmp_path, "played", "iterations=1", "eval.episodes=0"), tiny_model(tokenizer, seed=2))
    run_dir = trainer.fit()
    checkpoint = RunDir(run_dir).complete_checkpoints()[-1]
    model_dir = tmp_path / "tiny"
    tiny = tiny_model(tokenizer, seed=2)
    tiny.model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config_file = run_dir / "config.yaml"  # the run's base model as a checkpoint directory, as a user's would be
    config_file.write_text(config_file.read_text().replace("name: smollm2", f"name: {model_dir}"))

    agent = trained_policy(str(run_dir), LMOptions(constrained=True))
    assert agent.roles is not None and agent.roles.adapters == ROLE_ADAPTERS
    assert sorted(agent.backend.loaded.peft.peft_config) == ROLE_ADAPTERS
    choices = ["<accept/>", "<reject/>"]
    request = Request("e", 1, "responder", [Message("user", "Deal?")], {}, label="responder", choices=choices)
    assert agent._adapter(request) == "role-responder"
    answer = agent.act([request])[0]
    [row] = agent._generation_requests([request])
    assert row.adapter == "role-responder"
    for adapter, same in (("role-responder", True), ("role-proposer", False)):
        direct = agent.backend.generate([dataclasses.replace(row, adapter=adapter)], agent.params)[0]
        assert (direct.logp_sample == pytest.approx(answer.logp_sample, abs=1e-6)) == same, adapter

    exported = export_policy(run_dir, tmp_path / "export")
    assert json.loads((exported / "roles.json").read_text())["adapters"] == dict(
        zip(["proposer", "responder"], ROLE_ADAPTERS)
    )
    trained = _adapters(checkpoint)
    for adapter in ROLE_ADAPTERS:  # each directory is the base with that role's adapter merged in
        merged = load_model(str(exported / adapter))
        plain = load_model(str(model_dir))
        delta = {k: merged.model.state_dict()[k] - plain.model.state_dict()[k] for k in plain.model.state_dict()}
        assert any(d.abs().max() > 0 for d in delta.values()) == any(
            v.any() for k, v in trained[adapter].items() if "lora_B" in k
        )
    a, b = (load_model(str(exported / x)).model.state_dict() for x in ROLE_ADAPTERS)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # one model per role, not one model twice

    with pytest.raises(RepertoryError, match="already exists"):
        export_policy(run_dir, tmp_path / "export")

    with pytest.raises(RepertoryError, match=r"no --adapter\): serve one with --adapter ROLE \(proposer, responder\)"):
        load_served_policy(str(run_dir))
    with pytest.raises(RepertoryError, match="--adapter 'dealer'"):
        load_served_policy(str(run_dir), adapter="dealer")
    with pytest.raises(RepertoryError, match="picks an adapter of a run"):
        load_served_policy("base", adapter="responder")
    served = load_served_policy(str(run_dir), adapter="role-responder")  # the adapter's own name works too
    assert (served.name, served.policy_id, served.adapter) == (
        f"{run_dir.name}@1/responder",
        "snapshot@1/responder",
        "role-responder",
    )
    asked = []
    generate = served.backend.generate
    monkeypatch.setattr(
        served.backend,
        "generate",
        lambda rows, params: asked.append([r.adapter for r in rows]) or generate(rows, params),
    )
    with ServerThread(
        served, ServeOptions(port=0), ServedLog(tmp_path / "log", served.name, served.policy_id, len(tokenizer))
    ) as url:
        body = {"model": served.name, "messages": [{"role": "user", "content": "Deal?"}], "max_tokens": 4}
        answer = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert asked == [["role-responder"]]  # every row of the server's batch through the responder's adapter


def test_a_model_with_every_role_adapter_active_refuses_rows_that_name_none(tokenizer):
    loaded, _ = _two_adapters(tokenizer)
    backend = make_backend("hf", loaded)
    with pytest.raises(ValueError, match="name one per row"):
        backend.generate(rows([[1, 2, 3]], [0]), SamplingParams(1.0, 1.0, 2))
