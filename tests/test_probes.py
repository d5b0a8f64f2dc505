"""Suite probes (ProbesConfig): each finished run's last policy in self-play, against a partner, its closest classic
strategy and its exploiters, recorded once per run, and the arms compared paired by seed."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import tiny_checkpoint

from repertory.config import dump_config, load_config
from repertory.experiments import load_suite, probes_markdown, run_suite
from repertory.models import load_tokenizer


def _record(method: str, seed: int, selfplay: float, partner: float) -> dict:
    return {
        "run": f"{method}-ipd-s{seed}",
        "method": method,
        "env": "ipd",
        "seed": seed,
        "selfplay": {"outcome": selfplay, "se": 0.0},
        "partners": {"always-defect": {"outcome": 0.1, "se": 0.0, "partner": partner, "partner_se": 0.0}},
        "strategy": {"agreement": {"always-cooperate": 0.25, "tit-for-tat": 0.75}, "closest": "tit-for-tat"},
    }


def test_probes_markdown_pairs_the_arms_by_seed():
    records = [_record("naive", 0, 0.2, 0.9), _record("adalign", 0, 0.5, 0.6)]
    records += [_record("naive", 1, 0.4, 0.7), _record("adalign", 1, 0.6, 0.4)]
    text = probes_markdown(records, ["naive", "adalign"])
    assert "## self-play outcome, mean ± SE over seeds" in text
    assert "| naive | 0.30 ± .10 |" in text and "| adalign | 0.55 ± .05 |" in text
    # adalign - naive per seed: +0.3, +0.2 (self-play); -0.3, -0.3 (what always-defect takes)
    assert "| adalign − naive | ipd | +0.250 ± 0.050 |" in text
    assert "| adalign − naive | ipd | -0.300 ± 0.000 |" in text
    assert "## always-defect's outcome against it, mean ± SE over seeds" in text
    assert "| adalign-ipd-s1 | tit-for-tat (0.750) | — | — |" in text


def test_probes_markdown_puts_the_victims_loss_beside_the_exploiters_gain():
    exploit = {"gain": 0.28, "gain_lower_bound": 0.251, "gain_p": 0.0001, "loss": -0.072}
    records = [{**_record("adalign", 0, 0.6, 0.3), "exploit": exploit}]
    records.append({**_record("adalign", 1, 0.6, 0.3), "exploit": {**exploit, "gain": 0.2, "loss": 0.3}})
    text = probes_markdown(records, ["adalign"])
    # seed 0's exploiter learned to cooperate with a tit-for-tat victim, which gained too (a negative loss)
    assert "| adalign-ipd-s0 | tit-for-tat (0.750) | +0.280 (+0.251, p 0.000) | -0.072 |" in text
    assert "## victim loss, mean ± SE over seeds" in text and "| adalign | 0.11 ± .19 |" in text


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.mark.slow
def test_a_suite_probes_each_finished_run_once(tmp_path, tokenizer):
    model = tiny_checkpoint(tmp_path / "tiny", tokenizer, seed=6)
    recipe, grid, records = tmp_path / "online.yaml", tmp_path / "grid", tmp_path / "records"
    overrides = ["rollout.constrained=true", "rollout.kernels_per_iteration=1", "rollout.episodes_per_kernel=2",
                 "eval.episodes=2", "name=null", "iterations=1", f"model.name={model}"]  # fmt: skip
    recipe.write_text(dump_config(load_config(None, overrides)))
    suite_file = tmp_path / "suite.yaml"
    suite_file.write_text(
        f"suite: {{recipe: {recipe}, methods: [{{kind: selfplay, estimator: omar}}], envs: [ipd], seeds: [0, 1], "
        f"metric: outcome, output_dir: {grid}, records: {records}, probes: {{episodes: "
        f"4, partners: [always-defect], exploiters: [0], exploiter_iterations: 1, exploiter_set: "
        f"[rollout.kernels_per_iteration=1, rollout.constrained=true, 'model.name={model}']}}}}\n"
    )
    suite = load_suite(str(suite_file))
    run_suite(suite)
    paths = {p.stem: p for p in (records / "probes").glob("*.json")}
    assert sorted(paths) == ["omar-ipd-s0", "omar-ipd-s1"]
    record = json.loads(paths["omar-ipd-s1"].read_text())
    assert (record["method"], record["seed"]) == ("omar", 1)
    against = record["partners"]["always-defect"]
    # Against always-defect each of the policy's defections scores 1 and each cooperation 0; the defector scores
    # 1 and 5: over a 10-round game (Z = 50) the partner's outcome is 1 - 4 x the policy's, and so are the means.
    assert against["partner"] == pytest.approx(1 - 4 * against["outcome"], abs=1e-9)
    # 4 self-play games in both seats and 4 against the partner, 10 moves each
    assert record["strategy"]["moves"] == (4 * 2 + 4) * 10
    (exploiter,) = record["exploit"]["runs"]
    assert exploiter["seed"] == 0
    assert record["exploit"]["gain"] == pytest.approx(exploiter["exploiter_after"] - exploiter["exploiter_before"])
    # the exploiters trained in the output directory; the records keep small files only, no weights
    assert list((grid / "exploiters" / "omar-ipd-s1").glob("*/checkpoints/*/COMPLETE"))
    assert {p.suffix for p in records.rglob("*") if p.is_file()} <= {".json", ".jsonl", ".yaml", ".md"}
    text = (grid / "probes.md").read_text()
    assert "| omar | 0." in text and "## exploiter gain, mean ± SE over seeds" in text
    written = {name: path.stat().st_mtime_ns for name, path in paths.items()}
    run_suite(suite)  # finished runs are neither trained nor probed again
    assert {name: path.stat().st_mtime_ns for name, path in paths.items()} == written
    # Stopped while probing seed 1 (its exploiter's directory left behind, no probe record, no records yet): the
    # rerun probes it again from its checkpoint, its exploiter started afresh, and keeps its records after.
    paths["omar-ipd-s1"].unlink()
    shutil.rmtree(records / "omar-ipd-s1")
    run_suite(suite)
    again = json.loads(paths["omar-ipd-s1"].read_text())
    assert again["exploit"]["runs"][0]["seed"] == 0 and (records / "omar-ipd-s1" / "metrics.jsonl").is_file()
    assert again["partners"] == record["partners"]  # the same games: the probe is seeded
