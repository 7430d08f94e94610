"""The ``ngrav`` command line. Heavy modules are imported inside each command so ``--help`` is instant.

Examples::

    ngrav compare --profile profiles/binary_search.json \\
        --prompt "Write a binary search in Java and explain its time complexity." --seeds 5
    ngrav generate --prompts prompts.txt --profile profiles/space.yaml --raw --output out.jsonl
    ngrav inspect --profile profiles/binary_search.json

Every user mistake (a missing or unreadable file, an output path that cannot be written, a model that is not
there) ends in one line naming the problem and the fix, with exit code 2, before any model is loaded.
``ngrav --debug COMMAND`` prints the traceback as well.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import NarrativeGravityError
from .common import fail as _fail
from .common import set_debug
from .profile import profile_app

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Keep LLM generation on its narrative while it decodes.",
    rich_markup_mode="rich",
)
app.add_typer(profile_app, name="profile")


@app.callback()
def _main(
    debug: Annotated[bool, typer.Option("--debug", help="print the traceback of an error, too")] = False,
) -> None:
    set_debug(debug)


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number; give e.g. 0.7 (0 = greedy)")
    return value


ModelOpt = Annotated[
    str | None, typer.Option("--model", help="smollm2 (default), gemma3-270m, a HF folder or a .gguf file")
]
RawOpt = Annotated[bool, typer.Option("--raw", help="plain continuation, no chat template")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", min=1, help="token budget per prompt")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="top-k sampling (0 = off)")]
TempOpt = Annotated[float, typer.Option("--temperature", min=0.0, callback=_finite, help="0 = greedy decoding")]
SeedOpt = Annotated[int, typer.Option("--seed", help="random seed")]
EngineOpt = Annotated[
    str, typer.Option("--engine", help="hf (transformers, default) or vllm (in-process vLLM, from .venv-vllm)")
]
DeviceOpt = Annotated[
    str, typer.Option("--device", help="transformers engine: cpu, cuda, cuda:N, mps or auto (CUDA, MPS, else CPU)")
]


def _read_text(path: Path, flag: str) -> str:
    """The UTF-8 text of an input file, or one error line naming ``flag``, the path and the fix."""
    if not path.exists():
        _fail(f"{flag} {str(path)!r} does not exist; check the path")
    if path.is_dir():
        _fail(f"{flag} {str(path)!r} is a folder; give a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        _fail(f"{flag} {str(path)!r} cannot be read: {exc.strerror or exc}; check its permissions")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        _fail(
            f"{flag} {str(path)!r} is not UTF-8 text (byte {exc.start}, line {line}); save it as UTF-8, e.g. "
            f"iconv -f latin1 -t utf-8 {path} > fixed.txt"
        )
    raise AssertionError("unreachable")  # pragma: no cover


def _check_output(path: Path | None, flag: str, *, folder: bool = False) -> None:
    """Fail now, before a model loads, if ``path`` cannot be written (``folder``: a folder to write into)."""
    if path is None:
        return
    if folder:
        if path.exists() and not path.is_dir():
            _fail(f"{flag} {str(path)!r} is a file, but a folder is needed; choose another path")
    elif path.is_dir():
        _fail(f"{flag} {str(path)!r} is a folder; give a file path inside it, e.g. {path / 'out.jsonl'}")
    parent = path if folder else path.parent
    for up in (parent, *parent.parents):
        if up.exists():
            if not up.is_dir():
                _fail(f"{flag} {str(path)!r} cannot be created: {str(up)!r} is a file, not a folder")
            if not os.access(up, os.W_OK | os.X_OK):
                _fail(f"{flag} {str(path)!r} cannot be created: {str(up)!r} is not writable")
            break
    if not folder and path.exists() and not os.access(path, os.W_OK):
        _fail(f"{flag} {str(path)!r} is not writable; choose another path")


def _check_model(model: str | None) -> None:
    """Fail now if ``--model`` names nothing loadable (a missing path, a file that is not GGUF)."""
    from ..models import resolve_model

    source = _run_guarded(lambda: resolve_model(model))
    if source.gguf_file is not None:
        path = source.folder / source.gguf_file
        try:
            with path.open("rb") as fh:
                magic = fh.read(4)
        except OSError as exc:
            _fail(f"--model {str(path)!r} cannot be read: {exc.strerror or exc}")
        if magic != b"GGUF":
            _fail(
                f"--model {str(path)!r} is not a GGUF file (it does not start with the GGUF magic bytes); give a "
                "real .gguf file, a Hugging Face model folder, smollm2 or gemma3-270m"
            )


def _load_profile(path: Path) -> Any:
    """A profile file, validated; text that cannot be encoded (a lone surrogate) is refused by name."""
    from ..profiles.schema import load_profile
    from ..server.protocol import unencodable

    prof = _run_guarded(lambda: load_profile(path))
    bad = unencodable(prof.model_dump(mode="python"))
    if bad is not None:
        _fail(f"--profile {str(path)!r}: `{bad}` holds text that cannot be encoded as UTF-8 (a lone surrogate?)")
    return prof


def _read_prompts(path: Path) -> list[str]:
    text = _read_text(path, "--prompts")
    if path.suffix.lower() == ".jsonl":
        prompts = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                _fail(f"{path}:{n}: not valid JSON ({exc.msg}); each line must be an object with a `prompt` field")
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                _fail(f"{path}:{n}: each line must be a JSON object with a string `prompt` field")
            prompts.append(row["prompt"])
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        _fail(f"prompt file {str(path)!r} has no prompts; write one prompt per line (.txt) or JSONL with `prompt`")
    return prompts


def _load(model: str | None, device: str = "cpu") -> tuple[Any, Any]:
    from rich.console import Console

    from ..models import load_model

    _check_model(model)
    with Console(stderr=True).status(f"loading {model or 'smollm2'} (first use converts the GGUF once, ~30 s)"):
        try:
            return load_model(model, device=device)
        except NarrativeGravityError as exc:
            _fail(str(exc))
        except (OSError, ValueError, RuntimeError) as exc:  # a damaged model file
            _fail(f"--model {model or 'smollm2'} cannot be loaded: {exc}; check the file or folder")
    raise AssertionError("unreachable")  # pragma: no cover


def _encoder(name: str) -> Any:
    """The sentence encoder an ``--encoder`` option names: ``None`` for MiniLM (the default), or hashing."""
    if name not in ("minilm", "hashing"):
        _fail(f"--encoder must be minilm or hashing, got {name!r}")
    from ..levels.context import hashing_encoder

    return hashing_encoder() if name == "hashing" else None


def _run_guarded(fn: Any) -> Any:
    try:
        return fn()
    except NarrativeGravityError as exc:
        _fail(str(exc))


@app.command()
def generate(
    prompts: Annotated[Path, typer.Option("--prompts", help="one prompt per line (.txt) or JSONL with `prompt`")],
    output: Annotated[Path, typer.Option("--output", help="where to write one JSON object per prompt")],
    profile: Annotated[Path | None, typer.Option("--profile", help="profile file (.json/.yaml)")] = None,
    no_gravity: Annotated[bool, typer.Option("--no-gravity", help="plain decoding (control)")] = False,
    raw: RawOpt = False,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = 64,
    top_k: TopKOpt = 10,
    temperature: TempOpt = 1.0,
    seed: SeedOpt = 0,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="prompts per batch (left-padded; on vLLM, requests at once)")
    ] = 8,
    trace: Annotated[bool, typer.Option("--trace", help="record entropy, narrative mass, KL and λ")] = False,
    engine: EngineOpt = "hf",
    device: DeviceOpt = "cpu",
) -> None:
    """Generate a continuation for every prompt, with or without gravity.

    With `--engine vllm` the prompts run on an in-process vLLM engine (from .venv-vllm), each request carrying
    the profile; the output has the same fields. `--no-gravity` keeps no trace there. `--device cuda` runs the
    transformers engine on a GPU (the steering kernel follows the logits there).

    Example: ngrav generate --prompts prompts.txt --profile profiles/space.yaml --raw --output out.jsonl
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from ..engines.hf_generate import SamplingOptions, check_engine, vllm_engine
    from ..engines.hf_generate import generate as run
    from ..lead import lead_sentence, reading_profile
    from ..profiles.build import processor_from_profile

    if engine == "vllm" and device != "cpu":
        _fail("--device is for the transformers engine; vLLM places the model on its own device")
    _run_guarded(lambda: check_engine(engine))
    texts = _read_prompts(prompts)
    if profile is None and not no_gravity:
        _fail("give --profile FILE for gravity, or --no-gravity for plain decoding")
    _check_output(output, "--output")
    prof = _load_profile(profile) if profile is not None else None
    options = _run_guarded(lambda: SamplingOptions(max_new_tokens, top_k, temperature, seed))
    lead = None if no_gravity else _run_guarded(lambda: lead_sentence(prof, raw=raw))
    if lead is not None:
        prof = reading_profile(prof, raw=raw)  # the pull while the sentence is read (its KL budget)
    batch: Any  # (prompts, advance) -> results, on the chosen engine
    if engine == "vllm":
        vllm_generate = _run_guarded(vllm_engine)
        gen = _load_vllm(
            vllm_generate, model, texts, raw=raw, max_new_tokens=max_new_tokens, batch_size=batch_size, lead=lead
        )
        pull = None if no_gravity else prof

        def batch(chunk: list[str], advance: Any) -> Any:
            return gen.generate_texts(chunk, options, pull, raw=raw, record_trace=trace, progress=advance)

    else:
        m, tok = _load(model, device)

        def factory(budget: int, tr: Any) -> Any:
            if prof is None:
                return None
            return processor_from_profile(
                prof, tok, max_new_tokens=budget, trace=tr, measure_only=no_gravity, model=m, inplace=True
            )

        def batch(chunk: list[str], advance: Any) -> Any:
            return run(
                m,
                tok,
                chunk,
                options=options,
                processor_factory=factory,
                raw=raw,
                batch_size=batch_size,
                record_trace=trace,
                progress=advance,
                lead=lead,
            )

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fh = output.open("w", encoding="utf-8")
    except OSError as exc:
        _fail(f"--output {str(output)!r} cannot be written: {exc.strerror or exc}")
    results: list[Any] = []
    # Each batch is seeded alike, so running them one call at a time gives the same rows as one call; every
    # batch is written as soon as it is done, and an interrupt keeps what is finished.
    with (
        fh,
        Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeRemainingColumn(),
            transient=True,
        ) as bar,
    ):
        task = bar.add_task("generating", total=len(texts))
        for start in range(0, len(texts), batch_size):
            done = _run_guarded(
                lambda start=start: batch(texts[start : start + batch_size], lambda n: bar.advance(task, n))
            )
            for r in done:
                row = r.to_json()
                row["gravity"] = not no_gravity
                if prof is not None:
                    row["profile"] = prof.name
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
            results.extend(done)
    total_tokens = sum(r.new_tokens for r in results)
    total_s = sum(r.seconds for r in results)
    typer.echo(
        f"wrote {len(results)} generations to {output} ({total_tokens} tokens, "
        f"{total_tokens / max(total_s, 1e-9):.1f} tok/s)"
    )


def _load_vllm(
    vllm_generate: Any,
    model: str | None,
    texts: list[str],
    *,
    raw: bool,
    max_new_tokens: int,
    batch_size: int,
    lead: str | None = None,
) -> Any:
    """A :class:`~narrative_gravity.engines.vllm_generate.VLLMGenerator` sized for ``texts``, or one error line."""
    from rich.console import Console

    from ..engines.hf_generate import encode_prompts
    from ..models import load_tokenizer

    _check_model(model)
    tok = _run_guarded(lambda: load_tokenizer(model))
    longest = (
        max(len(ids) for ids in _run_guarded(lambda: encode_prompts(tok, texts, raw=raw, lead=lead))) + max_new_tokens
    )
    with Console(stderr=True).status(f"starting vLLM on {model or 'smollm2'} (~30 s on a CPU)"):
        try:
            return vllm_generate.VLLMGenerator.load(model, max_num_seqs=batch_size, longest=longest, tokenizer=tok)
        except NarrativeGravityError as exc:
            _fail(str(exc))
        except (OSError, ValueError, RuntimeError) as exc:  # a model vLLM cannot run, or a damaged folder
            _fail(f"--model {model or 'smollm2'} cannot be started on vLLM: {exc}; check it, or use --engine hf")
    raise AssertionError("unreachable")  # pragma: no cover


@app.command()
def compare(
    profile: Annotated[Path, typer.Option("--profile", help="profile file (.json/.yaml)")],
    prompt: Annotated[str, typer.Option("--prompt", help="the prompt to continue")],
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="number of seeds; control and gravity share each")] = 3,
    raw: RawOpt = False,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = 80,
    top_k: TopKOpt = 10,
    temperature: TempOpt = 1.0,
    plot: Annotated[Path | None, typer.Option("--plot", help="save a PNG of the thermometer traces")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="save every text and metric as JSON")] = None,
    show: Annotated[int, typer.Option("--show", min=0, help="how many seed pairs to print side by side")] = 2,
) -> None:
    """Run control (no gravity) and gravity with the same seeds; print texts side by side and a metrics table.

    Example: ngrav compare --profile profiles/binary_search.json --prompt "Write a binary search in Java." --seeds 20
    """
    from ..compare import run_compare

    prof = _load_profile(profile)
    _check_output(plot, "--plot")
    _check_output(json_out, "--json")
    m, tok = _load(model)
    _run_guarded(
        lambda: run_compare(
            m,
            tok,
            prof,
            prompt,
            seeds=seeds,
            raw=raw,
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            temperature=temperature,
            plot=plot,
            json_out=json_out,
            show=show,
        )
    )


@app.command()
def inspect(
    profile: Annotated[Path, typer.Option("--profile", help="profile file (.json/.yaml)")],
    model: ModelOpt = None,
) -> None:
    """Show how a profile's words map onto a model's tokenizer, and which words could not be used.

    Example: ngrav inspect --profile profiles/binary_search.json --model gemma3-270m
    """
    from rich.console import Console
    from rich.table import Table

    from ..models import load_tokenizer
    from ..profiles.build import field_from_profile

    prof = _load_profile(profile)
    if prof.field.mode != "lexical" and prof.field.semantic_source == "lm":  # the field reads the LM's embeddings
        lm, tok = _load(model)
    else:
        lm, tok = None, _run_guarded(lambda: load_tokenizer(model))
    field = _run_guarded(lambda: field_from_profile(prof, tok, model=lm))
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
    wordlists: Annotated[list[Path], typer.Argument(help="word list files, one word per line")],
    model: ModelOpt = None,
) -> None:
    """Count, per word list, the words that no surface form of the tokenizer can write.

    Example: ngrav reach ../shared/bench/topics/wordlists/*.txt
    """
    from rich.console import Console
    from rich.table import Table

    from ..fields.lexical import reach as reach_words
    from ..models import load_tokenizer

    tok = _run_guarded(lambda: load_tokenizer(model))
    table = Table(title=f"reach in {model or 'smollm2'}")
    for col in ("list", "words", "unreachable", "reachable %", "unreachable words"):
        table.add_column(col)
    worst = 100.0
    for path in wordlists:
        words = [w.strip() for w in _read_text(path, "word list").splitlines() if w.strip()]
        ok, bad = reach_words(tok, words)
        pct = 100.0 * len(ok) / max(1, len(words))
        worst = min(worst, pct)
        table.add_row(path.stem, str(len(words)), str(len(bad)), f"{pct:.1f}", ", ".join(bad[:8]))
    Console().print(table)
    if worst < 99.0:
        raise typer.Exit(1)


@app.command("eval")
def eval_command(
    prompts: Annotated[
        str,
        typer.Option(
            "--prompts",
            help="`topics` (the PPLM/FUDGE set), `empath` (25 Empath subject topics, the test half), `topics-tune` / "
            "`empath-tune` (tuning splits), a .txt file, or JSONL with `prompt`",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", help="run folder: results.jsonl, summary.json, report.md/.html")],
    profile: Annotated[
        list[str] | None,
        typer.Option(
            "--profile",
            help="repeat for several arms: a profile file; `auto` (one profile per topic from its words, with "
            "the settings of profiles/topic.yaml); "
            "`auto:TEMPLATE.json` (the same, from a template, named after it); `article` (the blog-post "
            "processor); `weighted:λ` (weighted decoding)",
        ),
    ] = None,
    samples: Annotated[int | None, typer.Option("--samples", min=1, help="samples per prompt: seeds 0..N-1")] = None,
    seeds: Annotated[str | None, typer.Option("--seeds", help="explicit seeds, e.g. 0,1,2 or 0-4")] = None,
    max_new_tokens: MaxNewOpt = 60,
    top_k: TopKOpt = 10,
    temperature: TempOpt = 1.0,
    raw: Annotated[
        bool | None,
        typer.Option("--raw/--chat", help="plain continuation or chat template (default: --raw for topic sets)"),
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="prompts per batch (left-padded)")] = 8,
    model: ModelOpt = None,
    judge: Annotated[
        str, typer.Option("--judge", help="perplexity judge: gemma3-270m (default), a model path, or none")
    ] = "gemma3-270m",
    metrics: Annotated[
        str | None, typer.Option("--metrics", help="comma-separated metric names (default: all)")
    ] = None,
    limit_prompts: Annotated[
        int | None, typer.Option("--limit-prompts", min=1, help="keep N prompts, spread over the topics")
    ] = None,
    auto_template: Annotated[
        str | None, typer.Option("--auto-template", help="profile whose settings `auto` profiles start from")
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="continue the run in --out; finished rows are kept")] = False,
    report_only: Annotated[
        bool, typer.Option("--report-only", help="rebuild the reports of --out, generate nothing")
    ] = False,
    engine: EngineOpt = "hf",
) -> None:
    """Evaluate profiles against control (no gravity) on a prompt set, with paired statistics and reports.

    Control runs with the same seeds, batches and settings as every profile. `--profile auto` (with `--prompts
    topics` or `empath`, or JSONL prompts that carry a `topic` list) builds one profile per topic from the
    conditioning half of its word list; the held-out half only scores. Results are appended as they are made:
    after Ctrl-C or a kill, rerun the same command with `--resume`.

    Examples:

        ngrav eval --prompts topics --profile auto --samples 1 --max-new-tokens 40 --out out/topics

        ngrav eval --prompts prompts.jsonl --profile profiles/space.yaml --seeds 0-4 --out out/space --resume

    With `--engine vllm` (run from .venv-vllm) every profile arm runs on an in-process vLLM engine and the judge
    stays on transformers; the `article` and `weighted:λ` baselines run on `--engine hf` only.
    """
    from ..engines.hf_generate import vllm_engine
    from ..eval.command import run_command
    from ..eval.runner import check_engine_arms

    if not profile and not report_only:
        _fail("give --profile FILE (repeat for several) or --profile auto")
    if not report_only:
        from ..eval.prompts import TOPIC_SETS

        _run_guarded(lambda: check_engine_arms(profile or [], engine))
        if prompts not in TOPIC_SETS:
            _read_text(Path(prompts), "--prompts")
        _check_output(out, "--out", folder=True)
        _check_model(model)
        if engine == "vllm":
            _run_guarded(vllm_engine)
    _run_guarded(
        lambda: run_command(
            prompts=prompts,
            profiles=list(profile or []),
            out=out,
            samples=samples,
            seeds=seeds,
            max_new_tokens=max_new_tokens,
            top_k=top_k,
            temperature=temperature,
            raw=raw,
            batch_size=batch_size,
            model=model,
            judge=judge,
            metrics=metrics,
            limit_prompts=limit_prompts,
            auto_template=auto_template,
            resume=resume,
            report_only=report_only,
            engine=engine,
        )
    )


@app.command()
def serve(
    model: ModelOpt = None,
    host: Annotated[str, typer.Option("--host", help="interface to bind; keep 127.0.0.1 unless you set a key")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port")] = 8000,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key", envvar="NGRAV_API_KEY", help="require `Authorization: Bearer KEY` (prefer the env var)"
        ),
    ] = None,
    store: Annotated[
        Path | None, typer.Option("--store", envvar="NARRATIVE_GRAVITY_STORE", help="profile store folder")
    ] = None,
    engine: Annotated[
        str, typer.Option("--engine", help="hf (embedded transformers) or vllm (in-process vLLM; its own venv)")
    ] = "hf",
    device: DeviceOpt = "cpu",
    max_batch_size: Annotated[int, typer.Option("--max-batch-size", min=1, help="rows per generate call")] = 8,
    batch_window_ms: Annotated[
        float, typer.Option("--batch-window-ms", min=0.0, help="how long a batch waits to fill")
    ] = 20.0,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="rows that may wait; more get 429")] = 64,
    max_tokens_limit: Annotated[int, typer.Option("--max-tokens-limit", min=1, help="largest max_tokens")] = 1024,
    max_prompt_tokens: Annotated[
        int, typer.Option("--max-prompt-tokens", min=1, help="longest prompt (tokens)")
    ] = 4096,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", min=1, help="largest request body")] = 1_000_000,
    inline_gravity: Annotated[
        bool, typer.Option("--inline-gravity/--no-inline-gravity", help="accept inline profiles, or stored ones only")
    ] = True,
    insecure_no_auth: Annotated[
        bool, typer.Option("--insecure-no-auth", help="allow a non-loopback --host without an API key")
    ] = False,
    max_stages: Annotated[int, typer.Option("--max-stages", min=1, help="most `stages` of one profile")] = 16,
    max_words_per_list: Annotated[
        int, typer.Option("--max-words-per-list", min=1, help="most words in one word list of a profile")
    ] = 256,
    max_words: Annotated[int, typer.Option("--max-words", min=1, help="most words of one profile, in all")] = 1024,
    max_semantic_top_k: Annotated[
        int, typer.Option("--max-semantic-top-k", min=1, help="largest field.semantic_top_k / thermostat.candidates")
    ] = 5000,
    max_neighbours: Annotated[
        int, typer.Option("--max-neighbours", min=1, help="largest field.neighbours of a profile")
    ] = 500,
    max_semantic_cache_entries: Annotated[
        int, typer.Option("--max-semantic-cache-entries", min=1, help="semantic fields kept in the disk cache (LRU)")
    ] = 256,
    prefill_tokens: Annotated[
        int,
        typer.Option(
            "--prefill-tokens", min=0, help="vLLM: new prompt tokens joining the batch per step (0: no limit)"
        ),
    ] = 512,
    read_timeout: Annotated[
        float, typer.Option("--read-timeout", min=0.001, help="seconds for request headers, or between body pieces")
    ] = 30.0,
    write_timeout: Annotated[
        float, typer.Option("--write-timeout", min=0.001, help="seconds a client may leave a response unread")
    ] = 60.0,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error")] = "info",
) -> None:
    """Serve an OpenAI-compatible API (chat, completions, streaming) with a `gravity` field per request.

    Needs the server extra: pip install 'narrative-gravity\\[server]'. See docs/server.md.

    Examples:

        ngrav serve --port 8000

        NGRAV_API_KEY=secret ngrav serve --host 0.0.0.0 --store /srv/ngrav/profiles

    Limits on what one request may make the server build (stages, words, semantic field size, disk cache) and
    the connection timeouts are described in docs/server.md.
    """

    if api_key is None and os.environ.get("NGRAV_API_KEY") == "":
        api_key = ""  # set but empty: refused below, never read as "no key"
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        _fail(f"--log-level must be debug, info, warning or error, got {log_level!r}")

    def run() -> None:
        from ..server import ServerConfig
        from ..server import serve as run_server

        config = ServerConfig(
            host=host,
            port=port,
            api_key=api_key,
            max_batch_size=max_batch_size,
            batch_window_ms=batch_window_ms,
            prefill_tokens=prefill_tokens,
            max_queue=max_queue,
            max_tokens_limit=max_tokens_limit,
            max_prompt_tokens=max_prompt_tokens,
            max_body_bytes=max_body_bytes,
            allow_inline_gravity=inline_gravity,
            insecure_no_auth=insecure_no_auth,
            max_stages=max_stages,
            max_words_per_list=max_words_per_list,
            max_words=max_words,
            max_semantic_top_k=max_semantic_top_k,
            max_neighbours=max_neighbours,
            max_semantic_cache_entries=max_semantic_cache_entries,
            read_timeout_s=read_timeout,
            write_timeout_s=write_timeout,
        )
        if store is not None:
            _check_output(store, "--store", folder=True)
        if engine == "hf":
            _check_model(model)
        run_server(config, model=model, engine=engine, device=device, store=store, log_level=log_level)

    _run_guarded(run)


@app.command()
def answer(
    question: Annotated[
        str | None, typer.Option("--question", help="the user's message (or give the whole --messages)")
    ] = None,
    messages: Annotated[
        Path | None, typer.Option("--messages", help='JSON list of {"role", "content"} turns, the question last')
    ] = None,
    documents: Annotated[
        Path | None, typer.Option("--documents", help='retrieved passages: JSONL, one {"text", "id"} per line')
    ] = None,
    profile: Annotated[
        Path | None, typer.Option("--profile", help="profile: gravity, and the levels it switches on")
    ] = None,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = 64,
    top_k: TopKOpt = 10,
    temperature: Annotated[
        float, typer.Option("--temperature", min=0.0, callback=_finite, help="0 = greedy decoding (default)")
    ] = 0.0,
    seed: SeedOpt = 0,
    engine: EngineOpt = "hf",
    json_out: Annotated[Path | None, typer.Option("--json", help="save the answer and the report as JSON")] = None,
) -> None:
    """Answer one request with every level the profile switches on: passages pruned (`context:`), earlier
    turns remembered (`conversation:`), a plan (`plan:`), then decoding with gravity; print what each did.

    This is what `ngrav serve` does for a chat request with `documents` (see docs/server.md).

    Example: ngrav answer --question "How did telescopes change astronomy?" --documents passages.jsonl \\
    --profile profiles/rag.yaml
    """
    from rich.console import Console

    from ..engines.hf_generate import SamplingOptions, check_engine, vllm_engine
    from ..levels.answer import answer as run_answer

    _run_guarded(lambda: check_engine(engine))
    if (question is None) == (messages is None):
        _fail("give --question TEXT or --messages FILE (one of them)")
    _check_output(json_out, "--json")
    if messages is not None:
        try:
            turns = json.loads(_read_text(messages, "--messages"))
        except json.JSONDecodeError as exc:
            _fail(f"--messages {str(messages)!r} is not valid JSON ({exc.msg}); give a list of {{role, content}}")
        if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns
        ):
            _fail(f'--messages {str(messages)!r} must be a JSON list of {{"role": ..., "content": ...}} objects')
    else:
        turns = [{"role": "user", "content": question}]
    docs = None
    if documents is not None:
        docs = []
        for n, line in enumerate(_read_text(documents, "--documents").splitlines(), 1):
            if not line.strip():
                continue
            try:
                docs.append(json.loads(line))
            except json.JSONDecodeError as exc:
                _fail(f"{documents}:{n}: not valid JSON ({exc.msg}); each line must be an object with a `text` field")
    prof = _load_profile(profile) if profile is not None else None
    options = _run_guarded(lambda: SamplingOptions(max_new_tokens, top_k, temperature, seed))
    kwargs: dict[str, Any] = {}
    if engine == "vllm":
        vllm_generate = _run_guarded(vllm_engine)
        kwargs["vllm"] = _load_vllm(vllm_generate, model, ["x"], raw=True, max_new_tokens=4096, batch_size=2)
    else:
        kwargs["model"], kwargs["tokenizer"] = _load(model)
    res = _run_guarded(lambda: run_answer(turns, documents=docs, profile=prof, options=options, **kwargs))
    console = Console()
    console.print(res.text)
    for line in _report_lines(res.report):
        console.print(line, highlight=False)
    if json_out is not None:
        body = {"answer": res.text, "pipeline": res.report, "messages": res.prepared.messages}
        json_out.write_text(json.dumps(body, indent=2, ensure_ascii=False), encoding="utf-8")


def _report_lines(report: dict[str, Any]) -> list[str]:
    """What each level did, one line each (for the terminal)."""
    out = []
    ctx = report.get("context")
    if ctx:
        out.append(
            f"context: kept {len(ctx['kept'])} of {len(ctx['kept']) + len(ctx['dropped'])} passages, "
            f"{ctx['tokens_kept']} of {ctx['tokens_total']} tokens"
            + (
                f" (budget {ctx['budget_tokens']})"
                if ctx.get("pruned")
                else " (not pruned: the profile has no context)"
            )
        )
        out += [f"  dropped {d['id']}: {d['reason']}" for d in ctx["dropped"]]
    mem = report.get("memory")
    if mem:
        words = ", ".join(f"{w} {x:.2f}" for w, x in mem["words"].items()) or "nothing yet"
        out.append(f"memory of {mem['turns']} earlier turn(s): {words}")
    plan_info = report.get("plan")
    if plan_info:
        out.append(f"plan: the best of {plan_info['drafts']} drafts: " + " | ".join(plan_info["outline"]))
    for s in report.get("stages", []):
        out.append(
            f"  stage {s['name']!r}: " + ("reached (" + ", ".join(s["words"]) + ")" if s["reached"] else "not reached")
        )
    return out


@app.command("prune-context")
def prune_context_command(
    question: Annotated[str, typer.Option("--question", help="the question the context must answer")],
    chunks: Annotated[Path, typer.Option("--chunks", help='JSONL, one chunk per line: {"text": ..., "id": ...}')],
    budget: Annotated[
        int | None, typer.Option("--budget", min=0, help="most chunk tokens to keep (default: no budget)")
    ] = None,
    profile: Annotated[
        Path | None, typer.Option("--profile", help="profile whose narrative joins the question")
    ] = None,
    model: ModelOpt = None,
    encoder: Annotated[
        str, typer.Option("--encoder", help="minilm (default) or hashing (word overlap only)")
    ] = "minilm",
    count: Annotated[str, typer.Option("--count", help="tokens (the model's tokenizer) or words")] = "tokens",
    json_out: Annotated[Path | None, typer.Option("--json", help="save every decision as JSON")] = None,
) -> None:
    """Score, cluster and trim retrieved chunks for a question; print what was kept and dropped, and why.

    Example: ngrav prune-context --question "How did telescopes change astronomy?" --chunks chunks.jsonl --budget 400
    """
    from rich.console import Console

    from ..levels.context import prune_context, result_table

    enc = _encoder(encoder)
    if count not in ("tokens", "words"):
        _fail(f"--count must be tokens or words, got {count!r}")
    _check_output(json_out, "--json")
    rows = []
    for n, line in enumerate(_read_text(chunks, "--chunks").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            _fail(f"{chunks}:{n}: not valid JSON ({exc.msg}); each line must be an object with a `text` field")
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            _fail(f"{chunks}:{n}: each line must be a JSON object with a string `text` field")
        rows.append(row)
    prof = _load_profile(profile) if profile is not None else None
    tok = None
    if count == "tokens":
        from ..models import load_tokenizer

        _check_model(model)
        tok = _run_guarded(lambda: load_tokenizer(model))
    result = _run_guarded(lambda: prune_context(question, rows, budget, profile=prof, tokenizer=tok, encoder=enc))
    console = Console()
    console.print(result_table(result))
    console.print(
        f"kept {len(result.kept)} of {len(result.decisions)} chunks; tokens saved: {result.tokens_saved} of "
        f"{result.tokens_total} ({100 * result.saved_fraction:.1f}%)"
        + ("" if count == "tokens" else ", counted as whitespace words")
    )
    if json_out is not None:
        json_out.write_text(json.dumps(result.to_json(), indent=2, ensure_ascii=False), encoding="utf-8")


@app.command()
def plan(
    prompt: Annotated[str, typer.Option("--prompt", help="what to write")],
    profile: Annotated[
        Path | None, typer.Option("--profile", help="profile: its narrative scores the drafts, its words join stages")
    ] = None,
    model: ModelOpt = None,
    drafts: Annotated[int, typer.Option("--drafts", min=1, help="outline drafts to sample (one batch)")] = 2,
    sections: Annotated[int, typer.Option("--sections", min=1, help="sections per outline")] = 3,
    outline_tokens: Annotated[int, typer.Option("--outline-tokens", min=1, help="token budget per draft")] = 28,
    max_new_tokens: MaxNewOpt = 128,
    strength: Annotated[
        float | None,
        typer.Option("--strength", min=0.0, help="λ_max of the thermostat (4.25), or λ with --schedule constant (3)"),
    ] = None,
    schedule: Annotated[
        str, typer.Option("--schedule", help="thermostat (the topic default) or constant")
    ] = "thermostat",
    semantic: Annotated[
        bool, typer.Option("--semantic/--no-semantic", help="keep the prompt's semantic field under every stage")
    ] = True,
    openings: Annotated[
        int, typer.Option("--openings", min=1, help="write from the best of K openings (1 = one text)")
    ] = 3,
    opening_tokens: Annotated[int, typer.Option("--opening-tokens", min=1, help="tokens per opening")] = 24,
    raw: RawOpt = False,
    seed: SeedOpt = 0,
    encoder: Annotated[
        str, typer.Option("--encoder", help="scores the drafts: minilm (default) or hashing (word overlap only)")
    ] = "minilm",
    json_out: Annotated[Path | None, typer.Option("--json", help="save the plan, drafts and text as JSON")] = None,
) -> None:
    """Plan-then-write: draft outlines, keep the best, and write along its sections with a staged field.

    Example: ngrav plan --prompt "Write a short article about coral reefs." --max-new-tokens 128
    """
    from rich.console import Console
    from rich.markup import escape

    from ..levels.plan import plan_table, plan_then_write

    enc = _encoder(encoder)
    if schedule not in ("thermostat", "constant"):
        _fail(f"--schedule must be thermostat or constant, got {schedule!r}")
    prof = _load_profile(profile) if profile is not None else None
    _check_output(json_out, "--json")
    m, tok = _load(model)
    console = Console()
    with Console(stderr=True).status(f"drafting {drafts} outlines and writing {max_new_tokens} tokens"):
        res = _run_guarded(
            lambda: plan_then_write(
                m,
                tok,
                prompt,
                profile=prof,
                n_drafts=drafts,
                sections=sections,
                outline_tokens=outline_tokens,
                max_new_tokens=max_new_tokens,
                strength=strength,
                schedule=schedule,
                semantic=semantic,
                openings=openings,
                opening_tokens=opening_tokens,
                raw=True if raw else None,
                seed=seed,
                encoder=enc,
            )
        )
    console.print(plan_table(res))
    for i, st in enumerate(res.stages, 1):
        console.print(
            f"[bold]stage {i}[/] ({st.share:.0%}): {escape(st.name)} [dim]<- {escape(', '.join(st.core_semantics))}[/]",
            highlight=False,
        )
    console.print(escape(res.text), highlight=False)
    console.print(
        f"[dim]tokens: {res.draft_tokens} drafting + {res.write_tokens} writing = {res.generated_tokens}; "
        f"final stage {[s + 1 for s in res.final_stage]}; {res.seconds:.1f} s[/]",
        highlight=False,
    )
    if json_out is not None:
        json_out.write_text(json.dumps(res.to_json(), indent=2, ensure_ascii=False), encoding="utf-8")


@app.command()
def chat(
    profile: Annotated[Path | None, typer.Option("--profile", help="profile file (.json/.yaml)")] = None,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = 96,
    decay: Annotated[
        float, typer.Option("--decay", min=0.0, max=0.99, help="how much topic memory survives a turn")
    ] = 0.5,
) -> None:
    """Chat with topic memory: each turn's topic is decayed into the next turn's field. Empty line or EOF ends.

    Example: ngrav chat --profile profiles/space.yaml
    """
    from rich.console import Console

    from ..levels.memory import Conversation, TopicMemory

    prof = _load_profile(profile) if profile is not None else None
    m, tok = _load(model)
    conv = Conversation(m, tok, profile=prof, memory=TopicMemory(decay=decay), max_new_tokens=max_new_tokens)
    console = Console()
    stdin = getattr(sys.stdin, "buffer", None)
    for n, raw_line in enumerate(stdin if stdin is not None else sys.stdin, 1):
        try:
            line = raw_line.decode("utf-8") if isinstance(raw_line, bytes) else raw_line
            line.encode("utf-8")  # a text stream may carry lone surrogates (surrogateescape)
        except UnicodeError:
            Console(stderr=True).print(
                f"[bold red]error:[/] input line {n} is not UTF-8 text; it was skipped (type it again)",
                highlight=False,
            )
            continue
        text = line.strip()
        if not text:
            break
        answer = _run_guarded(lambda text=text: conv.say(text))
        console.print(f"[bold]assistant:[/] {answer}", highlight=False)
        words = ", ".join(f"{w} {x:.2f}" for w, x in conv.memory.words().items())
        console.print(f"[dim]memory: {words}[/]", highlight=False)


def main() -> None:
    """Entry point of the ``ngrav`` console script."""
    try:
        app()
    except KeyboardInterrupt:  # pragma: no cover - interactive
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
