"""The layers stay layered and the light ones light: the environments (every registered game, the kernels
and the conformance checks), the vocabulary, the statistics, the estimators, the config, the results table and
the command line import without torch; ``repertory report --table`` runs without it; and no module takes part
in an import cycle."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import repertory

SOURCE = Path(repertory.__file__).resolve().parent.parent

# __main__ is left out: importing it regenerates the shipped kernel files.
TORCH_FREE = """
import pkgutil, sys
import repertory.envs, repertory.types
from repertory.envs import env_class, env_names
for name in env_names():
    env_class(name)
for module in pkgutil.iter_modules(repertory.envs.__path__, "repertory.envs."):
    if not module.name.endswith("__main__"):
        __import__(module.name)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:5]
print(len(env_names()), sorted(m for m in sys.modules if m.startswith("repertory.")))
"""


def test_envs_and_types_import_no_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", TORCH_FREE], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    count, modules = run.stdout.split(" ", 1)
    assert int(count) >= 9
    for module in ("repertory.envs.checks", "repertory.envs.deal_or_no_deal", "repertory.envs.alliance"):
        assert module in modules


def test_kernels_do_not_import_the_registry():
    # repertory.envs imports repertory.envs.kernels; an import back, even a lazy one, is a cycle.
    tree = ast.parse((SOURCE / "repertory" / "envs" / "kernels.py").read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported and not [m for m in imported if m == "repertory.envs" or m.startswith("repertory.envs.")]


LIGHT = """
import json, sys, tempfile
from pathlib import Path
import repertory.algos, repertory.config, repertory.report, repertory.runs, repertory.stats, repertory.types
from repertory.cli import main
from repertory.config import dump_config, load_config
from repertory.stats import mean_se
assert mean_se([1.0, 3.0]) == (2.0, 1.0)
root = Path(tempfile.mkdtemp())
for seed, best in ((0, 0.5), (1, 0.7)):
    run = root / f"igrpo-{seed}"
    run.mkdir()
    config = load_config(None, ["rollout.env=ultimatum", "rollout.opponent=bot", f"seed={seed}", "method.kind=igrpo"])
    (run / "config.yaml").write_text(dump_config(config))
    lines = [{"iteration": 0, "eval/discounted_return": 0.1}, {"iteration": 1, "eval/discounted_return": best}]
    lines[-1]["final/discounted_return"] = best + 0.1
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\\n" for line in lines))
main(["report", "--table", str(root / "igrpo-0"), str(root / "igrpo-1")])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft"))
assert not heavy, heavy[:5]
"""


def test_statistics_config_results_table_and_cli_need_no_torch():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", LIGHT], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "0.70 ± .10" in run.stdout and "+0.600 ± 0.100" in run.stdout  # last J 0.6 and 0.8; paired with base 0.1


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module in the direct-import graph (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_takes_part_in_an_import_cycle():
    grimp = pytest.importorskip("grimp")  # installed with import-linter, which make test runs
    graph = grimp.build_graph("repertory")
    assert len(graph.modules) > 50
    assert _cycles(graph) == []


def test_modules_and_functions_stay_readable():
    # docs/design.md: no module over 600 lines, no function over 80 (split by responsibility instead).
    too_long = []
    for path in sorted((SOURCE / "repertory").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = str(path.relative_to(SOURCE))
        if len(text.splitlines()) > 600:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                too_long.append(f"{name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_no_trainer_module_names_a_method_or_the_learner_a_game():
    # A method's own needs reach the loop through hooks (Method.opponents); the learner reads each sample's adapter
    # (type names aside).
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("repertory", exclude_type_checking_imports=True)
    loops = ["base", "online", "rounds", "lineup", "rollouts", "pool", "warm", "__init__"]
    methods = {m for m in graph.modules if m.startswith("repertory.train.methods.") and not m.endswith(".base")}
    naming = {
        (loop, method)
        for loop in loops
        for method in methods
        if graph.direct_import_exists(importer=f"repertory.train.{loop}".removesuffix(".__init__"), imported=method)
    }
    assert naming == set()
    learner = graph.find_modules_directly_imported_by("repertory.train.learner")
    assert not {m for m in learner if m == "repertory.envs" or m.startswith("repertory.envs.")}


SERVE_LIGHT = """
import sys
from repertory.serve import ServeOptions
from repertory.serve.protocol import ChatRequest, chat_input
try:
    ServeOptions(host="0.0.0.0")
except Exception as error:
    print(error)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "fastapi", "uvicorn"))
assert not heavy, heavy[:5]
"""


def test_serve_checks_its_options_before_loading_torch_or_fastapi():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SOURCE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", SERVE_LIGHT], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "binding 0.0.0.0 exposes the model beyond this machine" in run.stdout
