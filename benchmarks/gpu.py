"""GPU figures for ``benchmarks/gpu.sh``: rollout per engine, a learner step, and raw throughput at scale.

``python benchmarks/gpu.py --tokenizer DIR --out FILE [--device cuda] [--size 0.5b] [--quick]``

No weights exist offline on a lent machine, so every model is randomly initialised from a Llama-style config
of the named size with the embedded model's tokenizer (saved beforehand with ``--save-tokenizer DIR``).
Writes one JSON object with, per engine available here (``hf``, and ``vllm`` where it is installed):

- ``rollout``: ``repertory bench rollout`` on a 135M-shaped model (the embedded model's shape);
- ``throughput``: generated tok/s for ``--batch`` prompts x ``--new-tokens`` tokens on the ``--size`` model;
- ``train``: ``repertory bench train`` (one packed and one unpacked learner step) on the 135M shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from repertory.bench import RolloutBenchConfig, TrainBenchConfig, rollout_benchmark, train_benchmark
from repertory.generation import GenerationRequest, SamplingParams, make_backend
from repertory.models import LoadedModel, load_tokenizer, save_checkpoint

SIZES = {  # hidden, intermediate, layers, heads, kv heads: Llama-style shapes of about that many parameters
    "135m": (576, 1536, 30, 9, 3),
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "7b": (3584, 18944, 28, 28, 4),
}


def random_model(tokenizer, size: str, device: str) -> LoadedModel:
    """A randomly initialised Llama-style model of ``size`` (bfloat16 on a GPU)."""
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)  # every process of a launcher builds the same weights
    with torch.device(device):  # built where it runs: a 7B model never passes through host memory
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return LoadedModel(model.eval(), tokenizer, f"random-{size}")


def throughput(loaded: LoadedModel, kind: str, batch: int, new_tokens: int) -> dict[str, float]:
    """Generated tok/s of one engine for ``batch`` distinct ~100-token prompts, after its start."""
    start = time.perf_counter()
    backend = make_backend(kind, loaded)
    start_s = time.perf_counter() - start
    prompts = [loaded.tokenizer.encode(f"Seat {i}: the round begins. " * 12)[:100] for i in range(batch)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    rows = [GenerationRequest(prompt, seed) for seed, prompt in enumerate(prompts)]
    backend.generate(rows[:8], params)  # warm-up
    start = time.perf_counter()
    out = backend.generate(rows, params)
    seconds = time.perf_counter() - start
    backend.close()
    generated = sum(len(g.response_ids) for g in out)
    return {"start_seconds": start_s, "seconds": seconds, "generated_tokens": generated, "tok_s": generated / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save-tokenizer", help="write the embedded model's tokenizer to this directory and stop")
    parser.add_argument("--tokenizer", help="a tokenizer directory (from --save-tokenizer)")
    parser.add_argument("--save-model", help="write a random 135M-shaped checkpoint to this directory and stop")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="0.5b", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="tiny settings, to check the script on a CPU")
    parser.add_argument("--out", default="gpu.json")
    args = parser.parse_args()
    if args.save_tokenizer:
        load_tokenizer().save_pretrained(args.save_tokenizer)
        return
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else load_tokenizer()
    if args.save_model:
        save_checkpoint(random_model(tokenizer, "135m", "cpu").model, tokenizer, args.save_model)
        return
    engines = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])
    size = "135m" if args.quick else args.size
    result: dict = {"device": args.device, "engines": engines, "size": size}
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name()
    small = random_model(tokenizer, "135m", args.device)
    episodes, budget = (1, 8) if args.quick else (8, 64)
    config = RolloutBenchConfig(("trust-and-split", "ipd"), episodes, budget, naive=True, backends=tuple(engines))
    result["rollout"] = rollout_benchmark(small, config)
    Path(args.out).write_text(json.dumps(result, indent=2))
    big = small if size == "135m" else random_model(tokenizer, size, args.device)
    batch, new_tokens = (8, 8) if args.quick else (args.batch, args.new_tokens)
    result["throughput"] = {kind: throughput(big, kind, batch, new_tokens) for kind in engines}
    del big
    Path(args.out).write_text(json.dumps(result, indent=2))
    train_config = TrainBenchConfig(episodes=1, turns=2) if args.quick else TrainBenchConfig(episodes=8, turns=8)
    result["train"] = train_benchmark(small, train_config)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
