"""The three kernel splits: train, held-out and validation are disjoint in every game, the validation files
regenerate byte for byte without moving a train or held-out kernel, and every way of naming a split accepts
validation and refuses junk in one line."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from repertory.config import load_config
from repertory.envs import env_class, env_names, load_kernels
from repertory.envs.kernels import generate_kernels, kernel_file_text, shipped_file, splits_of
from repertory.types import SPLITS, RepertoryError, canonical_json

GAMES = [name for name in env_names() if name != "social"]


def test_the_splits_are_generated_train_then_heldout_then_validation():
    assert SPLITS == ("train", "heldout", "validation")
    assert len(GAMES) == 10 and splits_of(env_class("social")) == ("train", "heldout")


@pytest.mark.parametrize("name", GAMES)
def test_every_game_ships_three_disjoint_splits_of_100(name):
    cls = env_class(name)
    splits = {split: load_kernels(name, split) for split in SPLITS}
    for split, kernels in splits.items():
        assert [k.id for k in kernels] == [f"{name}/{split}/{i:03d}" for i in range(100)]
    every = [k for kernels in splits.values() for k in kernels]
    assert len({k.seed for k in every}) == 300
    contents = {split: {canonical_json(k.data) for k in kernels} for split, kernels in splits.items()}
    if cls.unique_kernels:
        assert [len(c) for c in contents.values()] == [100, 100, 100]
        assert not contents["validation"] & (contents["train"] | contents["heldout"])
        assert not contents["train"] & contents["heldout"]
    else:  # IPD: every kernel is the same 10-round game; the splits differ in ids and seeds only
        assert name == "ipd" and len(set.union(*contents.values())) == 1


@pytest.mark.parametrize("name", GAMES)
def test_the_shipped_files_are_the_generation_and_validation_moved_nothing(name):
    cls = env_class(name)
    generated = generate_kernels(cls)
    for split in SPLITS:
        assert shipped_file(name, split).read_text(encoding="utf-8") == kernel_file_text(generated[split]), split
    # the splits before validation come out the same when it is not generated at all
    assert generate_kernels(cls, splits=("train", "heldout")) == {s: generated[s] for s in ("train", "heldout")}


@pytest.mark.parametrize("options", [None, {"reward": "verifiable"}])
def test_a_junk_split_is_refused_naming_the_splits(options):
    with pytest.raises(RepertoryError, match="unknown split 'dev'; use one of train, heldout, validation"):
        load_kernels("social", "dev", options)


def test_the_config_takes_the_validation_split_and_refuses_junk():
    assert load_config(None, ["eval.split=validation"]).eval.split == "validation"
    assert load_config(None, []).eval.validation is True
    with pytest.raises(RepertoryError, match="eval.split: Input should be 'train', 'heldout' or 'validation'"):
        load_config(None, ["eval.split=dev"])


def test_the_command_line_plays_validation_kernels_and_refuses_junk(capsys):
    code, out, _ = run_cli(capsys, "play", "ultimatum", "-a", "bot,bot", "-n", "2", "--split", "validation", "--json")
    assert code == 0
    assert [json.loads(line)["kernel"][:21] for line in out.splitlines()] == ["ultimatum/validation/"] * 2
    code, _, err = run_cli(capsys, "tournament", "-e", "ipd", "-n", "1", "--split", "dev")
    assert code == 2 and "unknown split 'dev'; use one of train, heldout, validation" in err
    code, _, err = run_cli(capsys, "play", "social", "-a", "agreeable,agreeable", "--split", "validation")
    assert code == 2 and "social has no validation kernels" in err
