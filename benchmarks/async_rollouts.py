"""Synchronous against asynchronous rollouts (``rollout.max_staleness``) on the same samples.
``python benchmarks/async_rollouts.py [RECIPE] [--staleness 0 1] [--set key=value ...]``.

Trains RECIPE (default: the default recipe on Deal or No Deal with constrained answers, whose episodes end
at different rounds) once per staleness, one after the other in fresh run directories without evaluation,
and prints one JSON object: per staleness, the wall seconds of every iteration (from the loop's own
callback), the rollout, learner and waiting seconds the metrics report, and two ratios for the iterations
after the first (the first has nothing to overlap): the wall against the synchronous run's, and against
the perfect overlap measured in the same run (each iteration as long as the longer of its rollout and its
learner step). Run it on an idle machine: a second process on the cores is what the overlap competes with.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from repertory.config import load_config
from repertory.system import peak_rss_mb
from repertory.train import start_run

WORKLOAD = [
    "rollout.env=deal-or-no-deal",
    "rollout.constrained=true",
    "rollout.max_new_tokens=48",
    "iterations=5",
    "eval.episodes=0",
]

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("recipe", nargs="?", default=None)
parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
parser.add_argument("--set", dest="overrides", action="append", default=[])
args = parser.parse_args()


def measure(staleness: int, root: Path) -> dict:
    config = load_config(
        args.recipe,
        [*WORKLOAD, *args.overrides, f"output_dir={root}", f"name=s{staleness}", f"rollout.max_staleness={staleness}"],
    )
    trainer = start_run(config)
    walls: list[float] = []
    last = time.perf_counter()

    def tick(line: dict) -> None:
        nonlocal last
        now = time.perf_counter()
        walls.append(now - last)
        last = now

    run_dir = trainer.fit(tick)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = slice(1, None)
    overlap = [max(x["time/rollout_s"], x["time/train_s"]) for x in lines]
    return {
        "wall_s": walls,
        "rollout_s": [x["time/rollout_s"] for x in lines],
        "train_s": [x["time/train_s"] for x in lines],
        "wait_s": [x.get("time/rollout_wait_s", x["time/rollout_s"]) for x in lines],
        "staleness": [x.get("async/staleness", 0.0) for x in lines],
        "samples": [int(x["samples"]) for x in lines],
        "later_wall_s": sum(walls[later]),
        "later_perfect_overlap_s": sum(overlap[later]),
        "outcome": [x["outcome"] for x in lines],
    }


with tempfile.TemporaryDirectory() as tmp:
    results = {k: measure(k, Path(tmp)) for k in args.staleness}
base = results[args.staleness[0]]["later_wall_s"]
for result in results.values():
    result["wall_vs_first"] = result["later_wall_s"] / base
    result["wall_vs_perfect_overlap"] = result["later_wall_s"] / result["later_perfect_overlap_s"]
print(json.dumps({"staleness": results, "peak_rss_mb": peak_rss_mb()}, indent=1))
