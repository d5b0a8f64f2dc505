"""The light layers stay light: the environments (every registered game, the kernels and the
conformance checks) and the shared vocabulary import without torch, and the kernels module does not
import the environment registry that imports it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

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
