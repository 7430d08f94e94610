"""Run control against profiles on a prompt set, score every generation, and append the rows as they come.

The plan is fixed before anything runs: prompts that share their profiles are cut into batches of
``batch_size`` (in index order), and every batch runs once per seed as control (no gravity: the processor
measures with ``measure_only=True``, so entropy is recorded and the logits are untouched) and then once per
profile, with the same seed, the same batch composition and the same sampling settings. A control row and a
profile row with the same (prompt, seed) therefore form a pair.

Each batch's rows are scored and appended to ``results.jsonl`` (flushed and synced) before the next batch
starts. Every row is keyed by ``(profile, prompt index, seed)`` (``profile`` is ``control`` for control), so
a run that was interrupted, even by SIGKILL, resumes with ``resume=True`` without redoing or losing
finished generations; a half-written last line is dropped. Because the plan is fixed, a resumed run
produces exactly the rows an uninterrupted run would have produced.

A prompt that fails (a profile that does not fit the tokenizer, an error while generating) is written to
``failures.jsonl``, reported, and skipped; the run goes on, and ``resume`` retries it.

``engine="vllm"`` generates on an in-process vLLM engine (:mod:`narrative_gravity.engines.vllm_generate`):
every profile arm becomes each request's ``extra_args``, control runs without gravity (and, there, keeps no
trace), and gravity rows get their trace from the processor's ``on_step`` hook. The judge and the other
scoring models stay on transformers. The ``article`` and ``weighted:λ`` baselines are Python logits
processors, which vLLM cannot run: they are refused before anything loads.

The rooms: :mod:`.settings` (the settings, the arms, the plan), :mod:`.batch` (one batch of one arm: generate and
score), and this module (the run file, resume, the loop over the plan).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..engines.prompts import encode_prompts
from ..errors import ConfigurationError
from ..models import load_model, load_tokenizer
from .batch import _run_unit, _Runner, _VLLMRunner
from .metrics import Metric, MetricContext
from .prompts import BUILT_IN_SETS, EvalPrompt
from .report import write_reports
from .settings import AUTO, EvalSettings, _Plan, check_engine_arms, make_plan
from .store import CONTROL, FAILURES, RESULTS, RUN_FILE, ResultStore, row_key

__all__ = [
    "AUTO",
    "BUILT_IN_SETS",
    "CONTROL",
    "EvalModels",
    "EvalSettings",
    "ResultStore",
    "check_engine_arms",
    "make_plan",
    "run_eval",
]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def run_manifest(settings: EvalSettings, plan: _Plan) -> dict[str, Any]:
    """What ``run.json`` records: the settings, the prompts and the profiles (for resume checks and reports)."""
    prompts = [
        {
            "index": p.index,
            "text": p.text,
            "topic": p.topic_name,
            "n_topic_words": len(p.topic_words),
            "n_heldout": len(p.heldout_words),
            **({"require": list(p.required)} if p.required else {}),
        }
        for p in plan.prompts.values()
    ]
    profiles = {}
    for name, arm in plan.arms.items():
        if arm.profile is not None:
            profiles[name] = arm.profile.model_dump(mode="json")
        else:
            per_topic = {}
            for p in plan.prompts.values():
                prof = plan.profile_for(name, p)
                per_topic.setdefault(p.topic_name or AUTO, prof.model_dump(mode="json"))
            profiles[name] = {"auto": True, "per_topic": per_topic}
    return {
        "version": 1,
        "settings": settings.to_json(),
        "arms": [CONTROL, *plan.arms],
        "prompts": prompts,
        "prompts_digest": _digest([p.text if not p.required else [p.text, *p.required] for p in plan.prompts.values()]),
        "profiles": profiles,
        "profiles_digest": _digest(profiles),
        "n_chunks": len(plan.chunks),
        "planned": len(plan.keys(settings.seeds)),
    }


_RESUME_KEYS = ("prompts_digest", "profiles_digest")


def _check_resume(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    # runs from before --engine and --device
    old = {**old, "settings": {"engine": "hf", "device": "cpu", **old.get("settings", {})}}
    diffs = [k for k, v in new["settings"].items() if old["settings"].get(k) != v]
    diffs += [k.removesuffix("_digest") for k in _RESUME_KEYS if old.get(k) != new[k]]
    if diffs:
        detail = "; ".join(
            f"{k}: was {old.get('settings', {}).get(k)!r}, now {new['settings'].get(k)!r}"
            for k in diffs
            if k in new["settings"]
        )
        raise ConfigurationError(
            f"cannot resume {path.parent}: it was started with other settings ({', '.join(diffs)}"
            f"{'; ' + detail if detail else ''}). Rerun with the same options, or choose a new --out"
        )


@dataclass(frozen=True)
class EvalModels:
    """The models a run uses, where the caller has them already loaded (each ``None``: loaded when needed).

    ``model``/``tokenizer`` default to :func:`~narrative_gravity.models.load_model` of ``settings.model``;
    ``ctx`` to a :class:`MetricContext` with MiniLM and ``settings.judge``. With ``settings.engine == "vllm"``,
    ``generator`` (a :class:`~narrative_gravity.engines.vllm_generate.VLLMGenerator`) replaces ``model`` and
    ``tokenizer``; by default one is started on ``settings.model``, sized for the prompts and ``batch_size``.
    """

    model: Any = None
    tokenizer: Any = None
    ctx: MetricContext | None = None
    generator: Any = None


def run_eval(
    settings: EvalSettings,
    out_dir: str | os.PathLike[str],
    *,
    resume: bool = False,
    models: EvalModels = EvalModels(),
    prompts: Sequence[EvalPrompt] | None = None,
    progress: bool = True,
    write_report: bool = True,
    console: Any = None,
) -> dict[str, Any]:
    """Run (or resume) an eval into ``out_dir`` and write the reports; returns the summary.

    ``models`` (:class:`EvalModels`): what the caller has loaded already; the rest loads when there is something
    to generate. ``prompts`` replaces the prompt set that ``settings.prompts`` names.
    """

    console = console if console is not None else Console(stderr=True, soft_wrap=True)
    out = Path(out_dir)
    metrics = settings.metric_list()
    plan = make_plan(settings, prompts)
    vllm_generate = None
    if settings.engine == "vllm" and models.generator is None:
        from ..engines import vllm_generate  # imports vLLM, which lives in its own venv: only for engine="vllm"

        vllm_generate.require_vllm()
    store, done = _open_run(settings, plan, out, resume)
    all_keys = plan.keys(settings.seeds)
    todo_n = sum(1 for k in all_keys if k not in done)
    console.print(
        f"eval: {len(plan.prompts)} prompts × {len(settings.seeds)} seeds × {len(plan.arms) + 1} arms "
        f"(control, {', '.join(plan.arms)}) = {len(all_keys)} generations; {len(all_keys) - todo_n} already done, "
        f"{todo_n} to go → {out}",
        highlight=False,
    )
    if todo_n:
        if vllm_generate is not None:
            models = replace(models, generator=_start_vllm(vllm_generate, settings, plan, console))
        runner = _make_runner(settings, plan, models, metrics, console)
        runner.warmup()
        _loop(runner, store, done, todo_n, out, progress, console)
    summary: dict[str, Any] = {}
    if write_report:
        summary = write_reports(out)
    return summary


def _open_run(
    settings: EvalSettings, plan: _Plan, out: Path, resume: bool
) -> tuple[ResultStore, set[tuple[str, int, int]]]:
    """The run's result store and the keys it holds; checks that a resumed run has the same settings, and writes
    the run's manifest."""
    store = ResultStore(out / RESULTS)
    manifest = run_manifest(settings, plan)
    run_file = out / RUN_FILE
    if resume and run_file.exists():
        _check_resume(json.loads(run_file.read_text(encoding="utf-8")), manifest, run_file)
    elif store.path.exists() and store.load():
        raise ConfigurationError(
            f"{out} already holds results; pass --resume to continue that run, or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    done = {row_key(r) for r in store.load(repair=True)}
    run_file.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return store, done


def _make_runner(
    settings: EvalSettings, plan: _Plan, models: EvalModels, metrics: list[Metric], console: Any
) -> _Runner:
    """The runner of this engine, with every model it needs loaded (a missing package fails here, before the
    first generation)."""
    model, tokenizer, ctx = models.model, models.tokenizer, models.ctx
    if settings.engine == "hf" and (model is None or tokenizer is None):
        with console.status(f"loading {settings.model or 'smollm2'}"):
            model, tokenizer = load_model(settings.model, device=settings.device)
    if ctx is None:
        ctx = MetricContext(judge=settings.judge if settings.judge_on else None, device=settings.device)
    needs = set().union(*(m.needs for m in metrics))
    if needs:
        with console.status(f"loading scoring models ({', '.join(sorted(needs))})"):
            if "encoder" in needs:
                _ = ctx.encoder
            if "judge" in needs:
                _ = ctx.judge

    def say(message: str) -> None:
        console.print(message, highlight=False)

    if settings.engine == "vllm":
        return _VLLMRunner(settings, plan, models.generator, ctx, metrics, say)
    return _Runner(settings, plan, model, tokenizer, ctx, metrics, say)


def _start_vllm(vllm_generate: Any, settings: EvalSettings, plan: _Plan, console: Any) -> Any:
    """A vLLM engine on ``settings.model`` for ``batch_size`` requests at once, long enough for every prompt."""

    tok = load_tokenizer(settings.model)
    encoded = encode_prompts(tok, [p.text for p in plan.prompts.values()], raw=settings.raw_mode)
    longest = max(len(ids) for ids in encoded) + settings.max_new_tokens
    with console.status(f"starting vLLM on {settings.model or 'smollm2'} (~30 s on a CPU)"):
        return vllm_generate.VLLMGenerator.load(
            settings.model, max_num_seqs=settings.batch_size, longest=longest, tokenizer=tok
        )


def _loop(
    runner: _Runner,
    store: ResultStore,
    done: set[tuple[str, int, int]],
    total: int,
    out: Path,
    progress: bool,
    console: Any,
) -> None:
    """Every batch of the plan that is not done yet, in the plan's order: generate, score, append."""
    plan, settings = runner.plan, runner.s
    failures = ResultStore(out / FAILURES)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
    )
    with bar:
        task = bar.add_task("generating", total=total)
        for chunk in plan.chunks:
            for seed in settings.seeds:
                for arm in (CONTROL, *chunk.arms):
                    todo = [plan.prompts[i] for i in chunk.indices if (arm, i, seed) not in done]
                    if not todo:
                        continue
                    bar.update(task, description=f"{arm} · prompt {todo[0].index} · seed {seed}")
                    rows, failed = _run_unit(runner, arm, chunk, todo, seed)
                    store.append(rows)
                    failures.append(failed)
                    for f in failed:
                        console.print(
                            f"[yellow]skipped[/] {escape(f['profile'])} · prompt {f['prompt_index']} · seed "
                            f"{f['seed']}: {escape(f['error'])}",
                            highlight=False,
                        )
                    done.update(row_key(r) for r in rows)
                    bar.advance(task, len(todo))
