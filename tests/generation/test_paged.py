"""The hf engine's paged key/value cache: the paged decode kernel against SDPA over the same columns, the pool of
pages (taken, reclaimed, given back, never leaked), and the paged stream sampling exactly what the left-padded
stream samples, over turns that reuse kept prefixes, rows that share a prompt or a key, and constrained rows whose
forced tokens make a pass several tokens wide."""

from __future__ import annotations

import pytest
import torch
from conftest import rows

import repertory.generation.stream as stream
from repertory.generation import GenerationRequest, SamplingParams
from repertory.generation.hf import HFBackend
from repertory.generation.kvcache import PAGE, PagedPass, PagedPrefix, Pages, pages_for
from repertory.models import load_tokenizer, tiny_model
from repertory.models.decode import paged_decode_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def kernel(compiled_kernels):
    return compiled_kernels[1]


def scattered_pages(lengths: list[int], count: int, seed: int) -> torch.Tensor:
    """Each row's block table: its pages drawn from ``count`` in a shuffled order, unused entries 0."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros(len(lengths), max(pages_for(n) for n in lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        for page in range(pages_for(length)):
            table[row, page] = order.pop()
    return table


def sdpa_over(query, key_pages, value_pages, table, lengths) -> torch.Tensor:
    """SDPA over each row's first ``lengths[b]`` columns, gathered from its pages: [B, 1, Hq, D]."""
    outputs = []
    for b, length in enumerate(lengths):
        keys, values = (p[table[b]].float().transpose(0, 1).flatten(1, 2)[:, :length] for p in (key_pages, value_pages))
        out = torch.nn.functional.scaled_dot_product_attention(
            query[b : b + 1], keys[None], values[None], enable_gqa=True
        )
        outputs.append(out.transpose(1, 2))
    return torch.cat(outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_the_paged_kernel_equals_sdpa_over_each_rows_own_columns(kernel, dtype, splits):
    """Rows of 1, a page less one, a page, a page and one, and several pages, 9 query over 3 key/value heads of 64,
    pages in a shuffled order, rows split across the cores or not."""
    torch.manual_seed(4)
    lengths = [1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE + 17]
    count = sum(pages_for(n) for n in lengths) + 3
    key_pages, value_pages = (torch.randn(count, 3, PAGE, 64).to(dtype) for _ in range(2))
    table = scattered_pages(lengths, count, seed=1)
    query = torch.randn(len(lengths), 9, 1, 64)
    out = paged_decode_attention(query, key_pages, value_pages, table, torch.tensor(lengths), splits=splits)
    expected = sdpa_over(query, key_pages, value_pages, table, lengths)
    assert out.shape == (5, 1, 9, 64)
    assert (out - expected).abs().max().item() < 1e-5


def test_a_table_naming_a_page_outside_the_pool_is_an_error(kernel):
    pages = torch.zeros(2, 1, PAGE, 16)
    with pytest.raises(RuntimeError, match="a page index lies outside the pages"):
        paged_decode_attention(torch.zeros(1, 1, 1, 16), pages, pages, torch.tensor([[2]]), torch.tensor([3]))
    with pytest.raises(RuntimeError, match="a length exceeds its row's pages"):
        paged_decode_attention(torch.zeros(1, 1, 1, 16), pages, pages, torch.tensor([[1]]), torch.tensor([PAGE + 1]))


def test_pages_are_taken_reclaimed_and_given_back():
    pool = Pages(layers=1, kv_heads=1, head_dim=4, count=3, dtype=torch.float32)
    held = pool.take(2)
    assert sorted(held) == [0, 1] and pool.free == 1
    with pytest.raises(RuntimeError, match="no free page of 3 left for 2 more"):
        pool.take(2)
    assert pool.free == 1  # a failed take gives back what it had taken
    kept = PagedPrefix([7] * PAGE, held, pool, torch.float32)
    pool.reclaim = lambda: bool(kept.pages) and (kept.release() or True)
    assert len(pool.take(3)) == 3 and pool.free == 0 and kept.pages == []


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _turns(tokenizer, backend: HFBackend) -> list:
    """Two turns of keyed chats (the second continuing the first's kept prefixes), with two rows of one prompt,
    three questions about one episode (a shared prefix) and constrained rows (forced chunks several tokens wide)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=20)
    chats = [tokenizer.encode(t) for t in ("Round 1 of 10. " * 20, "You are Alice. " * 3, "x " * 40, "Hi")]
    episode = tokenizer.encode("The episode so far: an offer of 300 for the bike. " * 12)
    questions = [episode + tokenizer.encode(q) for q in (" Score it.", " Rate agent 1.", " Rate agent 2 now.")]
    prompts = [*chats, chats[0], *questions]
    keys = [("chat", i) for i in range(4)] + [None, "episode", "episode", "episode"]
    first = backend.generate(rows(prompts, list(range(8)), cache_keys=keys), params)
    trie = backend.constraint(["<offer>120</offer>", "<offer>150</offer>", "<accept/>"])
    longer = [p + g.response_ids + tokenizer.encode(" and then?") for p, g in zip(chats, first)]
    second = backend.generate(
        rows(longer, [11, 12, 13, 14], constraints=[trie, None, trie, None], cache_keys=keys[:4]), params
    )
    return first + second


def test_the_paged_stream_samples_what_the_padded_stream_samples(kernel, tokenizer, monkeypatch):
    loaded = tiny_model(tokenizer, layers=2, hidden=72, heads=9, kv_heads=3, seed=3)
    paged, padded = HFBackend(loaded), HFBackend(loaded, paged=False)
    assert paged.paged_cache and not padded.paged_cache
    widths = []

    def spied(pool, tables, cached, fed):
        widths.append(max(fed))
        return PagedPass(pool, tables, cached, fed)

    monkeypatch.setattr(stream, "PagedPass", spied)
    on, off = _turns(tokenizer, paged), _turns(tokenizer, padded)
    assert [g.response_ids for g in on] == [g.response_ids for g in off]
    gap = max(abs(a - b) for x, y in zip(on, off) for a, b in zip(x.logp_sample, y.logp_sample))
    assert gap < 1e-5
    assert paged.stats.reused_prompt_tokens == padded.stats.reused_prompt_tokens > 0
    assert paged.stats.shared_prompt_tokens == padded.stats.shared_prompt_tokens > 0
    assert min(widths) == 1 and max(widths) > 1  # decode passes of one token, and of a forced chunk


def test_prefill_passes_pad_no_more_than_the_cut():
    assert stream.prefill_passes([50, 648, 49, 51]) == [[2, 0, 3], [1]]  # a re-prefilled chat beside short suffixes
    assert stream.prefill_passes([1, 1, 300]) == [[0, 1], [2]]  # 2 x 299 pad tokens > 512
    assert stream.prefill_passes([200, 300, 400]) == [[0, 1, 2]]  # 3 x 400 - 900 = 300 pad tokens
    assert stream.prefill_passes([7]) == [[0]]


@pytest.mark.parametrize("paged", [True, False])
def test_prefill_in_passes_samples_what_one_padded_pass_samples(kernel, tokenizer, monkeypatch, paged):
    """Every distinct suffix length its own pass (cut 0), the passes' caches joined, against one pass for all."""
    loaded = tiny_model(tokenizer, layers=2, hidden=72, heads=9, kv_heads=3, seed=3)
    results, passes = {}, {}
    for cut in (0, 10**9):
        monkeypatch.setattr(stream, "PREFILL_PAD_TOKENS", cut)
        backend = HFBackend(loaded, paged=paged)
        results[cut] = _turns(tokenizer, backend)
        passes[cut] = backend.stats.forward_passes
    assert passes[0] > passes[10**9]
    apart, together = results[0], results[10**9]
    assert [g.response_ids for g in apart] == [g.response_ids for g in together]
    gap = max(abs(a - b) for x, y in zip(apart, together) for a, b in zip(x.logp_sample, y.logp_sample))
    assert gap < 1e-5


def test_a_chat_takes_over_its_kept_pages_and_no_page_leaks(kernel, tokenizer):
    backend = HFBackend(tiny_model(tokenizer, seed=0), kv_memory_mb=1)
    pool = backend.pages()
    params = SamplingParams(max_new_tokens=6)
    prompt = tokenizer.encode("Round 1 of 10. " * 40)  # a few pages
    [first] = backend.generate(rows([prompt], [0], cache_keys=["chat"]), params)
    [kept] = backend.prefixes.values()
    pages = list(kept.pages)
    assert len(pages) == pages_for(len(prompt) + len(first.response_ids) - 1)
    assert pool.free + len(pages) == pool.count
    longer = prompt + first.response_ids + tokenizer.encode(" go on")
    backend.generate(rows([longer], [1], cache_keys=["chat"]), params)
    [again] = backend.prefixes.values()
    assert again.pages[: len(pages) - 1] == pages[:-1]  # the same pages, not a copy (the last one partly rewritten)
    assert pool.free + len(again.pages) == pool.count
    backend.reset_cache()
    assert pool.free == pool.count


def test_rows_joining_with_a_common_prefix_hold_its_whole_pages_once(kernel, tokenizer):
    """A judge's questions about one episode: the episode's whole pages are held by every question, not copied."""
    backend = HFBackend(tiny_model(tokenizer, seed=0), kv_memory_mb=2)
    pool = backend.pages()
    episode = tokenizer.encode("The episode so far: an offer of 300 for the bike, then 280. " * 15)
    assert 2 * PAGE < len(episode) < 3 * PAGE - 16
    prompts = [episode + tokenizer.encode(q) for q in (" Score it.", " Rate agent 1.", " Rate agent 2.", " Who won?")]
    stream = backend.stream(SamplingParams(max_new_tokens=4))
    for seed, prompt in enumerate(prompts):
        stream.add(GenerationRequest(prompt, seed, cache_key="episode"))
    stream.step()
    assert [pages_for(len(p)) for p in prompts] == [3] * 4
    assert pool.count - pool.free == 3 + 3 * 1  # the first row's 3 pages; each other row 2 held and 1 of its own
    assert all(stream.held[b][:2] == stream.held[0][:2] for b in range(4))
    while stream.busy:
        stream.step()
    backend.reset_cache()
    assert pool.free == pool.count


def test_a_bfloat16_cache_halves_each_token_and_samples_close_to_float32(kernel, tokenizer):
    from repertory.generation import samples_exactly
    from repertory.types import RepertoryError

    loaded = tiny_model(tokenizer, layers=2, hidden=72, heads=9, kv_heads=3, seed=3)
    exact, halved = HFBackend(loaded, kv_memory_mb=4), HFBackend(loaded, kv_memory_mb=4, kv_dtype="bfloat16")
    assert halved.token_bytes * 2 == exact.token_bytes and halved.budget_tokens // 2 == exact.budget_tokens
    assert halved.pages().keys[0].dtype == torch.bfloat16
    prompts = [tokenizer.encode("Round 1 of 10. " * 30), tokenizer.encode("You are Alice. " * 3)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    sampled = halved.generate(rows(prompts, [0, 1]), params)
    with torch.no_grad():  # the float32 model's own log-probs of the tokens the bfloat16 cache sampled
        for prompt, generation in zip(prompts, sampled):
            ids = torch.tensor([prompt + generation.response_ids])
            logp = torch.log_softmax(loaded.model(ids).logits[0, len(prompt) - 1 : -1].float(), -1)
            exact_logp = logp.gather(1, torch.tensor(generation.response_ids).unsqueeze(1)).squeeze(1)
            gap = (exact_logp - torch.tensor(generation.logp_sample)).abs().max().item()
            assert 0 < gap < 1e-2  # rounded keys and values: close, and not exact
    assert not samples_exactly("hf", {"kv_dtype": "bfloat16"}) and samples_exactly("hf", {})
    with pytest.raises(RepertoryError, match="kv_dtype bfloat16 keeps the paged cache in bfloat16, and this engine"):
        HFBackend(loaded, kv_dtype="bfloat16", paged=False)
    with pytest.raises(RepertoryError, match="kv_dtype must be one of float32, bfloat16, not 'int8'"):
        HFBackend(loaded, kv_dtype="int8")
