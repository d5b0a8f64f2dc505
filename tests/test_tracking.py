"""Trackers: every metrics line, the config and the report reach TensorBoard and W&B (offline), and a resumed run
continues the same history."""

from __future__ import annotations

import json
import struct
import time
from collections import Counter

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from repertory.config import load_config
from repertory.models import load_tokenizer, tiny_model
from repertory.tracking import numeric
from repertory.train import resume_run, start_run
from repertory.types import RepertoryError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _config(tmp_path, name, *extra):
    return load_config(
        None,
        [
            f"output_dir={tmp_path}",
            f"name={name}",
            "iterations=2",
            "rollout.constrained=true",
            "rollout.kernels_per_iteration=1",
            "rollout.episodes_per_kernel=2",
            "eval.episodes=2",
            *extra,
        ],
    )


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _scalars(run_dir):
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_tensorboard_and_wandb_receive_every_metric_the_config_and_the_report(tmp_path, tokenizer, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = _config(tmp_path, "tracked", "tracking=[jsonl,tensorboard,wandb]")
    run_dir = start_run(config, tiny_model(tokenizer, seed=1)).fit()
    lines = _lines(run_dir)
    events = _scalars(run_dir)
    tags = events.Tags()
    assert set(tags["scalars"]) == {k for line in lines for k in numeric(line)}
    for key in ("outcome", "loss/policy", "eval/outcome", "final/outcome", "kl"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        assert logged == [(line["iteration"], pytest.approx(line[key])) for line in lines if key in line]
    assert "config/text_summary" in tags["tensors"]
    assert any(tag.startswith("report/") for tag in tags["tensors"])  # the page's path
    assert {"report/outcome", "report/losses"} <= set(tags["images"])

    [offline] = list((run_dir / "wandb").glob("offline-run-*"))
    assert (run_dir / "wandb-run-id").read_text().strip() in offline.name
    [log] = list(offline.glob("run-*.wandb"))
    records = _wandb_records_when_written(log)
    kinds = Counter(r.WhichOneof("record_type") for r in records)
    # a failure here names what the log held, to tell a record W&B lost from one this parser missed
    assert kinds["run"] == 1, f"{log.stat().st_size} bytes, records {dict(kinds)}"
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    saved = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert saved["tracking"] == ["jsonl", "tensorboard", "wandb"] and saved["rollout"]["env"] == "ipd"
    rows = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(row["_step"], row["outcome"]) for row in rows] == [(line["iteration"], line["outcome"]) for line in lines]
    assert rows[-1]["final/outcome"] == pytest.approx(lines[-1]["final/outcome"])
    assert rows[-1]["report/page/_type"] == "html-file" and rows[-1]["report/outcome/_type"] == "image-file"


def _wandb_records_when_written(path, wait_s=30.0):
    """The log's records once W&B's service process has written its exit record: ``run.finish()`` can return
    before the service flushes (seen under load: the 7-byte header alone, the whole log 30 ms later)."""
    deadline = time.monotonic() + wait_s
    records = _wandb_records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.1)
        records = _wandb_records(path)
    return records


def _wandb_records(path):
    """The records of a W&B offline run file: a LevelDB-style log (7-byte file header, 32 KiB blocks, each record
    split into chunks with a 7-byte header: CRC-32, length, kind 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos < len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


class _Stop(Exception):
    pass


def test_a_resumed_run_continues_one_tensorboard_history(tmp_path, tokenizer):
    config = _config(tmp_path, "resumed", "iterations=3", "tracking=[tensorboard]")
    trainer = start_run(config, tiny_model(tokenizer, seed=1))

    def stop_after_two(line):
        if line["iteration"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        trainer.fit(stop_after_two)
    resumed = resume_run(trainer.run_dir, loaded=tiny_model(tokenizer, seed=1))
    assert resumed.iteration == 2
    resumed.fit()
    events = _scalars(trainer.run_dir)
    assert [e.step for e in events.Scalars("outcome")] == [0, 1, 2]
    assert len(events.Tensors("config/text_summary")) == 1  # logged by the first session only
    assert [e.step for e in events.Images("report/outcome")] == [3]  # once, after the last iteration
    assert [e.value for e in _scalars(trainer.run_dir).Scalars("outcome")] == pytest.approx(
        [line["outcome"] for line in _lines(trainer.run_dir)]
    )


def test_an_unknown_tracker_is_a_clear_error(tmp_path):
    with pytest.raises(RepertoryError, match="tracking.0.*'jsonl', 'tensorboard' or 'wandb'"):
        _config(tmp_path, "bad", "tracking=[mlflow]")
