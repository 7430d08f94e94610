"""Reports of an eval run: ``summary.json``, ``report.md``, a self-contained ``report.html`` and the plots.

Everything is rebuilt from ``results.jsonl`` and ``run.json``, so a resumed run reports every generation,
including those of earlier sessions. Plots need matplotlib (the ``plot`` extra); without it the reports
are written without plots. The figures are drawn in :mod:`.report_plots`.
"""

from __future__ import annotations

import base64
import html
import json
import math
import shutil
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .metrics import METRICS
from .report_plots import plot_metrics, plot_pareto, plot_thermo
from .stats import BETTER, NO_CLEAR, WORSE, PairedComparison, bootstrap_ci, paired_bootstrap, summary_line
from .store import CONTROL, FAILURES, RESULTS, RUN_FILE, ResultStore, row_key

__all__ = ["build_summary", "export_markdown", "render_html", "render_markdown", "write_reports"]

PLOTS = ("metrics", "pareto", "traces")


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _val(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and v is not None else float("nan")


def _metric_order(rows: Sequence[dict[str, Any]]) -> list[str]:
    present: dict[str, None] = {}
    for r in rows:
        for k in r.get("metrics", {}):
            present.setdefault(k, None)
    return [m for m in METRICS if m in present] + [m for m in present if m not in METRICS]


def _how(name: str) -> str:
    return METRICS[name].aggregation if name in METRICS else "mean"


def _hib(name: str) -> bool | None:
    return METRICS[name].higher_is_better if name in METRICS else None


def build_summary(
    rows: Sequence[dict[str, Any]], manifest: dict[str, Any], failures: Sequence[dict[str, Any]] = ()
) -> tuple[dict[str, Any], dict[str, list[dict[str, list[float]]]]]:
    """Aggregates per arm, paired comparisons against control, per-topic tables, timings and examples;
    and the thermometer traces per arm (for the plot)."""
    run = _Rows.of(rows, manifest)
    arms, metrics = run.arms, run.metrics
    comparisons = {arm: run.comparison(arm) for arm in run.profiles}
    done = {row_key(r) for r in rows}
    open_failures = {row_key(f): f for f in failures if row_key(f) not in done}
    settings = manifest.get("settings", {})
    n_prompts = len(manifest.get("prompts", [])) or len({r["prompt_index"] for r in rows})
    expected = manifest.get("planned") or (
        n_prompts * len(settings.get("seeds", [])) * len(arms) if settings else len(rows)
    )
    by_arm = run.by_arm
    traces = {
        arm: [r["trace"] for r in by_arm.get(arm, {}).values() if r.get("trace")] for arm in arms if by_arm.get(arm)
    }
    return _clean(
        {
            "settings": settings,
            "arms": arms,
            "metrics": {
                m: {
                    "higher_is_better": _hib(m),
                    "aggregation": _how(m),
                    "description": METRICS[m].description if m in METRICS else "",
                    "unit": METRICS[m].unit if m in METRICS else "",
                }
                for m in metrics
            },
            "rows": len(rows),
            "expected_rows": expected,
            "per_arm": {arm: run.aggregates(arm) for arm in arms},
            "comparisons": comparisons,
            "summary_lines": [c["line"] for c in comparisons.values()],
            "topics": run.topics(),
            "timings": {arm: run.timing(arm) for arm in arms},
            "failures": list(open_failures.values()),
            "examples": run.examples(),
            "n_traces": {a: len(t) for a, t in traces.items()},
            "shortlist": {a: run.shortlist(a) for a in arms if run.shortlist(a)},
        }
    ), traces


@dataclass
class _Rows:
    """A run's rows by arm and (prompt, seed), with its arms and metrics."""

    by_arm: dict[str, dict[tuple[int, int], dict[str, Any]]]
    arms: list[str]
    profiles: list[str]
    metrics: list[str]

    @classmethod
    def of(cls, rows: Sequence[dict[str, Any]], manifest: dict[str, Any]) -> _Rows:
        arms = list(manifest.get("arms") or [CONTROL, *sorted({r["profile"] for r in rows} - {CONTROL})])
        by_arm: dict[str, dict[tuple[int, int], dict[str, Any]]] = defaultdict(dict)
        for r in rows:
            by_arm[r["profile"]][(int(r["prompt_index"]), int(r["seed"]))] = r
        return cls(by_arm, arms, [a for a in arms if a != CONTROL], _metric_order(rows))

    @property
    def control(self) -> dict[tuple[int, int], dict[str, Any]]:
        return self.by_arm.get(CONTROL, {})

    @staticmethod
    def control_metrics(r: dict[str, Any], arm: str | None) -> dict[str, Any]:
        """A control row's metrics as scored for ``arm`` (its own words), else as scored on their own."""
        if arm is not None and arm in r.get("metrics_vs", {}):
            return r["metrics_vs"][arm]
        return r.get("metrics", {})

    def aggregates(self, arm: str) -> dict[str, Any]:
        rs = list(self.by_arm.get(arm, {}).values())
        out: dict[str, Any] = {"n": len(rs), "metrics": {}}
        for m in self.metrics:
            vals = [_val(r.get("metrics", {}).get(m)) for r in rs]
            agg, lo, hi = bootstrap_ci(vals, _how(m))
            out["metrics"][m] = {"value": agg, "low": lo, "high": hi, "n": int(np.isfinite(vals).sum())}
        return out

    def comparison(self, arm: str) -> dict[str, Any]:
        """``arm`` against control, paired by (prompt, seed)."""
        control = self.control
        pairs = sorted(set(self.by_arm.get(arm, {})) & set(control))
        comp: dict[str, PairedComparison] = {}
        for m in self.metrics:
            c = [_val(self.control_metrics(control[k], arm).get(m)) for k in pairs]
            t = [_val(self.by_arm[arm][k]["metrics"].get(m)) for k in pairs]
            comp[m] = paired_bootstrap(c, t, higher_is_better=_hib(m), how=_how(m))
        line = summary_line(arm, comp)
        return {"pairs": len(pairs), "metrics": {m: v.to_json() for m, v in comp.items()}, "line": line}

    def topics(self) -> dict[str, dict[str, dict[str, Any]]]:
        out: dict[str, dict[str, dict[str, Any]]] = {}
        names = sorted({r["topic"] for rs in self.by_arm.values() for r in rs.values() if r.get("topic")})
        first = self.profiles[0] if self.profiles else None
        for arm in self.arms:
            for topic in names:
                rs = [r for r in self.by_arm.get(arm, {}).values() if r.get("topic") == topic]
                entry: dict[str, Any] = {"n": len(rs)}
                for m in ("topic_success", "topic_relevance", "judge_ppl"):
                    if m in self.metrics:
                        got = [(self.control_metrics(r, first) if arm == CONTROL else r["metrics"]).get(m) for r in rs]
                        entry[m] = bootstrap_ci([_val(v) for v in got], _how(m))[0]
                out.setdefault(topic, {})[arm] = entry
        return out

    def timing(self, arm: str) -> dict[str, float]:
        rs = list(self.by_arm.get(arm, {}).values())
        gen_s = sum(_val(r.get("batch_s")) / max(1, int(r.get("batch_size", 1))) for r in rs)
        toks = sum(int(r.get("new_tokens", 0)) for r in rs)
        return {
            "rows": len(rs),
            "generation_s": gen_s,
            "tokens": toks,
            "tokens_per_s": toks / gen_s if gen_s > 0 else float("nan"),
            "scoring_s": sum(_val(r.get("metric_s")) for r in rs),
        }

    def shortlist(self, arm: str) -> dict[str, Any]:
        """An arm's shortlist head (``prune.head``): its largest size and, where audited, the mean and the 99th
        percentile of the probability mass outside it over every audited step; ``{}`` for an arm without one."""
        heads = [r["shortlist"] for r in self.by_arm.get(arm, {}).values() if r.get("shortlist")]
        if not heads:
            return {}
        out: dict[str, Any] = {"size": max(h["size"] for h in heads)}
        cuts = [c for h in heads for c in h.get("cut_masses", ())]
        if cuts:
            out.update(
                cut_mass_mean=float(np.mean(cuts)), cut_mass_p99=float(np.percentile(cuts, 99)), audited_steps=len(cuts)
            )
        return out

    def examples(self) -> list[dict[str, Any]]:
        control = self.control
        return [
            {
                "profile": arm,
                "prompt_index": k[0],
                "seed": k[1],
                "prompt": control[k]["prompt"],
                "control": control[k]["text"],
                "gravity": self.by_arm[arm][k]["text"],
            }
            for arm in self.profiles
            for k in sorted(set(self.by_arm.get(arm, {})) & set(control))[:3]
        ]


# --------------------------------------------------------------------------------------------------
# text


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:.0f}"
        if abs(v) >= 100:
            return f"{v:.1f}"
        return f"{v:.{digits}f}"
    return str(v)


def _ci(e: dict[str, Any]) -> str:
    if e.get("value") is None:
        return "n/a"
    return f"{_fmt(e['value'])} [{_fmt(e.get('low'))}, {_fmt(e.get('high'))}]"


def _diff(c: dict[str, Any]) -> str:
    if c.get("difference") is None:
        return "n/a"
    return f"{_fmt(c['difference'])} [{_fmt(c.get('low'))}, {_fmt(c.get('high'))}]"


def _dir(hib: bool | None) -> str:
    return "↑" if hib is True else "↓" if hib is False else "·"


def comparison_table(summary: dict[str, Any], arm: str) -> list[list[str]]:
    """Rows of ``metric, better, control, profile, difference [95% CI], verdict, pairs``."""
    out = []
    comp = summary["comparisons"][arm]["metrics"]
    for m, meta in summary["metrics"].items():
        c = comp.get(m, {})
        out.append(
            [
                m,
                _dir(meta["higher_is_better"]),
                _fmt(c.get("control")),
                _fmt(c.get("treated")),
                _diff(c),
                c.get("verdict", "n/a"),
                str(c.get("n", 0)),
            ]
        )
    return out


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    esc = [[str(c).replace("|", "\\|").replace("\n", " ") for c in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in esc]
    return "\n".join(lines)


def _settings_line(s: dict[str, Any]) -> str:
    keys = ("prompts", "profiles", "seeds", "max_new_tokens", "top_k", "temperature", "raw", "batch_size")
    return ", ".join(f"{k}={s.get(k)}" for k in keys) + f", model={s.get('model') or 'smollm2'}, judge={s.get('judge')}"


def _topic_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    arms = summary["arms"]
    header = ["topic"] + [f"{a} success" for a in arms] + [f"{a} relevance" for a in arms]
    rows = []
    for topic, per in summary.get("topics", {}).items():
        rows.append(
            [topic]
            + [_fmt(per.get(a, {}).get("topic_success")) for a in arms]
            + [_fmt(per.get(a, {}).get("topic_relevance")) for a in arms]
        )
    return header, rows


def render_markdown(summary: dict[str, Any], images: dict[str, str], *, title: str = "ngrav eval report") -> str:
    """The report as Markdown; ``images`` maps a plot name to a relative path."""
    s = summary
    out = [f"# {title}", ""]
    out.append(f"Settings: {_settings_line(s['settings'])}.")
    out.append("")
    counts = ", ".join(f"{a}: {s['per_arm'][a]['n']}" for a in s["arms"])
    out.append(
        f"Generations: {s['rows']} of {s['expected_rows']} planned ({counts}); open failures: {len(s['failures'])}."
    )
    out += ["", "## Verdict", ""]
    out += [f"- {line}" for line in s["summary_lines"]] or ["- no profile rows yet"]
    for arm in s["comparisons"]:
        out += ["", f"## {arm} vs control (paired on prompt and seed)", ""]
        out.append(
            _md_table(
                ["metric", "better", "control", arm, f"{arm} − control [95% CI]", "verdict", "pairs"],
                comparison_table(s, arm),
            )
        )
    if s.get("topics"):
        header, rows = _topic_rows(s)
        out += ["", "## Per topic (means)", "", _md_table(header, rows)]
    out += ["", "## Timings", ""]
    out.append(
        _md_table(
            ["arm", "rows", "generation s", "tokens", "tokens/s", "scoring s"],
            [
                [
                    a,
                    str(t["rows"]),
                    _fmt(t["generation_s"], 1),
                    str(t["tokens"]),
                    _fmt(t["tokens_per_s"], 1),
                    _fmt(t["scoring_s"], 1),
                ]
                for a, t in s["timings"].items()
            ],
        )
    )
    if s.get("shortlist"):
        out += ["", "## Shortlist head (prune.head)", ""]
        out.append(
            _md_table(
                ["arm", "shortlist size", "mass outside: mean", "mass outside: p99", "audited steps"],
                [
                    [
                        a,
                        str(h["size"]),
                        _fmt(h.get("cut_mass_mean"), 5),
                        _fmt(h.get("cut_mass_p99"), 5),
                        str(h.get("audited_steps", 0)),
                    ]
                    for a, h in s["shortlist"].items()
                ],
            )
        )
    out += _md_extras(s, images)
    out += ["", "## Metrics", ""]
    out.append(
        _md_table(
            ["metric", "better", "aggregation", "definition"],
            [[m, _dir(v["higher_is_better"]), v["aggregation"], v["description"]] for m, v in s["metrics"].items()],
        )
    )
    out += [
        "",
        "Every comparison is paired: control and profile share prompt, seed, batch and sampling settings. The "
        "interval is a 95% percentile bootstrap (2000 draws) of aggregate(profile) − aggregate(control) over "
        "resampled pairs; `better`/`worse` when it excludes 0 (by the arrow), `no clear difference` when it "
        "contains 0. Metrics marked · are reported, not judged. Control rows are scored against each "
        "profile's field and words (off-topic rate, topic words), so a metric's control value can differ per "
        "profile.",
        "",
    ]
    return "\n".join(out)


def _md_extras(s: dict[str, Any], images: dict[str, str]) -> list[str]:
    """The plots, the failures and the examples of a Markdown report (each when there are some)."""
    out: list[str] = []
    if images:
        out += ["", "## Plots", ""]
        captions = {
            "metrics": "Per metric: each arm's aggregate with its 95% bootstrap interval.",
            "pareto": "Topic success against judge perplexity (up and to the left is better).",
            "traces": "Thermometer traces: entropy, narrative mass after the pull and λ per step, mean (line) and "
            "10th–90th percentile (band) per step.",
        }
        for name, rel in images.items():
            out += [f"![{name}]({rel})", "", captions.get(name, ""), ""]
    if s["failures"]:
        out += ["", "## Failures (skipped)", ""]
        out.append(
            _md_table(
                ["profile", "prompt", "seed", "error"],
                [[f["profile"], str(f["prompt_index"]), str(f["seed"]), f["error"][:200]] for f in s["failures"]],
            )
        )
    if s["examples"]:
        out += ["", "## Examples (same prompt and seed)", ""]
        for e in s["examples"]:
            out += [
                f"**{e['profile']}, prompt {e['prompt_index']}, seed {e['seed']}**: `{e['prompt']}`",
                "",
                f"- control: {e['control'].strip()!r}",
                f"- {e['profile']}: {e['gravity'].strip()!r}",
                "",
            ]
    return out


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1100px;color:#222;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.better{background:#e2f5e1}.worse{background:#fbe3e3}.nodiff{color:#777}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}.lines li{margin:.3em 0}code{background:#f6f6f6}
.ex{border-left:3px solid #ccc;padding-left:.8em;margin:.6em 0}.small{color:#666;font-size:.85em}
"""


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]], classes: Sequence[str] = ()) -> str:
    h = "".join(f"<th>{html.escape(c)}</th>" for c in header)
    body = []
    for i, r in enumerate(rows):
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>")
    return f"<table><thead><tr>{h}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def render_html(summary: dict[str, Any], images: dict[str, bytes], *, title: str = "ngrav eval report") -> str:
    """A self-contained HTML page: tables, and the plots embedded as base64 PNG."""
    s = summary
    e = html.escape
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p class='small'>Settings: {e(_settings_line(s['settings']))}.</p>",
        f"<p>Generations: {s['rows']} of {s['expected_rows']} planned; open failures: {len(s['failures'])}.</p>",
        "<h2>Verdict</h2><ul class='lines'>",
        *(f"<li>{e(line)}</li>" for line in s["summary_lines"]),
        "</ul>",
    ]
    cls = {BETTER: "better", WORSE: "worse", NO_CLEAR: "nodiff"}
    for arm in s["comparisons"]:
        rows = comparison_table(s, arm)
        parts.append(f"<h2>{e(arm)} vs control (paired on prompt and seed)</h2>")
        parts.append(
            _html_table(
                ["metric", "better", "control", arm, f"{arm} − control [95% CI]", "verdict", "pairs"],
                rows,
                [cls.get(r[5], "") for r in rows],
            )
        )
    if s.get("topics"):
        header, rows = _topic_rows(s)
        parts += ["<h2>Per topic (means)</h2>", _html_table(header, rows)]
    for name, png in images.items():
        b64 = base64.b64encode(png).decode("ascii")
        parts.append(f"<h2>{e(name)}</h2><img alt='{e(name)}' src='data:image/png;base64,{b64}'>")
    if s["failures"]:
        parts.append("<h2>Failures (skipped)</h2>")
        parts.append(
            _html_table(
                ["profile", "prompt", "seed", "error"],
                [[f["profile"], f["prompt_index"], f["seed"], f["error"][:300]] for f in s["failures"]],
            )
        )
    if s["examples"]:
        parts.append("<h2>Examples (same prompt and seed)</h2>")
        for x in s["examples"]:
            parts.append(
                f"<div class='ex'><b>{e(x['profile'])}, prompt {x['prompt_index']}, seed {x['seed']}</b>: "
                f"<code>{e(x['prompt'])}</code><br><b>control</b>: {e(x['control'])}<br>"
                f"<b>{e(x['profile'])}</b>: {e(x['gravity'])}</div>"
            )
    parts.append("<h2>Metrics</h2>")
    parts.append(
        _html_table(
            ["metric", "better", "aggregation", "definition"],
            [[m, _dir(v["higher_is_better"]), v["aggregation"], v["description"]] for m, v in s["metrics"].items()],
        )
    )
    parts.append("</body></html>")
    return "\n".join(parts)


def load_run(run_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]]]:
    d = Path(run_dir)
    rows = ResultStore(d / RESULTS).load()
    manifest = json.loads((d / RUN_FILE).read_text(encoding="utf-8")) if (d / RUN_FILE).exists() else {}
    failures = ResultStore(d / FAILURES).load() if (d / FAILURES).exists() else []
    return rows, manifest, failures


def write_reports(run_dir: str | Path) -> dict[str, Any]:
    """Write ``summary.json``, the plots, ``report.md`` and ``report.html`` into ``run_dir``; return the summary."""
    d = Path(run_dir)
    rows, manifest, failures = load_run(d)
    summary, traces = build_summary(rows, manifest, failures)
    images: dict[str, Path] = {}
    for name, fn in (
        ("metrics", lambda p: plot_metrics(summary, p)),
        ("pareto", lambda p: plot_pareto(summary, p)),
        ("traces", lambda p: plot_thermo(traces, p)),
    ):
        path = fn(d / f"{name}.png")
        if path is not None:
            images[name] = Path(path)
    summary["plots"] = {k: v.name for k, v in images.items()}
    (d / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (d / "report.md").write_text(render_markdown(summary, {k: v.name for k, v in images.items()}), encoding="utf-8")
    (d / "report.html").write_text(
        render_html(summary, {k: v.read_bytes() for k, v in images.items()}), encoding="utf-8"
    )
    return summary


def export_markdown(run_dir: str | Path, md_path: str | Path, *, title: str | None = None, preamble: str = "") -> Path:
    """Write a commit-ready Markdown report of a run at ``md_path``, with its PNGs copied next to it as
    ``<stem>-<plot>.png`` and referenced relatively."""
    d = Path(run_dir)
    md = Path(md_path)
    md.parent.mkdir(parents=True, exist_ok=True)
    summary = json.loads((d / "summary.json").read_text(encoding="utf-8"))
    images = {}
    for name, file in summary.get("plots", {}).items():
        target = md.parent / f"{md.stem}-{name}.png"
        shutil.copyfile(d / file, target)
        images[name] = target.name
    text = render_markdown(summary, images, title=title or md.stem)
    if preamble:
        head, _, rest = text.partition("\n\n")
        text = f"{head}\n\n{preamble.strip()}\n\n{rest}"
    md.write_text(text, encoding="utf-8")
    return md
