"""Linear layers through oneDNN (models/linear.py) and reduced-precision sampling on the hf backend."""

from __future__ import annotations

import pytest
import torch
from conftest import rows
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from repertory.generation import SamplingParams, engine_options, make_backend, samples_exactly
from repertory.models import load_tokenizer, tiny_model
from repertory.models.linear import (
    FastLinear,
    learner_precision,
    linear,
    onednn_available,
    resolve_precision,
    sampling_precision,
    use_fast_linears,
)
from repertory.types import RepertoryError

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@needs_onednn
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_and_its_gradients_equal_torch_within_float32_rounding(with_bias):
    torch.manual_seed(0)
    x = torch.randn(3, 40, 96, requires_grad=True)
    weight = torch.randn(160, 96, requires_grad=True)
    bias = torch.randn(160, requires_grad=True) if with_bias else None
    grad = torch.randn(3, 40, 160)
    ours = linear(x, weight, bias)
    assert type(ours.grad_fn.next_functions[0][0]).__name__ == "_OneDNNLinearBackward"  # under the reshape
    ours.backward(grad)
    mine = [t.grad.clone() for t in (x, weight, bias) if t is not None]
    for t in (x, weight, bias):
        if t is not None:
            t.grad = None
    torch.nn.functional.linear(x, weight, bias).backward(grad)
    theirs = [t.grad for t in (x, weight, bias) if t is not None]
    assert torch.allclose(ours, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    for a, b in zip(mine, theirs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_linear_output_may_be_modified_in_place_under_autograd():
    # PEFT's mixed-adapter LoRA adds each adapter's rows into the base layer's output in place
    x = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.randn(8, 16, requires_grad=True)
    out = linear(x, weight)
    out[[0, 2]] += 2 * x[[0, 2], :, :8]
    out.sum().backward()
    expected = weight.sum(0).expand(3, 5, 16).clone()
    expected[[0, 2], :, :8] += 2
    assert torch.allclose(x.grad, expected, atol=1e-5)


@needs_onednn
def test_linear_takes_strided_inputs_empty_batches_and_leaves_other_dtypes_to_torch():
    weight = torch.randn(8, 16)
    strided = torch.randn(16, 7).t()
    assert torch.allclose(linear(strided, weight), strided @ weight.t(), atol=1e-5)
    assert linear(torch.randn(0, 16), weight).shape == (0, 8)
    x64, w64 = torch.randn(2, 16, dtype=torch.float64), weight.double()
    assert torch.equal(linear(x64, w64), torch.nn.functional.linear(x64, w64))


@needs_onednn
def test_models_use_fast_linears_with_plain_state_dicts_and_lora(tokenizer):
    loaded = tiny_model(tokenizer, seed=1)
    plain = tiny_model(tokenizer, seed=1)
    for module in plain.model.modules():
        if isinstance(module, FastLinear):
            module.__class__ = torch.nn.Linear
    linears = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is FastLinear for m in linears)
    assert use_fast_linears(loaded.model) == 0  # nothing left to turn
    assert loaded.model.state_dict().keys() == plain.model.state_dict().keys()
    ids = torch.tensor([tokenizer.encode("Round 1 of 10. You offer 4.")])
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids).logits, plain.model(ids).logits, atol=1e-4)
    peft = get_peft_model(loaded.model, PeftLoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, parameter in peft.named_parameters():
        if "lora_B" in name:
            parameter.data.normal_()  # zero at initialisation, which would zero lora_A's gradient
    peft(ids).logits.sum().backward()
    grads = [p.grad for n, p in peft.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


@needs_onednn
def test_bfloat16_sampling_is_close_and_follows_weight_updates():
    torch.manual_seed(0)
    layer = FastLinear(64, 32)
    x = torch.randn(5, 64)
    with torch.no_grad():
        exact = layer(x)
        with sampling_precision("bfloat16"):
            reduced = layer(x)
            assert reduced.dtype == torch.float32 and not torch.equal(reduced, exact)
            assert torch.allclose(reduced, exact, rtol=2e-2, atol=2e-2)
            layer.weight.add_(1.0)  # an optimiser step: the bfloat16 copy must not go stale
            moved = layer(x)
        assert torch.allclose(moved, layer(x), rtol=2e-2, atol=2e-1)
        assert not torch.allclose(moved, reduced, atol=1.0)
    with pytest.raises(ValueError, match="precision must be one of float32, bfloat16, not 'int4'"):
        with sampling_precision("int4"):
            pass


@needs_onednn
def test_hf_backend_in_bfloat16_samples_close_to_the_float32_learner(tokenizer):
    loaded = tiny_model(tokenizer, layers=2, hidden=96, heads=6, kv_heads=2, seed=2)
    backend = make_backend("hf", loaded, precision="bfloat16")
    prompts = [tokenizer.encode(t) for t in ("Round 1 of 10. " * 5, "You are Alice. " * 3)]
    generations = backend.generate(rows(prompts, [1, 2]), SamplingParams(max_new_tokens=16))
    gaps = []
    for prompt, g in zip(prompts, generations):
        with torch.no_grad():
            logits = loaded.model(torch.tensor([prompt + g.response_ids])).logits[0]
        logp = torch.log_softmax(logits, -1)
        gaps += [abs(logp[len(prompt) - 1 + j, t].item() - g.logp_sample[j]) for j, t in enumerate(g.response_ids)]
    assert 1e-6 < max(gaps) < 0.1  # reduced precision: close to the learner, and not exact
    backend.close()
    assert all("_reduced_copy" not in m.__dict__ for m in loaded.model.modules())
    with pytest.raises(RepertoryError, match="precision must be one of float32, bfloat16, not 'fp8'"):
        make_backend("hf", loaded, precision="fp8")


def test_only_the_hf_engine_at_the_learners_precision_counts_as_an_exact_sampler():
    assert samples_exactly("hf", {})
    assert samples_exactly("hf", {"precision": "float32"})
    assert not samples_exactly("hf", {"precision": "bfloat16"})
    assert not samples_exactly("vllm", {})
    assert engine_options("hf", {}, "bfloat16") == {"precision": "bfloat16"}  # the sampler at the learner's
    assert engine_options("hf", {"precision": "float32"}, "bfloat16") == {"precision": "float32"}  # unless named
    assert not samples_exactly("hf", {}, "bfloat16")  # bfloat16 rounds slightly different activations apart
    assert engine_options("vllm", {"max_model_len": 64}, "bfloat16") == {"max_model_len": 64}


@needs_onednn
def test_the_learners_bfloat16_runs_only_frozen_products_and_matches_the_sampler():
    torch.manual_seed(0)
    frozen, trained = FastLinear(64, 32), FastLinear(64, 32)
    frozen.requires_grad_(False)
    x = torch.randn(2, 5, 64, requires_grad=True)
    exact = frozen(x)
    (exact_grad,) = torch.autograd.grad(exact.square().sum(), x)
    with learner_precision("bfloat16"):
        reduced = frozen(x)
        (reduced_grad,) = torch.autograd.grad(reduced.square().sum(), x)
        assert torch.equal(trained(x), linear(x, trained.weight, trained.bias))  # trained weights stay float32
    assert reduced.dtype == reduced_grad.dtype == torch.float32 and not torch.equal(reduced, exact)
    assert torch.allclose(reduced, exact, rtol=2e-2, atol=2e-2)
    assert torch.allclose(reduced_grad, exact_grad, rtol=5e-2, atol=5e-2)
    with torch.no_grad(), sampling_precision("bfloat16"):  # the same products the sampler runs: no gap from them
        assert torch.equal(frozen(x), reduced.detach())


def test_auto_precision_is_bfloat16_for_a_lora_run_on_one_cpu_learner_sampled_by_hf_with_native_bf16(monkeypatch):
    import repertory.models.linear as linear_module

    monkeypatch.setattr(linear_module, "native_bfloat16", lambda: True)
    assert resolve_precision("auto", "cpu", lora=True, sharded=False) == "bfloat16"
    assert resolve_precision("auto", "cpu", lora=False, sharded=False) == "float32"  # full fine-tuning
    assert resolve_precision("auto", "cpu", lora=True, sharded=True) == "float32"
    assert resolve_precision("auto", "cuda", lora=True, sharded=False) == "float32"
    assert resolve_precision("auto", "cpu", lora=True, sharded=False, engine="vllm") == "float32"  # its own dtype
    assert resolve_precision("bfloat16", "cpu", lora=False, sharded=False) == "bfloat16"  # asked for: given
    monkeypatch.setattr(linear_module, "native_bfloat16", lambda: False)  # emulated bfloat16 would be slower
    assert resolve_precision("auto", "cpu", lora=True, sharded=False) == "float32"
