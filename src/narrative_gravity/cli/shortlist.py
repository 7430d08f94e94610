"""``ngrav shortlist build``: a frequency list for the shortlist head (``prune: {head: {shortlist: N}}``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from .common import ModelOpt, SeedOpt, alias, check_output, fail, guarded, load, renamed

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")
shortlist_app = typer.Typer(rich_markup_mode="rich", no_args_is_help=True, help="the shortlist head's frequency lists")
app.add_typer(shortlist_app, name="shortlist")


@shortlist_app.command("build")
def build(
    output: Annotated[
        Path | None, typer.Option("--output", help="where to write the list (a .json or .json.gz file)")
    ] = None,
    model: ModelOpt = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", min=1, max=1600, help="prompts to continue")] = 256,
    new_tokens: Annotated[int, typer.Option("--new-tokens", min=1, help="tokens sampled after each")] = 40,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="prompts per generate call")] = 16,
    keep: Annotated[int, typer.Option("--keep", min=256, help="how many ranked tokens to keep")] = 65536,
    seed: SeedOpt = 0,
    out_alias: Annotated[Path | None, typer.Option("--out", hidden=True, help="old spelling of --output")] = None,
    prompts_renamed: Annotated[str | None, renamed("--prompts", "is now --num-prompts N in shortlist build")] = None,
) -> None:
    """Count the tokens a model samples on a broad, varied prompt set (made in code) and write them ranked.

    Name the file in a profile as ``prune: {head: {shortlist: 32768, file: LIST}}``; the shipped models have
    theirs packaged already (docs/shortlist.md).

    Example: ngrav shortlist build --model ./my-model --output my-model.json.gz
    """
    from ..engines.shortlist_build import FrequencyRun, build_frequency_list  # torch, transformers: not for --help

    out = alias("--out", "--output", output, out_alias)
    if out is None:
        fail("give --output FILE: where to write the list, e.g. --output my-model.json.gz")
    check_output(out, "--output")
    m, tok = load(model)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with Progress(*columns, TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("sampling", total=num_prompts)
        freq = guarded(
            lambda: build_frequency_list(
                m, tok, model_name=str(model or "smollm2"),
                run=FrequencyRun(
                    prompts=num_prompts, new_tokens=new_tokens, batch_size=batch_size, keep=keep, seed=seed
                ),
                progress=lambda n: bar.advance(task, n),
            )
        )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    freq.save(out)
    meta = freq.meta
    typer.echo(
        f"wrote {out}: {freq.ids.size} ranked tokens of {freq.vocab_size}, from {meta['sampled_tokens']} sampled "
        f"tokens ({meta['distinct_sampled']} distinct) after {meta['prompts']} prompts"
    )
