"""``ngrav inspect`` and ``ngrav reach``: how a profile's words, or word lists, map onto a tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from .common import FLAG, ModelOpt, guarded, load, read_profile, read_text, tokenizer

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")


@app.command()
def inspect(
    profile: Annotated[Path, typer.Option("--profile", help="profile file (.json/.yaml)")],
    model: ModelOpt = None,
) -> None:
    """Show how a profile's words map onto a model's tokenizer, and which words could not be used.

    Example: ngrav inspect --profile profiles/binary_search.json --model gemma3-270m
    """
    from ..profiles.build import field_from_profile  # torch: not for --help

    prof = read_profile(profile)
    if prof.field.mode != "lexical" and prof.field.semantic_source == "lm":  # the field reads the LM's embeddings
        lm, tok = load(model)
    else:
        lm, tok = None, tokenizer(model)
    field = guarded(lambda: field_from_profile(prof, tok, model=lm))
    table = Table(title=f"{prof.name}: {field.report.n_used} words used, {field.report.n_unusable} unusable")
    table.add_column("word")
    table.add_column("surface forms (token pieces)")
    for word, forms in field.report.used.items():
        table.add_row(word, "  ".join("|".join(f) for f in forms))
    for word, why in field.report.unusable.items():
        table.add_row(f"[red]{word}[/]", f"[red]unusable: {why}[/]")
    console = Console()
    console.print(table)
    pos = int((field.values > 0).sum())
    neg = int((field.values < 0).sum())
    n_cont = field.prefixes.shape[0] if field.has_continuations else 0
    console.print(f"field: {pos} tokens pulled, {neg} pushed away, {n_cont} multi-token continuations")


@app.command()
def reach(
    wordlists: Annotated[list[Path] | None, typer.Argument(help="word list files, one word per line")] = None,
    topics: Annotated[
        bool,
        typer.Option(
            "--topics",
            metavar=FLAG,
            help="also the topic protocol's 7 word lists (shipped, or $NARRATIVE_GRAVITY_BENCH)",
        ),
    ] = False,
    model: ModelOpt = None,
) -> None:
    """Count, per word list, the words that no surface form of the tokenizer can write.

    Examples: ngrav reach --topics · ngrav reach my_words.txt --model gemma3-270m
    """
    from ..eval.topics import topic_wordlists  # the eval package imports torch: not for --help
    from ..fields.lexical import reach as reach_words  # torch: not for --help

    wordlists = list(wordlists or [])
    if topics:
        wordlists += guarded(topic_wordlists)
    if not wordlists:
        raise typer.BadParameter("give word list files, or --topics for the topic protocol's lists")
    tok = tokenizer(model)
    table = Table(title=f"reach in {model or 'smollm2'}")
    for col in ("list", "words", "unreachable", "reachable %", "unreachable words"):
        table.add_column(col)
    worst = 100.0
    for path in wordlists:
        words = [w.strip() for w in read_text(path, "word list").splitlines() if w.strip()]
        ok, bad = reach_words(tok, words)
        pct = 100.0 * len(ok) / max(1, len(words))
        worst = min(worst, pct)
        table.add_row(path.stem, str(len(words)), str(len(bad)), f"{pct:.1f}", ", ".join(bad[:8]))
    Console().print(table)
    if worst < 99.0:
        raise typer.Exit(1)
