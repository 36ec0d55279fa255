"""``weir bench``: throughput and latency of the offline engine, and load tests of a server.

Register on the main app with ``app.add_typer(bench_app, name="bench")``.
"""

from __future__ import annotations

import typer

from weir.cli.bench.latency import latency
from weir.cli.bench.serve import serve
from weir.cli.bench.throughput import throughput

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks: offline throughput and latency, and serving load against any OpenAI-compatible server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app.command("throughput")(throughput)
bench_app.command("latency")(latency)
bench_app.command("serve")(serve)
