"""The contract every generation backend keeps, whatever its engine (``repertory.generation.Backend``).

Each test runs once per engine in ``ENGINES``; an engine joins by adding its name there (and, where it needs a
machine this suite lacks, a skip that names what is missing). The reference for log-probs is a teacher-forced
pass of the same weights in transformers, the quantity the learner recomputes.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import rows
from transformers import AutoTokenizer

from repertory.generation import BACKENDS, Backend, GenerationRequest, SamplingParams, TokenTrie, make_backend
from repertory.models import LoadedModel, load_tokenizer, tiny_model

NO_VLLM = importlib.util.find_spec("vllm") is None
ENGINES = [
    "hf",
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(NO_VLLM, reason="vLLM is not installed (make test installs it)"),
        ],
    ),
]
TOL = 1e-4
HIDDEN = 192  # 6 heads of 32 (vLLM's CPU attention has no kernel for heads of 16) over 2 key/value heads, 3:1
DEVICE = os.environ.get("REPERTORY_TEST_DEVICE", "cpu")  # benchmarks/gpu.sh runs the contract on "cuda"


def tiny(tokenizer, seed: int) -> LoadedModel:
    loaded = tiny_model(tokenizer, layers=2, hidden=HIDDEN, heads=6, kv_heads=2, seed=seed)
    loaded.model.to(DEVICE)
    return loaded


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tokenizer():
    # A machine without the embedded model's package (a lent GPU) names a saved copy of its tokenizer.
    saved = os.environ.get("REPERTORY_TEST_TOKENIZER")
    return AutoTokenizer.from_pretrained(saved) if saved else load_tokenizer()


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tokenizer) -> tuple[Backend, LoadedModel]:
    loaded = tiny(tokenizer, seed=0)
    backend = make_backend(request.param, loaded)
    yield backend, loaded
    backend.close()


def teacher_forced(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response], device=model.device)).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)]


def largest_gap(expected: list[float], got: list[float]) -> float:
    assert len(expected) == len(got)
    return max(abs(a - b) for a, b in zip(expected, got))


def test_every_engine_under_test_is_registered():
    assert {e if isinstance(e, str) else e.values[0] for e in ENGINES} <= set(BACKENDS)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_sampled_logprobs_equal_teacher_forced_recomputation(engine, tokenizer, temperature, top_p):
    backend, loaded = engine
    prompts = [tokenizer.encode(text) for text in ("Hi", "Round 1 of 10. " * 7, "You are Alice. " * 3, "x " * 40)]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=24)
    for prompt, g in zip(prompts, backend.generate(rows(prompts, [11, 12, 13, 14]), params)):
        assert len(g.logp_sample) == len(g.response_ids) > 0
        assert largest_gap(teacher_forced(loaded.model, prompt, g.response_ids, temperature), g.logp_sample) < TOL


def test_seeds_reproduce_rows_independent_of_batch_composition(engine, tokenizer):
    backend, _ = engine
    a, b, c = (tokenizer.encode(t) for t in ("alpha", "beta gamma delta", "epsilon " * 9))
    params = SamplingParams(max_new_tokens=16)
    first = backend.generate(rows([a, b, c], [1, 2, 3]), params)
    assert [g.response_ids for g in backend.generate(rows([a, b, c], [1, 2, 3]), params)] == [
        g.response_ids for g in first
    ]
    assert backend.generate(rows([b], [2]), params)[0].response_ids == first[1].response_ids
    assert [g.response_ids for g in backend.generate(rows([c, a, b], [3, 1, 2]), params)] == [
        first[2].response_ids,
        first[0].response_ids,
        first[1].response_ids,
    ]
    assert [g.response_ids for g in backend.generate(rows([a, b, c], [4, 5, 6]), params)] != [
        g.response_ids for g in first
    ]
    # Copies of one prompt in one call (a state's candidates) each sample as if alone.
    copies = backend.generate(rows([a, a, a], [7, 8, 9]), params)
    assert len({tuple(g.response_ids) for g in copies}) > 1
    for seed, g in zip([7, 8, 9], copies):
        alone = backend.generate(rows([a], [seed]), params)[0]
        assert alone.response_ids == g.response_ids and largest_gap(alone.logp_sample, g.logp_sample) < TOL


def test_greedy_budget_and_stop_strings(engine, tokenizer):
    backend, _ = engine
    prompt = [tokenizer.encode("Count with me")]
    greedy = backend.generate(rows(prompt, [0]), SamplingParams(temperature=0, max_new_tokens=5))[0]
    assert greedy.finish == "length" and len(greedy.response_ids) == 5
    assert backend.generate(rows(prompt, [9]), SamplingParams(temperature=0, max_new_tokens=5))[0] == greedy
    text = backend.decode(greedy.response_ids)
    stop = text[-2:] if len(text) >= 2 else text
    stopped = backend.generate(rows(prompt, [0]), SamplingParams(temperature=0, max_new_tokens=5, stop=(stop,)))[0]
    assert stopped.finish == "stop" and stop in backend.decode(stopped.response_ids)


def test_constrained_outputs_are_always_in_the_set(engine, tokenizer):
    backend, loaded = engine
    choices = ["<choose>A</choose>", "<choose>B</choose>", "<keep>3</keep>"]
    constraint = backend.constraint(choices)
    assert isinstance(constraint, TokenTrie)
    prompts = [tokenizer.encode(f"prompt {i} " * (i % 4 + 1)) for i in range(16)]
    out = backend.generate(
        rows(prompts, list(range(16)), constraints=[constraint] * 16), SamplingParams(max_new_tokens=32)
    )
    texts = [backend.decode(g.response_ids) for g in out]
    assert set(texts) <= set(choices) and len(set(texts)) > 1
    assert all(g.finish == "stop" for g in out)
    # The recorded log-probs are the unconstrained ones, so the learner can recompute them.
    for prompt, g in zip(prompts, out):
        assert largest_gap(teacher_forced(loaded.model, prompt, g.response_ids, 1.0), g.logp_sample) < TOL
    # A constrained row beside free rows changes neither.
    free = backend.generate(rows(prompts[:2], [0, 1]), SamplingParams(max_new_tokens=12))
    mixed = backend.generate(
        rows(prompts[:3], [0, 1, 2], constraints=[None, None, constraint]), SamplingParams(max_new_tokens=12)
    )
    assert [g.response_ids for g in mixed[:2]] == [g.response_ids for g in free]
    assert backend.decode(mixed[2].response_ids) in choices


def test_a_finite_answer_longer_than_max_new_tokens_is_one_clear_error(engine, tokenizer):
    """Cut at max_new_tokens, a constrained answer would never parse, and every turn would be invalid (results
    48's gate: Deal or No Deal's proposals under 24 tokens): the row is refused with the budget it needs."""
    from repertory.types import RepertoryError

    backend, _ = engine
    choices = ['<propose>{"books": 3, "hats": 0, "balls": 2}</propose>', "<accept/>"]
    constraint = backend.constraint(choices)
    assert constraint.depth == len(tokenizer.encode(choices[0], add_special_tokens=False)) + 1  # and the end
    prompt = [tokenizer.encode("Divide the items.")]
    needs = f"the longest allowed answer takes {constraint.depth} tokens .* at least {constraint.depth}$"
    with pytest.raises(RepertoryError, match=needs):
        backend.generate(
            rows(prompt, [0], constraints=[constraint]), SamplingParams(max_new_tokens=constraint.depth - 1)
        )
    fits = backend.generate(
        rows(prompt, [0], constraints=[constraint]), SamplingParams(max_new_tokens=constraint.depth)
    )
    assert backend.decode(fits[0].response_ids) in choices and fits[0].finish == "stop"


def test_prefix_reuse_never_changes_tokens(engine, tokenizer):
    """A chat that grows turn by turn under one cache key samples exactly what it samples without the key."""
    backend, _ = engine
    params = SamplingParams(max_new_tokens=10)
    histories = {key: tokenizer.encode(f"You are seat {key}. The game begins. " * 3) for key in ("p0", "p1")}
    for turn in range(3):
        keys = sorted(histories)
        prompts = [histories[k] for k in keys]
        seeds = [100 * turn + i for i in range(len(keys))]
        cached = backend.generate(rows(prompts, seeds, cache_keys=[("contract", k) for k in keys]), params)
        plain = backend.generate(rows(prompts, seeds), params)
        for c, p in zip(cached, plain):
            assert c.response_ids == p.response_ids and largest_gap(c.logp_sample, p.logp_sample) < TOL
        for k, g in zip(keys, cached):
            histories[k] = histories[k] + g.response_ids + tokenizer.encode(f" Turn {turn} is over.")
    backend.reset_cache()


def test_rows_joining_a_stream_in_flight_sample_as_if_alone(engine, tokenizer):
    """Continuous batching: a row queued while others decode gets the tokens it gets alone."""
    backend, _ = engine
    params = SamplingParams(max_new_tokens=12)
    prompts = [tokenizer.encode(t) for t in ("first row", "a second, longer row " * 4, "third " * 9)]
    alone = [backend.generate(rows([p], [s]), params)[0] for s, p in enumerate(prompts)]
    stream = backend.stream(params)
    index, got = {stream.add(GenerationRequest(prompts[0], 0)): 0}, {}
    for step in range(40):
        if step in (2, 4):
            index[stream.add(GenerationRequest(prompts[step // 2], step // 2))] = step // 2
        for ticket, generation in stream.step():
            got[index[ticket]] = generation
    assert sorted(got) == [0, 1, 2] and not stream.busy
    for i, g in got.items():
        assert g.response_ids == alone[i].response_ids and largest_gap(alone[i].logp_sample, g.logp_sample) < TOL


@pytest.mark.parametrize("kind", ENGINES)
def test_sync_makes_the_engine_sample_the_updated_weights(tokenizer, kind):
    """After the learner changes the weights, ``sync`` leaves nothing stale: the engine samples as a fresh one."""
    loaded = tiny(tokenizer, seed=4)
    backend = make_backend(kind, loaded)
    prompt = tokenizer.encode("Round 1 of 10. " * 4)
    params = SamplingParams(max_new_tokens=8)
    backend.generate(rows([prompt], [5], cache_keys=["seat"]), params)
    with torch.no_grad():
        for p in loaded.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backend.sync(loaded.model)
    after = backend.generate(rows([prompt + [13]], [6], cache_keys=["seat"]), params)[0]
    fresh = make_backend(kind, loaded).generate(rows([prompt + [13]], [6]), params)[0]
    assert after.response_ids == fresh.response_ids and largest_gap(after.logp_sample, fresh.logp_sample) < TOL
    backend.close()


@pytest.mark.parametrize("kind", ENGINES)
def test_a_free_row_ends_at_the_context_window_and_a_constrained_row_must_fit(tokenizer, kind):
    """hf's window is the model's positions, vLLM's its max_model_len: a free row stops there ("length"), a row
    whose constrained answer would be cut, or whose prompt fills the window, is one clear error."""
    from repertory.envs.grammar import literal, turn_grammar
    from repertory.types import RepertoryError

    loaded = tiny(tokenizer, seed=4)
    if kind == "hf":
        loaded.model.config.max_position_embeddings = 64
    backend = make_backend(kind, loaded, **({} if kind == "hf" else {"max_model_len": 64}))
    assert backend.context_window == 64
    prompt = tokenizer.encode("Round 1 of 10. " * 20)[:56]
    params = SamplingParams(max_new_tokens=16)
    free = backend.generate(rows([prompt], [3]), params)[0]
    assert len(free.response_ids) == 8 and free.finish == "length"
    short = backend.generate(rows([prompt], [3], constraints=[backend.constraint(["yes", "no"])]), params)[0]
    assert backend.decode(short.response_ids) in ("yes", "no")  # its whole answer fits
    too_long = "a prompt of 56 tokens and an answer of up to 16 do not fit the model's context of 64 tokens"
    with pytest.raises(RepertoryError, match=too_long):
        backend.generate(rows([prompt], [3], constraints=[turn_grammar(literal("<pass/>"), 16, 200)]), params)
    with pytest.raises(RepertoryError, match="a prompt of 64 tokens does not fit the model's context of 64 tokens"):
        backend.generate(rows([prompt + prompt[:8]], [3]), params)
    backend.close()


def test_unknown_engine_options_and_engines_are_one_line_errors(tokenizer):
    from repertory.types import RepertoryError

    loaded = tiny(tokenizer, seed=1)
    expected = (
        "the hf backend takes kv_memory_mb, max_batch, prefix_cache_tokens, precision, paged, kv_dtype, not 'gpu_memory"
    )
    with pytest.raises(RepertoryError, match=expected):
        make_backend("hf", loaded, gpu_memory_utilization=0.5)
    with pytest.raises(RepertoryError, match="unknown generation backend 'sglang'; known: hf, vllm"):
        make_backend("sglang", loaded)
