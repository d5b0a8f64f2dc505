"""The decode-attention kernel (repertory.models.decode) against PyTorch's SDPA with the same mask: padded
batches, holes, grouped and plain heads, rows split across the cores, views of a larger cache, no mask; the
dispatch from the model's attention function and its fallback; and a tiny model that samples the same tokens
with the kernel on and off."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import rows

import repertory.models.decode as decode
from repertory.generation import SamplingParams
from repertory.generation.hf import HFBackend
from repertory.models import load_tokenizer, tiny_model
from repertory.models.attention import gqa_sdpa_attention
from repertory.models.decode import SWITCH, decode_attention, decode_kernel, fits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def kernel(compiled_kernels):
    return compiled_kernels[0]


def cache(rows: int, kv_heads: int, tokens: int, dim: int, room: int = 37) -> torch.Tensor:
    """Keys or values as the engine holds them: the first ``tokens`` columns of a larger buffer (a view)."""
    return torch.randn(rows, kv_heads, tokens + room, dim)[..., :tokens, :]


def sdpa(query, key, value, mask, scale=None) -> torch.Tensor:
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key.float(), value.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def left_padded(lengths: list[int], tokens: int) -> torch.Tensor:
    mask = torch.zeros(len(lengths), 1, 1, tokens, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, ..., tokens - length :] = True
    return mask


def holes(rows: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """Per row: left padding, a reused prefix, padding, the new suffix, and right padding (a decode chunk)."""
    rng = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, 1, 1, tokens, dtype=torch.bool)
    for row in range(rows):
        cuts = sorted(torch.randint(0, tokens, (4,), generator=rng).tolist())
        mask[row, ..., cuts[0] : cuts[1]] = True
        mask[row, ..., cuts[2] : cuts[3] + 1] = True
    return mask


def check(kernel_op, query, key, value, mask, splits=0, scale=None):
    scale_value = query.shape[-1] ** -0.5 if scale is None else scale
    out = kernel_op(query, key, value, mask, scale_value, splits)
    assert out.shape == (query.shape[0], 1, query.shape[1], query.shape[3]) and out.is_contiguous()
    error = (out - sdpa(query, key, value, mask, scale)).abs().max().item()
    assert error < TOLERANCE, error


@pytest.mark.parametrize("rows", [1, 12])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_left_padded_batches_match_sdpa(kernel, rows, heads, kv_heads):
    torch.manual_seed(rows + heads)
    tokens = 300
    lengths = [tokens - 23 * (row % 7) for row in range(rows)]
    key, value = cache(rows, kv_heads, tokens, 64), cache(rows, kv_heads, tokens, 64)
    check(kernel, torch.randn(rows, heads, 1, 64), key, value, left_padded(lengths, tokens))


@pytest.mark.parametrize("rows", [1, 12])
def test_holes_in_the_middle_match_sdpa(kernel, rows):
    torch.manual_seed(1)
    key, value = cache(rows, 3, 500, 64), cache(rows, 3, 500, 64)
    check(kernel, torch.randn(rows, 9, 1, 64), key, value, holes(rows, 500))


def test_long_rows_split_across_the_cores_match_sdpa(kernel):
    torch.manual_seed(2)
    key, value = cache(1, 3, 3000, 64), cache(1, 3, 3000, 64)
    query = torch.randn(1, 9, 1, 64)
    for mask in (None, holes(1, 3000, seed=3), left_padded([2100], 3000)):
        check(kernel, query, key, value, mask)  # 3 (row, head) pairs on 2+ threads: the columns are split


@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_forced_splits_including_wholly_masked_ones_match_sdpa(kernel, splits):
    torch.manual_seed(splits)
    rows, tokens = 3, 640
    mask = left_padded([640, 100, 5], tokens)  # with 7 or more splits, some of rows 1 and 2 see no column
    key, value = cache(rows, 3, tokens, 64), cache(rows, 3, tokens, 64)
    check(kernel, torch.randn(rows, 9, 1, 64), key, value, mask, splits=splits)


@pytest.mark.parametrize("dim", [8, 16, 40, 64, 80, 128])
def test_head_sizes_with_and_without_a_vector_tail(kernel, dim):
    torch.manual_seed(dim)
    key, value = cache(2, 2, 200, dim), cache(2, 2, 200, dim)
    check(kernel, torch.randn(2, 6, 1, dim), key, value, holes(2, 200), scale=0.3)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 7, 8])
def test_groups_taken_some_heads_at_a_time(kernel, dim, group):
    # head sizes 64 and 128 hold 4 or 2 query heads' registers at once: whole passes and a remainder
    torch.manual_seed(group)
    key, value = cache(3, 2, 333, dim), cache(3, 2, 333, dim)
    check(kernel, torch.randn(3, 2 * group, 1, dim), key, value, holes(3, 333))


def test_no_mask_a_broadcast_mask_and_a_strided_query(kernel):
    torch.manual_seed(4)
    key, value = cache(5, 3, 260, 64), cache(5, 3, 260, 64)
    query = torch.randn(5, 1, 9, 64).transpose(1, 2)  # as a projection's output viewed per head
    check(kernel, query, key, value, None)
    shared = left_padded([200], 260)  # one row of mask for the whole batch
    check(kernel, query, key, value, shared)
    check(kernel, query, key, value, shared.expand(5, 1, 1, 260))


def test_masked_columns_are_never_read(kernel):
    torch.manual_seed(5)
    key, value = cache(2, 3, 128, 64), cache(2, 3, 128, 64)
    mask = holes(2, 128)
    query = torch.randn(2, 9, 1, 64)
    expected = sdpa(query, key, value, mask)
    poisoned_key, poisoned_value = key.clone(), value.clone()
    hidden = ~mask[:, 0, 0, :]
    poisoned_key[hidden.nonzero(as_tuple=True)[0], :, hidden.nonzero(as_tuple=True)[1]] = float("nan")
    poisoned_value[hidden.nonzero(as_tuple=True)[0], :, hidden.nonzero(as_tuple=True)[1]] = float("inf")
    out = kernel(query, poisoned_key, poisoned_value, mask, 0.125, 0)
    assert torch.isfinite(out).all()
    assert (out - expected).abs().max().item() < TOLERANCE


def test_a_row_with_no_attended_column_gives_zeros_as_sdpa_does(kernel):
    torch.manual_seed(6)
    key, value = cache(2, 3, 50, 64), cache(2, 3, 50, 64)
    mask = left_padded([50, 0], 50)
    query = torch.randn(2, 9, 1, 64)
    out = kernel(query, key, value, mask, 0.125, 0)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(sdpa(query, key, value, mask, 0.125)[1], out[1])  # PyTorch's CPU SDPA gives zeros too
    check(kernel, query, key, value, mask)


def test_bfloat16_keys_and_values_sum_in_float32(kernel):
    torch.manual_seed(7)
    key, value = cache(4, 3, 700, 64).bfloat16(), cache(4, 3, 700, 64).bfloat16()
    check(kernel, torch.randn(4, 9, 1, 64), key, value, holes(4, 700))


def test_the_dispatch_takes_decode_steps_only():
    query, key, value = torch.randn(2, 9, 1, 64), cache(2, 3, 40, 64), cache(2, 3, 40, 64)
    mask = left_padded([40, 30], 40)
    assert fits(query, key, value, mask) and fits(query, key, value, None)
    assert not fits(torch.randn(2, 9, 2, 64), key, value, mask)  # several query tokens: training, prefill
    assert not fits(query.double(), key.double(), value.double(), mask)
    assert not fits(query, key, value, torch.zeros(2, 1, 1, 40))  # an additive mask
    assert not fits(query, key, value, mask[..., :30])
    assert not fits(torch.randn(2, 8, 1, 64), key, value, mask)  # heads not in whole groups
    assert not fits(query, key.transpose(2, 3).contiguous().transpose(2, 3), value, mask)  # D not unit-stride
    grad = query.clone().requires_grad_()
    assert not fits(grad, key, value, mask)
    with torch.no_grad():
        assert fits(grad, key, value, mask)


def test_the_attention_function_runs_the_kernel_and_falls_back_unchanged(kernel, monkeypatch):
    torch.manual_seed(8)
    query, key, value = torch.randn(3, 9, 1, 64), cache(3, 3, 400, 64), cache(3, 3, 400, 64)
    mask = holes(3, 400)
    module = torch.nn.Module()
    expected = sdpa(query, key, value, mask)
    calls = []
    monkeypatch.setattr(decode, "decode_kernel", lambda: lambda *args: calls.append(args) or kernel(*args))
    on, _ = gqa_sdpa_attention(module, query, key, value, mask, scaling=None)
    assert len(calls) == 1 and (on - expected).abs().max().item() < TOLERANCE
    monkeypatch.undo()
    monkeypatch.setenv(SWITCH, "0")
    assert decode_kernel() is None and decode_attention(query, key, value, mask) is None
    off, _ = gqa_sdpa_attention(module, query, key, value, mask, scaling=None)
    assert (off - expected).abs().max().item() < 1e-6
    monkeypatch.delenv(SWITCH)
    assert decode_kernel() is kernel


def test_a_failed_build_says_so_in_one_line_and_sdpa_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    monkeypatch.setattr(decode, "kernel_path", lambda: tmp_path / "kernels" / "decode_attention-test.so")
    with caplog.at_level(logging.WARNING, logger=decode.__name__):
        assert decode._load() is None
    [record] = caplog.records
    expected = "repertory: decode-attention kernel unavailable (false exited with status 1); using SDPA"
    assert record.getMessage() == expected
    assert not list((tmp_path / "kernels").iterdir())  # no half-written build left behind


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _sample(tokenizer, loaded, temperature: float, paged: bool = False) -> list[list[int]]:
    """Two rounds of generation where the second reuses the first's prompts as kept prefixes (holes in the mask)."""
    backend = HFBackend(loaded, prefix_cache_tokens=4096, paged=paged)
    assert backend.paged_cache == paged
    params = SamplingParams(temperature=temperature, max_new_tokens=24)
    texts = ("Hi", "Round 1 of 10. " * 9, "You are Alice. " * 3, "x " * 40)
    prompts = [tokenizer.encode(text) for text in texts]
    keys = [f"row{i}" for i in range(len(prompts))]
    first = backend.generate(rows(prompts, [1, 2, 3, 4], cache_keys=keys), params)
    longer = [p + g.response_ids + tokenizer.encode(" and then?") for p, g in zip(prompts, first)]
    second = backend.generate(rows(longer, [5, 6, 7, 8], cache_keys=keys), params)
    assert backend.stats.reused_prompt_tokens > 0
    return [g.response_ids for g in first + second]


@pytest.mark.parametrize("heads,kv_heads,hidden", [(4, 2, 64), (9, 3, 72)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_tiny_model_samples_the_same_tokens_with_the_kernel_on_and_off(
    kernel, tokenizer, monkeypatch, heads, kv_heads, hidden, temperature
):
    """The kernel over one padded tensor, the kernel over pages and SDPA sample the same tokens."""
    loaded = tiny_model(tokenizer, layers=2, hidden=hidden, heads=heads, kv_heads=kv_heads, seed=3)
    calls = []
    monkeypatch.setattr(decode, "decode_kernel", lambda: lambda *args: calls.append(1) or kernel(*args))
    on = _sample(tokenizer, loaded, temperature)
    assert calls  # the decode steps went through the kernel
    pages = decode.paged_kernel()
    monkeypatch.setattr(decode, "paged_kernel", lambda: lambda *args: calls.append(2) or pages(*args))
    paged = _sample(tokenizer, loaded, temperature, paged=True)
    assert 2 in calls
    monkeypatch.undo()
    monkeypatch.setenv(SWITCH, "0")
    off = _sample(tokenizer, loaded, temperature)
    assert on == paged == off


def test_bench_attention_times_sdpa_and_the_kernel(kernel, capsys):
    from conftest import run_cli

    code, out, _ = run_cli(capsys, "bench", "attention", "--rows", "2", "--tokens", "64", "--repeats", "1", "--json")
    result = json.loads(out)
    assert code == 0 and result["rows"] == 2 and result["tokens"] == 64 and result["layers"] == 30
    assert result["kv_bytes"] == 2 * 3 * 64 * 64 * 4 * 2 and result["bandwidth_gbs"] > 0
    for name in ("sdpa", "kernel", "kernel_bfloat16"):
        assert result[f"{name}_seconds"] > 0 and result[f"{name}_gbs"] > 0 and result[f"{name}_over_bandwidth"] > 0
    assert result["max_abs_diff"] < TOLERANCE
    code, out, _ = run_cli(capsys, "bench", "attention", "--rows", "1", "--tokens", "16", "--repeats", "1")
    assert code == 0 and "kernel (bfloat16)" in out and "memory bandwidth" in out
