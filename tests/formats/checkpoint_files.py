"""Writers of the checkpoint layouts other tools produce, for the tests (imported by name:
tests/ is on sys.path through its conftest).

AutoAWQ and GPTQ do not install here (CUDA kernels), so their layouts are written from
their published descriptions, independently of fastdecode's readers: AutoAWQ's
``WQLinear_GEMM.from_linear`` packing loop (``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``) and
AutoGPTQ's ``QuantLinear.pack`` (values along the input, zero points stored minus one in
the v1 ``gptq`` format). compressed-tensors is written by the library itself where it is
installed. Each writer returns the reference weights W = s * (q - z) it stored, by layer.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word takes column order_map[i]


def quantized_linears(model, skip=("lm_head",)) -> dict:
    return {
        n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] not in skip
    }


def rtn(weight: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Round-to-nearest in groups of ``group`` input columns: (q int [out, in] in 0..2^b - 1,
    scales fp16-valued float32 [out, n_groups], zeros int [out, n_groups]); W ~ s * (q - z)."""
    out_features, in_features = weight.shape
    x = weight.detach().float().reshape(out_features, in_features // group, group)
    qmax = 2**bits - 1
    if symmetric:
        s = x.abs().amax(-1) / (2 ** (bits - 1) - 1)
        z = torch.full_like(s, 2 ** (bits - 1))
    else:
        lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
        s = (hi - lo) / qmax
        z = torch.round(-lo / s).clamp(0, qmax)
    s = s.half().float()  # checkpoints store fp16 scales
    q = torch.round(x / s[..., None] + z[..., None]).clamp(0, qmax)
    return q.reshape(out_features, in_features).int(), s, z.int()


def dequantized(q, s, z, group):
    idx = torch.arange(q.shape[1]) // group
    return s[:, idx] * (q - z[:, idx]).float()


def _words(fields: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 32 / bits] values -> int32 words, value k at bits k * bits (two's complement wrap)."""
    acc = torch.zeros(fields.shape[:-1], dtype=torch.int64)
    for k in range(fields.shape[-1]):
        acc |= fields[..., k].long() << (bits * k)
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def _write(directory, model, tensors: dict, quantization_config: dict, tokenizer=None) -> None:
    skip = {k.rpartition(".")[0] for k in tensors}
    for key, t in model.state_dict().items():
        if key.rpartition(".")[0] not in skip and key not in tensors:
            tensors[key] = t.detach().clone().contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def write_awq(directory, model, group: int = 32, tokenizer=None) -> dict:
    """AutoAWQ GEMM: qweight int32 [in, out/8], qzeros int32 [in/g, out/8], scales fp16 [in/g, out]."""
    tensors, reference = {}, {}
    for name, linear in quantized_linears(model).items():
        q, s, z = rtn(linear.weight, 4, group, symmetric=False)
        reference[name] = dequantized(q, s, z, group)
        for key, values in (("qweight", q.T), ("qzeros", z.T)):  # [in, out], [in/g, out]
            cols = values.shape[1] // 8
            fields = torch.stack([values[:, c * 8 : c * 8 + 8][:, AWQ_ORDER_MAP] for c in range(cols)], dim=1)
            tensors[f"{name}.{key}"] = _words(fields, 4)
        tensors[f"{name}.scales"] = s.T.half().contiguous()
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _write(directory, model, tensors, qc, tokenizer)
    return reference


def write_gptq(
    directory, model, bits: int = 4, group: int = 32, symmetric=True, fmt="gptq", g_idx=None, **extra
) -> dict:
    """AutoGPTQ: qweight int32 [in*b/32, out], qzeros int32 [in/g, out*b/32] (v1: z - 1),
    scales fp16 [in/g, out], g_idx int32 [in]."""
    tensors, reference, per_word = {}, {}, 32 // bits
    for name, linear in quantized_linears(model).items():
        q, s, z = rtn(linear.weight, bits, group, symmetric)
        reference[name] = dequantized(q, s, z, group)
        q_t = q.T  # [in, out]
        tensors[f"{name}.qweight"] = _words(q_t.reshape(-1, per_word, q_t.shape[1]).transpose(1, 2), bits)
        stored = z.T - (1 if fmt == "gptq" else 0)  # [in/g, out]
        tensors[f"{name}.qzeros"] = _words(stored.reshape(stored.shape[0], -1, per_word), bits)
        tensors[f"{name}.scales"] = s.T.half().contiguous()
        in_features = q.shape[1]
        tensors[f"{name}.g_idx"] = (torch.arange(in_features) // group if g_idx is None else g_idx(in_features)).int()
    qc = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": g_idx is not None,
        "sym": symmetric,
        "checkpoint_format": fmt,
        **extra,
    }
    _write(directory, model, tensors, qc)
    return reference


def write_compressed_tensors(directory, model, fmt: str, group: int | None = 32, symmetric=True, tokenizer=None):
    """A compressed-tensors directory written by the library (``ModelCompressor``), its scales
    found by round-to-nearest and rounded to fp16: W4A16 ``pack-quantized`` (``group`` None: per
    channel) or W8A8 ``int-quantized``. Returns the dequantized weights by layer, by the
    library's own decompression."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    if fmt == "pack-quantized":
        strategy = "group" if group else "channel"
        w = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
        scheme = QuantizationScheme(targets=["Linear"], weights=w)
    else:
        strategy = "channel"
        w = QuantizationArgs(num_bits=8, type="int", symmetric=symmetric, strategy=strategy)
        acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
        scheme = QuantizationScheme(targets=["Linear"], weights=w, input_activations=acts)
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, ignore=["lm_head"], quantization_status="initialized"
    )
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            x = module.weight.data
            x = x.reshape(x.shape[0], -1, w.group_size) if strategy == "group" else x[:, None, :]
            s, z = calculate_qparams(x.amin(-1), x.amax(-1), w)
            module.weight_scale.data = s.half().float().reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = z.reshape(module.weight_zero_point.shape).to(
                    module.weight_zero_point.dtype
                )
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    compressor.update_config(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return _library_decompressed(state, scheme)


def _library_decompressed(state: dict, scheme) -> dict:
    from compressed_tensors.compressors import BaseCompressor

    fmt = "pack-quantized" if any(k.endswith("weight_packed") for k in state) else "int-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    names = {k.rpartition(".")[0] for k in state if k.endswith(".weight_scale")}
    out = {}
    for name in names:
        local = {k[len(name) + 1 :]: v for k, v in state.items() if k.startswith(name + ".")}
        out[name] = compressor.decompress(local, scheme)["weight"].float()
    return out
