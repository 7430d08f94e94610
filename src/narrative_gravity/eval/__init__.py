"""Evaluation: prompt sets, control against profiles, a metric registry, paired statistics and reports.

``ngrav eval`` is the command line of this package; :func:`run_eval` is the same from Python.
"""

from __future__ import annotations

from .lexicon import load_empath
from .metrics import METRICS, Metric, MetricContext, Sample, compute_metrics, get_metric, register_metric
from .prompts import EvalPrompt, load_prompts, load_topics, split_wordlist
from .report import build_summary, export_markdown, write_reports
from .runner import AUTO, CONTROL, EvalModels, EvalSettings, ResultStore, run_eval
from .stats import PairedComparison, bootstrap_ci, paired_bootstrap, summary_line

__all__ = [
    "AUTO",
    "CONTROL",
    "METRICS",
    "EvalModels",
    "EvalPrompt",
    "EvalSettings",
    "Metric",
    "MetricContext",
    "PairedComparison",
    "ResultStore",
    "Sample",
    "bootstrap_ci",
    "build_summary",
    "compute_metrics",
    "export_markdown",
    "get_metric",
    "load_empath",
    "load_prompts",
    "load_topics",
    "paired_bootstrap",
    "register_metric",
    "run_eval",
    "split_wordlist",
    "summary_line",
    "write_reports",
]
