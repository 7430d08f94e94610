"""``ngrav profile``: the profile store from the command line (the store needs no torch; promote and report do).

Examples::

    ngrav profile set space profiles/space.yaml --message "first cut"
    ngrav profile list
    ngrav profile show space --version 1 > space_v1.json
    ngrav profile history space
    ngrav profile diff space 1 2
    ngrav profile rollback space --to 1
    ngrav profile stage space profiles/space_v2.yaml --message "stronger pull"
    ngrav profile rollout space --shadow 0.05 --split-version 4 --split-share 0.1
    ngrav profile report space
    ngrav profile promote space --prompts topics --limit distinct_2:0.05 --limit rep_2:0.05
    ngrav profile schema > profiles/profile.schema.json
    ngrav profile docs > docs/profiles.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..profiles.reference import profile_reference, profile_schema_text
from ..profiles.schema import load_profile
from ..profiles.store import ProfileStore
from .common import FLAG
from .common import guarded as _guard

__all__ = ["profile_app"]

profile_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="rich",
    help=(
        "Named, versioned profiles: every [bold]set[/] is a new numbered snapshot; history, diff and rollback. "
        "[bold]stage[/] stores a version that is not live yet; [bold]promote[/] makes it live once an eval shows no "
        "regression; [bold]rollout[/] shadows or splits a profile's traffic and [bold]report[/] compares the arms.\n\n"
        "The store folder is --store, else $NARRATIVE_GRAVITY_STORE, else "
        "~/.local/share/narrative-gravity/profiles.\n\n"
        "Examples:\n\n"
        "ngrav profile set space profiles/space.yaml --message 'first cut'\n\n"
        "ngrav profile list\n\n"
        "ngrav profile show space --version 1 > space_v1.json\n\n"
        "ngrav profile diff space 1 2\n\n"
        "ngrav profile rollback space --to 1\n\n"
        "ngrav profile stage space profiles/space_v2.yaml\n\n"
        "ngrav profile rollout space --shadow 0.05 --split-version 4 --split-share 0.1\n\n"
        "ngrav profile report space\n\n"
        "ngrav profile promote space --prompts prompts.txt --limit distinct_2:0.05\n\n"
        "ngrav profile schema > profiles/profile.schema.json   (the JSON Schema, for editors)\n\n"
        "ngrav profile docs > docs/profiles.md   (the reference, from the schema)"
    ),
)

NameArg = Annotated[str, typer.Argument(help="profile name: letters, digits, '-', '_' or '.'")]


def store_of(ctx: typer.Context) -> ProfileStore:
    """The store that ``--store`` (or ``$NARRATIVE_GRAVITY_STORE``, else the default folder) names."""
    return _guard(lambda: ProfileStore(ctx.ensure_object(dict).get("store")))


def stdout(*, wide: bool = False) -> Console:
    """The stdout console; ``wide`` tables get 150 columns when stdout is not a terminal (a pipe, a file)."""
    return Console(width=150 if wide and not sys.stdout.isatty() else None)


@profile_app.callback()
def _options(
    ctx: typer.Context,
    store: Annotated[
        Path | None,
        typer.Option(
            "--store",
            envvar="NARRATIVE_GRAVITY_STORE",
            help="store folder (default ~/.local/share/narrative-gravity/profiles)",
        ),
    ] = None,
) -> None:
    ctx.ensure_object(dict)["store"] = store


@profile_app.command("list")
def list_profiles(ctx: typer.Context) -> None:
    """List the stored profiles with their live and newest version, and what is staged.

    Example: ngrav profile list
    """
    store = store_of(ctx)
    infos = _guard(store.list)
    if not infos:
        typer.echo(f"no profiles in {store.root}; add one with: ngrav profile set NAME FILE")
        return
    table = Table(title=f"profiles in {escape(str(store.root))}")
    for col in ("name", "live", "newest", "staged", "updated (UTC)", "message"):
        table.add_column(col)
    for info in infos:
        live = "?" if info.live is None else str(info.live)
        staged = ", ".join(str(v) for v in info.staged)
        if info.error is not None:
            table.add_row(f"[red]{escape(info.name)}[/]", live, str(info.version), staged, "[red]damaged[/]", "")
        else:
            row = (escape(info.name), live, str(info.version), staged, info.created, escape(info.message or ""))
            table.add_row(*row)
    console = stdout()
    console.print(table)
    for info in infos:
        if info.error is not None:
            console.print(f"[bold red]damaged:[/] {escape(info.name)}: {escape(info.error)}", highlight=False)


@profile_app.command()
def show(
    ctx: typer.Context,
    name: NameArg,
    version: Annotated[int | None, typer.Option("--version", "-v", min=1, help="a past version")] = None,
) -> None:
    """Print a profile as JSON (ready for `set`): the live version unless --version names another.

    Its version, whether it is live or staged, its date and message go to stderr.

    Example: ngrav profile show space --version 1 > space_v1.json
    """
    store = store_of(ctx)
    snap, live = _guard(lambda: (store.snapshot(name, version), store.live_version(name)))
    note = f" ({snap.message})" if snap.message else ""
    state = "live" if snap.version == live else ("staged" if snap.version > live else f"not live; live is {live}")
    typer.echo(f"# {name} version {snap.version} [{state}], {snap.created}{note}", err=True)
    typer.echo(json.dumps(snap.profile.model_dump(mode="json"), indent=2, ensure_ascii=False))


@profile_app.command("set")
def set_profile(
    ctx: typer.Context,
    name: NameArg,
    file: Annotated[Path, typer.Argument(help="profile file (.json/.yaml)")],
    message: Annotated[str | None, typer.Option("--message", "-m", help="why it changed")] = None,
) -> None:
    """Validate a profile file and store it as the next version of NAME, live at once (see `stage` for not live).

    Example: ngrav profile set space profiles/space.yaml --message "stronger pull"
    """
    store = store_of(ctx)
    profile = _guard(lambda: load_profile(file))
    version = _guard(lambda: store.set(name, profile, message=message))
    typer.echo(f"{name}: stored version {version}")


@profile_app.command()
def history(ctx: typer.Context, name: NameArg) -> None:
    """Show every version of a profile, oldest first, which one is live and which are staged.

    Example: ngrav profile history space
    """
    store = store_of(ctx)
    infos, live, moves = _guard(lambda: (store.history(name), store.live_version(name), store.live_history(name)))
    table = Table(title=f"history of {escape(name)} (live: version {live})")
    for col in ("version", "", "created (UTC)", "message"):
        table.add_column(col)
    for info in infos:
        state = "[bold green]live[/]" if info.version == live else ("staged" if info.version > live else "")
        table.add_row(str(info.version), state, info.created, escape(info.message or ""))
    console = stdout()
    console.print(table)
    if moves:
        pointer = Table(title=f"live pointer of {escape(name)}")
        for col in ("updated (UTC)", "from", "to", "message"):
            pointer.add_column(col)
        for m in moves:
            before = "newest" if m.previous is None else str(m.previous)
            pointer.add_row(m.updated, before, str(m.version), escape(m.message or ""))
        console.print(pointer)


@profile_app.command()
def diff(
    ctx: typer.Context,
    name: NameArg,
    a: Annotated[int, typer.Argument(min=1, help="older version")],
    b: Annotated[int, typer.Argument(min=1, help="newer version")],
    keys: Annotated[
        bool, typer.Option("--keys", metavar=FLAG, help="a table of changed keys instead of a unified diff")
    ] = False,
) -> None:
    """Show what changed between two versions of a profile.

    Example: ngrav profile diff space 1 2
    """
    store = store_of(ctx)
    if keys:
        changes = _guard(lambda: store.changes(name, a, b))
        if not changes:
            typer.echo(f"{name}: versions {a} and {b} are identical")
            return
        table = Table(title=f"{escape(name)}: version {a} → {b}")
        for col in ("key", "kind", f"version {a}", f"version {b}"):
            table.add_column(col)
        for c in changes:
            old = "" if c.kind == "added" else json.dumps(c.old, ensure_ascii=False)
            new = "" if c.kind == "removed" else json.dumps(c.new, ensure_ascii=False)
            table.add_row(escape(c.key), c.kind, escape(old), escape(new))
        stdout().print(table)
        return
    text = _guard(lambda: store.diff(name, a, b))
    typer.echo(text.rstrip("\n") if text else f"{name}: versions {a} and {b} are identical")


@profile_app.command()
def rollback(
    ctx: typer.Context,
    name: NameArg,
    to: Annotated[int, typer.Option("--to", min=1, help="the version to restore")],
) -> None:
    """Restore an old version as a NEW version, and make it live; history is never rewritten.

    Versions staged before the rollback stay in the history (no longer staged, since the new version is the newest)
    and can still be made live with `promote --version V`. To go back to an older version without a new snapshot,
    use `promote NAME --version V --no-check`.

    Example: ngrav profile rollback space --to 1
    """
    version = _guard(lambda: store_of(ctx).rollback(name, to))
    typer.echo(f"{name}: stored version {version} (= version {to})")


@profile_app.command()
def stage(
    ctx: typer.Context,
    name: NameArg,
    file: Annotated[Path, typer.Argument(help="profile file (.json/.yaml)")],
    message: Annotated[str | None, typer.Option("--message", "-m", help="why it changed")] = None,
) -> None:
    """Store a profile file as the next version of NAME without making it live.

    Requests that name no version keep getting the live version; compare the two with `rollout --split-version`,
    then `promote`.

    Example: ngrav profile stage space profiles/space_v2.yaml --message "stronger pull"
    """
    store = store_of(ctx)
    profile = _guard(lambda: load_profile(file))
    version = _guard(lambda: store.stage(name, profile, message=message))
    live = _guard(lambda: store.live_version(name))
    typer.echo(f"{name}: staged version {version}; version {live} stays live")


@profile_app.command("schema")
def schema() -> None:
    """Print the JSON Schema of a profile, for editors that validate and complete profile files.

    The repository ships it as profiles/profile.schema.json; a YAML profile points at it with a first line
    `# yaml-language-server: $schema=profile.schema.json`, a JSON profile with a "$schema" key.

    Example: ngrav profile schema > profiles/profile.schema.json
    """
    sys.stdout.write(profile_schema_text())


@profile_app.command("docs")
def docs() -> None:
    """Print the profile reference (Markdown), generated from the schema's field descriptions.

    Example: ngrav profile docs > docs/profiles.md
    """
    sys.stdout.write(profile_reference())
