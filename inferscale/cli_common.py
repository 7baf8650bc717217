"""What every ``inferscale`` command prints with: the consoles and the one-line error exit."""

from __future__ import annotations

import typer
from rich.console import Console

from inferscale.config import AUTO_DTYPE_RULE

console = Console(soft_wrap=True)
errors = Console(soft_wrap=True, stderr=True)  # a command's errors go to stderr


def fail(message: str) -> None:
    """Print ``error: <message>`` on stderr and exit with status 2."""
    errors.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code=2)


def check_dtype(value: str) -> str:
    """Reject a bad ``--dtype`` before anything is written."""
    if value not in ("auto", "float32", "bfloat16"):
        raise typer.BadParameter(f"must be auto, float32 or bfloat16, got {value!r}")
    return value


#: the ``--dtype`` option of ``serve`` and the benchmarks
DTYPE_OPTION = typer.Option("auto", callback=check_dtype, help=f"auto ({AUTO_DTYPE_RULE}), float32 or bfloat16.")
