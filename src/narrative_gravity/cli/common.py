"""What every ``ngrav`` command shares: the one-line error that ends a user mistake, ``--debug``, the checks that
run before a model loads, and the options several commands take.

Only light modules are imported here (no torch), so that ``ngrav --help`` starts fast; each command imports the
heavy parts it runs inside its own function.

>>> try:
...     fail("--prompts 'x.txt' does not exist; check the path")
... except typer.Exit as exc:
...     exc.exit_code
2
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from ..engines.options import check_device_for
from ..errors import NarrativeGravityError
from ..models import load_model, load_tokenizer, resolve_device, resolve_model
from ..profiles.schema import Profile, load_profile
from ..text import unencodable

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEVICE_HELP",
    "FLAG",
    "MODEL_HELP",
    "DeviceOpt",
    "EngineOpt",
    "JsonAliasOpt",
    "MaxNewOpt",
    "ModelOpt",
    "OutputOpt",
    "RawOpt",
    "SeedOpt",
    "TempOpt",
    "TopKOpt",
    "alias",
    "check_device",
    "check_encoder",
    "check_model",
    "check_output",
    "fail",
    "finite",
    "guarded",
    "load",
    "load_vllm",
    "read_jsonl",
    "read_profile",
    "read_prompts",
    "read_text",
    "renamed",
    "set_debug",
    "tokenizer",
    "vllm_engine",
]

T = TypeVar("T")
_state = {"debug": False}


def set_debug(on: bool) -> None:
    """``ngrav --debug``: errors print their traceback, too."""
    _state["debug"] = bool(on)


def fail(message: str) -> NoReturn:
    """Print ``error: message`` on stderr (with the traceback under ``--debug``) and exit with code 2."""
    console = Console(stderr=True, soft_wrap=True)
    if _state["debug"] and sys.exc_info()[0] is not None:
        traceback.print_exc()
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(2)


def guarded(fn: Callable[[], T]) -> T:
    """``fn()``, with a :class:`~narrative_gravity.errors.NarrativeGravityError` turned into one error line."""
    try:
        return fn()
    except NarrativeGravityError as exc:
        fail(str(exc))


def finite(value: float | None) -> float | None:
    """A typer callback: refuse ``nan`` and ``inf``."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number; give e.g. 0.7 (0 = greedy)")
    return value


FLAG = ""
"""The metavar of a switch: ``typer.Option("--trace", metavar=FLAG)`` shows no ``<bool>``, as it takes no value."""

DEFAULT_MAX_NEW_TOKENS = 80
"""``--max-new-tokens`` where a command writes one free text (generate, compare, answer, chat); eval and promote keep
the benchmark protocol's 60 and plan its longer 128 (several sections), each saying so in its help."""


def alias(old: str, new: str, value: T | None, given: T | None, *, unset: object = None) -> T | None:
    """The value of ``new`` given either as ``new`` or as its hidden old spelling ``old`` (kept for one release);
    both at once is an error naming the two."""
    if given is None or given == unset:
        return value
    if value is not None and value != unset:
        fail(f"{old} is the old spelling of {new}; give {new} only")
    return given


def _renamed_callback(old: str, hint: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is not None and value is not False:
            fail(f"{old} {hint}")
        return value

    return check


def renamed(old: str, hint: str, *, switch: bool = False) -> Any:
    """A hidden option kept only to end an old command line with one error line naming the new flag, where the old
    spelling cannot stay an alias (it means something else on another command). Its help starts ``renamed:``."""
    return typer.Option(
        old, hidden=True, is_flag=switch, callback=_renamed_callback(old, hint), help=f"renamed: {old} {hint}"
    )


MODEL_HELP = "smollm2 (default), gemma3-270m, a HF folder or a .gguf file"
DEVICE_HELP = "transformers engine: cpu, cuda, cuda:N, mps or auto (CUDA, MPS, else CPU)"
ModelOpt = Annotated[str | None, typer.Option("--model", help=MODEL_HELP)]
RawOpt = Annotated[bool, typer.Option("--raw", metavar=FLAG, help="plain continuation, no chat template")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", min=1, help="token budget per prompt")]
OutputOpt = Annotated[Path | None, typer.Option("--output", help="save every text and metric as JSON (a file)")]
JsonAliasOpt = Annotated[Path | None, typer.Option("--json", hidden=True, help="old spelling of --output")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="top-k sampling (0 = off)")]
TempOpt = Annotated[float, typer.Option("--temperature", min=0.0, callback=finite, help="0 = greedy decoding")]
SeedOpt = Annotated[int, typer.Option("--seed", help="random seed")]
EngineOpt = Annotated[
    str, typer.Option("--engine", help="hf (transformers, default) or vllm (in-process vLLM, from .venv-vllm)")
]
DeviceOpt = Annotated[str, typer.Option("--device", help=DEVICE_HELP)]


def read_text(path: Path, flag: str) -> str:
    """The UTF-8 text of an input file, or one error line naming ``flag``, the path and the fix."""
    if not path.exists():
        fail(f"{flag} {str(path)!r} does not exist; check the path")
    if path.is_dir():
        fail(f"{flag} {str(path)!r} is a folder; give a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"{flag} {str(path)!r} cannot be read: {exc.strerror or exc}; check its permissions")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        fail(
            f"{flag} {str(path)!r} is not UTF-8 text (byte {exc.start}, line {line}); save it as UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > fixed.txt"
        )


def read_jsonl(path: Path, flag: str, field: str | None) -> list[Any]:
    """The values of a JSONL file (blank lines skipped), each an object with a string ``field`` unless ``field`` is
    ``None``; or one error line."""
    rows = []
    for n, line in enumerate(read_text(path, flag).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            fail(
                f"{path}:{n}: not valid JSON ({exc.msg}); each line must be an object with a `{field or 'text'}` field"
            )
        if field is not None and (not isinstance(row, dict) or not isinstance(row.get(field), str)):
            fail(f"{path}:{n}: each line must be a JSON object with a string `{field}` field")
        rows.append(row)
    return rows


def read_prompts(path: Path) -> list[str]:
    """One prompt per line (``.txt``), or JSONL with a ``prompt`` field; an empty file is an error."""
    if path.suffix.lower() == ".jsonl":
        prompts = [row["prompt"] for row in read_jsonl(path, "--prompts", "prompt")]
    else:
        prompts = [line for line in read_text(path, "--prompts").splitlines() if line.strip()]
    if not prompts:
        fail(f"prompt file {str(path)!r} has no prompts; write one prompt per line (.txt) or JSONL with `prompt`")
    return prompts


def check_output(path: Path | None, flag: str, *, folder: bool = False) -> None:
    """Fail now, before a model loads, if ``path`` cannot be written (``folder``: a folder to write into)."""
    if path is None:
        return
    if folder:
        if path.exists() and not path.is_dir():
            fail(f"{flag} {str(path)!r} is a file, but a folder is needed; choose another path")
    elif path.is_dir():
        fail(f"{flag} {str(path)!r} is a folder; give a file path inside it, e.g. {path / 'out.jsonl'}")
    parent = path if folder else path.parent
    for up in (parent, *parent.parents):
        if up.exists():
            if not up.is_dir():
                fail(f"{flag} {str(path)!r} cannot be created: {str(up)!r} is a file, not a folder")
            if not os.access(up, os.W_OK | os.X_OK):
                fail(f"{flag} {str(path)!r} cannot be created: {str(up)!r} is not writable")
            break
    if not folder and path.exists() and not os.access(path, os.W_OK):
        fail(f"{flag} {str(path)!r} is not writable; choose another path")


def check_model(model: str | None) -> None:
    """Fail now if ``--model`` names nothing loadable (a missing path, a file that is not GGUF)."""
    source = guarded(lambda: resolve_model(model))
    if source.gguf_file is not None:
        path = source.folder / source.gguf_file
        try:
            with path.open("rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            fail(f"--model {str(path)!r} cannot be read: {exc.strerror or exc}")
        if magic != b"GGUF":
            fail(
                f"--model {str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes); give a "
                "real .gguf file, a Hugging Face model folder, smollm2 or gemma3-270m"
            )


def check_encoder(name: str) -> None:
    """``--encoder`` must be ``minilm`` (the default) or ``hashing``."""
    if name not in ("minilm", "hashing"):
        fail(f"--encoder must be minilm or hashing, got {name!r}")


def read_profile(path: Path) -> Profile:
    """A profile file, validated; text that cannot be encoded (a lone surrogate) is refused by name."""
    prof = guarded(lambda: load_profile(path))
    bad = unencodable(prof.model_dump(mode="python"))
    if bad is not None:
        fail(f"--profile {str(path)!r}: `{bad}` holds text that cannot be encoded as UTF-8 (a lone surrogate?)")
    head = prof.prune.head if prof.prune is not None else None
    if head is not None and head.file is not None:  # a damaged or foreign list fails before the model loads
        from ..engines.shortlist import load_frequency_list  # torch: not for --help

        freq = guarded(lambda: load_frequency_list(head.file))
        if head.shortlist > freq.ids.size:
            fail(
                f"--profile {str(path)!r}: prune.head.shortlist is {head.shortlist}, but {head.file} ranks only "
                f"{freq.ids.size} tokens; lower it, or build a longer list with `ngrav shortlist build --keep N`"
            )
    return prof


def load(model: str | None, device: str = "cpu") -> tuple[Any, Any]:
    """The model and its tokenizer, or one error line (a missing or damaged model)."""
    check_model(model)
    with Console(stderr=True).status(f"loading {model or 'smollm2'} (first use converts the GGUF once, ~30 s)"):
        try:
            return load_model(model, device=device)
        except NarrativeGravityError as exc:
            fail(str(exc))
        except (OSError, ValueError, RuntimeError) as exc:  # a damaged model file
            fail(f"--model {model or 'smollm2'} cannot be loaded: {exc}; check the file or folder")


def tokenizer(model: str | None) -> Any:
    """The tokenizer of ``--model``, or one error line."""
    return guarded(lambda: load_tokenizer(model))


def check_device(engine: str, device: str) -> None:
    """One error line where ``device`` cannot be used: any but ``cpu`` with the vLLM engine (it places the model
    itself), or one this machine lacks (checked before anything loads)."""
    guarded(lambda: check_device_for(engine, device))
    if engine == "hf":
        guarded(lambda: resolve_device(device))  # imports torch: only once the command runs


def vllm_engine() -> ModuleType:
    """:mod:`narrative_gravity.engines.vllm_generate`, or one error line naming the setup when vLLM cannot be
    imported here."""
    from ..engines import vllm_generate  # imports vLLM, which lives in its own venv: only for --engine vllm

    guarded(vllm_generate.require_vllm)
    return vllm_generate


def load_vllm(model: str | None, texts: list[str], options: Any, profile: Profile | None = None) -> Any:
    """A :class:`~narrative_gravity.engines.vllm_generate.VLLMGenerator` for ``options.batch_size`` requests at
    once, sized for the longest of ``texts`` (after ``profile``'s topic sentence) plus its budget; or one error
    line."""
    if profile is not None and profile.prune is not None and profile.prune.head is not None:
        fail("prune.head (the shortlist head) runs on the transformers engine only; use --engine hf")
    engine = vllm_engine()
    check_model(model)
    tok = tokenizer(model)
    with Console(stderr=True).status(f"starting vLLM on {model or 'smollm2'} (~30 s on a CPU)"):
        try:
            return engine.VLLMGenerator.for_prompts(model, texts, options, profile=profile, tokenizer=tok)
        except NarrativeGravityError as exc:
            fail(str(exc))
        except (OSError, ValueError, RuntimeError) as exc:  # a model vLLM cannot run, or a damaged folder
            fail(f"--model {model or 'smollm2'} cannot be started on vLLM: {exc}; check it, or use --engine hf")
