"""I-GRPO's Q fit on a run's logged round, each turn read on its own against a conversation's turns read in one
pass (``models.packing.prefix_chains``): ``python benchmarks/q_fit.py RUN_DIR [--round K] [--model smollm2]``.

Fits the Q-function twice from the same initial state, as the run's I-GRPO fits it at round 0 (its ``method.q``
settings and ``algo.micro_batch_tokens``, the kernel split of its seed), and prints one JSON object per arm:
seconds, padded tokens read (and those read under gradient), the FLOP/s this implies against the faster of the
float32 and bfloat16 matmul limits measured in the same process (through the models' linear kernel), and the kept
epoch; then the speedup and the largest difference between the two fits' Q-val predictions (the same function:
only the grouping of the forward passes differs).
"""

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from repertory.config import load_config
from repertory.models import load_model
from repertory.models.linear import linear
from repertory.system import matmul_flops, peak_rss_mb
from repertory.train import heads
from repertory.train.heads import QFunction, fit_q, q_examples
from repertory.train.turns import kernel_split, read_turns

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("run", type=Path)
parser.add_argument("--round", type=int, default=0)
parser.add_argument("--model", default="smollm2")
args = parser.parse_args()
LIMIT_DTYPES = (torch.float32, torch.bfloat16)

config = load_config(str(args.run / "config.yaml"))
if config.method.kind != "igrpo":
    parser.error(f"{args.run} is a {config.method.kind} run; the Q fit is I-GRPO's")
turns_file = args.run / "rounds" / f"turns-{args.round:06d}.parquet"
if not turns_file.is_file():
    parser.error(f"{turns_file} does not exist: the run logged no round {args.round}")
loaded = load_model(args.model)
turns = read_turns(turns_file, loaded.tokenizer, config.method.gamma)
q_train, q_val = kernel_split([t.kernel_id for t in turns], config.method.q.val_fraction, config.seed)
train = q_examples([t for t in turns if t.kernel_id in q_train])
val = q_examples([t for t in turns if t.kernel_id in q_val])
# the frozen base's products run in bfloat16 where the CPU multiplies it natively (model.precision: auto)
limits = {str(dtype).removeprefix("torch."): matmul_flops(product=linear, dtype=dtype) for dtype in LIMIT_DTYPES}
limit = max(limits.values())
pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
chains = heads.prefix_chains


def alone(sequences):
    return [(s, [i]) for i, s in enumerate(sequences)]


def fit(grouping, train, val):
    """Seconds, tokens and Q-val predictions of one fit, forward passes grouped by ``grouping``."""
    heads.prefix_chains = grouping
    q = QFunction(copy.deepcopy(loaded.model), config.method.q, config.seed, pad)
    read = {"tokens": 0, "grad_tokens": 0}
    at = q.features.at

    def counted(sequences, positions):
        tokens = max(len(s.input_ids) for s in sequences) * len(sequences)
        read["tokens"] += tokens
        read["grad_tokens"] += tokens if torch.is_grad_enabled() else 0
        return at(sequences, positions)

    q.features.at = counted
    start = time.perf_counter()
    metrics = fit_q(q, train, val, config.method.q, config.seed, 0, False, config.algo.micro_batch_tokens)
    seconds = time.perf_counter() - start
    predicted = q.score([e.sequence for e in val], [e.start for e in val], config.algo.micro_batch_tokens)
    # a forward pass costs 2N FLOPs a token; a backward through the frozen base to the adapters about 2N more
    flops = 2 * loaded.n_params * (read["tokens"] + read["grad_tokens"])
    out = {"seconds": seconds, **read, "gflops": flops / seconds / 1e9, "share_of_limit": flops / seconds / limit}
    return {**out, "q/best_epoch": metrics["q/best_epoch"], "q/epochs": metrics["q/epochs"]}, predicted


fit(chains, train[:2], val[:1])  # first-call costs (allocator, autograd, kernels) out of the timings
each, each_val = fit(alone, train, val)
packed, packed_val = fit(chains, train, val)
print(
    json.dumps(
        {
            "run": str(args.run),
            "round": args.round,
            "turns": len(turns),
            "train_turns": len(train),
            "val_turns": len(val),
            "threads": torch.get_num_threads(),
            "limit_gflops": {name: flops / 1e9 for name, flops in limits.items()},
            "each_turn_alone": each,
            "conversation_chains": packed,
            "speedup": each["seconds"] / packed["seconds"],
            "token_ratio": each["tokens"] / packed["tokens"],
            "max_val_prediction_difference": max((abs(a - b) for a, b in zip(each_val, packed_val)), default=0.0),
            "peak_rss_mb": peak_rss_mb(),
        },
        indent=2,
    )
)
