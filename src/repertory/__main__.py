"""``python -m repertory`` is the ``repertory`` command."""

from repertory.cli import main

main()
