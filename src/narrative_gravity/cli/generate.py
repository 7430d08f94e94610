"""``ngrav generate``: a continuation for every prompt of a file, with or without gravity, on either engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ..engines.options import GenerationOptions
from .common import (
    DEFAULT_MAX_NEW_TOKENS,
    FLAG,
    DeviceOpt,
    EngineOpt,
    MaxNewOpt,
    ModelOpt,
    RawOpt,
    SeedOpt,
    TempOpt,
    TopKOpt,
    check_device,
    check_output,
    fail,
    guarded,
    load,
    load_vllm,
    read_profile,
    read_prompts,
)

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")


@app.command()
def generate(
    prompts: Annotated[Path, typer.Option("--prompts", help="one prompt per line (.txt) or JSONL with `prompt`")],
    output: Annotated[Path, typer.Option("--output", help="where to write one JSON object per prompt")],
    profile: Annotated[Path | None, typer.Option("--profile", help="profile file (.json/.yaml)")] = None,
    no_gravity: Annotated[bool, typer.Option("--no-gravity", metavar=FLAG, help="plain decoding (control)")] = False,
    raw: RawOpt = False,
    model: ModelOpt = None,
    max_new_tokens: MaxNewOpt = DEFAULT_MAX_NEW_TOKENS,
    top_k: TopKOpt = 10,
    temperature: TempOpt = 1.0,
    seed: SeedOpt = 0,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="prompts per batch (left-padded; on vLLM, requests at once)")
    ] = 8,
    trace: Annotated[
        bool, typer.Option("--trace", metavar=FLAG, help="record entropy, narrative mass, KL and λ")
    ] = False,
    engine: EngineOpt = "hf",
    device: DeviceOpt = "cpu",
) -> None:
    """Generate a continuation for every prompt, with or without gravity.

    With `--engine vllm` the prompts run on an in-process vLLM engine (from .venv-vllm), each request carrying
    the profile; the output has the same fields. `--no-gravity` keeps no trace there. `--device cuda` runs the
    transformers engine on a GPU (the steering kernel follows the logits there).

    Example: ngrav generate --prompts prompts.txt --profile profiles/space.yaml --raw --output out.jsonl
    """
    options = guarded(
        lambda: GenerationOptions(
            max_new_tokens, top_k, temperature, seed=seed, raw=raw, batch_size=batch_size, trace=trace,
            engine=engine, device=device,
        )
    )  # fmt: skip
    check_device(engine, device)
    texts = read_prompts(prompts)
    if profile is None and not no_gravity:
        fail("give --profile FILE for gravity, or --no-gravity for plain decoding")
    check_output(output, "--output")
    prof = read_profile(profile) if profile is not None else None
    run = _vllm_batches(model, texts, prof, options, no_gravity) if engine == "vllm" else None
    if run is None:
        run = _hf_batches(model, prof, options, no_gravity)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fh = output.open("w", encoding="utf-8")
    except OSError as exc:
        fail(f"--output {str(output)!r} cannot be written: {exc.strerror or exc}")
    with fh:
        results = _write_batches(run, texts, options.batch_size, fh, prof, no_gravity)
    total_tokens = sum(r.new_tokens for r in results)
    total_s = sum(r.seconds for r in results)
    typer.echo(
        f"wrote {len(results)} generations to {output} ({total_tokens} tokens, "
        f"{total_tokens / max(total_s, 1e-9):.1f} tok/s)"
    )


Batches = Any  # (prompts, advance) -> results, on the chosen engine


def _hf_batches(model: str | None, prof: Any, options: GenerationOptions, no_gravity: bool) -> Batches:
    from ..engines.hf_generate import generate_with_profile  # torch and transformers: not for --help

    m, tok = load(model, options.device)
    return lambda chunk, advance: generate_with_profile(
        m, tok, chunk, prof, options, measure_only=no_gravity, progress=advance
    )


def _vllm_batches(
    model: str | None, texts: list[str], prof: Any, options: GenerationOptions, no_gravity: bool
) -> Batches:
    pull = None if no_gravity else prof
    gen = load_vllm(model, texts, options, profile=pull)
    return lambda chunk, advance: gen.generate_texts(chunk, options, pull, progress=advance)


def _write_batches(run: Batches, texts: list[str], size: int, fh: Any, prof: Any, no_gravity: bool) -> list[Any]:
    """Run every batch, writing each as soon as it is done (an interrupt keeps what is finished).

    Each batch is seeded alike, so running them one call at a time gives the same rows as one call.
    """
    results: list[Any] = []
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"))
    with Progress(*columns, TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task("generating", total=len(texts))
        for start in range(0, len(texts), size):
            done = guarded(lambda start=start: run(texts[start : start + size], lambda n: bar.advance(task, n)))
            for r in done:
                row = r.to_json()
                row["gravity"] = not no_gravity
                if prof is not None:
                    row["profile"] = prof.name
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
            results.extend(done)
    return results
