"""``ngrav model``: where a model's files are, for engines that load a folder (``vllm serve``).

Examples::

    ngrav model path smollm2
    vllm serve "$(ngrav model path smollm2)"
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import guarded

__all__ = ["model_app"]

model_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="rich",
    help=(
        "The models ngrav knows: smollm2 (the default), gemma3-270m, a Hugging Face folder or a .gguf file.\n\n"
        "Examples:\n\n"
        "ngrav model path smollm2\n\n"
        'vllm serve "$(ngrav model path smollm2)"'
    ),
)


@model_app.command("path")
def path(
    name: Annotated[
        str, typer.Argument(help="smollm2, gemma3-270m, a Hugging Face model folder or a .gguf file")
    ] = "smollm2",
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", help="where converted models live (else $NARRATIVE_GRAVITY_CACHE)"),
    ] = None,
) -> None:
    """Print the Hugging Face folder (config, weights, tokenizer) of a model, for `vllm serve` or `LLM(model=...)`.

    A GGUF model (smollm2, gemma3-270m, a .gguf file) is de-quantized into the cache the first time (20-30 s);
    a Hugging Face folder is printed as it is. Only the path goes to standard output.

    Example: vllm serve "$(ngrav model path smollm2)"
    """
    from ..models import hf_folder  # torch and transformers: not for --help

    typer.echo(str(guarded(lambda: hf_folder(name, cache_dir=cache_dir))))
