"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="session")
def bench_script() -> Callable[[str], ModuleType]:
    """``bench_script("topics/paired")`` loads ``bench/topics/paired.py`` as a module named ``paired``, with its
    own folder on ``sys.path`` while it loads (the scripts import their neighbours, such as ``run_io``)."""

    def load(path: str) -> ModuleType:
        script = BENCH / f"{path}.py"
        name = script.stem
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        sys.path.insert(0, str(script.parent))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(script.parent))
        return module

    return load


# ---------------------------------------------------------------------------------------------------
# Tiny tokenizers trained in code (no download): a byte-level BPE (GPT-2 / SmolLM2 style, `Ġ` marks a
# space) and a SentencePiece-style Unigram with a Metaspace pre-tokenizer (`▁` marks a space).

_SUBJECTS = (
    "the planet", "a small moon", "the bright star", "our galaxy", "the comet", "a distant planet",
    "the old telescope", "the crew", "the rocket", "a young astronomer",
)  # fmt: skip
_VERBS = ("moves along", "drifts past", "watches", "circles", "leaves", "reaches", "falls toward", "enters")
_OBJECTS = (
    "its orbit", "the orbit of the sun", "a spiral galaxy", "the dark sky", "every planet",
    "the space station", "a cold planet", "the inner orbit", "the galaxy core", "the night",
)  # fmt: skip
# Quoted words train the glued (no leading space) forms of a few words into single tokens.
_QUOTED = ("planet", "orbit", "galaxy")


def tiny_corpus() -> list[str]:
    """About 1100 short astronomy sentences, deterministic."""
    lines = [f"{s[0].upper()}{s[1:]} {v} {o}." for s, v, o in itertools.product(_SUBJECTS, _VERBS, _OBJECTS)]
    lines += [f'They said "{w}" again and again.' for w in _QUOTED for _ in range(100)]
    return lines


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (vocab 400) wrapped in ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def tiny_sp_tokenizer() -> Any:
    """A SentencePiece-style Unigram tokenizer (``▁`` space marker, dummy prefix, ``<unk>`` for unseen chars)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.UnigramTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    tok.train_from_iterator(tiny_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


# ---------------------------------------------------------------------------------------------------
# A tiny seeded random Llama (no download) sized to the byte-level BPE tokenizer above.


@pytest.fixture(scope="session")
def tiny_model(tiny_tokenizer: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a 2-layer random ``LlamaForCausalLM`` (seed 0, eval mode, float32) and a copy of
    ``tiny_tokenizer`` that pads on the left with its end-of-text token."""
    import copy

    import torch
    import transformers

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def tiny_backend(tiny_model: tuple[Any, Any]) -> Any:
    """The server's transformers backend on ``tiny_model`` (its tokenizer given a chat template), served as
    model ``tiny``; one per test module."""
    from narrative_gravity.server import HFBackend
    from servers import with_chat_template

    model, tokenizer = tiny_model
    return HFBackend(model, with_chat_template(tokenizer), model_id="tiny")


# ------------------------------------------------------------------------------ browser tests, counted
# Tests marked `browser` drive headless Chromium and are skipped where it is missing. So that a skipped browser
# test is never silent, the run ends with one line that counts them; scripts/test.sh prints it again as its
# last line (it sets NGRAV_BROWSER_SUMMARY to a file for it).
_browser: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
_browser_reasons: dict[str, None] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "browser" not in report.keywords:
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _browser[report.outcome].append(report.nodeid)
        if report.skipped and isinstance(report.longrepr, tuple):
            _browser_reasons[str(report.longrepr[2]).removeprefix("Skipped: ")] = None


def browser_summary() -> str | None:
    """``browser tests: 5 ran (5 passed), 0 skipped``, with the reasons for any skip; None when none ran."""
    ran = len(_browser["passed"]) + len(_browser["failed"])
    skipped = len(_browser["skipped"])
    if not ran and not skipped:
        return None
    line = f"browser tests: {ran} ran ({len(_browser['passed'])} passed, {len(_browser['failed'])} failed), {skipped} skipped"
    if _browser_reasons:
        line += ": " + "; ".join(_browser_reasons)
    return line


def pytest_terminal_summary(terminalreporter: Any) -> None:
    import os

    line = browser_summary()
    if line is None:
        return
    terminalreporter.write_line(line, yellow=bool(_browser["skipped"]), green=not _browser["skipped"])
    path = os.environ.get("NGRAV_BROWSER_SUMMARY")
    if path:
        Path(path).write_text(line + "\n", encoding="utf-8")
