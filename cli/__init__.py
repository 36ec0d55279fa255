"""The `weir` command line (Typer)."""
