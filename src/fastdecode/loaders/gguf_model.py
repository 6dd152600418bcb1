"""A GGUF model at the memory of its file.

``load_gguf(path)`` builds the model's *skeleton* (its modules, config and RoPE buffers, every weight on
the ``meta`` device: no memory) - for an architecture the native decoder runs, its own
(``loaders/skeleton.py``: transformers' module names and shapes, a config view from
``architectures/config_view.py``, no transformers model or config class imported), else transformers'
- and hangs on each linear layer and on the embedding
a :class:`GGUFTensor`: where its weight lies in the file and in which row order the model reads it.
The small tensors (norms, biases) are read now, as transformers reads them. Nothing else is read
until a backend asks:

* the native decoder with ``--weights gguf`` takes each layer's blocks from the file, one tensor at
  a time, into the kernels' layout (``formats/gguf.py``'s ``BlockWeights``), and looks the embedding
  table up row by row (:class:`RowEmbedding`): no float copy of the model exists at any point;
* anything that needs float weights (``--weights float|int8|q4_0|...``, ``--backend hf``, compression,
  distillation) calls :func:`materialize`, which dequantizes tensor by tensor into the skeleton (a native
  skeleton first becomes transformers' skeleton of the file, in place): the float model transformers' GGUF
  loader builds, bit for bit (a test compares them), without its disk
  cache.

Row order: llama.cpp's converter permutes the rows of the ``llama`` architecture's q and k projections
for ggml's RoPE; transformers permutes them back (``LlamaTensorProcessor``). The blocks are whole rows,
so the same permutation of the blocks is exact (:attr:`GGUFTensor.row_order`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from fastdecode.architectures import ARCHITECTURES, Unsupported, layer_parts
from fastdecode.architectures.config_view import config_view
from fastdecode.architectures.table import GGUF_PERMUTED
from fastdecode.errors import ModelLoadError
from fastdecode.kernels.gguf_blocks import llama_unpermute
from fastdecode.loaders.gguf_config import config_from_dict, gguf_config_dict
from fastdecode.loaders.gguf_file import GGUFFile, TensorInfo
from fastdecode.loaders.skeleton import SkeletonCausalLM

ATTR = "fastdecode_gguf"  # the attribute a skeleton module's GGUFTensor hangs on
# an experts module's (3-D gate_up_proj, down_proj): ([gate per expert], [up ...], [down ...]) GGUFTensors
EXPERTS_ATTR = "fastdecode_gguf_experts"


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One weight of a skeleton model: tensor ``name`` of ``file``, its rows taken in ``row_order``
    (None: as stored), or only stored rows ``span`` = (start, stop): one expert of a 3-D experts
    tensor ([n_expert, rows, cols], each expert a contiguous run of rows)."""

    file: GGUFFile
    name: str
    row_order: np.ndarray | None = None
    span: tuple[int, int] | None = None

    @property
    def info(self) -> TensorInfo:
        return self.file.info(self.name)

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.info.rows if self.span is None else self.span[1] - self.span[0]
        return (rows, self.info.cols)

    def _raw(self) -> np.ndarray:
        """The stored bytes of its rows, uint8 [rows, row bytes], read-only, through a memory map of the
        file: the packer reads them from the page cache in place (a read into memory of their own first
        cost as much as the packing: 3.3 of a 3B Q8_0 load's 7.7 s). The map goes with its last view; the
        tensor's bounds were checked against the file when its header was read."""
        rows = self.file.rows(self.name)
        return rows if self.span is None else rows[self.span[0] : self.span[1]]

    @property
    def type_name(self) -> str:
        return self.info.type_name

    def blocks(self):
        """The tensor as a :class:`~fastdecode.kernels.gguf_blocks.BlockTensor` the block kernels run, or None
        when its type has no kernel here (then :meth:`float_weight` gives its values)."""
        from fastdecode.kernels.gguf_blocks import file_blocks
        from fastdecode.kernels.gguf_types import GGUF_TYPES

        if int(self.info.ggml_type) not in GGUF_TYPES:
            return None
        bt = file_blocks(self.info.ggml_type, self._raw(), self.info.cols)
        return bt if self.row_order is None else bt.view_rows(self.row_order)  # packed in that order, not copied

    def rows(self, index: np.ndarray) -> torch.Tensor:
        """float32 [len(index), cols]: rows ``index`` (stored order) read from the file and dequantized."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        start = 0 if self.span is None else self.span[0]
        raw = self.file.read_rows(self.name, index + start)
        values = dequantize(raw, GGMLQuantizationType(self.info.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def float_weight(self) -> torch.Tensor:
        """float32 [rows, cols] in the model's row order: gguf-py's dequantize of this one tensor."""
        if self.span is not None:
            return self.rows(np.arange(self.shape[0]))
        w = torch.from_numpy(self.file.values(self.name).reshape(self.info.rows, self.info.cols))
        return w if self.row_order is None else w[torch.from_numpy(self.row_order)].contiguous()


class RowEmbedding:
    """An embedding table left in its file: ``table[ids]`` reads and converts only the rows looked up
    (float32 [..., hidden]: a GGUF's rows dequantized, gguf-py's values; a safetensors table's widened)."""

    def __init__(self, ref) -> None:
        self.ref = ref
        self.shape = torch.Size(ref.shape)
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        index = ids.detach().cpu().numpy().astype(np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.shape[0]):
            raise IndexError(f"token id out of range 0..{self.shape[0] - 1}")
        return self.ref.rows(index.reshape(-1)).view(*index.shape, self.shape[1])


def is_lazy(model) -> bool:
    """Whether ``model`` is a skeleton whose weights are still in their file (GGUF or safetensors)."""
    return getattr(model, "fastdecode_lazy", None) is not None


def set_source(model, source) -> None:
    """Make ``model`` a skeleton whose weights lie in ``source`` (a GGUF or safetensors file's): fastdecode's
    targets read them; called as a transformers model, it says so in one error instead of torch's about the
    meta device (:func:`materialize` lifts it)."""
    model.fastdecode_lazy = source

    def refuse(module, args, kwargs):  # a no-op once materialized
        if not is_lazy(module):
            return None
        raise ModelLoadError(
            f"this model's weights are still in {source.path} (loaded at the size of the file): fastdecode's "
            "engine runs it; to call it as a transformers model, load it with load_model(..., lazy=False) or "
            "read its float weights with fastdecode.loaders.gguf_model.materialize(model)"
        )

    model.register_forward_pre_hook(refuse, with_kwargs=True)


def _processor(gguf: GGUFFile, config_dict: dict):
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    # the architectures llama.cpp permutes as it does Llama's take transformers' Llama processor (which undoes it)
    arch = "llama" if gguf.architecture in GGUF_PERMUTED else gguf.architecture
    return TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config_dict)


class _SmallTensors:
    """What transformers' GGUF tensor processors (``_processor``) do to the tensors a native skeleton reads
    at load (norms and biases), without importing them: ``modeling_gguf_pytorch_utils`` imports its
    tokenizer tables, and with them transformers' index of every model. Gemma 2 and 3's norms are stored
    as 1 + w (its ``Gemma2TensorProcessor`` subtracts 1); a llama's q and k rows are permuted back (its
    ``LlamaTensorProcessor``, where the config names both head counts); names are kept (``preprocess_name``
    renames per-expert modules, which the native skeleton does not have). tests/loaders/test_skeleton.py
    compares the values with transformers'."""

    def __init__(self, gguf: GGUFFile, config_dict: dict) -> None:
        self.arch, self.config = gguf.architecture, config_dict

    @staticmethod
    def preprocess_name(hf_name: str) -> str:
        return hf_name

    def process(self, weights: np.ndarray, name: str, **kwargs) -> SimpleNamespace:
        heads, kv_heads = self.config.get("num_attention_heads"), self.config.get("num_key_value_heads")
        if self.arch in GGUF_PERMUTED and None not in (heads, kv_heads) and (".attn_q." in name or ".attn_k." in name):
            weights = weights[llama_unpermute(weights.shape[0], heads if ".attn_q." in name else kv_heads)]
        if self.arch in ("gemma2", "gemma3") and "norm.weight" in name:
            weights = weights - 1
        return SimpleNamespace(weights=weights)


def _name_map(model, gguf: GGUFFile, processor) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """HF parameter name -> GGUF tensor name, by gguf-py's ``TensorNameMap`` for the file's architecture
    (what transformers' ``get_gguf_hf_weights_map`` does, built once: it builds one map per submodule,
    ~30 s for a 30-layer model); and each 3-D experts parameter -> its GGUF tensors (:func:`_expert_names`)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == gguf.architecture), None)
    if arch is None:
        raise ModelLoadError(f"{gguf.path}: GGUF architecture {gguf.architecture!r} is unknown to gguf-py")
    name_map = get_tensor_name_map(arch, model.config.num_hidden_layers)
    names, experts = {}, {}
    for hf_name, param in model.named_parameters(remove_duplicate=False):
        base, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if param.dim() == 3 and suffix in _EXPERT_PARTS:
            experts[hf_name] = _expert_names(gguf, name_map, base, suffix)
            continue
        gguf_base = name_map.get_name(base)
        if gguf_base is not None and f"{gguf_base}.{suffix}" in gguf.tensors:
            names[hf_name] = f"{gguf_base}.{suffix}"
        elif f"{name_map.get_name(hf_name)}.weight" in gguf.tensors:  # a parameter of its own (gpt-oss's sinks)
            names[hf_name] = f"{name_map.get_name(hf_name)}.weight"
    return names, {k: v for k, v in experts.items() if v}


# transformers' 3-D experts parameters -> the per-projection modules gguf-py's TensorNameMap names
# (``mlp.experts.gate_proj`` -> ``ffn_gate_exps``): gate_up_proj [E, 2 I, H] is llama.cpp's gate and up
# tensors [E, I, H] one after the other, down_proj [E, H, I] its ffn_down_exps.
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _expert_names(gguf: GGUFFile, name_map, base: str, suffix: str) -> tuple[str, ...]:
    names = tuple(name_map.get_name(f"{base}.{part}") for part in _EXPERT_PARTS[suffix])
    found = tuple(f"{n}.weight" for n in names if n is not None and f"{n}.weight" in gguf.tensors)
    return found if len(found) == len(names) else ()


def _check_experts(
    gguf: GGUFFile, hf_name: str, gguf_names: tuple[str, ...], expected: tuple[int, ...], layout: str
) -> None:
    n_experts, rows, cols = expected if layout == "stacked" else (expected[0], expected[2], expected[1])
    want = (n_experts, rows // len(gguf_names), cols)
    for name in gguf_names:
        stored = tuple(reversed(gguf.info(name).shape))
        if stored != want:
            raise ModelLoadError(
                f"{gguf.path}: expert tensor {name!r} has shape {list(stored)}, but the architecture's config "
                f"needs {list(want)} ({n_experts} experts) for {hf_name}"
            )


def _hang_experts(model, gguf: GGUFFile, experts: dict[str, tuple[str, ...]]) -> None:
    """Each experts module gets, under EXPERTS_ATTR, per expert where its gate, up and down rows lie."""
    parts: dict[str, dict[str, list]] = {}
    for hf_name, gguf_names in experts.items():
        owner, _, suffix = hf_name.rpartition(".")
        for name in gguf_names:
            info = gguf.info(name)
            n_experts = int(info.shape[2])
            rows = info.rows // n_experts
            refs = [GGUFTensor(gguf, name, span=(e * rows, (e + 1) * rows)) for e in range(n_experts)]
            parts.setdefault(owner, {}).setdefault(suffix, []).append(refs)
    for owner, by_param in parts.items():
        if set(by_param) == set(_EXPERT_PARTS):
            setattr(_module(model, owner), EXPERTS_ATTR, (*by_param["gate_up_proj"], *by_param["down_proj"]))


def _read_expert_biases(model, gguf: GGUFFile, experts: dict[str, tuple[str, ...]]) -> set[str]:
    """gpt-oss's experts' biases, read now (small): ``gate_up_proj_bias`` [E, 2 I] from ``ffn_gate_exps.bias``
    and ``ffn_up_exps.bias`` [E, I] in alternate columns (its layout), ``down_proj_bias`` from
    ``ffn_down_exps.bias``; returns the parameters set."""
    params, done = dict(model.named_parameters()), set()
    for hf_name, gguf_names in experts.items():
        name, bias_names = f"{hf_name}_bias", [n.replace(".weight", ".bias") for n in gguf_names]
        if name not in params or not all(n in gguf.tensors for n in bias_names):
            continue
        values = [gguf.values(n).reshape(-1, gguf.info(n).cols) for n in bias_names]  # [E, rows] each
        value = np.stack(values, axis=-1).reshape(values[0].shape[0], -1)  # alternate columns (one part: as is)
        if value.shape != tuple(params[name].shape):
            raise ModelLoadError(
                f"{gguf.path}: expert biases {bias_names} give {list(value.shape)}, but the architecture's config "
                f"needs {list(params[name].shape)} for {name}"
            )
        _set_param(model, name, torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32)))
        done.add(name)
    return done


def _experts_value(arrays: list[np.ndarray], layout: str) -> np.ndarray:
    """A 3-D experts parameter from its GGUF tensors ([E, rows, cols] each): "stacked", side by side on the
    rows; "interleaved" (gpt-oss), transposed, gate and up in alternate columns."""
    if layout == "stacked":
        return np.concatenate(arrays, axis=1)
    return np.stack([a.swapaxes(1, 2) for a in arrays], axis=-1).reshape(*arrays[0].shape[:1], arrays[0].shape[2], -1)


def _module(model, dotted: str):
    return model.get_submodule(dotted) if dotted else model


def _set_param(model, hf_name: str, value: torch.Tensor) -> None:
    owner, _, attr = hf_name.rpartition(".")
    module = _module(model, owner)
    module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)


def _row_order(gguf: GGUFFile, gguf_name: str, config) -> np.ndarray | None:
    if gguf.architecture not in GGUF_PERMUTED:
        return None
    rows = gguf.info(gguf_name).rows
    if ".attn_q." in gguf_name:
        return llama_unpermute(rows, config.num_attention_heads)
    if ".attn_k." in gguf_name:
        return llama_unpermute(rows, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return None


def _check_shape(gguf: GGUFFile, gguf_name: str, hf_name: str, expected: tuple[int, ...]) -> None:
    info = gguf.info(gguf_name)
    stored = tuple(reversed(info.shape))
    if int(np.prod(stored)) != int(np.prod(expected)) or (len(expected) == 2 and stored[-1] != expected[-1]):
        raise ModelLoadError(
            f"{gguf.path}: tensor {gguf_name!r} has shape {list(stored)}, but the architecture's config needs "
            f"{list(expected)} for {hf_name}"
        )


def _skeleton(gguf: GGUFFile, config):
    """transformers' model of ``config`` (a ``PretrainedConfig``), its weights on meta, its RoPE buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"{gguf.path}: architecture {config.model_type!r} is not a causal language model")
    with init_empty_weights(include_buffers=False):  # weights on meta, RoPE buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _native_skeleton(config_dict: dict) -> SkeletonCausalLM | None:
    """The skeleton the native decoder needs, without transformers' modeling code (``loaders/skeleton.py``),
    where it runs this config; else None (transformers' skeleton serves, and says what is wrong with it)."""
    entry = ARCHITECTURES.get(config_dict.get("model_type"))
    try:
        config = config_view(config_dict)
        arch = None if config is None or entry is None else entry.describe(config)
    except (ValueError, Unsupported, AttributeError, KeyError, TypeError):
        return None
    return None if arch is None else SkeletonCausalLM(config, arch).eval()


def load_gguf(path: str, native: bool = True):
    """(skeleton model, its weights' file) for a GGUF file: see the module's docstring. Validates the file
    and every tensor the model needs against the config before returning. ``native``: for an architecture
    the native decoder runs, the skeleton it needs (:class:`SkeletonCausalLM`, no transformers model class
    imported; :func:`materialize` makes it transformers' model in place); False: transformers' skeleton."""
    gguf = GGUFFile(path)
    config_dict = gguf_config_dict(gguf)
    model = _native_skeleton(config_dict) if native else None
    if model is None:
        model = _skeleton(gguf, config_from_dict(gguf, config_dict))
    _place_tensors(model, gguf, config_dict)
    return model


def _place_tensors(model, gguf: GGUFFile, config_dict: dict) -> None:
    """Hang on ``model``'s modules where each of its tensors lies in ``gguf`` (the small ones read now),
    each checked against the shape the model needs."""
    config = model.config
    native = isinstance(model, SkeletonCausalLM)
    processor = _SmallTensors(gguf, config_dict) if native else _processor(gguf, config_dict)
    names, experts = _name_map(model, gguf, processor)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(config, "tie_word_embeddings", False)
    biases = _read_expert_biases(model, gguf, experts)
    missing = [
        n
        for n in params
        if n not in names and n not in experts and n not in biases and not (tied and n.endswith("lm_head.weight"))
    ]
    if missing:
        raise ModelLoadError(
            f"{gguf.path}: {len(missing)} tensor(s) the {config.model_type!r} architecture needs are not in the "
            f"file (such as {missing[0]})"
        )
    for hf_name, gguf_name in names.items():
        expected = tuple(params[hf_name].shape)
        _check_shape(gguf, gguf_name, hf_name, expected)
        owner = _module(model, hf_name.rpartition(".")[0])
        if len(expected) == 1:  # norms and biases: small, read now, as transformers reads them
            result = processor.process(weights=gguf.values(gguf_name), name=gguf_name, tensor_key_mapping={})
            _set_param(model, hf_name, torch.from_numpy(np.array(result.weights, dtype=np.float32)).reshape(expected))
        elif hf_name.endswith(".weight"):
            setattr(owner, ATTR, GGUFTensor(gguf, gguf_name, _row_order(gguf, gguf_name, config)))
    layout = layer_parts(config)[0].experts_layout if experts else None
    for hf_name, gguf_names in experts.items():
        _check_experts(gguf, hf_name, gguf_names, tuple(params[hf_name].shape), layout)
    _hang_experts(model, gguf, experts)
    if tied:
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and getattr(embed, ATTR, None) is not None:
            setattr(head, ATTR, getattr(embed, ATTR))
    set_source(model, GGUFSource(gguf, names, config_dict, experts))
    model.config.fastdecode_gguf_file = gguf.path


def _to_transformers(model: SkeletonCausalLM) -> None:
    """``model`` becomes, in place, transformers' skeleton of the same file (whoever holds the object holds
    transformers' model): built as ``load_gguf(path, native=False)`` builds it, then its class and state
    taken over."""
    source = model.fastdecode_lazy
    hf = _skeleton(source.file, config_from_dict(source.file, source.config_dict))
    _place_tensors(hf, source.file, source.config_dict)
    model.__class__ = type(hf)
    model.__dict__ = hf.__dict__


@dataclass(frozen=True, eq=False)
class GGUFSource:
    """Where a GGUF skeleton's weights are: the file and the HF -> GGUF name map."""

    file: GGUFFile
    names: dict[str, str]
    config_dict: dict
    experts: dict[str, tuple[str, ...]]  # a 3-D experts parameter -> its GGUF tensors, side by side on dim 1

    @property
    def path(self) -> str:
        return self.file.path

    @property
    def size(self) -> int:
        return self.file.size

    def materialize(self, model, dtype: torch.dtype) -> None:
        """Dequantize every weight still on meta, tensor by tensor, as transformers' GGUF loader does."""
        processor = _processor(self.file, self.config_dict)
        for hf_name, gguf_name in self.names.items():
            param = model.get_parameter(hf_name)
            if param.device.type != "meta":
                if param.dtype != dtype:
                    _set_param(model, hf_name, param.detach().to(dtype))
                continue
            result = processor.process(weights=self.file.values(gguf_name), name=gguf_name, tensor_key_mapping={})
            w = torch.from_numpy(np.ascontiguousarray(result.weights, dtype=np.float32)).reshape(param.shape)
            _set_param(model, hf_name, w.to(dtype))
        layout = layer_parts(model.config)[0].experts_layout if self.experts else None
        for hf_name, gguf_names in self.experts.items():  # [E, I, H] each -> gate_up [E, 2 I, H]; down as stored
            if model.get_parameter(hf_name).device.type == "meta":
                w = _experts_value([self.file.values(n) for n in gguf_names], layout)
                _set_param(model, hf_name, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype))


def materialize(model, dtype: torch.dtype = torch.float32):
    """Read a skeleton's weights into it, tensor by tensor (a GGUF's: transformers' values and row order),
    in place, in ``dtype``; returns ``model``. A model already materialized is returned as it is."""
    if not is_lazy(model):
        return model
    if isinstance(model, SkeletonCausalLM):  # float weights go in transformers' own model
        _to_transformers(model)
    model.fastdecode_lazy.materialize(model, dtype)
    for module in model.modules():
        for attr in (ATTR, EXPERTS_ATTR):
            if hasattr(module, attr):
                delattr(module, attr)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    model.fastdecode_lazy = None
    return model


def model_device(model) -> torch.device:
    """The device ``model`` computes on (a GGUF skeleton's: the CPU, where its file is read)."""
    return torch.device("cpu") if is_lazy(model) else next(model.parameters()).device


def model_dtype(model) -> torch.dtype:
    """The dtype of ``model``'s weights (a GGUF skeleton's: float32, its activations' and norms')."""
    return torch.float32 if is_lazy(model) else next(model.parameters()).dtype


def float_cost(model) -> str:
    """What loading a GGUF skeleton through transformers costs, in words a user can act on."""
    size = model.fastdecode_lazy.size
    params = sum(p.numel() for p in model.parameters())
    return (
        f"--backend hf loads it through transformers, in float32: {params * 4 / 1e9:.2f} GB of "
        f"weights in memory for a {size / 1e9:.2f} GB file"
    )
