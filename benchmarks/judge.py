"""The local judge's wall time over social conversations, its answer cache off (docs/results.md 34).
``python benchmarks/judge.py --requests FILE [--conversations 12] [--verdicts OUT] [--engine-args JSON]``.

The first run plays ``--conversations`` held-out social conversations (the embedded model in every seat, 10 turns
of at most 40 tokens, seed 0) and records their judge requests (episode and fine-grained) to ``--requests``; every
later run reads that file, so checkouts compared back to back (``PYTHONPATH=<checkout>/src``) judge the same
requests. Then a fresh ``LocalJudge`` on the embedded model scores them, and one JSON object is printed: wall time,
prompt tokens (all, from kept prefixes, shared within a join), forward passes. ``--verdicts`` writes the verdicts
as JSON, to check that two checkouts answer alike. ``--engine-args`` are the hf engine's (``'{"paged": false}'``:
its left-padded cache).
"""

import argparse
import json
import pickle
import time
from pathlib import Path

from repertory.eval import evaluate, evaluation_lineup
from repertory.generation import make_backend
from repertory.judges import LocalJudge
from repertory.models import load_model
from repertory.system import peak_rss_mb

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--requests", type=Path, required=True)
parser.add_argument("--conversations", type=int, default=12)
parser.add_argument("--verdicts", type=Path)
parser.add_argument("--engine-args", type=json.loads, default={})
args = parser.parse_args()


class Recorder:
    """A judge that keeps the requests it is given and scores nothing."""

    fine_grained = True

    def __init__(self):
        self.requests = []

    def score(self, requests):
        self.requests += requests
        return [None] * len(requests)


if not args.requests.exists():
    recorder = Recorder()
    agent, opponent, env = evaluation_lineup("base", "social", "self", 0, "smollm2", 40, None)
    evaluate(env, agent, args.conversations, 0, "heldout", opponent, env_options={"max_turns": 10}, judge=recorder)
    args.requests.write_bytes(pickle.dumps(recorder.requests))
requests = pickle.loads(args.requests.read_bytes())
backend = make_backend("hf", load_model("smollm2"), **args.engine_args)
judge = LocalJudge(backend, "local:smollm2", None, True)
start = time.perf_counter()
verdicts = judge.score(requests)
seconds = time.perf_counter() - start
stats = backend.stats
print(
    json.dumps(
        {
            "requests": len(requests),
            "seconds": round(seconds, 1),
            "prompt_tokens": stats.prompt_tokens,
            "reused_prompt_tokens": stats.reused_prompt_tokens,
            "shared_prompt_tokens": stats.shared_prompt_tokens,
            "encoded_prompt_tokens": stats.prompt_tokens - stats.reused_prompt_tokens - stats.shared_prompt_tokens,
            "forward_passes": stats.forward_passes,
            "peak_rss_mb": round(peak_rss_mb()),
        }
    )
)
if args.verdicts is not None:
    args.verdicts.write_text(json.dumps(verdicts))
