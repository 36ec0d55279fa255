"""The ``weir`` command: a Typer app; each subcommand lives in its own module.

Adding a command is one import and one ``app.command(...)`` line below.
"""

from __future__ import annotations

import typer

from weir.cli.bench import bench_app
from weir.cli.generate_cmd import generate
from weir.cli.plugins_cmd import plugins
from weir.cli.serve_cmd import serve

app = typer.Typer(
    name="weir",
    help="Weir: a small, fast LLM inference and serving engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(asked: bool) -> None:
    if asked:
        from weir import __version__

        typer.echo(f"weir {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print Weir's version and exit")) -> None:
    """Weir: a small, fast LLM inference and serving engine."""


app.command("generate")(generate)
app.command("plugins")(plugins)
app.command("serve")(serve)
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":
    app()
