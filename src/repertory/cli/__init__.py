"""The ``repertory`` command line: thin wrappers that parse options, call the library and print.

One module per command group (:mod:`~repertory.cli.play`, :mod:`~repertory.cli.train`, :mod:`~repertory.cli.eval`,
:mod:`~repertory.cli.report`, :mod:`~repertory.cli.serve`, :mod:`~repertory.cli.bench`). Usage errors (unknown names,
bad counts, unreadable files) print one line on stderr and exit with status 2, never a traceback.
"""

from __future__ import annotations

import sys

import typer

from repertory.cli import bench, eval, play, report, serve, train
from repertory.cli.common import out, with_optional_values
from repertory.types import RepertoryError

app = typer.Typer(
    help="Train one language model to play every role of multi-agent conversations.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.command()(play.envs)
app.command()(play.play)
app.command()(play.tournament)
app.command()(train.train)
app.command()(report.report)
app.command()(report.export)
app.command()(serve.serve)
app.add_typer(eval.eval_app, name="eval")
app.add_typer(bench.bench_app, name="bench")

__all__ = ["app", "main", "out"]


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning user errors into one line on stderr and exit status 2."""
    try:
        app(args=with_optional_values(sys.argv[1:] if argv is None else argv), standalone_mode=False)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:
        if exc.format_message():
            print(f"error: {exc.format_message()}", file=sys.stderr)
        sys.exit(2)
    except RepertoryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except typer.Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
