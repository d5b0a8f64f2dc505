"""Generation backend ``hf``: batched sampling with exact per-token log-probs and constrained actions.

One call samples continuations for many prompts of different lengths at once: prompts are
left-padded into one batch, encoded in one forward pass, then decoded token by token with a KV
cache; rows that finish are dropped from the batch so the rest run on. For every sampled token it
records ``log softmax(logits / T)[token]`` over the full vocabulary — the quantity the learner
recomputes (algorithms.md 1.2) — also when top-p or a constraint restricted what could be drawn.

Each row draws its randomness from its own seed, so a row's tokens do not depend on which other
rows share its batch. Constrained rows may only produce one of a finite set of complete responses:
their logits are masked to the children of the current node of a token trie built from the
tokenised choices (each followed by the end-of-turn token).
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from repertory.models import LoadedModel


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: temperature (0 = greedy), nucleus top-p, token budget, extra stop strings."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 400
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (got {self.max_new_tokens})")


@dataclass
class Generation:
    """One sampled continuation: its token ids, their log-probs and why it ended ("stop" or "length")."""

    token_ids: list[int]
    logprobs: list[float]
    finish: str


@dataclass
class TokenTrie:
    """The token sequences of a finite set of complete responses, as a prefix tree."""

    children: dict[int, TokenTrie] = field(default_factory=dict)

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]]) -> TokenTrie:
        root = cls()
        for seq in sequences:
            node = root
            for token in seq:
                node = node.children.setdefault(token, cls())
        return root


@dataclass
class GenerationStats:
    """Counters over the backend's lifetime (for benchmarks and metrics)."""

    calls: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0


class HFBackend:
    """Batched sampling with a transformers causal LM (CPU in float32, GPU in bfloat16)."""

    def __init__(self, loaded: LoadedModel, max_batch: int = 64):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_batch = max_batch
        self.stats = GenerationStats()
        self.stop_ids = self._stop_token_ids()
        self._tries: dict[tuple[str, ...], TokenTrie] = {}
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"

    def _stop_token_ids(self) -> set[int]:
        tok = self.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"):
            token_id = tok.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != tok.unk_token_id:
                ids.add(token_id)
        return ids

    @property
    def end_of_turn_id(self) -> int:
        """The token that closes an assistant turn (the one a constrained response ends with)."""
        tok = self.tokenizer
        token_id = tok.convert_tokens_to_ids("<|im_end|>")
        return token_id if isinstance(token_id, int) and token_id in self.stop_ids else tok.eos_token_id

    def trie(self, choices: Sequence[str]) -> TokenTrie:
        """The (cached) token trie of a finite set of responses, each closed by the end-of-turn token."""
        key = tuple(choices)
        if key not in self._tries:
            encoded = [self.tokenizer.encode(c, add_special_tokens=False) + [self.end_of_turn_id] for c in key]
            self._tries[key] = TokenTrie.build(encoded)
        return self._tries[key]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of response tokens, without special tokens such as the end-of-turn token."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        seeds: Sequence[int],
        constraints: Sequence[TokenTrie | None] | None = None,
    ) -> list[Generation]:
        """Sample one continuation per prompt, in order; ``seeds[i]`` drives row i's randomness."""
        if len(seeds) != len(prompts):
            raise ValueError("one seed per prompt is required")
        constraints = list(constraints) if constraints is not None else [None] * len(prompts)
        out: list[Generation | None] = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        for start in range(0, len(order), self.max_batch):
            chunk = order[start : start + self.max_batch]
            results = self._generate_batch(
                [prompts[i] for i in chunk], params, [seeds[i] for i in chunk], [constraints[i] for i in chunk]
            )
            for i, result in zip(chunk, results):
                out[i] = result
        self.stats.calls += 1
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[Sequence[int]],
        params: SamplingParams,
        seeds: list[int],
        constraints: list[TokenTrie | None],
    ) -> list[Generation]:
        device = self.loaded.device
        n = len(prompts)
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        input_ids = torch.full((n, width), pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self.stats.prompt_tokens += sum(len(p) for p in prompts)

        rngs = [random.Random(s) for s in seeds]
        nodes = list(constraints)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        active = list(range(n))
        logits, cache = self._forward(input_ids, mask, positions, None)
        last_pos = positions[:, -1]
        for step in range(params.max_new_tokens):
            chosen, chosen_logp = self._sample(logits, params, [rngs[i] for i in active], [nodes[i] for i in active])
            still: list[int] = []
            for row, i in enumerate(active):
                token = int(chosen[row])
                tokens[i].append(token)
                logps[i].append(float(chosen_logp[row]))
                if nodes[i] is not None:
                    nodes[i] = nodes[i].children.get(token)  # type: ignore[union-attr]
                if token in self.stop_ids or (params.stop and self._hit_stop(tokens[i], params.stop)):
                    finish[i] = "stop"
                else:
                    still.append(row)
            self.stats.generated_tokens += len(active)
            if not still or step == params.max_new_tokens - 1:
                break
            keep = torch.tensor(still, device=device)
            if len(still) < len(active):
                cache.batch_select_indices(keep)
                mask, last_pos, chosen = mask[keep], last_pos[keep], chosen[keep]
            active = [active[row] for row in still]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=mask.dtype, device=device)], dim=1)
            last_pos = last_pos + 1
            logits, cache = self._forward(chosen.view(-1, 1), mask, last_pos.view(-1, 1), cache)
        return [Generation(tokens[i], logps[i], finish[i]) for i in range(n)]

    def _forward(
        self, input_ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: object
    ) -> tuple[torch.Tensor, object]:
        """Logits of the last position (float32) and the updated KV cache."""
        kwargs = {self._cache_kwarg: cache} if cache is not None else {}
        output = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        self.stats.forward_passes += 1
        new_cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        return output.logits[:, -1, :].float(), new_cache

    def _hit_stop(self, token_ids: list[int], stop: tuple[str, ...]) -> bool:
        tail = self.decode(token_ids[-16:])
        return any(s in tail for s in stop)

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        params: SamplingParams,
        rngs: list[random.Random],
        nodes: list[TokenTrie | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row; return the tokens and their full-vocabulary log-probs."""
        temperature = params.temperature if params.temperature > 0 else 1.0
        logp_full = torch.log_softmax(logits / temperature, dim=-1)
        scores = logp_full.clone()
        for row, node in enumerate(nodes):
            if node is not None and node.children:
                allowed = torch.tensor(list(node.children), device=scores.device)
                masked = torch.full_like(scores[row], float("-inf"))
                masked[allowed] = scores[row, allowed]
                scores[row] = masked
        if params.temperature == 0:
            chosen = scores.argmax(dim=-1)
        else:
            probs = torch.softmax(scores, dim=-1)
            if params.top_p < 1:
                sorted_probs, index = probs.sort(dim=-1, descending=True)
                outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
                sorted_probs[outside] = 0
                probs = torch.zeros_like(probs).scatter(-1, index, sorted_probs)
            cdf = probs.cumsum(dim=-1)
            u = torch.tensor([1.0 - rng.random() for rng in rngs], dtype=cdf.dtype, device=cdf.device)
            chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1).clamp(max=cdf.shape[1] - 1)
        return chosen, logp_full.gather(1, chosen.unsqueeze(1)).squeeze(1)
