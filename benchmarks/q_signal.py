"""Does a linear Q head on the model's features rank the logged returns of I-GRPO runs?
``python benchmarks/q_signal.py RUN_DIR [RUN_DIR ...] [--model smollm2] [--head-lr 1e-3] [--epochs 2]``.

Reads every ``rounds/turns-K.parquet`` of the runs, encodes each turn's [prompt; response] once with the frozen
model, and prints one JSON object:

- ``rounds``: the head alone fitted on one logged round as ``fit_q`` starts it (w = 0, b = logit of the mean
  return, AdamW, batches of 16, gradient norm clipped at 1, BCE), on raw and on standardised last-token features;
  its training loss after each epoch and the rank correlation of its predictions with the returns of the
  *other* runs' turns (a run never predicts its own kernels).
- ``pooled``: ridge regression on all turns, 5 folds by kernel, for the last token's features and the mean over
  the response's tokens: how much of the return a linear head could read at this amount of data.

No LoRA: the Q backbone's adapter gets no gradient before the head moves off 0, so the head's first steps are
what this measures (docs/results.md 22).
"""

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch

from repertory.algos import offline
from repertory.models import load_model
from repertory.stats import rank_correlation
from repertory.train.heads import standard_scale
from repertory.train.turns import read_turns

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("runs", nargs="+", type=Path)
parser.add_argument("--model", default="smollm2")
parser.add_argument("--head-lr", type=float, default=1e-3)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--gamma", type=float, default=0.95)
args = parser.parse_args()
if len(args.runs) < 2:
    parser.error("give at least two runs: each round's head is scored on the other runs' turns")


@torch.no_grad()
def encode(model, turns) -> tuple[torch.Tensor, torch.Tensor]:
    """(last-token features, response-mean features), one row per turn."""
    decoder = model.get_decoder()
    last, mean = [], []
    for turn in turns:
        ids = list(turn.prompt_ids) + list(turn.response_ids)
        hidden = decoder(input_ids=torch.tensor([ids])).last_hidden_state[0].float()
        last.append(hidden[-1])
        mean.append(hidden[len(turn.prompt_ids) :].mean(dim=0))
    return torch.stack(last), torch.stack(mean)


def fit_head(x: torch.Tensor, y: torch.Tensor, test: torch.Tensor, standardise: bool) -> tuple[list[float], list]:
    """Training loss at epochs 0..E and the predictions on ``test``."""
    if standardise:
        shift, scale = standard_scale(x)
        x, test = (x - shift) / scale, (test - shift) / scale
    head = torch.nn.Linear(x.shape[1], 1)
    torch.nn.init.zeros_(head.weight)
    head.bias.data.fill_(offline.q_head_init_bias(float(y.mean()), True))
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.head_lr)
    order = list(range(len(x)))

    def loss() -> float:
        with torch.no_grad():
            return float(offline.q_loss(head(x).squeeze(-1), y, True))

    losses = [loss()]
    for epoch in range(args.epochs):
        random.Random(epoch).shuffle(order)
        for start in range(0, len(order), 16):
            batch = order[start : start + 16]
            optimizer.zero_grad()
            offline.q_loss(head(x[batch]).squeeze(-1), y[batch], True).backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
        losses.append(loss())
    with torch.no_grad():
        return losses, torch.sigmoid(head(test).squeeze(-1)).tolist()


def ridge_cv(x: np.ndarray, y: np.ndarray, kernels: list[str], l2: float) -> float | None:
    """Rank correlation of 5-fold (by kernel) ridge predictions on standardised features with the returns."""
    names = sorted(set(kernels))
    random.Random(0).shuffle(names)
    fold = {k: i % 5 for i, k in enumerate(names)}
    predicted = np.zeros(len(y))
    for f in range(5):
        test = np.array([fold[k] == f for k in kernels])
        shift, scale = (v.numpy() for v in standard_scale(torch.from_numpy(x[~test])))
        a, b = (x[~test] - shift) / scale, (x[test] - shift) / scale
        w = np.linalg.solve(a.T @ a + l2 * np.eye(a.shape[1]), a.T @ (y[~test] - y[~test].mean()))
        predicted[test] = b @ w + y[~test].mean()
    return rank_correlation(predicted.tolist(), y.tolist())


loaded = load_model(args.model, "cpu")
turns, origin = [], []
for run in args.runs:
    for path in sorted((run / "rounds").glob("turns-*.parquet")):
        logged = read_turns(path, loaded.tokenizer, args.gamma)
        turns += logged
        origin += [(run.name, path.stem)] * len(logged)
last, mean = encode(loaded.model, turns)
returns = torch.tensor([t.ret for t in turns])
rounds = []
for source in sorted(set(origin)):
    train = [i for i, o in enumerate(origin) if o == source]
    test = [i for i, o in enumerate(origin) if o[0] != source[0]]
    row = {"run": source[0], "round": source[1], "turns": len(train)}
    for name, standardise in (("raw", False), ("standardised", True)):
        losses, predicted = fit_head(last[train], returns[train], last[test], standardise)
        rho = rank_correlation(predicted, returns[test].tolist())
        row[name] = {
            "loss_by_epoch": [round(v, 4) for v in losses],
            "other_runs_spearman": None if rho is None else round(rho, 3),
            "prediction_sd": round(float(np.std(predicted)), 4),
        }
    rounds.append(row)
kernels = [t.kernel_id for t in turns]
y = returns.numpy()
pooled = {
    "turns": len(turns),
    "kernels": len(set(kernels)),
    "return_mean": round(float(y.mean()), 4),
    "return_sd": round(float(y.std()), 4),
}
for name, features in (("last_token", last), ("response_mean", mean)):
    rhos = {str(l2): ridge_cv(features.numpy(), y, kernels, l2) for l2 in (1.0, 10.0, 100.0, 1000.0)}
    pooled[f"{name}_ridge_cv_spearman"] = {l2: None if rho is None else round(rho, 3) for l2, rho in rhos.items()}
summary = {
    kind: {
        "rounds_whose_loss_rose_at_epoch_1": sum(
            r[kind]["loss_by_epoch"][1] > r[kind]["loss_by_epoch"][0] for r in rounds
        ),
        "mean_other_runs_spearman": round(
            sum(r[kind]["other_runs_spearman"] or 0.0 for r in rounds) / max(1, len(rounds)), 3
        ),
        "mean_prediction_sd": round(sum(r[kind]["prediction_sd"] for r in rounds) / max(1, len(rounds)), 4),
    }
    for kind in ("raw", "standardised")
}
print(json.dumps({"summary": summary, "rounds": rounds, "pooled": pooled}, indent=2))
