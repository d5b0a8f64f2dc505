"""Continuous batching: rows join a batch in flight, episodes step as soon as their seats have answered, and the
episodes are the same as under tick scheduling, token for token; the key/value memory budget."""

from __future__ import annotations

import pytest
import torch
from conftest import rows

from repertory.agents import BotAgent, Request, Response
from repertory.agents.lm import LMAgent
from repertory.envs import env_class, load_kernels
from repertory.generation import GenerationRequest, SamplingParams
from repertory.generation.hf import HFBackend
from repertory.generation.kvcache import PAGE
from repertory.models import load_tokenizer, tiny_model
from repertory.rollout import EpisodeSpec, run_episodes, schedule
from repertory.types import RepertoryError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def backend(tokenizer):
    """A tiny 3:1 grouped-query model that ends about one turn in ten at each token, so rows finish unevenly."""
    loaded = tiny_model(tokenizer, layers=2, hidden=96, heads=6, kv_heads=2, seed=5)
    backend = HFBackend(loaded)
    bias = torch.zeros(loaded.model.config.vocab_size)
    bias[backend.end_of_turn_id] = 8.5
    loaded.model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + bias)
    return backend


class Watched(LMAgent):
    """An LM agent that notes how many rows were in flight whenever requests joined its batch."""

    def submit(self, requests: list[Request]) -> None:
        self.joined_busy = getattr(self, "joined_busy", 0) + (self._stream is not None and bool(self._stream.rows))
        super().submit(requests)


def same_episodes(a, b) -> None:
    assert [ep.episode_id for ep in a] == [ep.episode_id for ep in b]
    for x, y in zip(a, b):
        assert [(t.seat_id, t.turn_index, t.text, t.response_ids, t.prompt_ids) for t in x.turns] == [
            (t.seat_id, t.turn_index, t.text, t.response_ids, t.prompt_ids) for t in y.turns
        ]
        assert [t.reward for t in x.turns] == [t.reward for t in y.turns]
        assert x.result == y.result and x.metrics == y.metrics
        for s, t in zip(x.turns, y.turns):
            assert max((abs(p - q) for p, q in zip(s.logp_sample, t.logp_sample)), default=0.0) < 1e-4


@pytest.mark.parametrize(
    "env,episodes,constrained",
    [
        ("ipd", 4, False),  # simultaneous moves
        ("trust-and-split", 3, False),  # alternating free text of uneven lengths
        ("werewolf", 2, True),  # six seats, phases, team and private channels
    ],
)
def test_continuous_and_tick_scheduling_play_the_same_episodes(backend, env, episodes, constrained):
    params = SamplingParams(max_new_tokens=24)
    played = {}
    for mode in ("tick", "continuous"):
        backend.reset_cache()
        agent = Watched(backend, "model", params, constrained=constrained, seed=11)
        seats = len(env_class(env).roles)
        played[mode] = run_episodes(schedule(env, [agent] * seats, episodes, seed=3), schedule=mode)
        if mode == "continuous" and not constrained:
            assert agent.joined_busy > 0, "requests joined a batch while others were still decoding"
    same_episodes(played["tick"], played["continuous"])


class Delayed:
    """A streaming agent over a scripted one: each answer arrives after a number of polls that depends on the
    request, so answers come back out of order."""

    name, policy_id = "delayed", "base"

    def __init__(self, inner):
        self.inner, self.queue = inner, []

    def submit(self, requests: list[Request]) -> None:
        for r in requests:
            self.queue.append([1 + (r.seat + r.turn_index + r.attempt) % 3, r])

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def poll(self) -> list[tuple[Request, Response]]:
        for item in self.queue:
            item[0] -= 1
        ready = [r for left, r in self.queue if left <= 0]
        self.queue = [item for item in self.queue if item[0] > 0]
        return list(zip(ready, self.inner.act(ready))) if ready else []


class ByAttempt:
    name, policy_id = "attempts", "base"

    def __init__(self, answers: list[str]):
        self.answers = answers

    def act(self, requests: list[Request]) -> list[Response]:
        return [Response(self.answers[min(r.attempt, len(self.answers) - 1)]) for r in requests]


@pytest.mark.parametrize("mode", ["tick", "continuous"])
def test_the_partner_guard_resamples_through_a_batch_in_flight(mode):
    cls = env_class("craigslist")
    kernels = load_kernels("craigslist", "heldout")[:3]
    limit = kernels[0].data["limit"]
    answers = ["Deal. <accept/>", f'<propose>{{"price": {limit + 1}}}</propose>', "Let us keep talking."]

    def specs(customer):
        vendor = BotAgent("bot", cls.bots["bot"])
        return [
            EpisodeSpec(f"guard/{i}", "craigslist", k, i, [vendor, customer], guarded=[False, True])
            for i, k in enumerate(kernels)
        ]

    plain = run_episodes(specs(ByAttempt(answers)))
    streamed = run_episodes(specs(Delayed(ByAttempt(answers))), schedule=mode)
    same_episodes(plain, streamed)
    assert all(ep.metrics["guard/resampled"] >= 2 for ep in streamed)


@pytest.mark.parametrize("paged", [False, True])
def test_rows_in_flight_stay_within_the_memory_budget(tokenizer, paged):
    loaded = tiny_model(tokenizer, layers=2, hidden=96, heads=6, kv_heads=2, seed=5)
    unbounded = HFBackend(loaded, paged=paged)
    assert unbounded.paged_cache == paged
    per_token = unbounded.token_bytes  # 2 layers x 2 key/value heads x 16 x 2 (keys, values) x 4 bytes = 512
    assert per_token == 512
    prompts = [tokenizer.encode(f"row {i} " * 10) for i in range(8)]
    params = SamplingParams(max_new_tokens=8)
    longest = max(len(p) for p in prompts) + params.max_new_tokens
    # room for three rows at most: padded to the longest, or a page each
    tight = HFBackend(loaded, kv_memory_mb=3.5 * (PAGE if paged else longest) * per_token / 2**20, paged=paged)
    out = tight.generate(rows(prompts, list(range(8))), params)
    assert max(p.rows for p in tight.stats.passes) == 3
    free = unbounded.generate(rows(prompts, list(range(8))), params)
    assert [g.response_ids for g in out] == [g.response_ids for g in free]
    assert max(p.rows for p in unbounded.stats.passes) == 8
    if paged:
        assert tight.pages().free == 3  # every row's pages given back (no key: none kept)


@pytest.mark.parametrize(
    "paged,need",
    [(False, r"44 \(36 of prompt and 8 to generate\)"), (True, r"128 \(36 .* generate, in whole pages of 128\)")],
)
def test_a_budget_too_small_for_one_row_is_a_one_line_error(tokenizer, paged, need):
    backend = HFBackend(tiny_model(tokenizer, seed=0), kv_memory_mb=0.01 if not paged else 0.05, paged=paged)
    fit = backend.budget_tokens
    with pytest.raises(
        RepertoryError, match=rf"kv_memory_mb: {fit} tokens .* one row needs {need}; raise kv_memory_mb"
    ) as e:
        backend.generate(rows([tokenizer.encode("x " * 35)], [0]), SamplingParams(max_new_tokens=8))
    assert "\n" not in str(e.value)
    with pytest.raises(RepertoryError, match="kv_memory_mb must be positive"):
        HFBackend(tiny_model(tokenizer, seed=0), kv_memory_mb=0)


def test_kept_prefixes_share_the_budget_with_rows_in_flight(tokenizer):
    backend = HFBackend(tiny_model(tokenizer, seed=0), kv_memory_mb=0.25)  # 512 tokens at 512 bytes
    params = SamplingParams(max_new_tokens=4)
    prompts = [tokenizer.encode(f"seat {i} speaks. " * 8) for i in range(6)]
    backend.generate(rows(prompts, list(range(6)), cache_keys=[("k", i) for i in range(6)]), params)
    assert 0 < backend.prefixes.tokens <= backend.budget_tokens
    kept = sum(p.size for p in backend.prefixes.values())  # whole pages: 1 of 128 tokens a ~40-token chat
    assert kept == backend.prefixes.tokens == PAGE * len(backend.prefixes.values())
    stream = backend.stream(params)
    stream.add(GenerationRequest(tokenizer.encode("a long new prompt " * 40), 0))
    stream.step()  # a row in flight claims its room: the kept prefixes shrink to what is left
    assert backend.prefixes.tokens + stream._need(stream.rows) <= backend.budget_tokens


def test_constrained_rows_reserve_their_longest_answer_so_the_chats_stay_cached(tokenizer):
    """A row that can only write one of two 6-token moves reserves 6 tokens, not max_new_tokens: the four chats
    run in one batch and their prefixes are kept for the next turn (with 400 reserved each, one row fit at a
    time and the kept prefixes were evicted)."""
    backend = HFBackend(tiny_model(tokenizer, seed=0), kv_memory_mb=0.25)  # 512 tokens at 512 bytes
    params = SamplingParams(max_new_tokens=400)
    moves = ["<choose>A</choose>", "<choose>B</choose>"]
    trie = backend.constraint(moves)
    assert trie.depth == max(len(tokenizer.encode(m, add_special_tokens=False)) for m in moves) + 1  # and the end
    prompts = [tokenizer.encode(f"seat {i} speaks. " * 8) for i in range(4)]
    keys = [("chat", i) for i in range(4)]
    first = backend.generate(rows(prompts, list(range(4)), constraints=[trie] * 4, cache_keys=keys), params)
    assert max(p.rows for p in backend.stats.passes) == 4
    following = [p + g.response_ids + tokenizer.encode(" next turn") for p, g in zip(prompts, first)]
    backend.generate(rows(following, list(range(4)), constraints=[trie] * 4, cache_keys=keys), params)
    assert backend.stats.reused_prompt_tokens == sum(len(p) + len(g.response_ids) - 1 for p, g in zip(prompts, first))
