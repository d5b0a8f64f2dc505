"""Training-step benchmark without the CLI: ``python benchmarks/train.py [--episodes N] [--turns K] [--full]``.

Prints one JSON object: one optimisation step with packed turns (float32, and on a CPU with the frozen base's
products in bfloat16) and unpacked turns, each against the matmul limit of its precision at 6 x parameters FLOPs
per token (see ``repertory.bench``).
"""

import argparse
import json

from repertory.bench import TrainBenchConfig, train_benchmark
from repertory.models import load_model

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--episodes", type=int, default=2)
parser.add_argument("--turns", type=int, default=8)
parser.add_argument("--model", default="smollm2")
parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
args = parser.parse_args()
config = TrainBenchConfig(episodes=args.episodes, turns=args.turns, lora=not args.full)
print(json.dumps(train_benchmark(load_model(args.model), config), indent=2))
