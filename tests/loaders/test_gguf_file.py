"""The GGUF reader's checks: a corrupt file is one ModelLoadError naming the file and the tensor,
before anything is built from it. Each case edits a few header bytes of a copy of a tiny Llama's
file, written as llama.cpp's converter writes one (Q8_0, two layers; the embedded file's 49,152-token
header took a second to walk per case)."""

from __future__ import annotations

import struct

import pytest

from fastdecode.errors import ModelLoadError
from fastdecode.loaders.gguf_file import GGUFFile
from fastdecode.loading import BUILTIN_MODELS, load_model

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _positions(data: bytes) -> tuple[dict[str, int], dict[str, int]]:
    """(metadata key -> offset of its value, tensor name -> offset of its (type, offset) fields)."""
    pos = 24
    _, _, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return data[pos - n : pos].decode()

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                skip(etype)
        else:
            pos += _SCALAR[vtype]

    keys, tensors = {}, {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        keys[key] = pos
        skip(vtype)
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims
        tensors[name] = pos
        pos += 12
    return keys, tensors


@pytest.fixture(scope="module")
def file_bytes(tmp_path_factory) -> bytes:
    from gguf_files import write_tokenizer_gguf
    from tiny_models import tiny_llama

    from fastdecode.formats.gguf_export import export_gguf

    tmp = tmp_path_factory.mktemp("tiny-gguf")
    model = tiny_llama(0, vocab_size=128, hidden_size=64, intermediate_size=128)  # two layers
    return export_gguf(model, tmp / "tiny.gguf", write_tokenizer_gguf(tmp / "tokenizer.gguf", 128), "q8_0").read_bytes()


def _edited(tmp_path, data: bytes, edit) -> str:
    buf = bytearray(data)
    keys, tensors = _positions(data)
    edit(buf, keys, tensors)
    path = tmp_path / "edited.gguf"
    path.write_bytes(bytes(buf))
    return str(path)


def test_the_embedded_file_reads():
    gguf = GGUFFile(BUILTIN_MODELS["smollm2-135m"].locate())
    assert gguf.architecture == "llama"
    assert gguf.info("token_embd.weight").shape == (576, 49152)
    assert gguf.read("blk.0.attn_norm.weight").nbytes == 576 * 4


def test_a_misaligned_tensor_is_refused(tmp_path, file_bytes):
    # the reproduction: token_embd's offset moved by 7 bytes loaded and decoded [0, 0, 0, 0]
    def edit(buf, keys, tensors):
        at = tensors["token_embd.weight"] + 4
        struct.pack_into("<Q", buf, at, struct.unpack_from("<Q", buf, at)[0] + 7)

    with pytest.raises(ModelLoadError, match=r"edited\.gguf: tensor 'token_embd\.weight' .* alignment"):
        load_model(_edited(tmp_path, file_bytes, edit))


def test_a_tensor_past_the_end_is_refused(tmp_path, file_bytes):
    def edit(buf, keys, tensors):
        struct.pack_into("<Q", buf, tensors["blk.1.ffn_down.weight"] + 4, 1 << 40)

    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.1\.ffn_down\.weight' runs to byte .* past the end"):
        load_model(_edited(tmp_path, file_bytes, edit))


def test_overlapping_tensors_are_refused(tmp_path, file_bytes):
    def edit(buf, keys, tensors):
        first = struct.unpack_from("<Q", buf, tensors["blk.0.attn_q.weight"] + 4)[0]
        struct.pack_into("<Q", buf, tensors["blk.0.attn_k.weight"] + 4, first)

    with pytest.raises(ModelLoadError, match="overlap"):
        load_model(_edited(tmp_path, file_bytes, edit))


def test_an_unknown_tensor_type_is_refused(tmp_path, file_bytes):
    def edit(buf, keys, tensors):
        struct.pack_into("<I", buf, tensors["blk.1.attn_v.weight"], 99)

    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.1\.attn_v\.weight' has unknown ggml type 99"):
        load_model(_edited(tmp_path, file_bytes, edit))


def test_a_shape_the_config_disagrees_with_is_refused(tmp_path, file_bytes):
    def edit(buf, keys, tensors):
        struct.pack_into("<I", buf, keys["llama.feed_forward_length"], 96)  # the file's FFN is 128 wide

    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.0\.ffn_(gate|up|down)\.weight' has shape .* config"):
        load_model(_edited(tmp_path, file_bytes, edit))


def test_missing_tokenizer_metadata_is_refused(tmp_path, file_bytes, monkeypatch):
    monkeypatch.setenv("FASTDECODE_NO_CACHE", "1")

    def edit(buf, keys, tensors):
        at = buf.find(b"tokenizer.ggml.tokens")
        buf[at : at + 21] = b"tokenizer.ggml.tokenX"

    with pytest.raises(ModelLoadError, match="no tokenizer metadata"):
        load_model(_edited(tmp_path, file_bytes, edit))


def test_the_skeleton_holds_no_weights():
    model, _ = load_model("smollm2-135m", lazy=True)
    real = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")
    assert real < 1 << 20  # the norms (30 layers x 2 x 576 floats, and the final one)
    assert model.model.embed_tokens.weight.device.type == "meta"


@pytest.mark.parametrize("cut", ["tokenizer.ggml.tokens", "tokenizer.ggml.merges"])
def test_a_file_cut_inside_its_vocabulary_is_refused(tmp_path, cut):
    data = BUILTIN_MODELS["smollm2-135m"].locate().read_bytes()[: 1 << 20]  # the header and then some
    at = data.find(cut.encode()) + len(cut) + 12 + 4000  # past the key, the types and the count, into the strings
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:at])
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF file"):
        GGUFFile(path)


def test_metadata_items_read_in_full_are_gguf_pys(tmp_path):
    """``read_metadata``: the items a first reading counts (a vocabulary, its types), in full, as
    gguf-py reads them; ``metadata_bytes``: each item as stored, from its key to the end of its value."""
    from gguf import GGUFReader
    from gguf_files import write_tokenizer_gguf

    path = write_tokenizer_gguf(tmp_path / "t.gguf", 5000)  # arrays past 4096 entries: counted, not kept
    gguf = GGUFFile(path)
    assert gguf.metadata["tokenizer.ggml.tokens"] == gguf.metadata["tokenizer.ggml.token_type"] == 5000
    keys = [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
    ]
    full = gguf.read_metadata([*keys, "no.such.key"])
    assert sorted(full) == sorted(keys)
    fields = GGUFReader(path).fields
    assert full["tokenizer.ggml.tokens"] == fields["tokenizer.ggml.tokens"].contents()
    assert full["tokenizer.ggml.token_type"] == fields["tokenizer.ggml.token_type"].contents()
    assert full["tokenizer.ggml.merges"] == ["t 1", "t 2"]
    assert full["tokenizer.ggml.bos_token_id"] == 1
    data = path.read_bytes()
    for key, raw in gguf.metadata_bytes(keys).items():
        assert raw.startswith(struct.pack("<Q", len(key)) + key.encode())
        assert data.count(raw) == 1


@pytest.mark.parametrize("preadv", [True, False])
def test_rows_read_by_index_are_the_mapped_rows(tmp_path, file_bytes, monkeypatch, preadv):
    import os

    import numpy as np

    if not preadv:  # a platform without positioned reads (Windows): a seek and a read
        monkeypatch.delattr(os, "preadv", raising=False)
    path = tmp_path / "tiny.gguf"
    path.write_bytes(file_bytes)
    gguf = GGUFFile(path)
    mapped = np.asarray(gguf.rows("token_embd.weight"))
    for index in ([5], [3, 4, 5, 9, 9, 2, 127, 0, 1], list(range(128)), []):
        got = gguf.read_rows("token_embd.weight", np.array(index, dtype=np.int64))
        assert got.shape == (len(index), mapped.shape[1]) and np.array_equal(got, mapped[index])
    import pickle

    copy = pickle.loads(pickle.dumps(gguf))  # a copy opens a descriptor of its own
    assert np.array_equal(copy.read_rows("token_embd.weight", np.array([7])), mapped[[7]])
    # a file cut after its header was read: an error naming it, not a SIGBUS from a memory map
    with open(path, "r+b") as fh:
        fh.truncate(gguf.info("token_embd.weight").offset + 10 * mapped.shape[1])
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: tensor 'token_embd\.weight' is truncated \(rows 3\.\.12\)"):
        gguf.read_rows("token_embd.weight", np.array([1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]))
