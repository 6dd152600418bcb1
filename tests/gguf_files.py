"""GGUF files written by gguf's own writer, for tests (not a test module)."""


def finish_gguf(writer) -> None:
    """Write a ``gguf.GGUFWriter``'s header, metadata and tensors to its file, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tokenizer_gguf(path, vocab_size: int):
    """A GGUF of a small byte-level BPE tokenizer's keys alone, for ``export_gguf`` to copy into a
    tiny model's file: <unk> <s> </s>, the printable ASCII characters, "t1" and "t2" (merges
    "t 1" and "t 2"), then w0, w1, ... up to ``vocab_size`` (at least 99); bos 1, eos 2."""
    from gguf import GGUFWriter

    tokens = ["<unk>", "<s>", "</s>", *[chr(c) for c in range(33, 127)], "t1", "t2"]
    tokens += [f"w{i}" for i in range(vocab_size - len(tokens))]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, *[1] * (vocab_size - 3)])
    writer.add_token_merges(["t 1", "t 2"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    finish_gguf(writer)
    return path


# Where each block type keeps its fp16 scales (d, and dmin or m): every other bit pattern of a block is valid.
FP16_SCALES = {
    "q8_0": (0,),
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "iq4_nl": (0,),
    "q2_k": (80, 82),
    "q3_k": (108,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "iq4_xs": (0,),
}
# Where a block type keeps an E8M0 scale byte e (2^(e - 128) times MXFP4's doubled levels).
E8M0_SCALES = {"mxfp4": (0,)}
BLOCK_TYPES = (*FP16_SCALES, *E8M0_SCALES)  # every block type


def unit_scales(name: str, b) -> None:
    """Every scale of blocks b (uint8 [..., block_bytes]) of block type ``name`` set to 1.0, in place."""
    import numpy as np

    for at in FP16_SCALES.get(name, ()):
        b[..., at : at + 2] = np.full(b.shape[:-1] + (1,), 1.0, np.float16).view(np.uint8)
    for at in E8M0_SCALES.get(name, ()):
        b[..., at] = 128


def random_raw(name: str, rows: int, cols: int, seed: int = 0, scale: float = 1e-2):
    """A tensor's bytes in block type ``name`` as a GGUF file stores them, uint8 [rows, row bytes]:
    random bytes with finite fp16 scales of size ``scale`` (some +0 and -0; E8M0 scales within a
    factor of 4 of it, some of them 2^-128 and 2^-127, float32's subnormals); a float type's random
    normal weights."""
    import numpy as np

    from fastdecode.kernels.gguf_types import BLOCK_FORMATS

    f = BLOCK_FORMATS[name]
    rng = np.random.default_rng(seed)
    if f.is_float:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        w.flat[::13] = -0.0
        if name == "bf16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.astype({"f32": np.float32, "f16": np.float16}[name]).view(np.uint8)
    b = rng.integers(0, 256, (rows, cols // f.block_weights, f.block_bytes), dtype=np.uint8)
    for at in FP16_SCALES.get(name, ()):
        d = (rng.standard_normal(b.shape[:2]) * scale).astype(np.float16)
        d.flat[::7] = 0.0
        d.flat[3::11] = -0.0
        b[..., at : at + 2] = d[..., None].view(np.uint8)
    for at in E8M0_SCALES.get(name, ()):
        e = 128 + round(np.log2(scale)) + rng.integers(-2, 3, b.shape[:2])
        e.flat[::7], e.flat[3::11] = 0, 1
        b[..., at] = e
    return b.reshape(rows, -1)
