"""Rollout benchmark without the CLI: ``python benchmarks/rollout.py [--episodes N] [--backend hf --backend vllm]``.

Prints one JSON object: each engine vs naive per-turn generate() vs the float32 matmul limit and the
memory-bandwidth roofline (see ``repertory.bench``).
"""

import argparse
import json

from repertory.bench import RolloutBenchConfig, rollout_benchmark
from repertory.models import load_model

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--env", action="append", help="environment (repeatable); default trust-and-split and ipd")
parser.add_argument("--episodes", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=48)
parser.add_argument("--model", default="smollm2")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--no-naive", action="store_true")
parser.add_argument("--backend", action="append", help="generation engine (repeatable): hf (default), vllm")
args = parser.parse_args()
config = RolloutBenchConfig(
    tuple(args.env or ("trust-and-split", "ipd")),
    args.episodes,
    args.max_new_tokens,
    args.seed,
    not args.no_naive,
    backends=tuple(args.backend or ("hf",)),
)
print(json.dumps(rollout_benchmark(load_model(args.model), config), indent=2))
