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


@app.callback()
def _main() -> None:
    """Weir: a small, fast LLM inference and serving engine."""


app.command("generate")(generate)
app.command("plugins")(plugins)
app.command("serve")(serve)
app.add_typer(bench_app, name="bench")


if __name__ == "__main__":
    app()
