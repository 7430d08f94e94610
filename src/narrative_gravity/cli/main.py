"""The ``ngrav`` command line: one app, its commands gathered from one module per group.

Examples::

    ngrav compare --profile profiles/binary_search.json \\
        --prompt "Write a binary search in Java and explain its time complexity." --samples 5
    ngrav generate --prompts prompts.txt --profile profiles/space.yaml --raw --output out.jsonl
    ngrav inspect --profile profiles/binary_search.json
    ngrav model path smollm2          # the model folder for `vllm serve`

Every user mistake (a missing or unreadable file, an output path that cannot be written, a model that is not
there) ends in one line naming the problem and the fix, with exit code 2, before any model is loaded.
``ngrav --debug COMMAND`` prints the traceback as well. Each command imports the heavy parts it runs (torch,
transformers, FastAPI) inside its own function, so ``ngrav --help`` starts fast.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from . import compare, generate, inspect, levels, rollout, serve, shortlist
from . import eval as evaluate
from .common import FLAG, set_debug
from .model import model_app
from .profile import profile_app

__all__ = ["app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Keep LLM generation on its narrative while it decodes.",
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},  # every command inherits -h
)
for group in (generate, compare, inspect, evaluate, serve, levels, shortlist):
    app.add_typer(group.app)
profile_app.add_typer(rollout.app)  # promote, rollout and report join the store's commands
app.add_typer(profile_app, name="profile")
app.add_typer(model_app, name="model")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version  # the installed package's metadata: no torch for --version

        typer.echo(f"narrative-gravity {version('narrative-gravity')}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", metavar=FLAG, help="print the traceback of an error, too")] = False,
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", metavar=FLAG, callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    set_debug(debug)


def main() -> None:
    """Entry point of the ``ngrav`` console script."""
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover - interactive
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
