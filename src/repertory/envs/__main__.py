"""Regenerate the shipped kernel files: ``python -m repertory.envs [ENV ...]`` (default: all)."""

import sys
from importlib import resources
from pathlib import Path

from repertory.envs import env_class, env_names, write_kernels

root = Path(str(resources.files("repertory").joinpath("kernels")))
for name in sys.argv[1:] or env_names():
    for path in write_kernels(env_class(name), root):
        print(path)
