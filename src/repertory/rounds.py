"""Batch-online training (algorithms.md 5-6): deployment rounds, logged turns, the step-level Q-function,
Iterative GRPO, and the baselines that learn from the same logs.

One iteration of a ``trainer: rounds`` run is one deployment round k:

1. deploy pi_k against the partner (``rollout.opponent``) on train kernels, or, in round 0, read the
   logged turns a user brings (``rounds.logs``);
2. store the conversations (``episodes/iter-K.parquet``) and one record per agent turn
   (``rounds/turns-K.parquet``, 5.3) with its Monte-Carlo return G_t;
3. improve the policy offline with ``rounds.method``: ``igrpo`` fits the Q-function on the round's
   turns (kernel-split validation, early stopping, warm start) and runs single-turn GRPO over the logged
   states with candidates scored by Q; ``st-grpo``, ``mt-sft`` and ``mt-kto`` learn from the logged
   conversations directly. No game is played while improving: the partner's calls and the simulator's
   episodes are counted and must not move;
4. evaluate pi_{k+1} on held-out kernels (the trainer's ``eval`` section; ``eval/discounted_return`` is J).

The online :class:`~repertory.train.Trainer` supplies everything else (deployment line-up, evaluation,
checkpoints, resume, metrics, report).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn

from repertory import algos
from repertory.agents import make_agent
from repertory.agents.lm import chat_prompt_ids
from repertory.config import QConfig, SuiteConfig, TrainConfig, load_config
from repertory.envs import Env, env_class, make
from repertory.generation import Generation, TokenTrie
from repertory.learner import Batch, PackedSequence, Sample, collect, model_inputs, shared_prompt, token_batches
from repertory.models import LoadedModel, load_model
from repertory.report import ResultsTable, results_table
from repertory.rollout import run_episodes, schedule
from repertory.store import MESSAGE_TYPE, EpisodeStore, read_episodes, write_episodes, write_table
from repertory.train import Trainer, export_policy, resume_run, rollout_metrics, start_run
from repertory.types import Episode, Message, RepertoryError, derive

DEFAULT_EPOCHS = {"igrpo": 1, "st-grpo": 2, "mt-sft": 2, "mt-kto": 1, "mt-ppo": 4, "archer": 1, "archer-lc": 1}

# ----------------------------------------------------------------------------------------------------------
# Logged turns (5.3)
# ----------------------------------------------------------------------------------------------------------


@dataclass
class LoggedTurn:
    """One agent turn of a logged conversation: the state (prompt), the action (response), the
    conversation's outcome R and the discounted return G_t from this turn on."""

    episode_id: str
    kernel_id: str
    t: int
    T: int
    prompt_ids: list[int]
    response_ids: list[int]
    outcome: float
    ret: float
    round: int = 0
    seat_id: str = "p0"
    policy_id: str = "logged"
    logp_sample: list[float] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    response: str = ""


TURN_SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("kernel_id", pa.string()),
        ("t", pa.int32()),
        ("T", pa.int32()),
        ("outcome", pa.float64()),
        ("ret", pa.float64()),
        ("round", pa.int32()),
        ("seat_id", pa.string()),
        ("policy_id", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("response", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("logp_sample", pa.list_(pa.float64())),
    ]
)
REQUIRED_COLUMNS = ("episode_id", "kernel_id", "t", "outcome")


def logged_turns(episodes: list[Episode], round_index: int, gamma: float) -> list[LoggedTurn]:
    """The turns of every trainable seat that produced tokens, with G_t = sum_{t'>=t} gamma^(t'-t) r_t'."""
    out = []
    for ep in episodes:
        for seat in ep.seats:
            if not seat.trainable:
                continue
            turns = ep.trajectory(seat.seat_id)
            returns = algos.discounted_returns([turn.reward for turn in turns], gamma)
            outcome = ep.result.roles[seat.name].outcome
            for t, (turn, ret) in enumerate(zip(turns, returns)):
                if not turn.response_ids:
                    continue
                out.append(
                    LoggedTurn(
                        episode_id=ep.episode_id,
                        kernel_id=ep.kernel_id,
                        t=t,
                        T=len(turns) - 1,
                        prompt_ids=list(turn.prompt_ids),
                        response_ids=list(turn.response_ids),
                        outcome=outcome,
                        ret=ret,
                        round=round_index,
                        seat_id=seat.seat_id,
                        policy_id=f"pi_{round_index}",
                        logp_sample=list(turn.logp_sample),
                        messages=ep.prompt_messages(seat.seat_id, turn.turn_index),
                        response=turn.text,
                    )
                )
    return out


def write_turns(path: str | Path, turns: Iterable[LoggedTurn]) -> Path:
    """Write logged turns to one Parquet file atomically (the schema users' own logs follow)."""
    rows = []
    for turn in turns:
        row = {name: getattr(turn, name) for name in TURN_SCHEMA.names}
        row["messages"] = [{"role": m.role, "content": m.content} for m in turn.messages]
        rows.append(row)
    return write_table(path, pa.Table.from_pylist(rows, schema=TURN_SCHEMA))


def read_turns(path: str | Path, tokenizer: Any, gamma: float) -> list[LoggedTurn]:
    """Logged turns from a Parquet file: ours, or a user's with at least ``episode_id``, ``kernel_id``, ``t``,
    ``outcome`` and either ``prompt_ids`` + ``response_ids`` or ``messages`` + ``response`` (rendered with the
    policy's chat template). Missing ``T`` is the episode's last t; missing ``ret`` is gamma^(T-t) * outcome."""
    path = Path(path)
    try:
        table = pq.read_table(path)
    except FileNotFoundError:
        raise RepertoryError(f"{path}: no such file") from None
    except (OSError, pa.ArrowException) as exc:
        raise RepertoryError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = set(table.column_names)
    missing = [c for c in REQUIRED_COLUMNS if c not in columns]
    has_ids = {"prompt_ids", "response_ids"} <= columns
    has_text = {"messages", "response"} <= columns
    if missing or not (has_ids or has_text):
        need = ", ".join(missing) if missing else "prompt_ids + response_ids, or messages + response"
        raise RepertoryError(f"{path}: not a logged-turns file (missing columns: {need}); see the README's schema")
    rows = table.to_pylist()
    if not rows:
        raise RepertoryError(f"{path}: no logged turns")
    for n, row in enumerate(rows):
        for column in REQUIRED_COLUMNS:
            if row[column] is None:
                raise RepertoryError(f"{path}, row {n}: {column} is empty")
    episodes: dict[tuple[str, str], list[int]] = {}
    for n, row in enumerate(rows):
        episodes.setdefault((str(row["episode_id"]), row.get("seat_id") or "p0"), []).append(n)
    for (episode_id, seat_id), members in episodes.items():
        where = f"{path}: episode {episode_id!r}" + (f" seat {seat_id!r}" if "seat_id" in columns else "")
        for column in ("kernel_id", "outcome"):
            if len({rows[n][column] for n in members}) > 1:
                raise RepertoryError(f"{where} has more than one {column}")
        ts = [int(rows[n]["t"]) for n in members]
        if len(set(ts)) < len(ts):
            raise RepertoryError(f"{where} logs the same turn t twice")
    vocabulary = len(tokenizer)
    out = []
    for n, row in enumerate(rows):
        where = f"{path}, row {n}"
        outcome = row["outcome"]
        if not isinstance(outcome, (int, float)) or not math.isfinite(outcome):
            raise RepertoryError(f"{where}: outcome must be a finite number (got {outcome!r})")
        T = (
            int(row["T"])
            if row.get("T") is not None
            else max(int(rows[k]["t"]) for k in episodes[str(row["episode_id"]), row.get("seat_id") or "p0"])
        )
        t = int(row["t"])
        if not 0 <= t <= T:
            raise RepertoryError(f"{where}: t = {t} is outside 0..T = {T}")
        messages = [Message(m["role"], m["content"]) for m in row.get("messages") or []]
        if has_ids and row.get("prompt_ids") and row.get("response_ids"):
            prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
            if not all(0 <= i < vocabulary for i in prompt + response):
                raise RepertoryError(f"{where}: token ids outside the policy's vocabulary (0..{vocabulary - 1})")
        elif messages and row.get("response") is not None:
            prompt, response = _render(tokenizer, messages, row["response"])
        else:
            raise RepertoryError(f"{where}: no prompt_ids/response_ids and no messages/response")
        ret = row.get("ret")
        if ret is not None and (not isinstance(ret, (int, float)) or not math.isfinite(ret)):
            raise RepertoryError(f"{where}: ret must be a finite number (got {ret!r})")
        out.append(
            LoggedTurn(
                episode_id=str(row["episode_id"]),
                kernel_id=str(row["kernel_id"]),
                t=t,
                T=T,
                prompt_ids=prompt,
                response_ids=response,
                outcome=float(outcome),
                ret=float(ret) if ret is not None else gamma ** (T - t) * float(outcome),
                round=int(row.get("round") or 0),
                seat_id=row.get("seat_id") or "p0",
                policy_id=row.get("policy_id") or "logged",
                logp_sample=list(row.get("logp_sample") or []),
                messages=messages,
                response=row.get("response") or "",
            )
        )
    return out


def demonstration_turns(episodes: list[Episode], env: type[Env], tokenizer: Any, gamma: float) -> list[LoggedTurn]:
    """Logged turns from any played episodes (bots, people, other models): the turns of the seat the policy
    is trained in (the game's trained seat, or every seat where the game fixes none), each text rendered with
    the policy's chat template, G_t from the turn rewards."""
    out = []
    for ep in episodes:
        if ep.env != env.name:
            raise RepertoryError(f"episode {ep.episode_id} is a game of {ep.env}, not {env.name}")
        seats = [env.roles.index(env.default_trained_role)] if env.fixed_seat else range(len(ep.seats))
        for index in seats:
            seat = ep.seats[index]
            own = ep.trajectory(seat.seat_id)
            returns = algos.discounted_returns([turn.reward for turn in own], gamma)
            for t, (turn, ret) in enumerate(zip(own, returns)):
                messages = ep.prompt_messages(seat.seat_id, turn.turn_index)
                prompt, response = _render(tokenizer, messages, turn.text)
                out.append(
                    LoggedTurn(
                        ep.episode_id,
                        ep.kernel_id,
                        t,
                        len(own) - 1,
                        prompt,
                        response,
                        ep.result.roles[seat.name].outcome,
                        ret,
                        0,
                        seat.seat_id,
                        seat.agent,
                        messages=messages,
                        response=turn.text,
                    )
                )
    return out


def read_logs(path: str | Path, env: type[Env], tokenizer: Any, gamma: float) -> tuple[list[LoggedTurn], list[Episode]]:
    """Round 0's logs: a logged-turns Parquet file, or played episodes — an episode file or an episode store
    directory (``repertory play --out``) — whose trained seat's turns become the logged turns."""
    path = Path(path)
    if path.is_dir():
        episodes, errors = EpisodeStore(path).load()
        if errors:
            raise RepertoryError("; ".join(map(str, errors)))
        if not episodes:
            raise RepertoryError(f"{path}: no episodes in this store")
    elif path.is_file() and _is_episode_file(path):
        episodes = read_episodes(path)
    else:
        return read_turns(path, tokenizer, gamma), []
    return demonstration_turns(episodes, env, tokenizer, gamma), episodes


def _is_episode_file(path: Path) -> bool:
    try:
        return "turns" in pq.read_schema(path).names
    except (OSError, pa.ArrowException):
        return False  # read_turns reports what is wrong with it


def _render(tokenizer: Any, messages: list[Message], response: str) -> tuple[list[int], list[int]]:
    """Prompt ids as the policy samples them (chat template, generation prompt) and the response ids
    closed by the end-of-turn token, as a sampled response ends."""
    prompt = chat_prompt_ids(tokenizer, messages)
    response_ids = tokenizer.encode(response, add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    return prompt, response_ids + ([end] if end is not None else [tokenizer.eos_token_id])


def kernel_split(kernel_ids: Iterable[str], val_fraction: float, seed: int) -> tuple[set[str], set[str]]:
    """(Q-train, Q-val) kernels: every turn of a kernel on one side, and each kernel on the same side in every
    round whatever else was logged (Q-val iff a hash of seed and kernel id falls below ``val_fraction``)."""
    kernels = set(kernel_ids)
    val = {k for k in kernels if derive(seed, "q-split", k) % 1_000_000 < val_fraction * 1_000_000}
    if val == kernels:  # nothing left to fit on: no validation this round
        val = set()
    return kernels - val, val


def first_return(convo: list[LoggedTurn], gamma: float) -> float:
    """G_0 of a conversation: its first turn's return, discounted back to t = 0 when the log starts later (a
    first turn without tokens is not logged; its reward, if any, is unknown)."""
    return gamma ** convo[0].t * convo[0].ret


def group_key(turn: LoggedTurn) -> str:
    """Conversations compared with each other (ST-GRPO groups, KTO's kernel means): same kernel, same seat."""
    return f"{turn.kernel_id}/{turn.seat_id}"


Conversation = tuple[str, str]
"""One seat's side of one logged episode: (episode id, seat id). Both seats of a self-play game are logged,
each its own conversation with its own outcome."""


def conversation_of(turn: LoggedTurn) -> Conversation:
    """The conversation a logged turn belongs to."""
    return turn.episode_id, turn.seat_id


def conversations(turns: list[LoggedTurn]) -> dict[Conversation, list[LoggedTurn]]:
    """Turns grouped by conversation, in turn order."""
    out: dict[Conversation, list[LoggedTurn]] = {}
    for turn in sorted(turns, key=lambda x: (x.episode_id, x.seat_id, x.t)):
        out.setdefault(conversation_of(turn), []).append(turn)
    return out


# ----------------------------------------------------------------------------------------------------------
# The step-level Q-function (5.4)
# ----------------------------------------------------------------------------------------------------------


class LastTokenFeatures(nn.Module):
    """The final hidden state at the last token of each sequence (right padding), read by a backbone that is
    frozen or has a LoRA adapter of its own (``lora``); the features of the Q-function and ArCHer's critic."""

    def __init__(self, backbone: nn.Module, lora: QConfig | None, seed: int, pad_id: int, name: str):
        super().__init__()
        backbone.requires_grad_(False)
        self.peft = None
        if lora is not None:
            config = PeftLoraConfig(r=lora.lora_r, lora_alpha=lora.lora_alpha, target_modules=list(lora.target_modules))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive(seed, "lora", name))
                self.peft = get_peft_model(backbone, config)
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


class QFunction(nn.Module):
    """Q(s, a): a scalar head on the last-token features of [history; response], the backbone with its own LoRA
    adapter. Outputs are probabilities (sigmoid) when every target lies in [0, 1] (``bce``), else raw values."""

    def __init__(self, backbone: nn.Module, config: QConfig, seed: int, pad_id: int):
        super().__init__()
        self.features = LastTokenFeatures(backbone, config, seed, pad_id, "q")
        self.peft = self.features.peft
        self.head = nn.Linear(self.features.size, 1).to(self.features.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.bce = True

    def trainable(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(adapter parameters, head parameters)."""
        return self.features.adapter(), list(self.head.parameters())

    def logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """z per sequence."""
        return self.head(self.features(sequences)).squeeze(-1)

    @torch.no_grad()
    def score(self, sequences: list[list[int]], micro_tokens: int) -> list[float]:
        """q per sequence."""
        out: list[float] = [0.0] * len(sequences)
        for micro in token_batches([len(s) for s in sequences], micro_tokens):
            z = self.logits([sequences[i] for i in micro])
            for i, value in zip(micro, algos.q_values(z, self.bce).tolist()):
                out[i] = value
        return out

    @torch.no_grad()
    def score_groups(self, prompts: list[list[int]], groups: list[list[list[int]]], micro_tokens: int) -> list[float]:
        """q of every response of every group (flat, in order), each group's prompt encoded once for all its
        responses (a shared-prompt tree); equal to :meth:`score` of each prompt + response."""
        trees = [shared_prompt(p, list(enumerate(rs))) for p, rs in zip(prompts, groups)]
        ends = [
            [start + len(r) - 1 if r else len(p) - 1 for (_, start), r in zip(tree.spans, rs)]
            for tree, p, rs in zip(trees, prompts, groups)
        ]
        out: list[float] = []
        for micro in token_batches([len(t.input_ids) for t in trees], micro_tokens):
            z = self.head(self.features.at([trees[i] for i in micro], [ends[i] for i in micro])).squeeze(-1)
            out += algos.q_values(z, self.bce).tolist()
        return out

    def state(self) -> dict[str, torch.Tensor]:
        """Adapter and head weights, and the output mode."""
        tensors = {f"adapter.{k}": v for k, v in get_peft_model_state_dict(self.peft).items()}
        tensors.update({f"head.{k}": v for k, v in self.head.state_dict().items()})
        tensors["bce"] = torch.tensor(float(self.bce))
        return {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state`."""
        adapter = {k.removeprefix("adapter."): v for k, v in tensors.items() if k.startswith("adapter.")}
        set_peft_model_state_dict(self.peft, adapter)
        self.head.load_state_dict({k.removeprefix("head."): v for k, v in tensors.items() if k.startswith("head.")})
        self.bce = bool(tensors["bce"].item())


def _pearson(x: list[float], y: list[float]) -> float | None:
    mx, my = sum(x) / len(x), sum(y) / len(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else None


def _ranks(x: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their average rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and x[order[end + 1]] == x[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def rank_correlation(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho (Pearson on average ranks); None when either side is constant."""
    return _pearson(_ranks(x), _ranks(y))


@dataclass
class QExample:
    sequence: list[int]
    target: float


def q_examples(turns: list[LoggedTurn]) -> list[QExample]:
    """[history; response] -> G_t."""
    return [QExample(list(t.prompt_ids) + list(t.response_ids), t.ret) for t in turns]


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
    without one. Without a warm start the head begins at w = 0, b = the mean target (as a logit for BCE)."""
    if not train:
        raise RepertoryError("the Q-function has no training turns (every logged kernel fell into Q-val)")
    q.bce = algos.q_uses_bce([e.target for e in train + val])
    if not warm:
        with torch.no_grad():
            q.head.weight.zero_()
            q.head.bias.fill_(algos.q_head_init_bias(sum(e.target for e in train) / len(train), q.bce))
    adapter, head = q.trainable()
    optimizer = torch.optim.AdamW([{"params": adapter, "lr": config.lr}, {"params": head, "lr": config.head_lr}])

    def loss_on(examples: list[QExample], train_step: bool) -> float:
        total = 0.0
        for micro in token_batches([len(e.sequence) for e in examples], micro_tokens):
            with torch.set_grad_enabled(train_step):
                z = q.logits([examples[i].sequence for i in micro])
                targets = torch.tensor([examples[i].target for i in micro], dtype=z.dtype, device=z.device)
                loss = algos.q_loss(z, targets, q.bce) * (len(micro) / len(examples))
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
        predicted = q.score([e.sequence for e in val], micro_tokens)
        targets = [e.target for e in val]
        metrics["q/val_loss"] = best_loss
        metrics["q/val_mse"] = sum((p - g) ** 2 for p, g in zip(predicted, targets)) / len(val)
        for name, value in (
            ("pearson", _pearson(predicted, targets)),
            ("spearman", rank_correlation(predicted, targets)),
        ):
            if value is not None:
                metrics[f"q/val_{name}"] = value
    return metrics


# ----------------------------------------------------------------------------------------------------------
# ArCHer's critic (6.4, 6.5)
# ----------------------------------------------------------------------------------------------------------


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


@dataclass
class Transition:
    """(s_t, a_t, r_t, s_{t+1}, d_t) of one logged agent turn; s' is the agent's next prompt (with the reply)."""

    state: list[int]
    action: list[int]
    reward: float
    next_state: list[int] | None

    @property
    def done(self) -> bool:
        return self.next_state is None


def transitions(turns: list[LoggedTurn], gamma: float) -> list[Transition]:
    """ArCHer's transitions of logged turns: r_t = G_t - gamma G_{t+1} (0 before the last agent turn and R on it
    where the reward is terminal), done on the conversation's last turn."""
    out = []
    for convo in conversations(turns).values():
        for turn, following in zip(convo, [*convo[1:], None]):
            if following is None:
                out.append(Transition(turn.prompt_ids, turn.response_ids, turn.ret, None))
            else:
                reward = turn.ret - gamma ** (following.t - turn.t) * following.ret
                out.append(Transition(turn.prompt_ids, turn.response_ids, reward, following.prompt_ids))
    return out


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
        algos.soft_update(self.target, self.heads, tau)
        algos.soft_update(self.target_adapter, [p.detach() for p in self.features.adapter()], tau)

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


# ----------------------------------------------------------------------------------------------------------
# Logged states replayed by the referee (format gate, constrained candidates)
# ----------------------------------------------------------------------------------------------------------


def replay(episode: Episode, seat_id: str, t: int) -> tuple[Env, str]:
    """The environment as the seat saw it before its ``t``-th turn of a logged conversation, and the seat's
    role: rebuilt from the kernel and seed and stepped with the logged texts. Only the referee runs; no
    partner is asked and nothing beyond the log is played, so ``validate`` and ``action_choices`` on it are
    the state's own."""
    env = make(episode.env)
    env.reset(episode.kernel, episode.episode_seed)
    role = env.roles[int(seat_id[1:])]
    steps: dict[int, dict[str, str]] = {}
    for turn in episode.turns:
        steps.setdefault(turn.global_step, {})[env.roles[int(turn.seat_id[1:])]] = turn.text
    own = 0
    for step in sorted(steps):
        actions = steps[step]
        if role in actions:
            if own == t:
                return env, role
            own += 1
        env.step(actions)
    raise RepertoryError(f"episode {episode.episode_id} has no turn {t} of seat {seat_id}")


# ----------------------------------------------------------------------------------------------------------
# The rounds trainer
# ----------------------------------------------------------------------------------------------------------


class _Counting:
    """The partner, counting its calls; it refuses to answer while the policy improves offline."""

    def __init__(self, agent: Any, trainer: RoundsTrainer):
        self.agent, self.trainer, self.calls = agent, trainer, 0
        self.name, self.policy_id = agent.name, agent.policy_id

    def act(self, requests):
        self.trainer._online("the partner was asked")
        self.calls += 1
        return self.agent.act(requests)


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class RoundsTrainer(Trainer):
    """Batch-online rounds (see the module docstring); one iteration = one round."""

    def __init__(self, config: TrainConfig, run_dir: Path, loaded: LoadedModel | None = None):
        if config.rollout.opponent in ("self", "pool"):
            raise RepertoryError(
                f"trainer rounds deploys the policy against a partner; set rollout.opponent to a bot of "
                f"{config.rollout.env}, base or model:PATH (got {config.rollout.opponent!r})"
            )
        method = config.rounds.method
        loaded = loaded or load_model(config.model.name, config.model.device)
        critic_backbone = None
        if method in ("igrpo", "archer", "archer-lc"):
            other = config.rounds.q.model if method == "igrpo" else None
            critic_backbone = (
                copy.deepcopy(loaded.model) if other is None else load_model(other, config.model.device).model
            )
        if config.algo.kl_mode != "loss":
            raise RepertoryError("trainer rounds puts the KL to the reference in the loss; set algo.kl_mode: loss")
        if method == "mt-ppo" and config.rounds.logs:
            raise RepertoryError("mt-ppo learns from deployed conversations; rounds.logs needs another method")
        super().__init__(config, run_dir, loaded)
        if method == "mt-ppo":
            self.estimator = algos.get_estimator("gae")  # MT-PPO is token-level GAE (6.3, section 3)
        assert self.opponent is not None
        self.partner = _Counting(self.opponent, self)
        self.opponent = self.partner
        pad = self.loaded.tokenizer.pad_token_id if self.loaded.tokenizer.pad_token_id is not None else 0
        self.q: QFunction | None = None
        self.archer: ArcherCritic | None = None
        if method == "igrpo":
            self.q = QFunction(critic_backbone, config.rounds.q, config.seed, pad)
        elif critic_backbone is not None:
            lora = config.rounds.q if method == "archer-lc" else None
            self.archer = ArcherCritic(
                LastTokenFeatures(critic_backbone, lora, config.seed, pad, "archer"), config.seed
            )
            self.archer_optimizer = torch.optim.AdamW(self.archer.parameters_to_train(), lr=config.rounds.archer.lr)
        self.simulator_episodes = 0
        self.discount = config.rounds.gamma
        self.offline = False

    def needs_critic(self) -> bool:
        return self.config.rounds.method == "mt-ppo"

    def estimator_inputs(self, batch: Batch) -> list[algos.TrajectoryInput]:
        """MT-PPO's reward (6.3): the conversation's G_0 on the agent's last turn, nothing before, so that
        maximising it maximises the metric J."""
        inputs = batch.estimator_inputs()
        for traj in inputs:
            g0 = algos.discounted_returns(traj.rewards, self.config.rounds.gamma)[0] if traj.rewards else 0.0
            traj.rewards = [0.0] * (len(traj.rewards) - 1) + [g0] if traj.rewards else []
        return inputs

    # checkpoints: the policy, and the Q-function that the next round warm-starts from

    def save_state(self, directory: Path) -> None:
        super().save_state(directory)
        if self.q is not None:
            save_file(self.q.state(), str(directory / "q.safetensors"))
        if self.archer is not None:
            save_file(self.archer.state(), str(directory / "archer.safetensors"))
            torch.save(self.archer_optimizer.state_dict(), directory / "archer_optimizer.pt")

    def load_state(self, directory: Path) -> None:
        super().load_state(directory)
        if self.q is not None:
            if not (directory / "q.safetensors").is_file():
                raise RepertoryError(f"checkpoint {directory} has no Q-function (q.safetensors) to warm-start from")
            self.q.load(load_file(str(directory / "q.safetensors")))
        if self.archer is not None and (directory / "archer.safetensors").is_file():
            self.archer.load(load_file(str(directory / "archer.safetensors")))
            self.archer_optimizer.load_state_dict(torch.load(directory / "archer_optimizer.pt", weights_only=True))

    # one round

    def turns_path(self, round_index: int) -> Path:
        return self.run_dir / "rounds" / f"turns-{round_index:06d}.parquet"

    def _online(self, what: str) -> None:
        if self.offline:
            raise RuntimeError(f"{what} while the policy improves offline (algorithms.md 5.2 forbids it)")

    def evaluate(self, iteration: int) -> dict[str, Any]:
        self._online("a held-out evaluation")
        return super().evaluate(iteration)

    def deploy(self, round_index: int) -> tuple[list[LoggedTurn], list[Episode]]:
        """Round k's data: the user's logs (round 0 with ``rounds.logs``) or a deployment of pi_k."""
        self._online("a deployment")
        rounds = self.config.rounds
        if round_index == 0 and rounds.logs:
            turns, episodes = read_logs(rounds.logs, self.env, self.loaded.tokenizer, rounds.gamma)
            if episodes:  # kept with the run, so later rounds can replay them (ArCHer's buffer)
                write_episodes(self.run_dir / "episodes" / "iter-000000.parquet", episodes)
            return turns, episodes
        episodes = run_episodes(self.specs(round_index), self.config.rollout.max_concurrent)
        self.simulator_episodes += len(episodes)
        write_episodes(self.run_dir / "episodes" / f"iter-{round_index:06d}.parquet", episodes)
        return logged_turns(episodes, round_index, rounds.gamma), episodes

    def run_iteration(self, iteration: int) -> dict[str, Any]:
        config, rounds = self.config, self.config.rounds
        line: dict[str, Any] = {"iteration": iteration, "round": iteration}
        if config.eval.episodes and (iteration == 0 or (config.eval.every and iteration % config.eval.every == 0)):
            line.update(self.evaluate(iteration))
        start = time.perf_counter()
        turns, episodes = self.deploy(iteration)
        self.backend.clear_prefixes()
        if not turns:
            raise RepertoryError(f"round {iteration}: no logged agent turns with tokens to learn from")
        write_turns(self.turns_path(iteration), turns)
        line["time/deploy_s"] = time.perf_counter() - start
        if episodes and not (iteration == 0 and rounds.logs):  # a deployment's own outcome, not the logs'
            line.update(rollout_metrics(episodes))
        g0 = [first_return(convo, rounds.gamma) for convo in conversations(turns).values()]
        line["deploy/conversations"] = float(len(conversations(turns)))
        line["deploy/turns"] = float(len(turns))
        if g0:
            line["deploy/return"] = sum(g0) / len(g0)

        start = time.perf_counter()
        partner_calls = self.partner.calls
        if rounds.reference == "round":
            self.learner.freeze_reference()
        self.offline = True
        try:
            line.update(self.improve(iteration, turns, {ep.episode_id: ep for ep in episodes}))
        finally:
            self.offline = False
        if self.partner.calls != partner_calls:
            raise RuntimeError("the improvement step asked the partner")  # 5.2: improvement is offline
        self.backend.clear_prefixes()
        line["time/train_s"] = time.perf_counter() - start
        return line

    def improve(self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]) -> dict[str, float]:
        """The round's offline policy improvement with the configured method; its metrics."""
        method = self.config.rounds.method
        epochs = self.config.rounds.epochs or DEFAULT_EPOCHS[method]
        if method == "igrpo":
            return self.improve_igrpo(round_index, turns, episodes, epochs)
        if method == "st-grpo":
            return self.improve_st_grpo(round_index, turns, epochs)
        if method == "mt-sft":
            return self.improve_mt_sft(round_index, turns, epochs)
        if method == "mt-ppo":
            return self.improve_mt_ppo(round_index, list(episodes.values()), epochs)
        if method in ("archer", "archer-lc"):
            return self.improve_archer(round_index, turns, episodes)
        return self.improve_mt_kto(round_index, turns, epochs)

    def history(
        self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> tuple[list[LoggedTurn], dict[str, Episode]]:
        """Every round's logged turns and deployed conversations up to this one (read back from the run)."""
        all_turns, all_episodes = [], {}
        for k in range(round_index):
            if self.turns_path(k).is_file():
                all_turns += read_turns(self.turns_path(k), self.loaded.tokenizer, self.config.rounds.gamma)
            deployed = self.run_dir / "episodes" / f"iter-{k:06d}.parquet"
            if deployed.is_file():
                all_episodes.update({ep.episode_id: ep for ep in read_episodes(deployed)})
        return all_turns + turns, {**all_episodes, **episodes}

    def sample(
        self, states: list[LoggedTurn], episodes: dict[str, Episode], n: int, key: tuple
    ) -> tuple[list[Generation], list[tuple[Env, str] | None]]:
        """``n`` fresh responses of the live policy per logged state, sampled as deployed (constrained where the
        deployment was), and each state's replayed referee (None without its conversation)."""
        replayed = [
            replay(episodes[x.episode_id], x.seat_id, x.t) if x.episode_id in episodes else None for x in states
        ]
        prompts = [x.prompt_ids for x in states for _ in range(n)]
        seeds = [derive(self.config.seed, *key, x.episode_id, x.t, c, "sample") for x in states for c in range(n)]
        constraints = [self._constraint(state) for state in replayed for _ in range(n)]
        return self.backend.generate(prompts, self.live.params, seeds, constraints), replayed

    def improve_igrpo(
        self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode], epochs: int
    ) -> dict[str, float]:
        """Fit Q on the log, then single-turn GRPO over the logged states with Q as the reward (5.4, 5.5)."""
        assert self.q is not None
        rounds, algo = self.config.rounds, self.config.algo
        data = turns if rounds.q.data == "round" else self.history(round_index, turns, {})[0]
        q_train, q_val = kernel_split([t.kernel_id for t in data], rounds.q.val_fraction, self.config.seed)
        metrics = fit_q(
            self.q,
            q_examples([t for t in data if t.kernel_id in q_train]),
            q_examples([t for t in data if t.kernel_id in q_val]),
            rounds.q,
            self.config.seed,
            round_index,
            warm=round_index > 0,
            micro_tokens=algo.micro_batch_tokens,
        )
        n = rounds.candidates
        sums: dict[str, float] = {}
        steps = gated = candidates = 0
        rewards_all: list[float] = []
        spreads: list[float] = []
        for epoch in range(epochs):
            order = list(range(len(turns)))
            random.Random(derive(self.config.seed, round_index, epoch, "igrpo")).shuffle(order)
            for chunk in _chunks(order, rounds.states_per_step):
                states = [turns[i] for i in chunk]
                generations, replayed = self.sample(states, episodes, n, (round_index, epoch, "candidate"))
                prompts = [x.prompt_ids for x in states for _ in range(n)]
                rewards = self.q.score_groups(
                    [list(x.prompt_ids) for x in states],
                    [[g.token_ids for g in generations[j * n : (j + 1) * n]] for j in range(len(states))],
                    algo.micro_batch_tokens,
                )
                valid = [True] * len(generations)
                for j, state in enumerate(replayed):
                    if rounds.format_gate and state is not None:  # users' logs carry no game state to check
                        env, role = state
                        texts = [self.backend.decode(g.token_ids) for g in generations[j * n : (j + 1) * n]]
                        valid[j * n : (j + 1) * n] = [env.validate(role, text)[0] for text in texts]
                gated += valid.count(False)
                candidates += len(generations)
                rewards_all += rewards
                groups = [rewards[j * n : (j + 1) * n] for j in range(len(states))]
                spreads += [statistics.stdev(group) if n > 1 else 0.0 for group in groups]
                advantages = [
                    a
                    for j, group in enumerate(groups)
                    for a in algos.candidate_advantages(group, valid[j * n : (j + 1) * n], rounds.scale_advantages)
                ]
                batch, adv = single_turn_batch(prompts, [g.token_ids for g in generations], advantages)
                if not batch.sequences:
                    continue
                self.learner.score(batch)
                stats = self.learner.update(batch, adv, None, f"igrpo/{round_index}/{epoch}/{steps}", 1, 1)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps += 1
        metrics.update({key: value / steps for key, value in sums.items()} if steps else {})
        metrics["igrpo/steps"] = float(steps)
        metrics["igrpo/states"] = float(len(turns) * epochs)
        metrics["igrpo/candidate_q"] = sum(rewards_all) / len(rewards_all) if rewards_all else 0.0
        # Advantages divide by this spread: near 0, they amplify the Q-function's noise to unit scale.
        metrics["igrpo/candidate_q_std"] = sum(spreads) / len(spreads) if spreads else 0.0
        metrics["igrpo/gated_rate"] = gated / candidates if candidates else 0.0
        return metrics

    def _constraint(self, state: tuple[Env, str] | None) -> TokenTrie | None:
        """Candidates are sampled as the policy was deployed: constrained to the state's valid actions where
        ``rollout.constrained`` and the action set is finite."""
        if state is None or not self.config.rollout.constrained:
            return None
        env, role = state
        choices = env.action_choices(role)
        return self.backend.trie(choices) if choices is not None else None

    def improve_st_grpo(self, round_index: int, turns: list[LoggedTurn], epochs: int) -> dict[str, float]:
        """ST-GRPO (6.6): each logged conversation is one sample with reward G_0, grouped by kernel (and seat)."""
        convos, gamma = conversations(turns), self.config.rounds.gamma
        by_kernel: dict[str, list[Conversation]] = {}
        for key, convo in convos.items():
            by_kernel.setdefault(group_key(convo[0]), []).append(key)
        advantage: dict[Conversation, float] = {}
        for members in by_kernel.values():
            for key, a in zip(members, algos.candidate_advantages([first_return(convos[e], gamma) for e in members])):
                advantage[key] = a
        flat = [t for convo in convos.values() for t in convo]
        batch, adv = single_turn_batch(
            [t.prompt_ids for t in flat], [t.response_ids for t in flat], [advantage[conversation_of(t)] for t in flat]
        )
        self.learner.score(batch)
        mini = max(1, math.ceil(len(batch.sequences) / self.config.rounds.batch_size))
        metrics = self.learner.update(batch, adv, None, f"st-grpo/{round_index}", epochs, mini)
        metrics["st-grpo/groups"] = float(sum(len(m) >= 2 for m in by_kernel.values()))
        return metrics

    def improve_mt_sft(self, round_index: int, turns: list[LoggedTurn], epochs: int) -> dict[str, float]:
        """MT-SFT (6.1): token-mean NLL on the agent turns of the conversations at or above the G_0 quantile."""
        convos, gamma = conversations(turns), self.config.rounds.gamma
        ids = list(convos)
        cutoff, keep = algos.filtered_bc_keep(
            [first_return(convos[e], gamma) for e in ids], self.config.rounds.sft_quantile
        )
        kept = [t for e, k in zip(ids, keep) if k for t in convos[e]]
        metrics = {"sft/cutoff": cutoff, "sft/kept_conversations": float(sum(keep)), "sft/kept_turns": float(len(kept))}
        losses = []
        for epoch in range(epochs):
            order = list(range(len(kept)))
            random.Random(derive(self.config.seed, round_index, epoch, "sft")).shuffle(order)
            for chunk in _chunks(order, self.config.rounds.batch_size):
                pairs = [(kept[i].prompt_ids, kept[i].response_ids) for i in chunk]
                n_tokens = sum(len(r) for _, r in pairs)
                loss = self.learner.backward_on(pairs, lambda _, logps, n=n_tokens: -torch.cat(logps).sum() / n)
                self.learner.optimizer_step()
                losses.append(loss)
        if losses:
            metrics["loss/sft"] = sum(losses) / len(losses)
        return metrics

    def improve_mt_ppo(self, round_index: int, episodes: list[Episode], epochs: int) -> dict[str, float]:
        """MT-PPO in batch-online mode (6.3): token-level GAE with the critic (warm across rounds) on the round's
        conversations, PPO epochs with the deployed policy as the old one."""
        batch = collect(episodes, self.config.algo.packing, self.config.algo.mask_truncated)
        self.learner.score(batch)
        advantages, returns, metrics = self.advantages(batch)
        metrics.update(self.learner.update(batch, advantages, returns, f"mt-ppo/{round_index}", epochs))
        return metrics

    def improve_archer(
        self, round_index: int, turns: list[LoggedTurn], episodes: dict[str, Episode]
    ) -> dict[str, float]:
        """ArCHer (6.4, 6.5): a critic pass over the replay buffer of every round's transitions (two in round 0),
        then an actor pass over this round's states with fresh samples a_pi and A = min Q - min V."""
        assert self.archer is not None
        self.archer.cache.clear()  # features of last round's fresh samples will not be asked for again
        all_turns, all_episodes = self.history(round_index, turns, episodes)
        buffer = transitions(all_turns, self.config.rounds.gamma)
        by_state = {(tuple(t.prompt_ids)): t for t in all_turns}
        metrics: dict[str, float] = {"archer/buffer": float(len(buffer))}
        losses = []
        for critic_pass in range(2 if round_index == 0 else 1):
            order = list(range(len(buffer)))
            random.Random(derive(self.config.seed, round_index, critic_pass, "archer-critic")).shuffle(order)
            for chunk in _chunks(order, self.config.rounds.archer.batch_size):
                batch = [buffer[i] for i in chunk]
                states = [by_state[tuple(x.state)] for x in batch]
                generations, _ = self.sample(states, all_episodes, 1, (round_index, critic_pass, "archer-critic"))
                losses.append(self.critic_step(batch, [g.token_ids for g in generations]))
        metrics["loss/critic"] = sum(losses) / len(losses)
        actor_losses, advantages = [], []
        order = list(range(len(turns)))
        random.Random(derive(self.config.seed, round_index, "archer-actor")).shuffle(order)
        for chunk in _chunks(order, self.config.rounds.archer.batch_size):
            states = [turns[i] for i in chunk]
            generations, _ = self.sample(states, episodes, 1, (round_index, "archer-actor"))
            actions = [g.token_ids for g in generations]
            loss, adv = self.actor_step([x.prompt_ids for x in states], actions)
            actor_losses.append(loss)
            advantages += adv
        metrics["loss/actor"] = sum(actor_losses) / len(actor_losses)
        metrics["archer/advantage"] = sum(advantages) / len(advantages)
        return metrics

    def critic_step(self, batch: list[Transition], sampled: list[list[int]]) -> float:
        """One critic update (6.4): y_Qi = r + gamma (1 - d) Vbar_i(s'), y_Vi = Qbar_i(s, a_pi), the sum of the
        four mean squared errors, then the soft update of the target. Returns the loss."""
        assert self.archer is not None
        critic, gamma = self.archer, self.config.rounds.gamma
        with torch.no_grad():
            h_s_bar = critic.encode([x.state for x in batch], target=True)
            following = [i for i, x in enumerate(batch) if not x.done]
            v_bar = torch.zeros(2, len(batch), device=h_s_bar.device)
            if following:
                h_next = critic.encode([batch[i].next_state for i in following], target=True)
                v_bar[:, following] = torch.stack(critic.target.values(h_next))
            reward = torch.tensor([x.reward for x in batch], device=h_s_bar.device)
            done = torch.tensor([x.done for x in batch], device=h_s_bar.device)
            y_q = [algos.archer_q_target(reward, done, v_bar[i], gamma) for i in range(2)]
            h_sa_pi = critic.encode([x.state + a for x, a in zip(batch, sampled)], target=True)
            y_v = critic.target.qs(h_s_bar, h_sa_pi)
        self.archer_optimizer.zero_grad(set_to_none=True)
        total = 0.0
        # Each squared error is a mean over the batch, so micro-batches add up to the batch's gradient.
        lengths = [len(x.state) + len(x.action) for x in batch]
        for micro in token_batches(lengths, self.config.algo.micro_batch_tokens):
            h_s = critic.encode([batch[i].state for i in micro])
            h_sa = critic.encode([batch[i].state + batch[i].action for i in micro])
            q, v = critic.heads.qs(h_s, h_sa), critic.heads.values(h_s)
            loss = sum(
                ((q[k] - y_q[k][micro]) ** 2).sum() + ((v[k] - y_v[k][micro]) ** 2).sum() for k in range(2)
            ) / len(batch)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(critic.parameters_to_train(), self.config.algo.grad_clip)
        self.archer_optimizer.step()
        critic.soft_update(self.config.rounds.archer.tau)
        return total

    def actor_step(self, states: list[list[int]], actions: list[list[int]]) -> tuple[float, list[float]]:
        """One actor update (6.4): -mean_s [A * sum of log pi(a_pi | s)], A = min(Q1, Q2)(s, a_pi) - min(V1, V2)(s)
        from the online critic, detached. Returns the loss and the advantages."""
        assert self.archer is not None
        critic = self.archer
        with torch.no_grad():
            h_s = critic.encode(states)
            q1, q2 = critic.heads.qs(h_s, critic.encode([s + a for s, a in zip(states, actions)]))
            v1, v2 = critic.heads.values(h_s)
        kept = [i for i, a in enumerate(actions) if a]
        if not kept:
            return 0.0, []
        pairs = [(states[i], actions[i]) for i in kept]

        def loss_of(indices: list[int], logps: list[torch.Tensor]) -> torch.Tensor:
            sums = torch.stack([lp.sum() for lp in logps])
            rows = [kept[i] for i in indices]
            loss, _ = algos.archer_actor_loss(q1[rows], q2[rows], v1[rows], v2[rows], sums)
            return loss * (len(indices) / len(kept))

        loss = self.learner.backward_on(pairs, loss_of)
        self.learner.optimizer_step()
        advantages = (torch.minimum(q1, q2) - torch.minimum(v1, v2))[kept].tolist()
        return loss, advantages

    def improve_mt_kto(self, round_index: int, turns: list[LoggedTurn], epochs: int) -> dict[str, float]:
        """MT-KTO (6.2): conversations above their kernel's mean G_0 are desirable, below undesirable; every
        agent turn inherits its conversation's label; KTO against the round's reference."""
        rounds = self.config.rounds
        convos = conversations(turns)
        labels = algos.kto_labels(
            [group_key(c[0]) for c in convos.values()], [first_return(c, rounds.gamma) for c in convos.values()]
        )
        label_of = dict(zip(convos, labels))
        samples = [t for e, convo in convos.items() if label_of[e] is not None for t in convo]
        metrics: dict[str, float] = {"kto/desirable": 0.0, "kto/undesirable": 0.0}
        if not samples:
            metrics["kto/skipped"] = 1.0
            return metrics
        desirable = [bool(label_of[conversation_of(t)]) for t in samples]
        n_d, n_u = sum(desirable), len(desirable) - sum(desirable)
        lambda_d, lambda_u = algos.kto_lambdas(n_d, n_u)
        metrics.update({"kto/desirable": float(n_d), "kto/undesirable": float(n_u), "kto/lambda_d": lambda_d})
        metrics["kto/lambda_u"] = lambda_u
        ref = [
            float(x.sum()) for x in self.learner.token_logps([(t.prompt_ids, t.response_ids) for t in samples], True)
        ]
        losses = []
        for epoch in range(epochs):
            order = list(range(len(samples)))
            random.Random(derive(self.config.seed, round_index, epoch, "kto")).shuffle(order)
            for chunk in _chunks(order, rounds.batch_size):
                mismatched = self._kto_mismatched([samples[i] for i in chunk])
                n = len(chunk)

                def loss_of(indices: list[int], logps: list[torch.Tensor], chunk=chunk, mismatched=mismatched, n=n):
                    device = logps[0].device
                    reference = torch.tensor([ref[chunk[i]] for i in indices], device=device)
                    r = torch.stack([lp.sum() for lp in logps]) - reference
                    mask = torch.tensor([desirable[chunk[i]] for i in indices], device=device)
                    per = algos.kto_loss(r, mismatched.to(device), mask, rounds.kto_beta, lambda_d, lambda_u)
                    return per.sum() / n

                pairs = [(samples[i].prompt_ids, samples[i].response_ids) for i in chunk]
                losses.append(self.learner.backward_on(pairs, loss_of))
                self.learner.optimizer_step()
        metrics["loss/kto"] = sum(losses) / len(losses)
        return metrics

    def _kto_mismatched(self, chunk: list[LoggedTurn]) -> torch.Tensor:
        """Implied rewards of the mismatched pairs (x_i, y_{(i-1) mod n}) whose mean is KTO's reference point;
        a lone sample has none (z0 = 0)."""
        if len(chunk) < 2:
            return torch.zeros(1)
        pairs = [(chunk[i].prompt_ids, chunk[i - 1].response_ids) for i in range(len(chunk))]
        policy = self.learner.token_logps(pairs)
        reference = self.learner.token_logps(pairs, reference=True)
        return torch.tensor([float(p.sum() - r.sum()) for p, r in zip(policy, reference)])


def single_turn_batch(
    prompts: list[list[int]], responses: list[list[int]], advantages: list[float]
) -> tuple[Batch, dict[int, torch.Tensor]]:
    """One learner sample per (prompt, response), its advantage on every token. Consecutive samples with the
    same prompt (a state's candidates) share one tree sequence, so the prompt is encoded once for all of them."""
    samples = [Sample(i, 0, list(p), list(r), [], bool(r)) for i, (p, r) in enumerate(zip(prompts, responses))]
    sequences = []
    for _, group in itertools.groupby((i for i, s in enumerate(samples) if s.trained), lambda i: samples[i].prompt_ids):
        members = list(group)
        sequences.append(shared_prompt(samples[members[0]].prompt_ids, [(i, samples[i].response_ids) for i in members]))
    adv = {
        i: torch.full((len(s.response_ids),), float(a))
        for i, (s, a) in enumerate(zip(samples, advantages))
        if s.trained
    }
    return Batch([], samples, sequences), adv


# ----------------------------------------------------------------------------------------------------------
# A grid of runs and its table
# ----------------------------------------------------------------------------------------------------------


def suite_runs(suite: SuiteConfig) -> list[tuple[str, list[str]]]:
    """(run name, overrides) of every cell of the grid, environment-major."""
    out = []
    for env in suite.envs:
        for method in suite.methods:
            for seed in suite.seeds:
                name = f"{method}-{env}-s{seed}"
                overrides = [*suite.set, f"rounds.method={method}", f"rollout.env={env}", f"seed={seed}"]
                if suite.warm_start is not None:
                    overrides.append(f"model.name={suite.warm_model(env)}")
                out.append((name, [*overrides, f"output_dir={suite.output_dir}", f"name={name}"]))
    return out


def warm_start(
    suite: SuiteConfig,
    env: str,
    loaded: Callable[[], LoadedModel] | None = None,
    on_run: Callable[[str, Trainer], None] | None = None,
    on_line: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """The suite's warm start of ``env`` (see WarmStartConfig): bot-vs-bot demonstrations, one mt-sft round on
    them, the policy exported. Each step is skipped when its output exists, so an interrupted suite resumes."""
    assert suite.warm_start is not None
    model_dir = suite.warm_model(env)
    if (model_dir / "config.json").is_file():
        return model_dir
    config = load_config(suite.recipe, suite.warm_overrides(env))
    demos = suite.warm_demos(env)
    if not demos.is_file():
        cls = env_class(env)
        bots = [make_agent(config.rollout.opponent, cls) for _ in cls.roles]
        demos.parent.mkdir(parents=True, exist_ok=True)
        write_episodes(demos, run_episodes(schedule(env, bots, suite.warm_start.episodes, config.seed, "train")))
    run_dir = Path(suite.output_dir) / f"warm-{env}"
    model = loaded() if loaded is not None else None
    trainer = resume_run(run_dir, loaded=model) if (run_dir / "config.yaml").is_file() else start_run(config, model)
    if on_run is not None:
        on_run(run_dir.name, trainer)
    if trainer.iteration < trainer.config.iterations:
        trainer.fit(on_line)
    return export_policy(run_dir, model_dir, config.model.device or "cpu")


def run_suite(
    suite: SuiteConfig,
    loaded: Callable[[], LoadedModel] | None = None,
    on_run: Callable[[str, Trainer], None] | None = None,
    on_line: Callable[[dict[str, Any]], None] | None = None,
) -> ResultsTable:
    """Train every run of the grid one after the other — a finished run is skipped, an interrupted one resumed,
    so rerunning the suite continues it — then write ``table.md`` and ``table.csv`` into the output directory."""
    runs = []
    warmed: set[str] = set()
    for name, overrides in suite_runs(suite):
        run_dir = Path(suite.output_dir) / name
        env = load_config(suite.recipe, overrides).rollout.env
        if suite.warm_start is not None and env not in warmed:
            warm_start(suite, env, loaded, on_run, on_line)
            warmed.add(env)
        # Warm-started runs load their environment's exported policy, not the caller's model.
        model = loaded() if loaded is not None and suite.warm_start is None else None
        if (run_dir / "config.yaml").is_file():
            trainer = resume_run(run_dir, loaded=model)
        else:
            trainer = start_run(load_config(suite.recipe, overrides), model)
        if on_run is not None:
            on_run(name, trainer)
        if trainer.iteration < trainer.config.iterations:
            trainer.fit(on_line)
        runs.append(run_dir)
    table = results_table(runs)
    Path(suite.output_dir, "table.md").write_text(table.markdown())
    Path(suite.output_dir, "table.csv").write_text(table.csv())
    return table
