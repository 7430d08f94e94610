"""The article's other levels from the command line: ``ngrav answer`` (one request through every level),
``ngrav prune-context`` (passages), ``ngrav plan`` (plan-then-write) and ``ngrav chat`` (topic memory)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from ..engines.options import GenerationOptions, check_engine
from .common import (
    DEFAULT_MAX_NEW_TOKENS,
    FLAG,
    DeviceOpt,
    EngineOpt,
    JsonAliasOpt,
    MaxNewOpt,
    ModelOpt,
    RawOpt,
    SeedOpt,
    TopKOpt,
    alias,
    check_device,
    check_encoder,
    check_model,
    check_output,
    fail,
    finite,
    guarded,
    load,
    load_vllm,
    read_jsonl,
    read_profile,
    read_text,
    tokenizer,
)

__all__ = ["app"]

app = typer.Typer(rich_markup_mode="rich")


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
    max_new_tokens: MaxNewOpt = DEFAULT_MAX_NEW_TOKENS,
    top_k: TopKOpt = 10,
    temperature: Annotated[
        float, typer.Option("--temperature", min=0.0, callback=finite, help="0 = greedy decoding (default)")
    ] = 0.0,
    seed: SeedOpt = 0,
    engine: EngineOpt = "hf",
    device: DeviceOpt = "cpu",
    output: Annotated[
        Path | None, typer.Option("--output", help="save the answer and the report as JSON (a file)")
    ] = None,
    output_alias: JsonAliasOpt = None,
) -> None:
    """Answer one request with every level the profile switches on: passages pruned (`context:`), earlier
    turns remembered (`conversation:`), a plan (`plan:`), then decoding with gravity; print what each did.

    This is what `ngrav serve` does for a chat request with `documents` (see docs/server.md).

    Example: ngrav answer --question "How did telescopes change astronomy?" --documents passages.jsonl \\
    --profile profiles/rag.yaml
    """
    from ..levels.answer import answer as run_answer  # torch, transformers and MiniLM: not for --help

    guarded(lambda: check_engine(engine))
    if (question is None) == (messages is None):
        fail("give --question TEXT or --messages FILE (one of them)")
    json_out = alias("--json", "--output", output, output_alias)
    check_output(json_out, "--output")
    if messages is not None:
        try:
            turns = json.loads(read_text(messages, "--messages"))
        except json.JSONDecodeError as exc:
            fail(f"--messages {str(messages)!r} is not valid JSON ({exc.msg}); give a list of {{role, content}}")
        if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns
        ):
            fail(f'--messages {str(messages)!r} must be a JSON list of {{"role": ..., "content": ...}} objects')
    else:
        turns = [{"role": "user", "content": question}]
    docs = None if documents is None else read_jsonl(documents, "--documents", None)
    prof = read_profile(profile) if profile is not None else None
    options = guarded(
        lambda: GenerationOptions(max_new_tokens, top_k, temperature, seed=seed, engine=engine, device=device)
    )
    check_device(engine, device)
    kwargs: dict[str, Any] = {}
    if engine == "vllm":  # one request at a time, up to the model's whole context
        kwargs["vllm"] = load_vllm(model, ["x"], GenerationOptions(max_new_tokens=4096, batch_size=2, raw=True))
    else:
        kwargs["model"], kwargs["tokenizer"] = load(model, device)
    res = guarded(lambda: run_answer(turns, documents=docs, profile=prof, options=options, **kwargs))
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
    documents: Annotated[
        Path | None, typer.Option("--documents", help='retrieved passages: JSONL, one {"text", "id"} per line')
    ] = None,
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
    output: Annotated[Path | None, typer.Option("--output", help="save every decision as JSON (a file)")] = None,
    output_alias: JsonAliasOpt = None,
    documents_alias: Annotated[
        Path | None, typer.Option("--chunks", hidden=True, help="old spelling of --documents")
    ] = None,
) -> None:
    """Score, cluster and trim retrieved chunks for a question; print what was kept and dropped, and why.

    Example: ngrav prune-context --question "How did telescopes change astronomy?" --documents passages.jsonl \\
    --budget 400
    """
    from ..levels import context, ranking  # torch and MiniLM: not for --help

    check_encoder(encoder)
    enc = ranking.hashing_encoder() if encoder == "hashing" else None
    if count not in ("tokens", "words"):
        fail(f"--count must be tokens or words, got {count!r}")
    chunks = alias("--chunks", "--documents", documents, documents_alias)
    if chunks is None:
        fail("give --documents FILE: the retrieved passages, JSONL with a `text` field per line")
    json_out = alias("--json", "--output", output, output_alias)
    check_output(json_out, "--output")
    rows = read_jsonl(chunks, "--documents", "text")
    prof = read_profile(profile) if profile is not None else None
    tok = None
    if count == "tokens":
        check_model(model)
        tok = tokenizer(model)
    result = guarded(lambda: context.prune_context(question, rows, budget, profile=prof, tokenizer=tok, encoder=enc))
    console = Console()
    console.print(context.result_table(result))
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
    max_new_tokens: Annotated[
        int,
        typer.Option(
            "--max-new-tokens", min=1, help="token budget of the whole text (128, not 80: it holds several sections)"
        ),
    ] = 128,
    strength: Annotated[
        float | None,
        typer.Option("--strength", min=0.0, help="λ_max of the thermostat (4.25), or λ with --schedule constant (3)"),
    ] = None,
    schedule: Annotated[
        str, typer.Option("--schedule", help="thermostat (the topic default) or constant")
    ] = "thermostat",
    semantic: Annotated[
        bool,
        typer.Option(
            "--semantic/--no-semantic", metavar=FLAG, help="keep the prompt's semantic field under every stage"
        ),
    ] = True,
    openings: Annotated[
        int, typer.Option("--openings", min=1, help="write from the best of K openings (1 = one text)")
    ] = 3,
    opening_tokens: Annotated[int, typer.Option("--opening-tokens", min=1, help="tokens per opening")] = 24,
    raw: RawOpt = False,
    seed: SeedOpt = 0,
    device: DeviceOpt = "cpu",
    encoder: Annotated[
        str, typer.Option("--encoder", help="scores the drafts: minilm (default) or hashing (word overlap only)")
    ] = "minilm",
    output: Annotated[
        Path | None, typer.Option("--output", help="save the plan, drafts and text as JSON (a file)")
    ] = None,
    output_alias: JsonAliasOpt = None,
) -> None:
    """Plan-then-write: draft outlines, keep the best, and write along its sections with a staged field.

    Example: ngrav plan --prompt "Write a short article about coral reefs." --max-new-tokens 128
    """
    from ..levels import ranking, write  # torch and MiniLM: not for --help

    check_encoder(encoder)
    if schedule not in ("thermostat", "constant"):
        fail(f"--schedule must be thermostat or constant, got {schedule!r}")
    enc = ranking.hashing_encoder() if encoder == "hashing" else None
    settings = guarded(
        lambda: write.PlanSettings(
            n_drafts=drafts, sections=sections, outline_tokens=outline_tokens, strength=strength, schedule=schedule,
            semantic=semantic, openings=openings, opening_tokens=opening_tokens,
        )
    )  # fmt: skip
    options = guarded(lambda: GenerationOptions(max_new_tokens, seed=seed, raw=True if raw else None, device=device))
    prof = read_profile(profile) if profile is not None else None
    json_out = alias("--json", "--output", output, output_alias)
    check_output(json_out, "--output")
    m, tok = load(model, device)
    console = Console()
    with Console(stderr=True).status(f"drafting {drafts} outlines and writing {max_new_tokens} tokens"):
        res = guarded(
            lambda: write.plan_then_write(m, tok, prompt, profile=prof, settings=settings, options=options, encoder=enc)
        )
    console.print(write.plan_table(res))
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
    max_new_tokens: MaxNewOpt = DEFAULT_MAX_NEW_TOKENS,
    decay: Annotated[
        float, typer.Option("--decay", min=0.0, max=0.99, help="how much topic memory survives a turn")
    ] = 0.5,
    device: DeviceOpt = "cpu",
) -> None:
    """Chat with topic memory: each turn's topic is decayed into the next turn's field. Empty line or EOF ends.

    Example: ngrav chat --profile profiles/space.yaml
    """
    from ..levels.memory import CHAT_OPTIONS, Conversation, TopicMemory  # torch: not for --help

    options = guarded(lambda: CHAT_OPTIONS.replace(max_new_tokens=max_new_tokens, device=device))
    prof = read_profile(profile) if profile is not None else None
    m, tok = load(model, device)
    conv = Conversation(m, tok, profile=prof, memory=TopicMemory(decay=decay), options=options)
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
        answer = guarded(lambda text=text: conv.say(text))
        console.print(f"[bold]assistant:[/] {answer}", highlight=False)
        words = ", ".join(f"{w} {x:.2f}" for w, x in conv.memory.words().items())
        console.print(f"[dim]memory: {words}[/]", highlight=False)
