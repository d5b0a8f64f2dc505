"""Rollout benchmark without the CLI: ``python benchmarks/rollout.py [--episodes N] [--max-new-tokens T]``.

Prints one JSON object: ours vs naive per-turn generate() vs the float32 matmul limit (see
``repertory.bench``).
"""

import argparse
import json

from repertory.agents.lm import shared_backend
from repertory.bench import RolloutBenchConfig, rollout_benchmark

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--env", action="append", help="environment (repeatable); default trust-and-split and ipd")
parser.add_argument("--episodes", type=int, default=4)
parser.add_argument("--max-new-tokens", type=int, default=48)
parser.add_argument("--model", default="smollm2")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--no-naive", action="store_true")
args = parser.parse_args()
config = RolloutBenchConfig(
    tuple(args.env or ("trust-and-split", "ipd")), args.episodes, args.max_new_tokens, args.seed, not args.no_naive
)
print(json.dumps(rollout_benchmark(shared_backend(args.model), config), indent=2))
