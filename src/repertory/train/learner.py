"""The learner: policy (LoRA or full), frozen reference, critic, and the optimisation step.

Training samples are turns of trainable seats, exactly as sampled: the stored prompt ids and
response ids, never re-rendered. When a seat's next prompt begins with its previous prompt and
response (the chat grows append-only), the seat's turns are packed into one sequence, so the
shared history is encoded once instead of once per turn; a causal model gives every response
token the same log-prob and value either way (tested). Losses are aggregated with per-token
weights computed over the whole mini-batch, so gradient accumulation over micro-batches
reproduces the unsplit gradient.
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from torch.distributed.tensor import DTensor

from repertory.agents.lm import LIVE_ADAPTER
from repertory.algos import losses
from repertory.config import AlgoConfig, CriticConfig, LoraConfig
from repertory.generation.core import end_of_turn_id, stop_token_ids
from repertory.generation.grammar import GrammarMasks, grammar_masks
from repertory.models import LoadedModel
from repertory.models.adapters import per_row_adapters
from repertory.models.linear import learner_precision
from repertory.models.packing import PackedSequence, model_inputs, prefix_chains, token_batches
from repertory.train import distributed
from repertory.train.batch import Batch, Experience, Sample
from repertory.train.heads import ValueModel, with_lora
from repertory.train.sharding import (
    Scorer,
    Sharded,
    Unsharded,
)
from repertory.types import derive

if TYPE_CHECKING:  # the learner reads the adapters' names; each sample carries its own (train/batch.py)
    from repertory.envs.roles import RoleAdapters

Pair = tuple[list[int], list[int]]
"""A (prompt ids, response ids) pair the round methods score."""
FLAT_LOGP_TOL = 1e-5  # policy and reference log-probs this close are the same policy up to float noise
REUSED_GAP_TOL = 1e-4  # the exact sampler's float noise against the learner's packed rows (2-3e-5 measured)
REFERENCE_ADAPTER = "reference"


@dataclass
class _Scored:
    """Per-sample tensors from one forward pass over a group of sequences."""

    logp: dict[int, torch.Tensor]
    values: dict[int, torch.Tensor]
    entropy: dict[int, torch.Tensor]


class OneAdapter:
    """The step bookkeeping of one shared adapter: every sequence trains it (see :class:`RoleSteps`)."""

    def start(self) -> None:
        """A new update begins."""

    def of(self, micro: list[PackedSequence], batch: Batch) -> list[str] | None:
        """Each sequence's adapter; None: the one adapter."""
        return None

    def idle(self, mini: list[PackedSequence], batch: Batch, flat: Callable[..., bool]) -> set[str]:
        """The adapters a step on ``mini`` must leave alone."""
        return set()

    def stepped(self, mini: list[PackedSequence], batch: Batch, idle: set[str]) -> None:
        """A step on ``mini`` was taken."""

    def drop_absent(self, mini: list[PackedSequence], batch: Batch, idle: set[str]) -> None:
        """Clear the gradients the step on ``mini`` must not apply."""


class RoleSteps(OneAdapter):
    """The step bookkeeping of one LoRA adapter per role or team (``model.adapters``): each sequence trains its
    seat's adapter (recorded at collection), and an adapter with nothing to learn in a step is left alone."""

    def __init__(self, peft: nn.Module):
        self.peft = peft
        self.moved: set[str] = set()  # the adapters stepped so far in this update

    def start(self) -> None:
        self.moved = set()

    def of(self, micro: list[PackedSequence], batch: Batch) -> list[str]:
        adapters = [batch.samples[sequence.spans[0][0]].adapter for sequence in micro]
        if None in adapters:
            raise ValueError("a batch trained with per-role adapters is collected with them: collect(..., roles)")
        return adapters  # type: ignore[return-value]

    def idle(self, mini: list[PackedSequence], batch: Batch, flat: Callable[..., bool]) -> set[str]:
        """The adapters a ``flat`` step would skip on their own: not stepped yet in this update, and flat on all
        their sequences in the mini-batch (another role's advantages must not turn their float noise into a
        step)."""
        groups: dict[str, list[PackedSequence]] = {}
        for name, sequence in zip(self.of(mini, batch), mini):
            groups.setdefault(name, []).append(sequence)
        return {name for name, group in groups.items() if name not in self.moved and flat(group, batch)}

    def stepped(self, mini: list[PackedSequence], batch: Batch, idle: set[str]) -> None:
        self.moved |= set(self.of(mini, batch)) - idle

    def drop_absent(self, mini: list[PackedSequence], batch: Batch, idle: set[str]) -> None:
        """Clear the gradients of adapters without a sequence in the mini-batch, or ``idle`` ones, so AdamW leaves
        them alone as it does in one process (data-parallel summing gives every parameter a gradient, zeros
        included)."""
        present = set(self.of(mini, batch)) - idle
        for key, param in self.peft.named_parameters():
            if ".lora_" in key and not any(f".{name}." in key for name in present):
                param.grad = None


class Learner:
    """Owns the trainable weights and turns scored batches and advantages into optimizer steps."""

    def __init__(
        self,
        loaded: LoadedModel,
        algo: AlgoConfig,
        lora: LoraConfig,
        critic: CriticConfig,
        needs_critic: bool,
        temperature: float = 1.0,
        seed: int = 0,
        exact_sampler: bool = True,
        roles: RoleAdapters | None = None,
        sharding: str = "none",
        precision: str = "float32",
    ):
        """``exact_sampler``: the batches' log-probs come from this very module at this ``precision`` (the hf
        backend at the learner's precision), so ``rollout_correction: auto`` corrects nothing; otherwise auto is
        tis. ``precision``: of the frozen weights' linear products on a CPU (``model.precision``, resolved). ``roles``:
        one LoRA adapter per role or team (``model.adapters``), each trained on its own seats' turns only.
        ``sharding`` fsdp: weights, gradients and optimiser state sharded over the data-parallel processes
        (:mod:`repertory.train.sharding`); its checkpoints keep the optimiser as shards, in one process too."""
        self.algo, self.critic_config, self.seed = algo, critic, seed
        self.precision = precision
        auto = "none" if exact_sampler else "tis"
        self.correction = auto if algo.rollout_correction == "auto" else algo.rollout_correction
        self.temperature = temperature
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        base = loaded.model
        hidden = base.config.hidden_size
        critic_base = copy.deepcopy(base) if needs_critic and not critic.share_backbone else None
        self.reference: nn.Module | None = None
        self.adapters = roles.adapters if roles is not None else [LIVE_ADAPTER]
        if lora.enabled:
            self.peft = with_lora(base, lora, derive(seed, "lora", "policy"), self.adapters)
        else:
            self.peft = None
            self.reference = copy.deepcopy(base).requires_grad_(False)
            base.requires_grad_(True)
        self.model = base  # the causal LM generation runs on; LoRA layers are injected into it in place
        self.role_steps = RoleSteps(self.peft) if roles is not None else OneAdapter()
        self.reference_adapter: str | None = None
        self.round_reference: nn.Module | None = None
        self.critic: ValueModel | None = None
        self.critic_peft = None
        if needs_critic:
            if critic_base is None:
                self.critic = ValueModel(base.get_decoder(), hidden).to(self.device)
            else:
                if lora.enabled:
                    self.critic_peft = with_lora(critic_base, lora, derive(seed, "lora", "critic"))
                else:
                    critic_base.requires_grad_(True)
                self.critic = ValueModel(critic_base.get_decoder(), hidden).to(self.device)
        self.scorer = Scorer(base)
        self.reference_scorer = Scorer(self.reference) if self.reference is not None else None
        self.shared_critic = self.critic is not None and critic.share_backbone
        self.optimizer_shards = sharding == "fsdp"
        self.sharded = Unsharded()
        if self.optimizer_shards and distributed.world_size() > 1:
            self.sharded = Sharded([s for s in (self.scorer, self.reference_scorer) if s is not None])
        self.policy_params = [p for p in base.parameters() if p.requires_grad]  # sharded ones: the optimiser's
        groups = _param_groups(self.policy_params, self.critic, critic, algo.lr)
        self.optimizer = torch.optim.AdamW(groups, weight_decay=algo.weight_decay)
        if self.sharded.active:
            self.sharded.gather()
        warmup = algo.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

    def stateful(self) -> nn.Module:
        """A module holding every parameter the optimiser steps, by which its sharded state is named."""
        modules = {"policy": self.scorer}
        if self.critic is not None:
            modules["value"] = self.critic.head
        return nn.ModuleDict(modules)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Every parameter the optimizer updates (policy first, then the critic's)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @functools.cached_property
    def grammar_masks(self) -> GrammarMasks:
        """The tokenizer's grammar masks, as the samplers have them (built at the first grammar-constrained turn)."""
        return grammar_masks(self.tokenizer, end_of_turn_id(self.tokenizer, stop_token_ids(self.tokenizer)))

    # forward passes

    def _forward(
        self,
        sequences: list[PackedSequence],
        samples: list[Sample],
        values: bool = False,
        entropy: bool = False,
        reference: bool = False,
        adapters: list[str] | None = None,
    ) -> _Scored:
        """Log-probs (policy or reference), values and entropies of every span's response tokens; with
        ``adapters``, sequence i through the policy's adapter ``adapters[i]``."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows, cols, targets, owners = [], [], [], []
        for b, seq in enumerate(sequences):
            for index, start in seq.spans:
                n = len(samples[index].response_ids)
                rows += [b] * n
                cols += seq.predecessors(start, n)
                targets += seq.input_ids[start : start + n]
                owners.append((index, n))
        inputs = model_inputs(sequences, pad, self.device, self.model.get_input_embeddings().weight.dtype)
        row_t, col_t = torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)
        logp: dict[int, torch.Tensor] = {}
        ents: dict[int, torch.Tensor] = {}
        vals: dict[int, torch.Tensor] = {}
        scorer = self.scorer
        if reference and self.peft is None:
            scorer = Scorer(self.round_reference) if self.round_reference is not None else self.reference_scorer
        if reference and self.peft is not None and self.reference_adapter is not None:
            self.peft.set_adapter(self.reference_adapter, inference_mode=True)
            try:
                picked, logits = scorer(inputs, row_t, col_t)
            finally:
                self.peft.set_adapter(LIVE_ADAPTER)
        elif reference and self.peft is not None:
            with self.peft.disable_adapter():
                picked, logits = scorer(inputs, row_t, col_t)
        elif adapters is not None:
            with per_row_adapters(self.peft, adapters):
                picked, logits = scorer(inputs, row_t, col_t)
        else:
            picked, logits = scorer(inputs, row_t, col_t)
        logits = logits.float() / self.temperature
        if any(samples[i].grammar is not None for i, _ in owners):
            logits = _masked(logits, [samples[i] for i, _ in owners], self.grammar_masks)
        all_logp = torch.log_softmax(logits, dim=-1)
        token_logp = all_logp.gather(1, torch.tensor(targets, device=self.device).unsqueeze(1)).squeeze(1)
        logp = _split(token_logp, owners)
        if entropy:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.algo.entropy_coef > 0):
                ents = _split(losses.entropy_from_logits(logits), owners)
        if values and self.critic is not None and not reference:
            if self.shared_critic:
                value_hidden = picked
            else:
                value_hidden = self.critic.backbone(**inputs).last_hidden_state[row_t, col_t]
            vals = _split(self.critic.head(value_hidden.float()).squeeze(-1), owners)
        return _Scored(logp, vals, ents)

    def freeze_reference(self) -> None:
        """Make the current policy the KL reference (pi_k of a batch-online round) instead of the initial one.
        With LoRA the reference is a frozen copy of the live adapter inside the same model."""
        if self.peft is None:
            # A copy of its own: the initial reference may also serve as the frozen 'base' agent.
            if self.round_reference is None:
                self.round_reference = copy.deepcopy(self.model).requires_grad_(False)
            self.round_reference.load_state_dict(self.model.state_dict())
            return
        if self.reference_adapter is None:
            self.reference_adapter = REFERENCE_ADAPTER
            with torch.random.fork_rng(devices=[]):  # the new adapter's initial draw must not move the global stream
                self.peft.add_adapter(REFERENCE_ADAPTER, self.peft.peft_config[LIVE_ADAPTER])
        live = get_peft_model_state_dict(self.peft, adapter_name=LIVE_ADAPTER)
        set_peft_model_state_dict(self.peft, live, adapter_name=REFERENCE_ADAPTER)
        self.peft.set_adapter(LIVE_ADAPTER)

    @torch.no_grad()
    def token_logps(
        self, pairs: list[Pair], reference: bool = False, grammars: list[str | None] | None = None
    ) -> list[torch.Tensor]:
        """Per-token log-probs of each (prompt ids, response ids) pair under the policy or the reference, masked by
        its grammar where ``grammars`` gives one."""
        samples, sequences = _pair_sequences(pairs, grammars, self.algo.packing)
        out: dict[int, torch.Tensor] = {}
        for micro in micro_batches(sequences, self.algo.micro_batch_tokens):
            out.update(self._forward(micro, samples, reference=reference).logp)
        return [out[i] for i in range(len(pairs))]

    def backward_on(
        self,
        pairs: list[Pair],
        loss_of: Callable[[list[int], list[torch.Tensor]], torch.Tensor],
        grammars: list[str | None] | None = None,
    ) -> float:
        """Accumulate the gradient of a loss over (prompt, response) pairs one micro-batch at a time:
        ``loss_of(indices, token_logps)`` is a micro-batch's share of the loss (the caller normalises), its
        log-probs masked by each pair's grammar as in :meth:`token_logps`. Returns the summed loss; call
        :meth:`optimizer_step` after."""
        samples, sequences = _pair_sequences(pairs, grammars, self.algo.packing)
        total = 0.0
        for micro in micro_batches(sequences, self.algo.micro_batch_tokens):
            logp = self._forward(micro, samples).logp
            indices = [index for seq in micro for index, _ in seq.spans]
            loss = loss_of(indices, [logp[i] for i in indices])
            loss.backward()
            total += float(loss.detach())
        return total

    def optimizer_step(self) -> float:
        """Clip the accumulated gradients per parameter group, step, and clear them; the policy's grad norm."""
        norms = [torch.nn.utils.clip_grad_norm_(g["params"], self.algo.grad_clip) for g in self.optimizer.param_groups]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norms[0].full_tensor() if isinstance(norms[0], DTensor) else norms[0])

    @torch.no_grad()
    def score(self, batch: Batch, version: int | None = None) -> dict[str, float]:
        """Give every trained sample its :class:`Experience`: the learner's and the reference's log-probs, the
        rollout correction and (with a critic) values; returns the sampler-learner mismatch over the tokens the
        sampler recorded. ``version``: the policy version this learner holds (the trainer's updates so far).
        Where the sampler is exact and every sample was drawn from that version (:func:`_reuses_sampler`), the
        sampler's log-probs are the old policy's: the policy scores the first micro-batch only, to measure the
        gap, and the rest when that gap is above the exact path's float noise (``REUSED_GAP_TOL``)."""
        micros = micro_batches(batch.sequences, self.algo.micro_batch_tokens)
        recorded = {
            i: torch.tensor(s.logp_sample, device=self.device)
            for i, s in enumerate(batch.samples)
            if s.trained and s.logp_sample and len(s.logp_sample) == len(s.response_ids)
        }
        # the sampler stands for the old policy only where nothing else needs the pass: no correction to compute,
        # no critic (its values come from the same pass), one process
        exact = self.correction == "none" and self.critic is None and distributed.world_size() == 1
        reuse = exact and _reuses_sampler(batch, version, recorded)
        with self.sharded.sharded(), learner_precision(self.precision):
            logp, values = self._scores(batch, micros[:1] if reuse else micros)
            if reuse and _mismatch(logp, recorded).get("offpolicy/max_gap", 0.0) > REUSED_GAP_TOL:
                reuse = False
                more, _ = self._scores(batch, micros[1:])
                logp.update(more)
            logp_ref, _ = self._scores(batch, micros, reference=True)
        scored = sum(len(t) for t in logp.values())
        batch.old_gap = REUSED_GAP_TOL if reuse else 0.0
        old_of = {i: logp.get(i, recorded.get(i)) for i in logp_ref} if reuse else logp
        cap = self.algo.rollout_correction_cap
        for i, old in old_of.items():
            mode = self.correction if i in recorded else "none"  # logged turns may carry no log-probs
            correction = losses.rollout_correction(old, recorded.get(i, old), mode, cap)
            batch.experience[i] = Experience(old, logp_ref[i], correction, values.get(i))
        metrics = _mismatch(logp, recorded)
        if not metrics:
            return {}
        weights = torch.cat([batch.experience[i].correction for i in recorded])
        metrics["offpolicy/weight_mean"] = float(weights.mean())
        metrics["offpolicy/rescored_frac"] = scored / max(1, sum(len(t) for t in logp_ref.values()))
        return metrics

    def _scores(
        self, batch: Batch, micros: list[list[PackedSequence]], reference: bool = False
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """The policy's (or the reference's) log-probs and, with a critic, the policy's values of the
        micro-batches' samples."""
        logp: dict[int, torch.Tensor] = {}
        values: dict[int, torch.Tensor] = {}
        for micro in micros:
            if reference:
                scored = self._forward(micro, batch.samples, reference=True)
            else:
                scored = self._forward(micro, batch.samples, values=True, adapters=self.role_steps.of(micro, batch))
            logp.update({i: t.detach() for i, t in scored.logp.items()})
            values.update({i: t.detach() for i, t in scored.values.items()})
        return logp, values

    # the optimisation step

    def update(
        self, batch: Batch, seed_key: int | str, epochs: int | None = None, mini_batches: int | None = None
    ) -> dict[str, float]:
        """PPO (or REINFORCE) epochs over a scored batch whose advantages (and critic targets) were assigned
        (default ``algo.ppo_epochs`` of ``algo.mini_batches`` optimizer steps); returns the loss and diagnostic
        means over the steps taken, and ``skipped_frac``, the share of steps skipped because nothing could move
        the policy yet (see :meth:`_flat`). ``seed_key`` seeds the mini-batches' shuffle (an iteration, or a round
        method's step name)."""
        algo = self.algo
        unready = [i for seq in batch.sequences for i, _ in seq.spans if i not in batch.experience]
        if unready:
            raise ValueError(f"samples {unready[:5]} were not scored: call Learner.score(batch) before update")
        unready = [i for i, x in batch.experience.items() if x.advantages is None]
        if unready:
            raise ValueError(f"samples {unready[:5]} have no advantages: call batch.assign(...) before update")
        with self.sharded.sharded(), learner_precision(self.precision):
            return self._epochs(batch, seed_key, epochs or algo.ppo_epochs, mini_batches or algo.mini_batches)

    def _epochs(self, batch: Batch, seed_key: int | str, epochs: int, mini_batches: int) -> dict[str, float]:
        totals: dict[str, float] = {}
        steps = skipped = 0
        self.role_steps.start()
        for epoch in range(epochs):
            order = list(range(len(batch.sequences)))
            random.Random(derive(self.seed, seed_key, epoch, "minibatch")).shuffle(order)
            n_mini = min(mini_batches, len(order))
            for m in range(n_mini):
                mini = [batch.sequences[i] for i in order[m::n_mini]]
                # one decision for every process (each computed it from its own scoring pass)
                if steps == 0 and distributed.broadcast(_flat(self.algo, self.critic is not None, mini, batch)):
                    skipped += 1
                    continue
                idle = self.role_steps.idle(mini, batch, functools.partial(_flat, self.algo, self.critic is not None))
                stats = self._step(mini, batch, idle)
                self.role_steps.stepped(mini, batch, idle)
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
                steps += 1
        if not steps and not skipped:
            return {}
        out = {key: value / steps for key, value in totals.items()} if steps else {"loss/policy": 0.0, "kl": 0.0}
        out["skipped_frac"] = skipped / (steps + skipped)
        out["memory/learner_state_mb"] = self.state_bytes() / 2**20
        return out

    def state_bytes(self) -> int:
        """Bytes of the trained parameters and their AdamW moments as this process holds them (its shards, when
        sharded): what sharding divides."""
        tensors = [*self.trainable_parameters()]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in local)

    def _step(self, mini: list[PackedSequence], batch: Batch, idle: set[str] | None = None) -> dict[str, float]:
        algo = self.algo
        order = [index for seq in mini for index, _ in seq.spans]
        lengths = [batch.samples[i].n_tokens for i in order]
        weights = losses.aggregation_weights(lengths, algo.aggregation).to(self.device)
        offsets, total = {}, 0
        for index, n in zip(order, lengths):
            offsets[index] = (total, n)
            total += n
        sums = {"loss/policy": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "loss/value": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        # data-parallel: each process takes its share of the micro-batches; the summed gradients are the whole's
        micros = micro_batches(mini, self.algo.micro_batch_tokens)
        mine = micros[distributed.rank() :: distributed.world_size()]
        for _ in range(self.sharded.idle_passes(len(micros), len(mine))):
            # a pass that adds nothing to the gradients, so that every process's collectives are matched
            (0.0 * sum(t.sum() for t in self._forward(micros[0], batch.samples).logp.values())).backward()
        for micro in mine:
            tokens, value = self._terms(micro, batch, weights, offsets)
            loss, stats = losses.objective(tokens, algo, value)
            loss.backward()
            for name, total in stats.items():
                sums[name] += float(total)
        distributed.sum_gradients(self.trainable_parameters())
        self.role_steps.drop_absent(mini, batch, idle or set())
        sums = distributed.sum_values(sums)
        if len(self.optimizer.param_groups) > 1:
            # actor and critic are clipped separately, as separate optimisers would (docs/algorithms.md 2.7)
            sums["critic_grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[1]["params"], algo.grad_clip)
            )
        sums["grad_norm"] = self.optimizer_step()
        return sums

    def _terms(
        self, micro: list[PackedSequence], batch: Batch, weights: torch.Tensor, offsets: dict[int, tuple[int, int]]
    ) -> tuple[losses.TokenTerms, losses.ValueTerms | None]:
        """One micro-batch scored now, aligned token by token with what its samples recorded at scoring."""
        adapters = self.role_steps.of(micro, batch)
        scored = self._forward(micro, batch.samples, values=self.critic is not None, entropy=True, adapters=adapters)
        idx = [index for seq in micro for index, _ in seq.spans]
        recorded = [batch.experience[i] for i in idx]
        logp = torch.cat([scored.logp[i] for i in idx])
        tokens = losses.TokenTerms(
            logp,
            torch.cat([x.logp_old for x in recorded]),
            torch.cat([x.logp_ref for x in recorded]),
            torch.cat([x.advantages for x in recorded]).to(self.device, logp.dtype),  # type: ignore[misc]
            torch.cat([weights[offsets[i][0] : offsets[i][0] + offsets[i][1]] for i in idx]),
            torch.cat([x.correction for x in recorded]),
            torch.cat([scored.entropy[i] for i in idx]),
        )
        if self.critic is None or not batch.has_returns:
            return tokens, None
        values = torch.cat([scored.values[i] for i in idx])
        returns = torch.cat([x.returns for x in recorded]).to(self.device, values.dtype)  # type: ignore[misc]
        coef = self.critic_config.value_coef if self.shared_critic else 1.0
        return tokens, losses.ValueTerms(values, torch.cat([x.values for x in recorded]), returns, coef)  # type: ignore[misc]


def _param_groups(policy: list[nn.Parameter], value: ValueModel | None, critic: CriticConfig, lr: float) -> list[dict]:
    """The optimiser's groups: the policy's parameters at ``lr``, then the critic's (its head, and its own backbone
    where it has one) at the critic's."""
    groups: list[dict] = [{"params": policy, "lr": lr}]
    if value is not None:
        critic_params = list(value.head.parameters())
        if not critic.share_backbone:
            critic_params += [p for p in value.backbone.parameters() if p.requires_grad]
        groups.append({"params": critic_params, "lr": critic.lr})
    return groups


def _masked(logits: torch.Tensor, owners: list[Sample], masks: GrammarMasks) -> torch.Tensor:
    """``logits`` of the owners' response tokens (in order), with every token a sample's grammar did not allow at
    a position set to -inf: a grammar-constrained turn's log-probs are the masked policy's, as sampled."""
    allowed, start = torch.ones(logits.shape, dtype=torch.bool), 0
    for sample in owners:
        n = len(sample.response_ids)
        if sample.grammar is not None:
            allowed[start : start + n] = masks.replay(sample.grammar, sample.response_ids, logits.shape[1])
        start += n
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def _pair_sequences(
    pairs: list[Pair], grammars: list[str | None] | None, packing: bool
) -> tuple[list[Sample], list[PackedSequence]]:
    """(prompt ids, response ids) pairs as trained samples under their grammars; with ``packing`` every pair that
    another one extends (a conversation's earlier turns) is read inside that one's sequence (:func:`prefix_chains`),
    else one sequence each."""
    grammars = grammars or [None] * len(pairs)
    samples = [
        Sample(0, 0, prompt, response, [], True, grammar=grammar)
        for (prompt, response), grammar in zip(pairs, grammars, strict=True)
    ]
    full = [list(p) + list(r) for p, r in pairs]
    groups = prefix_chains(full) if packing else [(ids, [i]) for i, ids in enumerate(full)]
    return samples, [PackedSequence(ids, [(i, len(pairs[i][0])) for i in members]) for ids, members in groups]


def _split(flat: torch.Tensor, owners: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
    out, start = {}, 0
    for index, n in owners:
        out[index] = flat[start : start + n]
        start += n
    return out


def _mismatch(logp: dict[int, torch.Tensor], recorded: dict[int, torch.Tensor]) -> dict[str, float]:
    """The sampler-learner mismatch (:func:`losses.sampler_mismatch`) over the samples the learner scored and the
    sampler recorded; empty when there are none."""
    both = [i for i in logp if i in recorded]
    if not both:
        return {}
    return losses.sampler_mismatch(torch.cat([logp[i] for i in both]), torch.cat([recorded[i] for i in both]))


def micro_batches(sequences: list[PackedSequence], tokens: int) -> list[list[PackedSequence]]:
    """``sequences`` in groups of at most ``tokens`` tokens (``algo.micro_batch_tokens``), one forward pass each."""
    groups = token_batches([len(s.input_ids) for s in sequences], tokens)
    return [[sequences[i] for i in group] for group in groups]


def _reuses_sampler(batch: Batch, version: int | None, recorded: dict[int, torch.Tensor]) -> bool:
    """Whether, for an exact sampler, its log-probs can stand for the old policy's: every trained sample
    ``recorded`` in full by policy ``version``."""
    if version is None:
        return False
    trained = [i for i, s in enumerate(batch.samples) if s.trained]
    return bool(trained) and all(i in recorded and batch.samples[i].policy_version == version for i in trained)


def _flat(algo: AlgoConfig, has_critic: bool, mini: list[PackedSequence], batch: Batch) -> bool:
    """Whether a step of the still-unchanged (scored) policy has a zero gradient: every advantage is 0, no
    entropy or value term, and the policy equals its KL reference on these tokens. Such a step is skipped:
    its computed gradient is float noise, which AdamW would turn into a full learning-rate step."""
    if algo.entropy_coef > 0 or (batch.has_returns and has_critic):
        return False
    mine = [batch.experience[index] for seq in mini for index, _ in seq.spans]
    if any(bool(x.advantages.any()) for x in mine):  # type: ignore[union-attr]
        return False
    if algo.kl_mode != "loss" or algo.beta_kl == 0:
        return True
    tolerance = FLAT_LOGP_TOL + batch.old_gap
    return all(torch.allclose(x.logp_old, x.logp_ref, rtol=0, atol=tolerance) for x in mine)
