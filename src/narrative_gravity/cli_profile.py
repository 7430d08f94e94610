"""``ngrav profile``: the profile store from the command line. Only typer is imported up front.

Examples::

    ngrav profile set space profiles/space.yaml --message "first cut"
    ngrav profile list
    ngrav profile show space --version 1 > space_v1.json
    ngrav profile history space
    ngrav profile diff space 1 2
    ngrav profile rollback space --to 1
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from .cli_common import fail as _fail

if TYPE_CHECKING:
    from .store import ProfileStore

__all__ = ["profile_app"]

profile_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode="rich",
    help=(
        "Named, versioned profiles: every [bold]set[/] is a new numbered snapshot; history, diff and rollback.\n\n"
        "The store folder is --store, else $NARRATIVE_GRAVITY_STORE, else "
        "~/.local/share/narrative-gravity/profiles.\n\n"
        "Examples:\n\n"
        "ngrav profile set space profiles/space.yaml --message 'first cut'\n\n"
        "ngrav profile list\n\n"
        "ngrav profile show space --version 1 > space_v1.json\n\n"
        "ngrav profile diff space 1 2\n\n"
        "ngrav profile rollback space --to 1"
    ),
)

NameArg = Annotated[str, typer.Argument(help="profile name: letters, digits, '-', '_' or '.'")]


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


def _guard(fn: Any) -> Any:
    from .errors import NarrativeGravityError

    try:
        return fn()
    except NarrativeGravityError as exc:
        _fail(str(exc))


def _store(ctx: typer.Context) -> ProfileStore:
    from .store import ProfileStore

    return _guard(lambda: ProfileStore(ctx.ensure_object(dict).get("store")))


def _console() -> Any:
    from rich.console import Console

    return Console()


@profile_app.command("list")
def list_profiles(ctx: typer.Context) -> None:
    """List the stored profiles with their newest version.

    Example: ngrav profile list
    """
    from rich.markup import escape
    from rich.table import Table

    store = _store(ctx)
    infos = _guard(store.list)
    if not infos:
        typer.echo(f"no profiles in {store.root}; add one with: ngrav profile set NAME FILE")
        return
    table = Table(title=f"profiles in {escape(str(store.root))}")
    for col in ("name", "version", "updated (UTC)", "message"):
        table.add_column(col)
    for info in infos:
        if info.error is not None:
            table.add_row(f"[red]{escape(info.name)}[/]", str(info.version), "[red]damaged[/]", "")
        else:
            table.add_row(escape(info.name), str(info.version), info.created, escape(info.message or ""))
    console = _console()
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
    """Print a profile as JSON (ready for `set`); its version, date and message go to stderr.

    Example: ngrav profile show space --version 1 > space_v1.json
    """
    snap = _guard(lambda: _store(ctx).snapshot(name, version))
    note = f" ({snap.message})" if snap.message else ""
    typer.echo(f"# {name} version {snap.version}, {snap.created}{note}", err=True)
    typer.echo(json.dumps(snap.profile.model_dump(mode="json"), indent=2, ensure_ascii=False))


@profile_app.command("set")
def set_profile(
    ctx: typer.Context,
    name: NameArg,
    file: Annotated[Path, typer.Argument(help="profile file (.json/.yaml)")],
    message: Annotated[str | None, typer.Option("--message", "-m", help="why it changed")] = None,
) -> None:
    """Validate a profile file and store it as the next version of NAME.

    Example: ngrav profile set space profiles/space.yaml --message "stronger pull"
    """
    from .profile import load_profile

    store = _store(ctx)
    profile = _guard(lambda: load_profile(file))
    version = _guard(lambda: store.set(name, profile, message=message))
    typer.echo(f"{name}: stored version {version}")


@profile_app.command()
def history(ctx: typer.Context, name: NameArg) -> None:
    """Show every version of a profile, oldest first.

    Example: ngrav profile history space
    """
    from rich.markup import escape
    from rich.table import Table

    infos = _guard(lambda: _store(ctx).history(name))
    table = Table(title=f"history of {escape(name)}")
    for col in ("version", "created (UTC)", "message"):
        table.add_column(col)
    for info in infos:
        table.add_row(str(info.version), info.created, escape(info.message or ""))
    _console().print(table)


@profile_app.command()
def diff(
    ctx: typer.Context,
    name: NameArg,
    a: Annotated[int, typer.Argument(min=1, help="older version")],
    b: Annotated[int, typer.Argument(min=1, help="newer version")],
    keys: Annotated[bool, typer.Option("--keys", help="a table of changed keys instead of a unified diff")] = False,
) -> None:
    """Show what changed between two versions of a profile.

    Example: ngrav profile diff space 1 2
    """
    store = _store(ctx)
    if keys:
        from rich.markup import escape
        from rich.table import Table

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
        _console().print(table)
        return
    text = _guard(lambda: store.diff(name, a, b))
    typer.echo(text.rstrip("\n") if text else f"{name}: versions {a} and {b} are identical")


@profile_app.command()
def rollback(
    ctx: typer.Context,
    name: NameArg,
    to: Annotated[int, typer.Option("--to", min=1, help="the version to restore")],
) -> None:
    """Restore an old version as a NEW version; history is never rewritten.

    Example: ngrav profile rollback space --to 1
    """
    version = _guard(lambda: _store(ctx).rollback(name, to))
    typer.echo(f"{name}: stored version {version} (= version {to})")
