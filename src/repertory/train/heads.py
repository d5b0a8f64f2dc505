"""The value-like modules the trainers fit beside the policy: the critic's value head, the step-level
Q-function of Iterative GRPO with its fit (docs/algorithms.md 5.4), and ArCHer's double critic (6.4, 6.5)."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from repertory.algos import offline
from repertory.config import AdapterConfig, QConfig
from repertory.models.linear import use_fast_linears
from repertory.models.packing import PackedSequence, model_inputs, prefix_chains, shared_prompt, token_batches
from repertory.stats import pearson, rank_correlation
from repertory.store.turns import LoggedTurn
from repertory.types import RepertoryError, derive


class ValueModel(nn.Module):
    """A backbone with a scalar head (zero-initialised, so the first values are 0)."""

    def __init__(self, backbone: nn.Module, hidden: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)


def with_lora(model: nn.Module, lora: AdapterConfig, seed: int, names: Sequence[str] = ("default",)) -> nn.Module:
    """``model`` wrapped in PEFT with one trainable LoRA adapter per name (the base frozen), the first drawn from
    ``seed``, each further one from a seed of its own; every adapter starts as the base (B = 0)."""
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    config = PeftLoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    peft = get_peft_model(model, config, adapter_name=names[0])
    for name in names[1:]:
        torch.manual_seed(derive(seed, "adapter", name))
        peft.add_adapter(name, config)
    if len(names) > 1:
        # PEFT keeps only active adapters trainable (and re-applies that whenever adapters are re-enabled); every
        # one is active here, and each row picks its own (models.adapters.per_row_adapters)
        peft.base_model.set_adapter(list(names))
    use_fast_linears(peft)  # the adapters' own layers
    return peft


class LastTokenFeatures(nn.Module):
    """The final hidden state at the last token of each sequence (right padding), read by a backbone that is
    frozen or has a LoRA adapter of its own (``lora``); the features of the Q-function and ArCHer's critic."""

    def __init__(self, backbone: nn.Module, lora: AdapterConfig | None, seed: int, pad_id: int, name: str):
        super().__init__()
        backbone.requires_grad_(False)
        self.peft = None
        if lora is not None:
            config = PeftLoraConfig(
                r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive(seed, "lora", name))
                self.peft = get_peft_model(backbone, config)
            use_fast_linears(self.peft)
        self.decoder = backbone.get_decoder()
        self.size = backbone.config.hidden_size
        self.device = next(backbone.parameters()).device
        self.pad_id = pad_id

    def adapter(self) -> list[nn.Parameter]:
        """The trainable adapter parameters (none for a frozen backbone)."""
        return [p for p in self.decoder.parameters() if p.requires_grad]

    def forward(self, sequences: list[list[int]]) -> torch.Tensor:
        return self.at([PackedSequence(list(s), []) for s in sequences], [[len(s) - 1] for s in sequences])

    def at(self, sequences: list[PackedSequence], positions: list[list[int]]) -> torch.Tensor:
        """Final hidden states at the given positions of each (chain or tree) sequence, in order."""
        dtype = self.decoder.get_input_embeddings().weight.dtype
        hidden = self.decoder(**model_inputs(sequences, self.pad_id, self.device, dtype)).last_hidden_state
        rows = torch.tensor([b for b, ps in enumerate(positions) for _ in ps], device=self.device)
        cols = torch.tensor([p for ps in positions for p in ps], device=self.device)
        return hidden[rows, cols].float()


def standard_scale(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension (mean, standard deviation) of feature rows, a dimension that barely varies floored at 1% of
    the mean deviation (not blown up): the Q head reads (h - mean) / deviation (docs/algorithms.md 5.4)."""
    std = features.std(dim=0, unbiased=False)
    return features.mean(dim=0), std.clamp_min(max(0.01 * float(std.mean()), 1e-6))


class QFunction(nn.Module):
    """Q(s, a): a scalar head on the features of [history; response] (the last token's, or the mean over the
    response's tokens: ``config.features``), the backbone with its own LoRA adapter. Outputs are probabilities
    (sigmoid) when every target lies in [0, 1] (``bce``), else raw values. Each sequence comes with ``start``,
    where its response begins.

    The head reads the features standardised per dimension (``shift``, ``scale``: the Q-train features' mean and
    standard deviation at the first fit). Still linear in h, but a language model's final hidden states share one
    dominant direction (SmolLM2: norm about 50, cosine 0.97 with their mean), so on raw features Adam's first
    steps move every z together and overshoot; docs/results.md 22 measured the training loss rising after the
    first epoch and early stopping keeping the constant head."""

    def __init__(self, backbone: nn.Module, config: QConfig, seed: int, pad_id: int):
        super().__init__()
        self.features = LastTokenFeatures(backbone, config.lora, seed, pad_id, "q")
        self.peft = self.features.peft
        self.head = nn.Linear(self.features.size, 1).to(self.features.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.register_buffer("shift", torch.zeros(self.features.size, device=self.features.device))
        self.register_buffer("scale", torch.ones(self.features.size, device=self.features.device))
        self.response_mean = config.features == "response_mean"
        self.bce = True

    def trainable(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(adapter parameters, head parameters)."""
        return self.features.adapter(), list(self.head.parameters())

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The positions [a, b) whose features a response at [start, end) is read from: the last token, or every
        response token (a response without tokens is read at the prompt's last token)."""
        return (start, end) if self.response_mean and start < end else (end - 1, end)

    def pooled(self, sequences: list[PackedSequence], spans: list[list[tuple[int, int]]]) -> torch.Tensor:
        """One feature row per span (in order): the mean of the final hidden states over its positions."""
        positions = [[p for a, b in row for p in range(a, b)] for row in spans]
        hidden = self.features.at(sequences, positions)
        return torch.stack([part.mean(dim=0) for part in hidden.split([b - a for row in spans for a, b in row])])

    def micro_batches(
        self, sequences: list[list[int]], starts: list[int], micro_tokens: int
    ) -> Iterator[tuple[list[int], torch.Tensor]]:
        """(indices, their features) per micro-batch of at most ``micro_tokens`` padded tokens, every sequence that
        another one extends read inside that one's pass (:func:`prefix_chains`): a conversation's turns cost one
        pass, not one each. Each sequence's features are those it has read on its own."""
        groups = prefix_chains(sequences)
        for micro in token_batches([len(chain) for chain, _ in groups], micro_tokens):
            members = [i for g in micro for i in groups[g][1]]
            spans = [[self.span(starts[i], len(sequences[i])) for i in groups[g][1]] for g in micro]
            yield members, self.pooled([PackedSequence(list(groups[g][0]), []) for g in micro], spans)

    def z(self, features: torch.Tensor) -> torch.Tensor:
        """The head on standardised features."""
        return self.head((features - self.shift) / self.scale).squeeze(-1)

    @torch.no_grad()
    def standardise(self, sequences: list[list[int]], starts: list[int], micro_tokens: int) -> None:
        """Set ``shift`` and ``scale`` to :func:`standard_scale` of these sequences' features."""
        rows = [features for _, features in self.micro_batches(sequences, starts, micro_tokens)]
        shift, scale = standard_scale(torch.cat(rows))
        self.shift.copy_(shift)
        self.scale.copy_(scale)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], starts: list[int], micro_tokens: int) -> list[float]:
        """q per sequence."""
        out: list[float] = [0.0] * len(sequences)
        for members, features in self.micro_batches(sequences, starts, micro_tokens):
            for i, value in zip(members, offline.q_values(self.z(features), self.bce).tolist()):
                out[i] = value
        return out

    @torch.no_grad()
    def score_groups(self, prompts: list[list[int]], groups: list[list[list[int]]], micro_tokens: int) -> list[float]:
        """q of every response of every group (flat, in order), each group's prompt encoded once for all its
        responses (a shared-prompt tree); equal to :meth:`score` of each prompt + response."""
        trees = [shared_prompt(p, list(enumerate(rs))) for p, rs in zip(prompts, groups)]
        spans = [
            [self.span(start, start + len(r)) if r else self.span(len(p), len(p)) for (_, start), r in zip(t.spans, rs)]
            for t, p, rs in zip(trees, prompts, groups)
        ]
        out: list[float] = []
        for micro in token_batches([len(t.input_ids) for t in trees], micro_tokens):
            z = self.z(self.pooled([trees[i] for i in micro], [spans[i] for i in micro]))
            out += offline.q_values(z, self.bce).tolist()
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """Adapter and head weights, and the output mode."""
        tensors = {f"adapter.{k}": v for k, v in get_peft_model_state_dict(self.peft).items()}
        tensors.update({f"head.{k}": v for k, v in self.head.state_dict().items()})
        tensors.update(shift=self.shift, scale=self.scale, bce=torch.tensor(float(self.bce)))
        return {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state`."""
        adapter = {k.removeprefix("adapter."): v for k, v in tensors.items() if k.startswith("adapter.")}
        set_peft_model_state_dict(self.peft, adapter)
        self.head.load_state_dict({k.removeprefix("head."): v for k, v in tensors.items() if k.startswith("head.")})
        # Checkpoints from before standardisation hold heads trained on raw features: identity for them.
        self.shift.copy_(tensors.get("shift", torch.zeros_like(self.shift)))
        self.scale.copy_(tensors.get("scale", torch.ones_like(self.scale)))
        self.bce = bool(tensors["bce"].item())


@dataclass
class QExample:
    sequence: list[int]
    target: float
    start: int  # where the response begins in ``sequence``


def q_examples(turns: list[LoggedTurn]) -> list[QExample]:
    """[history; response] -> G_t."""
    return [QExample(list(t.prompt_ids) + list(t.response_ids), t.ret, len(t.prompt_ids)) for t in turns]


def fit_q(
    q: QFunction,
    train: list[QExample],
    val: list[QExample],
    config: QConfig,
    seed: int,
    round_index: int,
    warm: bool,
    micro_tokens: int,
) -> dict[str, float]:
    """Fit Q to Monte-Carlo returns (5.4): BCE on sigmoid outputs when every target is in [0, 1], else MSE;
    keep the epoch (0 = the starting point) with the lowest Q-val loss, stop after ``patience`` epochs
    without one. Without a warm start the head begins at w = 0, b = the mean target (as a logit for BCE), on
    features standardised by the Q-train split's."""
    if not train:
        raise RepertoryError("the Q-function has no training turns (every logged kernel fell into Q-val)")
    q.bce = offline.q_uses_bce([e.target for e in train + val])
    if not warm:
        q.standardise([e.sequence for e in train], [e.start for e in train], micro_tokens)
        with torch.no_grad():
            q.head.weight.zero_()
            q.head.bias.fill_(offline.q_head_init_bias(sum(e.target for e in train) / len(train), q.bce))
    adapter, head = q.trainable()
    optimizer = torch.optim.AdamW([{"params": adapter, "lr": config.lr}, {"params": head, "lr": config.head_lr}])

    def loss_on(examples: list[QExample], train_step: bool) -> float:
        total = 0.0
        sequences, starts = [e.sequence for e in examples], [e.start for e in examples]
        with torch.set_grad_enabled(train_step):
            for micro, features in q.micro_batches(sequences, starts, micro_tokens):
                z = q.z(features)
                targets = torch.tensor([examples[i].target for i in micro], dtype=z.dtype, device=z.device)
                loss = offline.q_loss(z, targets, q.bce) * (len(micro) / len(examples))
                if train_step:
                    loss.backward()
                total += float(loss.detach())
        return total

    selection = val or train
    best_loss, best_epoch, best_state = loss_on(selection, False), 0, q.state()
    train_loss, epochs = math.nan, 0
    for epoch in range(1, config.max_epochs + 1):
        order = list(range(len(train)))
        random.Random(derive(seed, round_index, epoch, "q")).shuffle(order)
        losses = []
        for start in range(0, len(order), config.batch_size):
            batch = [train[i] for i in order[start : start + config.batch_size]]
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss_on(batch, True) * len(batch))
            torch.nn.utils.clip_grad_norm_(adapter + head, 1.0)
            optimizer.step()
        epochs, train_loss = epoch, sum(losses) / len(train)
        current = loss_on(selection, False)
        if current < best_loss:
            best_loss, best_epoch, best_state = current, epoch, q.state()
        elif epoch - best_epoch >= config.patience:
            break
    q.load(best_state)
    metrics = {
        "q/train_loss": train_loss,
        "q/best_epoch": float(best_epoch),
        "q/epochs": float(epochs),
        "q/train_examples": float(len(train)),
        "q/val_examples": float(len(val)),
    }
    if val:
        predicted = q.score([e.sequence for e in val], [e.start for e in val], micro_tokens)
        targets = [e.target for e in val]
        metrics["q/val_loss"] = best_loss
        metrics["q/val_mse"] = sum((p - g) ** 2 for p, g in zip(predicted, targets)) / len(val)
        for name, value in (
            ("pearson", pearson(predicted, targets)),
            ("spearman", rank_correlation(predicted, targets)),
        ):
            if value is not None:
                metrics[f"q/val_{name}"] = value
    return metrics


def _mlp(d_in: int, d: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 1))


class ArcherHeads(nn.Module):
    """Two V heads on h_s and two Q heads on concat(h_s, h_sa)."""

    def __init__(self, d: int):
        super().__init__()
        self.v = nn.ModuleList([_mlp(d, d), _mlp(d, d)])
        self.q = nn.ModuleList([_mlp(2 * d, d), _mlp(2 * d, d)])

    def values(self, h_s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v1, v2 = (head(h_s).squeeze(-1) for head in self.v)
        return v1, v2

    def qs(self, h_s: torch.Tensor, h_sa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.cat([h_s, h_sa], dim=-1)
        q1, q2 = (head(both).squeeze(-1) for head in self.q)
        return q1, q2


class ArcherCritic(nn.Module):
    """ArCHer's double critic with a target copy. ``archer``: heads on the frozen initial model's features
    (features of logged sequences are cached); ``archer-lc``: the backbone has a LoRA adapter shared by the
    four heads, and the target network copies adapter and heads."""

    def __init__(self, features: LastTokenFeatures, seed: int):
        super().__init__()
        self.features = features
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive(seed, "archer", "heads"))
            self.heads = ArcherHeads(features.size).to(features.device)
        self.target = copy.deepcopy(self.heads).requires_grad_(False)
        self.target_adapter = [p.detach().clone() for p in features.adapter()]
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}

    def parameters_to_train(self) -> list[nn.Parameter]:
        return self.features.adapter() + list(self.heads.parameters())

    def encode(self, sequences: list[list[int]], target: bool = False) -> torch.Tensor:
        """Features of each sequence: cached for a frozen backbone, with the target adapter if ``target``."""
        if self.features.peft is None:
            missing = [s for s in sequences if tuple(s) not in self.cache]
            if missing:
                with torch.no_grad():
                    for s, h in zip(missing, self.features(missing)):
                        self.cache[tuple(s)] = h
            return torch.stack([self.cache[tuple(s)] for s in sequences])
        if not target:
            return self.features(sequences)
        online = self.features.adapter()
        saved = [p.detach().clone() for p in online]
        with torch.no_grad():
            for p, t in zip(online, self.target_adapter):
                p.copy_(t)
            try:
                return self.features(sequences)
            finally:
                for p, o in zip(online, saved):
                    p.copy_(o)

    def soft_update(self, tau: float) -> None:
        """theta_bar <- (1 - tau) theta_bar + tau theta for heads and adapter (after every critic step)."""
        offline.soft_update(self.target, self.heads, tau)
        offline.soft_update(self.target_adapter, [p.detach() for p in self.features.adapter()], tau)

    def state(self) -> dict[str, torch.Tensor]:
        tensors = {f"heads.{k}": v for k, v in self.heads.state_dict().items()}
        tensors.update({f"target.{k}": v for k, v in self.target.state_dict().items()})
        tensors.update({f"adapter.{i}": p for i, p in enumerate(self.features.adapter())})
        tensors.update({f"target_adapter.{i}": p for i, p in enumerate(self.target_adapter)})
        return {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        self.heads.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("heads.")})
        self.target.load_state_dict({k[7:]: v for k, v in tensors.items() if k.startswith("target.")})
        with torch.no_grad():
            for i, p in enumerate(self.features.adapter()):
                p.copy_(tensors[f"adapter.{i}"])
            for i, p in enumerate(self.target_adapter):
                p.copy_(tensors[f"target_adapter.{i}"])
