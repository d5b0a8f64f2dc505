"""Memory of the learner's update per process: data-parallel (``model.sharding: none``) against sharded (fsdp).

``python benchmarks/sharded_memory.py [--processes 2] [--shape smollm2|1.5b|7b] [--device cpu|cuda] [--set k=v]``

For each sharding it trains one iteration of full fine-tuning under torch's launcher on PROCESSES processes and
measures in every process the peak memory of the learner's phase alone (scoring, advantages and the update,
after the rollouts): resident memory on a CPU (the kernel's high-water mark, reset before the phase), allocated
device memory on a GPU, with what was held when the phase began; and the bytes of trained parameters and AdamW
moments the process holds (the ``memory/learner_state_mb`` metric). Prints one JSON object: per sharding, every
process's figures and the phase's wall seconds; then the ratios fsdp / none. Shapes: ``smollm2`` is the embedded
model with its weights; ``1.5b`` and ``7b`` are random weights of those sizes in the embedded architecture
(Qwen2.5's dimensions, SmolLM2's tokenizer), built in each process — for a GPU machine. Run it on an idle
machine: the processes share its cores.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

WORKLOAD = [
    "iterations=1",
    "model.lora.enabled=false",
    "rollout.constrained=true",
    "rollout.kernels_per_iteration=2",
    "rollout.episodes_per_kernel=2",
    "eval.episodes=0",
]

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--processes", type=int, default=2)
parser.add_argument("--shape", choices=["smollm2", "1.5b", "7b"], default="smollm2")
parser.add_argument("--device", default="cpu")
parser.add_argument("--set", dest="overrides", action="append", default=[])
parser.add_argument("--worker", help=argparse.SUPPRESS)  # the sharding one launched process measures
parser.add_argument("--out", help=argparse.SUPPRESS)
args = parser.parse_args()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # the kernel's high-water mark of resident memory


def held_mb(device: str, field: str = "VmRSS:") -> float:
    """Memory held now (``VmHWM:``: the peak since the last :func:`reset_peak`)."""
    if device.startswith("cuda"):
        return (torch.cuda.max_memory_allocated() if field == "VmHWM:" else torch.cuda.memory_allocated()) / 2**20
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith(field)) / 1024


def worker(sharding: str, out: Path) -> None:
    """One launched process: an iteration's rollouts, then the learner's phase measured."""
    from gpu import random_model  # benchmarks/gpu.py, beside this script

    from repertory.config import load_config
    from repertory.models import load_tokenizer
    from repertory.train import distributed, start_run
    from repertory.train.batch import collect

    distributed.initialise()
    device = args.device if not args.device.startswith("cuda") else f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    overrides = [*WORKLOAD, *args.overrides, f"model.sharding={sharding}", f"model.device={device}"]
    overrides += [f"output_dir={out / 'runs'}", f"name={sharding}"]
    loaded = None if args.shape == "smollm2" else random_model(load_tokenizer(), args.shape, device)
    trainer = start_run(load_config(None, overrides), loaded)
    algo = trainer.config.algo
    episodes, _ = trainer.rollouts(0)
    batch = collect(episodes, algo.packing, algo.mask_truncated)
    reset_peak(device)
    before = held_mb(device)
    start = time.perf_counter()
    trainer.learner.score(batch)
    trainer.method.credit(batch, algo)
    update = trainer.learner.update(batch, 0)
    figures = {
        "learner_phase_s": time.perf_counter() - start,
        "held_before_mb": before,
        "learner_phase_peak_mb": held_mb(device, "VmHWM:"),
        "learner_state_mb": update["memory/learner_state_mb"],
        "trained_tokens": batch.n_tokens,
    }
    (out / f"{sharding}-{distributed.rank()}.json").write_text(json.dumps(figures))
    distributed.barrier()


def launch(sharding: str, out: Path) -> list[dict]:
    """Every process's figures for ``sharding``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.processes}"]
    argv = [*launcher, __file__, "--worker", sharding, "--out", str(out), "--processes", str(args.processes)]
    argv += ["--shape", args.shape, "--device", args.device, *[f"--set={x}" for x in args.overrides]]
    threads = max(1, (os.cpu_count() or 1) // args.processes) if args.device == "cpu" else 4
    subprocess.run(argv, check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return [json.loads((out / f"{sharding}-{rank}.json").read_text()) for rank in range(args.processes)]


if args.worker:
    worker(args.worker, Path(args.out))
else:
    with tempfile.TemporaryDirectory() as root:
        results = {sharding: launch(sharding, Path(root)) for sharding in ("none", "fsdp")}
    ratios = {
        key: max(x[key] for x in results["fsdp"]) / max(x[key] for x in results["none"])
        for key in ("learner_phase_s", "learner_phase_peak_mb", "learner_state_mb")
    }
    print(json.dumps({"processes": args.processes, "shape": args.shape, **results, "fsdp_over_none": ratios}, indent=1))
