"""The run directory: one class spells every path, names runs after their method, resumes cleanly."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from repertory.config import dump_config, load_config, recipe_name
from repertory.runs import RunDir, load_run_config, new_run_dir, resolve_checkpoint
from repertory.system import PACKAGE, machine, source_commit
from repertory.types import RepertoryError


def test_paths_are_spelled_once(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run.config == tmp_path / "r" / "config.yaml"
    assert run.metrics == tmp_path / "r" / "metrics.jsonl"
    assert run.sessions == tmp_path / "r" / "sessions.jsonl"
    assert run.episodes(3) == tmp_path / "r" / "episodes" / "iter-000003.parquet"
    assert run.credit(12) == tmp_path / "r" / "credit" / "iter-000012.parquet"
    assert run.turns(1) == tmp_path / "r" / "rounds" / "turns-000001.parquet"
    assert run.snapshot(20) == tmp_path / "r" / "snapshots" / "000020.safetensors"
    assert run.checkpoint(7) == tmp_path / "r" / "checkpoints" / "000007"
    assert run.page == tmp_path / "r" / "report" / "index.html"
    assert run.served == tmp_path / "r" / "served"
    assert Path(run) == tmp_path / "r" and str(run) == str(tmp_path / "r") and RunDir(run) == run


def test_numbered_files_are_read_by_number(tmp_path):
    run = RunDir(tmp_path)
    for k in (10, 2, 0):
        run.episodes(k).parent.mkdir(exist_ok=True)
        run.episodes(k).write_bytes(b"")
        run.snapshot(k).parent.mkdir(exist_ok=True)
        run.snapshot(k).write_bytes(b"")
    (tmp_path / "episodes" / "iter-notes.parquet").write_bytes(b"")
    (tmp_path / "snapshots" / ".tmp-000011.safetensors-99").write_bytes(b"")
    assert run.iteration_files("episodes") == [run.episodes(0), run.episodes(2), run.episodes(10)]
    assert run.snapshots() == [0, 2, 10]
    assert RunDir(tmp_path / "absent").snapshots() == [] and RunDir(tmp_path / "absent").iteration_files("credit") == []


def test_truncate_after_keeps_what_the_checkpoint_covers(tmp_path):
    run = RunDir(tmp_path)
    run.create("seed: 0\n")
    for k in range(3):
        run.episodes(k).write_bytes(b"e")
        run.credit(k).parent.mkdir(exist_ok=True)
        run.credit(k).write_bytes(b"c")
    run.metrics.write_text("".join(json.dumps({"iteration": k}) + "\n" for k in range(3)) + '{"iteration": 3, "tor')
    run.checkpoints_dir.mkdir()
    (run.checkpoints_dir / ".tmp-000002-123").mkdir()
    run.truncate_after(2)
    assert run.iteration_files("episodes") == [run.episodes(0), run.episodes(1)]
    assert run.iteration_files("credit") == [run.credit(0), run.credit(1)]
    assert [json.loads(x)["iteration"] for x in run.metrics.read_text().splitlines()] == [0, 1]
    assert not list(run.checkpoints_dir.iterdir())


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    run = RunDir(tmp_path)
    for done in (1, 2, 3):
        run.write_checkpoint(done, lambda d, done=done: (d / "state.txt").write_text(str(done)), keep=2)
    (run.checkpoints_dir / "000004").mkdir()  # a checkpoint killed before COMPLETE
    assert [c.name for c in run.complete_checkpoints()] == ["000002", "000003"]
    run.create("iterations: 3\n")
    checkpoint, config = resolve_checkpoint(run.root)
    assert checkpoint == run.checkpoint(3) and (checkpoint / "state.txt").read_text() == "3"
    assert config.iterations == 3
    assert resolve_checkpoint(run.checkpoint(2))[0] == run.checkpoint(2)


def test_existing_refuses_a_folder_without_config(tmp_path):
    with pytest.raises(RepertoryError, match=r"^\S+ is not a run directory \(no config.yaml\)$"):
        RunDir.existing(tmp_path)


@pytest.mark.parametrize(
    ("recipe", "overrides", "prefix"),
    [
        ("igrpo-craigslist", [], "igrpo-craigslist-"),  # was omar-craigslist-: named after the estimator
        ("igrpo-craigslist", ["method.kind=mt-kto"], "mt-kto-craigslist-"),
        ("igrpo-craigslist", ["rounds.method=mt-kto"], "mt-kto-craigslist-"),  # the old key, translated
        ("adalign-ipd", [], "adalign-ipd-"),
        (None, [], "omar-ipd-"),
    ],
)
def test_runs_are_named_after_their_method(tmp_path, recipe, overrides, prefix):
    config = load_config(recipe, [*overrides, f"output_dir={tmp_path}"])
    run = new_run_dir(config)
    assert run.name.startswith(prefix) and run.root.parent == tmp_path
    run.create("seed: 0\n")
    second = new_run_dir(config)  # within the same second: a suffix, never the same folder
    assert second != run and second.name.startswith(prefix)


@pytest.mark.parametrize(
    "recipe,overrides,prefix",
    [
        ("ppo-ipd-vs-cooperator", [], "ppo-ipd-vs-cooperator_omar-ipd-"),
        ("igrpo-craigslist", ["method.kind=mt-kto"], "igrpo-craigslist_mt-kto-craigslist-"),
        ("default", [], "omar-ipd-"),  # the default recipe says nothing the method and game do not
    ],
)
def test_runs_started_from_a_recipe_are_named_after_it_too(tmp_path, recipe, overrides, prefix):
    config = load_config(recipe, [*overrides, f"output_dir={tmp_path}"])
    run = new_run_dir(config.model_copy(update={"recipe": recipe_name(recipe)}))
    assert run.name.startswith(prefix)


def test_a_recipe_file_is_named_by_its_stem(tmp_path):
    recipe = tmp_path / "my-sweep.yaml"
    recipe.write_text("iterations: 1\n")
    assert recipe_name(str(recipe)) == "my-sweep" and recipe_name("omar-ipd") == "omar-ipd"


def test_a_run_directory_is_a_path_for_the_users_own_files(tmp_path):
    run = RunDir(tmp_path / "r")
    assert run / "notes.txt" == tmp_path / "r" / "notes.txt"
    assert run / "episodes" / "iter-000000.parquet" == run.episodes(0)


def test_a_run_directory_travels_to_workers_and_processes(tmp_path):
    import pickle

    run = RunDir(tmp_path / "r")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(run, protocol))
        assert copy == run and copy.snapshot(3) == run.snapshot(3)
    assert RunDir.of_checkpoint(run.checkpoint(4)) == run


def test_a_run_saved_before_model_precision_keeps_float32(tmp_path):
    saved = dump_config(load_config())
    assert "precision: auto" in saved  # the default now: bfloat16 where the CPU has it
    new, old = tmp_path / "new.yaml", tmp_path / "old.yaml"
    new.write_text(saved)
    old.write_text(saved.replace("  precision: auto\n", ""))  # as runs wrote it before the key existed
    assert load_run_config(new).model.precision == "auto"
    assert load_run_config(old).model.precision == "float32"  # it trained in float32: it resumes in float32
    assert load_run_config(old, ["model.precision=bfloat16"]).model.precision == "bfloat16"  # asked for: given
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed")
    with pytest.raises(RepertoryError, match="not valid YAML"):
        load_run_config(broken)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_source_commit_is_the_checkouts_own_or_none(tmp_path):
    repo = tmp_path / "checkout"
    package = repo / "src" / "repertory"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (repo / "notes.md").write_text("results")
    assert source_commit(package) is None  # not a repository
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    head = _git(repo, "rev-parse", "HEAD")
    assert source_commit(package) == head
    (repo / "notes.md").write_text("edits outside the package change nothing that runs")
    assert source_commit(package) == head
    (package / "new.py").write_text("y = 2\n")  # a module not committed yet runs too
    assert source_commit(package) == head + "+dirty"
    (package / "new.py").unlink()
    (package / "__init__.py").write_text("x = 1\n")
    assert source_commit(package) == head + "+dirty"
    # A package installed inside some other repository (a virtual environment in a project) has no commit of its own.
    installed = repo / ".venv" / "lib" / "site-packages" / "repertory"
    installed.mkdir(parents=True)
    assert source_commit(installed) is None


def test_the_machine_names_the_software_and_hardware_a_run_trained_on():
    here = machine()
    assert here["repertory"] and here["python"].count(".") == 2 and here["torch"].startswith("2.")
    assert here["cpu"] and here["cores"] >= 1 and here["threads"] >= 1 and here["cpu_capability"]
    if (PACKAGE.parent.parent / ".git").exists() and shutil.which("git"):  # run from a checkout, as CI is
        assert here["commit"].split("+")[0] == _git(PACKAGE, "rev-parse", "HEAD")
    json.dumps(here)  # a sessions.jsonl line
