"""I-GRPO policy-step benchmark without the CLI: ``python benchmarks/candidates.py [--states N] [--candidates C]
[--prompt-tokens P] [--response-tokens R]``.

Prints one JSON object: the step with each state's prompt shared by its candidates (one tree sequence per
state) and with one sequence per candidate, against the float32 matmul limit (see ``repertory.bench``).
"""

import argparse
import json

from repertory.bench import CandidatesBenchConfig, candidates_benchmark
from repertory.models import load_model

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--states", type=int, default=2)
parser.add_argument("--candidates", type=int, default=4)
parser.add_argument("--prompt-tokens", type=int, default=640)
parser.add_argument("--response-tokens", type=int, default=48)
parser.add_argument("--model", default="smollm2")
args = parser.parse_args()
config = CandidatesBenchConfig(args.states, args.candidates, args.prompt_tokens, args.response_tokens)
print(json.dumps(candidates_benchmark(load_model(args.model), config), indent=2))
