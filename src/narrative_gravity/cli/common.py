"""What every ``ngrav`` command shares: the one-line error that ends a user mistake, and ``--debug``.

>>> import typer
>>> try:
...     fail("--prompts 'x.txt' does not exist; check the path")
... except typer.Exit as exc:
...     exc.exit_code
2
"""

from __future__ import annotations

import sys
import traceback

import typer
from rich.console import Console
from rich.markup import escape

__all__ = ["fail", "set_debug"]

_state = {"debug": False}


def set_debug(on: bool) -> None:
    """``ngrav --debug``: errors print their traceback, too."""
    _state["debug"] = bool(on)


def fail(message: str) -> None:
    """Print ``error: message`` on stderr (with the traceback under ``--debug``) and exit with code 2."""
    console = Console(stderr=True, soft_wrap=True)
    if _state["debug"] and sys.exc_info()[0] is not None:
        traceback.print_exc()
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(2)
