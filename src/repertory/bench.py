"""Benchmarks, reported as ratios measured in one run: ours, a naive baseline, the hardware limit.

``rollout``: the same self-play episodes played (a) by each chosen engine (``hf``, ``vllm``) — every
pending turn of every episode in one batched generation call per tick, the engine's start timed apart —
and (b) naively, one ``model.generate`` call per agent per turn. Besides generated tokens/s it reports
computed tokens/s: prompt tokens actually encoded (not reused) plus generated tokens, the model's whole
workload. Two ceilings are measured in the same process:

- the limit: the machine's matmul throughput (float32 on the CPU, bfloat16 on a GPU) converted to
  tokens/s at 2 x parameters FLOPs per token. It bounds computed tokens, but decoding feeds a few
  tokens per row and pass and is bound by memory, not arithmetic, so it overstates what generation
  can reach.
- the roofline: the hf engine records every forward pass's workload (rows, new tokens, cached context
  tokens, query-key pairs attended; :class:`~repertory.generation.core.ForwardPass`). A pass must read
  every weight and the cached keys and values it attends to (context tokens x
  :func:`~repertory.models.kv_bytes_per_token`), and compute 2 x parameters FLOPs per new token plus
  4 x layers x heads x head size per pair attended (scores and weighted values), so it takes at least
  max(bytes / memory bandwidth, FLOPs / matmul peak) (:func:`roofline_seconds`). Summed over the run's
  passes, generated tokens over that sum is the fastest the same passes could generate; ``over_roofline``
  is the share of it reached. It prices the passes as the engine scheduled them (fewer, wider passes
  would lower it), ignores writing the new keys and values, and counts the output layer for every new
  token where a prompt needs it for its last only. vLLM records no passes (its scheduler is its own):
  when ``hf`` ran too it gets the hf run's roofline, the same episodes' workload as hf batched it, else
  none.

``train``: one optimisation step (forward, backward, AdamW) of the learner over a batch of
self-play trajectories shaped like the default recipe's (a growing chat, short answers), timed
with the turns packed into one sequence per seat and unpacked (one sequence per turn). The limit
is the same matmul throughput converted with the usual 6 x parameters FLOPs per trained token.

``attention``: one layer's decode attention (one query token per row over a long key/value cache, SmolLM2's 9
query heads over 3 key/value heads of size 64) through PyTorch's SDPA and through repertory's kernel
(:mod:`repertory.models.decode`), as the model's attention function runs them, each as seconds per call and as
the bytes of keys and values it must read (rows x key/value heads x tokens x head size x 4 x 2) per second,
against the measured memory bandwidth. Every layer holds its own cache, as in the model, and the layers are
called in turn, so the reads come from memory rather than the last-level cache.

``candidates``: Iterative GRPO's policy step over logged states, each with several sampled
candidates (score with policy and reference, then forward, backward, AdamW), timed with each
state's candidates sharing one encoding of its prompt (a tree sequence) and with one sequence per
candidate. The limit converts the matmul throughput with 10 x parameters FLOPs per computed token
(two scoring forwards and one forward/backward).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from repertory.agents import Request, Response
from repertory.agents.lm import LMAgent
from repertory.config import AlgoConfig, CriticConfig, LoraConfig
from repertory.generation import SamplingParams, make_backend
from repertory.generation.core import ForwardPass, stop_token_ids
from repertory.models import LoadedModel, attention_shape, kv_bytes_per_token
from repertory.models.attention import gqa_sdpa_attention
from repertory.models.chat import chat_prompt_ids
from repertory.models.decode import SWITCH, decode_kernel
from repertory.models.linear import linear, sampled_weight_bytes
from repertory.models.packing import PackedSequence
from repertory.rollout import EpisodeSpec, run_episodes, schedule
from repertory.system import matmul_flops, memory_bandwidth, peak_rss_mb
from repertory.types import Episode, Kernel, Result, RoleResult, Seat, Turn, derive


class NaiveAgent:
    """The baseline: one ``model.generate`` call per request, sampling log-probs from its scores."""

    def __init__(self, loaded: LoadedModel, params: SamplingParams, seed: int):
        self.loaded, self.params, self.seed = loaded, params, seed
        self.name, self.policy_id = "naive", "base"
        self.stop_ids = sorted(stop_token_ids(loaded.tokenizer))
        self.prompt_tokens = 0
        self.generated_tokens = 0

    @torch.no_grad()
    def act(self, requests: list[Request]) -> list[Response]:
        loaded, params = self.loaded, self.params
        out = []
        for request in requests:
            prompt = chat_prompt_ids(loaded.tokenizer, request.messages)
            torch.manual_seed(derive(self.seed, request.episode_id, request.seat, request.turn_index) % 2**63)
            ids = torch.tensor([prompt], device=loaded.device)
            result = loaded.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=0,
                max_new_tokens=params.max_new_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=loaded.tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_scores=True,
            )
            tokens = result.sequences[0, len(prompt) :].tolist()
            logps = [
                torch.log_softmax(score[0].float(), dim=-1)[token].item() for score, token in zip(result.scores, tokens)
            ]
            self.prompt_tokens += len(prompt)
            self.generated_tokens += len(tokens)
            text = loaded.tokenizer.decode(tokens, skip_special_tokens=True)
            out.append(Response(text, "stop", prompt, tokens, logps))
        return out


@dataclass
class RolloutBenchConfig:
    """What the rollout benchmark plays: environments, episodes per environment, token budget, engines."""

    envs: tuple[str, ...] = ("trust-and-split", "ipd")
    episodes: int = 4
    max_new_tokens: int = 48
    seed: int = 0
    naive: bool = True
    matmul_seconds: float = 2.0
    backends: tuple[str, ...] = ("hf",)
    bandwidth_seconds: float = 1.0
    precision: str = "float32"  # the hf engine's linear layers (rollout.engine_args.precision)


@dataclass(frozen=True)
class PassCost:
    """What one forward pass of a model reads and computes, per unit of its workload (a :class:`ForwardPass`)."""

    weight_bytes: int  # every parameter, read once per pass
    kv_bytes_per_token: int  # per cached context token attended to
    flops_per_token: int  # 2 x parameters per new token
    flops_per_pair: int  # 4 x layers x heads x head size per (query, key) pair: scores and weighted values


def pass_cost(loaded: LoadedModel, precision: str = "float32") -> PassCost:
    """The per-pass costs of ``loaded``, from its parameters and attention shape, in the dtype it runs in (its
    linear layers' weights in ``precision``)."""
    config = loaded.model.config
    layers, heads, _, head_dim = attention_shape(config)
    kv = kv_bytes_per_token(config, loaded.model.dtype)
    weights = sampled_weight_bytes(loaded.model, precision)
    return PassCost(weights, kv, 2 * loaded.n_params, 4 * layers * heads * head_dim)


def roofline_seconds(passes: Iterable[ForwardPass], cost: PassCost, bandwidth: float, peak_flops: float) -> float:
    """The least time the passes take one after another: each at least its bytes (weights and cached keys and
    values) over the memory ``bandwidth`` (bytes/s) and its FLOPs over ``peak_flops`` (FLOP/s), whichever is
    longer."""
    return sum(
        max(
            (cost.weight_bytes + p.context_tokens * cost.kv_bytes_per_token) / bandwidth,
            (p.new_tokens * cost.flops_per_token + p.attended * cost.flops_per_pair) / peak_flops,
        )
        for p in passes
    )


BENCH_ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
    "hf": ("hf", {}),
    "hf-padded": ("hf", {"paged": False}),  # one left-padded cache: the path the pages replace
    "hf-kv-bf16": ("hf", {"kv_dtype": "bfloat16"}),  # pages in bfloat16
    "vllm": ("vllm", {}),
}
"""The engines ``bench rollout`` runs, by name: a backend and its engine arguments."""


def _specs(config: RolloutBenchConfig, agent: Any) -> list[EpisodeSpec]:
    return [spec for env in config.envs for spec in schedule(env, [agent, agent], config.episodes, config.seed)]


def _engine_run(
    loaded: LoadedModel, kind: str, config: RolloutBenchConfig, limit_tok_s: float, bandwidth: float, peak: float
) -> dict[str, Any]:
    """Start the ``kind`` engine on ``loaded``, play the episodes with it, close it; its numbers, with the roofline
    of its forward passes when it records them (else None)."""
    start = time.perf_counter()
    engine, options = BENCH_ENGINES[kind]
    backend = make_backend(engine, loaded, **({"precision": config.precision, **options} if engine == "hf" else {}))
    start_s = time.perf_counter() - start
    params = SamplingParams(temperature=1.0, max_new_tokens=config.max_new_tokens)
    agent = LMAgent(backend, "model", params, constrained=False, seed=config.seed)
    start = time.perf_counter()
    episodes = run_episodes(_specs(config, agent))
    seconds = time.perf_counter() - start
    backend.close()
    stats = backend.stats
    prompt, generated, reused = stats.prompt_tokens, stats.generated_tokens, stats.reused_prompt_tokens
    passes = stats.passes
    cost = pass_cost(loaded, config.precision)
    roofline_tok_s = generated / roofline_seconds(passes, cost, bandwidth, peak) if passes else None
    return {
        "start_seconds": start_s,
        "seconds": seconds,
        "episodes": len(episodes),
        "turns": sum(len(ep.turns) for ep in episodes),
        "generation_calls": stats.calls,
        "tok_s": generated / seconds,
        "prompt_tok_s": prompt / seconds,
        "generated_tokens": generated,
        "prompt_tokens": prompt,
        "cache_hit_rate": reused / prompt if prompt else 0.0,
        "computed_tok_s": (prompt - reused + generated) / seconds,
        "over_limit": generated / seconds / limit_tok_s,
        "computed_over_limit": (prompt - reused + generated) / seconds / limit_tok_s,
        "forward_passes": len(passes) or None,
        "rows_per_pass": sum(p.rows for p in passes) / len(passes) if passes else None,
        "roofline_tok_s": roofline_tok_s,
        "over_roofline": generated / seconds / roofline_tok_s if roofline_tok_s else None,
    }


def _matmul_limit(seconds: float, device: str, precision: str = "float32") -> float:
    """The matmul FLOP/s of the kernel the models' linear layers run (oneDNN on a CPU), in ``precision`` where
    sampling reduces it (a CPU's)."""
    dtype = getattr(torch, precision) if precision != "float32" and device == "cpu" else None
    return matmul_flops(seconds, device=device, product=linear, dtype=dtype)


def rollout_benchmark(loaded: LoadedModel, config: RolloutBenchConfig) -> dict[str, Any]:
    """Play the configured self-play episodes with each engine and naively; measure the matmul limit and the
    memory bandwidth; return the numbers. ``engines`` holds each engine's; the ``ours_*`` keys repeat the first
    engine's. An engine without pass records (vLLM) gets the hf run's roofline when hf ran too."""
    device = str(loaded.device)
    limit_flops = _matmul_limit(config.matmul_seconds, device, config.precision)
    bandwidth = memory_bandwidth(config.bandwidth_seconds, device=device)
    limit_tok_s = limit_flops / (2 * loaded.n_params)
    engines = {kind: _engine_run(loaded, kind, config, limit_tok_s, bandwidth, limit_flops) for kind in config.backends}
    if "hf" in engines:
        for numbers in engines.values():
            if numbers["roofline_tok_s"] is None:
                numbers["roofline_tok_s"] = engines["hf"]["roofline_tok_s"]
                numbers["over_roofline"] = numbers["tok_s"] / numbers["roofline_tok_s"]
    first = engines[config.backends[0]]
    result: dict[str, Any] = {
        "model": loaded.name,
        "params": loaded.n_params,
        "envs": list(config.envs),
        "episodes": first["episodes"],
        "turns": first["turns"],
        "max_new_tokens": config.max_new_tokens,
        "threads": torch.get_num_threads(),
        "limit_gflops": limit_flops / 1e9,
        "bandwidth_gbs": bandwidth / 1e9,
        "limit_tok_s": limit_tok_s,
        "engines": engines,
        **{f"ours_{key}": value for key, value in first.items() if key not in ("episodes", "turns")},
    }
    result["cache_hit_rate"] = first["cache_hit_rate"]
    if config.naive:
        params = SamplingParams(temperature=1.0, max_new_tokens=config.max_new_tokens)
        naive = NaiveAgent(loaded, params, config.seed)
        start = time.perf_counter()
        run_episodes(_specs(config, naive))
        naive_s = time.perf_counter() - start
        result.update(
            naive_seconds=naive_s,
            naive_tok_s=naive.generated_tokens / naive_s,
            naive_prompt_tok_s=naive.prompt_tokens / naive_s,
            naive_generated_tokens=naive.generated_tokens,
            naive_computed_tok_s=(naive.prompt_tokens + naive.generated_tokens) / naive_s,
        )
        for numbers in engines.values():
            numbers["over_naive"] = numbers["tok_s"] / result["naive_tok_s"]
        result["ours_over_naive"] = first["over_naive"]
    if "hf" in engines:
        for numbers in engines.values():
            numbers["over_hf"] = numbers["tok_s"] / engines["hf"]["tok_s"]
    result["peak_rss_mb"] = peak_rss_mb()
    return result


@dataclass
class TrainBenchConfig:
    """The synthetic batch: episodes x 2 seats x turns, each turn a new observation and a short answer."""

    episodes: int = 2
    turns: int = 8
    system_tokens: int = 190
    observation_tokens: int = 48
    response_tokens: int = 8
    lora: bool = True
    seed: int = 0
    matmul_seconds: float = 2.0


def synthetic_episodes(config: TrainBenchConfig, vocab: int) -> list[Episode]:
    """Two-seat episodes whose prompts grow append-only, with random token ids and rewards."""
    rng = torch.Generator().manual_seed(config.seed)
    kernel = Kernel("bench/train/000", "bench", "train", 0, 0, {})
    episodes = []
    for e in range(config.episodes):
        turns = []
        for seat in ("p0", "p1"):
            history = torch.randint(0, vocab, (config.system_tokens,), generator=rng).tolist()
            for k in range(config.turns):
                history += torch.randint(0, vocab, (config.observation_tokens,), generator=rng).tolist()
                response = torch.randint(0, vocab, (config.response_tokens,), generator=rng).tolist()
                reward = float(torch.rand((), generator=rng))
                turns.append(
                    Turn(
                        seat,
                        k,
                        k,
                        k,
                        [],
                        "",
                        prompt_ids=list(history),
                        response_ids=response,
                        logp_sample=[0.0] * len(response),
                        reward=reward,
                    )
                )
                history += response
        seats = [Seat("p0", "A", "player", "live", "live", True), Seat("p1", "B", "player", "live", "live", True)]
        roles = {"A": RoleResult(0, 0, config.turns, 0), "B": RoleResult(0, 0, config.turns, 0)}
        episodes.append(Episode(f"bench/{e}", "bench", kernel, e, seats, turns, Result(roles, "done"), {}))
    return episodes


def train_benchmark(loaded: Any, config: TrainBenchConfig) -> dict[str, Any]:
    """Time one optimisation step on the same samples packed in float32, packed with the frozen base's products in
    bfloat16 (``model.precision``, a CPU's), and unpacked; compare each with the matmul limit of its precision."""
    result: dict[str, Any] = {
        "model": loaded.name,
        "params": loaded.n_params,
        "lora": config.lora,
        "threads": torch.get_num_threads(),
    }
    device = str(loaded.device)
    for precision in ("float32", "bfloat16") if device == "cpu" else ("float32",):
        flops = _matmul_limit(config.matmul_seconds, device, precision)
        prefix = "" if precision == "float32" else "bfloat16_"
        result[f"{prefix}limit_gflops"] = flops / 1e9
        result[f"{prefix}limit_tok_s"] = flops / (6 * loaded.n_params)
    episodes = synthetic_episodes(config, loaded.model.config.vocab_size)
    variants = {"packed": (True, "float32"), "unpacked": (False, "float32")}
    if device == "cpu":
        variants["packed_bfloat16"] = (True, "bfloat16")
    for key, (packing, precision) in variants.items():
        seconds, tokens, trained = _train_step(loaded, episodes, config.lora, packing, precision)
        result.update({f"{key}_seconds": seconds, f"{key}_tokens": tokens, f"{key}_tok_s": tokens / seconds})
        result["trained_tokens"] = trained
    if device == "cpu":
        result["packed_bfloat16_limit_tok_s"] = result["bfloat16_limit_tok_s"]
        result["bfloat16_speedup"] = result["packed_seconds"] / result["packed_bfloat16_seconds"]
    full, reused = _score_seconds(loaded, episodes, config.lora)
    result.update(score_seconds=full, score_reused_seconds=reused, score_reused_speedup=full / reused)
    result["train_tok_s"] = result["packed_tok_s"]
    result["train_over_limit"] = result["train_tok_s"] / result["limit_tok_s"]
    result["packed_speedup"] = result["unpacked_seconds"] / result["packed_seconds"]
    result["samples_per_s_packed"] = config.episodes * 2 * config.turns / result["packed_seconds"]
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def _train_step(
    loaded: Any, episodes: list[Episode], lora: bool, packing: bool, precision: str
) -> tuple[float, int, int]:
    """Seconds, tokens computed and tokens trained of one optimisation step over ``episodes`` (its inputs as if
    scored, so that only the step is timed), after an untimed step that takes the first-call costs."""
    # The learner stack (peft, the trainers) is loaded only by the benchmarks that time it, so the rollout
    # benchmark's process holds what a rollout needs and its numbers measure the engine alone.
    from repertory.train.batch import Experience, collect
    from repertory.train.learner import Learner

    algo = AlgoConfig(mini_batches=1, lr=1e-5)
    learner = Learner(
        copy.deepcopy(loaded), algo, LoraConfig(enabled=lora), CriticConfig(), needs_critic=False, precision=precision
    )
    for iteration in range(2):
        batch = collect(episodes, packing=packing)
        for i, sample in enumerate(batch.samples):
            if sample.trained:
                logp = torch.tensor(sample.logp_sample, device=learner.device)
                advantages = torch.randn(sample.n_tokens)
                batch.experience[i] = Experience(logp, logp, torch.ones_like(logp), advantages=advantages)
        start = time.perf_counter()
        learner.update(batch, seed_key=iteration)
        seconds = time.perf_counter() - start
    return seconds, sum(len(seq.input_ids) for seq in batch.sequences), batch.n_tokens


def _score_seconds(loaded: Any, episodes: list[Episode], lora: bool) -> tuple[float, float]:
    """Seconds of a critic-free, float32 scoring pass over ``episodes`` with every sample scored by the policy, and
    with an exact sampler's log-probs taken for the old policy's (the policy scoring the first micro-batch only),
    each timed after an untimed pass. The sampler's log-probs are the learner's own, as the exact path records."""
    from repertory.train.batch import collect
    from repertory.train.learner import Learner

    learner = Learner(copy.deepcopy(loaded), AlgoConfig(), LoraConfig(enabled=lora), CriticConfig(), needs_critic=False)
    batch = collect(episodes)
    learner.score(batch)
    for i, experience in batch.experience.items():
        batch.samples[i].logp_sample = experience.logp_old.tolist()
    seconds = {}
    for version in (None, 0, None, 0):  # each path's second pass is kept
        start = time.perf_counter()
        learner.score(batch, version=version)
        seconds[version] = time.perf_counter() - start
    return seconds[None], seconds[0]


@dataclass
class CandidatesBenchConfig:
    """The synthetic step: ``states`` logged prompts of ``prompt_tokens``, ``candidates`` responses each."""

    states: int = 2
    candidates: int = 4
    prompt_tokens: int = 640
    response_tokens: int = 48
    seed: int = 0
    matmul_seconds: float = 2.0


def candidates_benchmark(loaded: Any, config: CandidatesBenchConfig) -> dict[str, Any]:
    """Time the I-GRPO policy step with shared-prompt trees and with one sequence per candidate."""
    from repertory.train.batch import Batch, single_turn_batch
    from repertory.train.learner import Learner

    rng = torch.Generator().manual_seed(config.seed)
    vocab = loaded.model.config.vocab_size
    prompts, responses = [], []
    for _ in range(config.states):
        prompt = torch.randint(0, vocab, (config.prompt_tokens,), generator=rng).tolist()
        for _ in range(config.candidates):
            prompts.append(prompt)
            responses.append(torch.randint(0, vocab, (config.response_tokens,), generator=rng).tolist())
    advantages = torch.randn(len(prompts), generator=rng).tolist()
    limit_flops = _matmul_limit(config.matmul_seconds, str(loaded.device))
    limit_tok_s = limit_flops / (10 * loaded.n_params)  # two scoring forwards (2 x 2N) + forward/backward (6N)
    result: dict[str, Any] = {
        "model": loaded.name,
        "threads": torch.get_num_threads(),
        "limit_gflops": limit_flops / 1e9,
        "limit_tok_s": limit_tok_s,
    }
    algo = AlgoConfig(mini_batches=1, lr=1e-5)

    def step(n: int, shared: bool) -> tuple[float, int]:
        """Seconds and tokens computed of one policy step over the first ``n`` candidates."""
        batch, adv = single_turn_batch(prompts[:n], responses[:n], advantages[:n])
        if not shared:
            pairs = zip(prompts[:n], responses[:n])
            batch = Batch([], batch.samples, [PackedSequence(p + r, [(i, len(p))]) for i, (p, r) in enumerate(pairs)])
        learner = Learner(copy.deepcopy(loaded), algo, LoraConfig(), CriticConfig(), needs_critic=False)
        start = time.perf_counter()
        learner.score(batch)
        batch.assign(adv)
        learner.update(batch, seed_key=0)
        return time.perf_counter() - start, sum(len(seq.input_ids) for seq in batch.sequences)

    step(min(2, len(prompts)), True)  # first-call costs (allocator, autograd, kernels) out of the timings
    step(min(2, len(prompts)), False)
    for key in ("shared", "separate"):
        seconds, tokens = step(len(prompts), key == "shared")
        result[f"{key}_seconds"] = seconds
        result[f"{key}_tokens"] = tokens
        result[f"{key}_tok_s"] = tokens / seconds
    result["trained_tokens"] = len(responses) * config.response_tokens
    result["shared_speedup"] = result["separate_seconds"] / result["shared_seconds"]
    result["peak_rss_mb"] = peak_rss_mb()
    return result


@dataclass
class AttentionBenchConfig:
    """One layer's decode attention: ``rows`` x ``tokens`` cached, SmolLM2's heads by default."""

    rows: int = 12
    tokens: int = 2400
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    repeats: int = 20
    layers: int = 30  # caches called in turn (SmolLM2's layers), fewer where they would pass 1 GiB
    bandwidth_seconds: float = 1.0
    seed: int = 0


def _decode_caches(config: AttentionBenchConfig, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values as the engine holds them: the first ``tokens`` columns of a longer buffer."""
    rng = torch.Generator().manual_seed(config.seed)
    shape = (config.rows, config.kv_heads, config.tokens + 128, config.head_dim)
    per_layer = 2 * config.rows * config.kv_heads * config.tokens * config.head_dim * dtype.itemsize
    caches = []
    for _ in range(max(1, min(config.layers, 2**30 // max(per_layer, 1)))):
        key, value = (torch.randn(shape, generator=rng).to(dtype)[..., : config.tokens, :] for _ in range(2))
        caches.append((key, value))
    return caches


def _seconds_per_call(query: torch.Tensor, caches: list, mask: torch.Tensor, repeats: int, kernel: bool) -> float:
    """The median over ``repeats`` passes through every layer's cache of the attention function's seconds per call,
    with the kernel switched on or off (``REPERTORY_DECODE_KERNEL``), after an untimed pass."""
    module = torch.nn.Module()
    before = os.environ.get(SWITCH)
    os.environ[SWITCH] = "1" if kernel else "0"
    try:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for key, value in caches:
                gqa_sdpa_attention(module, query, key, value, mask, scaling=None)
            times.append((time.perf_counter() - start) / len(caches))
    finally:
        if before is None:
            del os.environ[SWITCH]
        else:
            os.environ[SWITCH] = before
    return sorted(times[1:])[repeats // 2]


def attention_benchmark(config: AttentionBenchConfig) -> dict[str, Any]:
    """Seconds per call and GB/s of keys and values read by SDPA and by the kernel (float32 caches, and bfloat16
    caches for the kernel alone), on the same inputs, with the measured memory bandwidth; ``kernel_*`` None where the
    kernel could not be built."""
    bandwidth = memory_bandwidth(config.bandwidth_seconds)
    start = time.perf_counter()
    loaded = decode_kernel() is not None
    result: dict[str, Any] = {
        **{k: getattr(config, k) for k in ("rows", "tokens", "heads", "kv_heads", "head_dim", "repeats")},
        "threads": torch.get_num_threads(),
        "bandwidth_gbs": bandwidth / 1e9,
        "kernel_load_seconds": time.perf_counter() - start,
    }
    query = torch.randn(config.rows, config.heads, 1, config.head_dim, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(config.rows, 1, 1, config.tokens, dtype=torch.bool)  # as transformers passes a padded batch's
    caches = _decode_caches(config, torch.float32)
    result["layers"] = len(caches)
    elements = config.rows * config.kv_heads * config.tokens * config.head_dim * 2
    runs = {"sdpa": (caches, False, 4)}
    if loaded:
        runs.update(kernel=(caches, True, 4), kernel_bfloat16=(_decode_caches(config, torch.bfloat16), True, 2))
    for name, (layer_caches, kernel, size) in runs.items():
        seconds = _seconds_per_call(query, layer_caches, mask, config.repeats, kernel)
        result[f"{name}_seconds"] = seconds
        result[f"{name}_gbs"] = elements * size / seconds / 1e9
        result[f"{name}_over_bandwidth"] = elements * size / seconds / bandwidth
    for name in ("kernel", "kernel_bfloat16"):
        result[f"{name}_speedup"] = result["sdpa_seconds"] / result[f"{name}_seconds"] if loaded else None
        for key in ("seconds", "gbs", "over_bandwidth"):
            result.setdefault(f"{name}_{key}", None)
    if loaded:
        key, value = caches[0]
        reference = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
        out, _ = gqa_sdpa_attention(torch.nn.Module(), query, key, value, mask, scaling=None)
        result["max_abs_diff"] = (out - reference.transpose(1, 2)).abs().max().item()
    result["kv_bytes"] = elements * 4
    return result
