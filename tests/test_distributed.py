"""Data-parallel training (``repertory train --gpus N``) on two CPU processes over Gloo: the same episodes,
metrics and trained adapter as one process, and only process 0 writes the run directory."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_checkpoint
from safetensors.torch import load_file

from repertory.config import LoraConfig
from repertory.models import load_model, load_tokenizer, save_checkpoint, tiny_model, weights
from repertory.runs import RunDir
from repertory.store import read_episodes
from repertory.train import TIMING_PREFIXES
from repertory.train.heads import with_lora

pytestmark = pytest.mark.slow


def _train(tmp_path, model, name, *extra):
    argv = [sys.executable, "-m", "repertory", "train", "--quiet"]
    for key in (
        f"output_dir={tmp_path}",
        f"name={name}",
        f"model.name={model}",
        "iterations=2",
        "rollout.constrained=true",
        "rollout.kernels_per_iteration=2",
        "rollout.episodes_per_kernel=2",
        "eval.episodes=2",
        "algo.lr=1e-2",
        "algo.mini_batches=1",
        "algo.micro_batch_tokens=256",  # several micro-batches per step, shared between the processes
        "model.precision=float32",  # the exact path: bfloat16 rounds differently as the batch is split
    ):
        argv += ["--set", key]
    argv += extra  # after the defaults, so that an extra --set wins
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(tmp_path.glob(f"{name}*"))
    assert len(runs) == 1, runs
    return runs[0], done.stdout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model every run of the module trains."""
    return tiny_checkpoint(tmp_path_factory.mktemp("model") / "m", load_tokenizer(), seed=2)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, tiny):
    """The reference: the tiny model's two-iteration LoRA run on one process."""
    return _train(tmp_path_factory.mktemp("one"), tiny, "one")[0]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, tiny):
    """The same LoRA run with the learner sharded over two processes, and what it printed."""
    return _train(tmp_path_factory.mktemp("sharded"), tiny, "straight", "--set", "model.sharding=fsdp", "--gpus", "2")


def test_two_processes_train_what_one_process_trains(tmp_path, tiny, one_process_run):
    one = one_process_run
    two, shown = _train(tmp_path, tiny, "two", "--gpus", "2")
    assert shown.count("run: ") == 1  # process 0 speaks for both
    for iteration in range(2):
        a = read_episodes(one / "episodes" / f"iter-{iteration:06d}.parquet")
        b = read_episodes(two / "episodes" / f"iter-{iteration:06d}.parquet")
        assert [t.response_ids for ep in a for t in ep.turns] == [t.response_ids for ep in b for t in ep.turns]
    lines = [[json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] for run in (one, two)]
    assert [line["iteration"] for line in lines[1]] == [0, 1]
    for x, y in zip(*lines):
        assert x.keys() == y.keys()
        for key in x:
            if not key.startswith(TIMING_PREFIXES):
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    files = [RunDir(run).complete_checkpoints()[-1] / "policy" / "adapter_model.safetensors" for run in (one, two)]
    adapters = [load_file(str(f)) for f in files]
    assert adapters[0].keys() == adapters[1].keys()
    moved = max(float(adapters[0][k].abs().max()) for k in adapters[0] if "lora_B" in k)
    assert moved > 1e-4  # the policy did learn, so equal adapters mean equal updates
    # Summing in another order changes gradients in the last bits; AdamW turns a coordinate's tiny gradient into
    # a step of about lr either way, so the adapters agree to 1% of one step (lr 1e-2) nearly everywhere, not bit
    # for bit; a rare coordinate whose gradient is near zero moves further (1.7e-4 on one of 2,048 with oneDNN).
    for k in adapters[0]:
        gap = (adapters[0][k] - adapters[1][k]).abs()
        assert float(gap.max()) < 5e-4 and float((gap > 1e-4).float().mean()) < 1e-3, k


# the sharded learner (model.sharding fsdp)


def _tensors(run, name, checkpoint=-1):
    return load_file(str(RunDir(run).complete_checkpoints()[checkpoint] / "policy" / name))


def _same_lines(a, b, unshared=()):
    """Equal metrics lines; keys with an ``unshared`` prefix may be in one line only."""
    lines = [[json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] for run in (a, b)]
    assert len(lines[0]) == len(lines[1])
    for x, y in zip(*lines):
        assert {k for k in x if not k.startswith(unshared)} == {k for k in y if not k.startswith(unshared)}
        for key in x.keys() & y.keys():
            if not key.startswith(TIMING_PREFIXES):
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


def _close(a, b, tolerance):
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).abs().max()) < tolerance, k


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_sharded_learner_on_two_processes_trains_what_one_process_trains(
    tmp_path, tiny, one_process_run, sharded_run, lora
):
    if lora:  # the module's runs are these two
        one, (two, shown) = one_process_run, sharded_run
    else:
        extra = ["--set", "model.lora.enabled=false"]
        one, _ = _train(tmp_path, tiny, "one", *extra)
        two, shown = _train(tmp_path, tiny, "two", *extra, "--set", "model.sharding=fsdp", "--gpus", "2")
    assert shown.count("run: ") == 1
    _same_lines(one, two)
    name = "adapter_model.safetensors" if lora else "model.safetensors"
    plain, sharded = _tensors(one, name), _tensors(two, name)
    initial = load_file(str(tiny / "model.safetensors"))
    moved = max(float((plain[k] - initial.get(k, 0 * plain[k])).abs().max()) for k in plain if "lora_A" not in k)
    assert moved > 1e-3  # the policy learned (lr 1e-2): the agreement below is of real updates
    _close(plain, sharded, 5e-4)  # as data-parallel training: summation order, amplified by AdamW (see above)
    shards = RunDir(two).complete_checkpoints()[-1] / "optimizer"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_sharded_checkpoint_resumes_on_another_process_count(tmp_path, tiny, sharded_run, before, after):
    straight, _ = sharded_run
    fsdp = ["--set", "model.sharding=fsdp"]
    half, _ = _train(tmp_path, tiny, "half", *fsdp, "--gpus", str(before), "--set", "iterations=1")
    argv = [sys.executable, "-m", "repertory", "train", "--quiet", "--resume", str(half), "--set", "iterations=2"]
    argv += ["--gpus", str(after)]
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first, last = RunDir(half).complete_checkpoints()
    assert json.loads((first / "trainer_state.json").read_text())["iterations_done"] == 1
    _same_lines(straight, half, unshared=("final/",))  # the first run's iteration 0 was its last
    # the weights and the AdamW moments came back from the other layout: the resumed second update equals the
    # uninterrupted one: to float rounding when the first update ran on the same two processes (which pins the
    # moments), to the data-parallel tolerance when it ran on one (another summation order, amplified by AdamW)
    tolerance = 1e-6 if before == 2 else 5e-4
    _close(_tensors(straight, "adapter_model.safetensors"), _tensors(half, "adapter_model.safetensors"), tolerance)
    shards = [sorted(p.name for p in (c / "optimizer").glob("*.distcp")) for c in (first, last)]
    assert shards == [[f"__{r}_0.distcp" for r in range(n)] for n in (before, after)]


GATHERED_SCRIPT = """
import sys
import torch
from torch.distributed.tensor import DTensor
from repertory.config import LoraConfig
from repertory.models import load_model, weights
from repertory.train import distributed
from repertory.train.heads import with_lora
from repertory.train.sharding import Scorer, Sharded

distributed.initialise()
model = with_lora(load_model(sys.argv[1], "cpu").model, LoraConfig(r=4), seed=0)
sharded = Sharded([Scorer(model)])
sharded.gather()
read = weights(model)
assert not any(isinstance(t, DTensor) for t in read.values()), "weights() read shards"
assert not any(isinstance(p, DTensor) for p in model.parameters()), "weights() resharded the model"
torch.save({k: v.clone() for k, v in read.items()}, f"{sys.argv[2]}/{distributed.rank()}.pt")
sharded.shard()
assert isinstance(next(iter(model.state_dict().values())), DTensor)  # why a sync must not call state_dict()
"""


def test_a_gathered_sharded_model_hands_a_weight_sync_its_full_weights(tmp_path):
    """A weight sync (vLLM's) reads the gathered weights of the sharded learner on every process: the full
    tensors of an unsharded model, and the layers stay gathered for sampling."""
    model = tiny_checkpoint(tmp_path / "m", load_tokenizer(), seed=2)
    script = tmp_path / "gathered.py"
    script.write_text(GATHERED_SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = subprocess.run(
        [*argv, str(model), str(tmp_path)], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    plain = weights(with_lora(load_model(str(model), "cpu").model, LoraConfig(r=4), seed=0))
    for rank in (0, 1):
        read = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        assert read.keys() == plain.keys()
        assert all(torch.equal(read[k], plain[k]) for k in plain), rank


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test does)")
@pytest.mark.parametrize(
    "extra",
    [[], ["--set", "model.sharding=fsdp", "--set", "model.lora.enabled=false"]],
    ids=["data-parallel-lora", "fsdp-full"],
)
def test_every_process_samples_the_learners_weights_on_its_own_vllm_engine(tmp_path, extra):
    """Each process of ``--gpus 2`` runs a vLLM engine of its own beside the learner, and after an update it
    samples the weights the learner holds: the log-probs it records are the learner's (under fsdp, read from the
    gathered layers; full fine-tuning rebuilds the CPU engine from them). vLLM's CPU kernels want heads of 32."""
    tokenizer = load_tokenizer()
    model = save_checkpoint(tiny_model(tokenizer, hidden=128, seed=2).model, tokenizer, tmp_path / "m")
    run, _ = _train(tmp_path, model, "vllm", "--gpus", "2", "--set", "rollout.backend=vllm", *extra)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["iteration"] for line in lines] == [0, 1]
    assert lines[1]["kl"] > 1e-3  # the second iteration was sampled after a real update
    assert all(line["offpolicy/max_gap"] < 1e-4 for line in lines)
    assert "final/outcome" in lines[-1]
