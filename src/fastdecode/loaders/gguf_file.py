"""One ``.gguf`` file read as a table of tensors, validated before anything is built from it.

What this adds to the readers that exist (why it is written here): gguf-py's ``GGUFReader`` parses
every metadata item into numpy views (~10 s for a 49,152-token vocabulary) and checks nothing about
where tensors lie; transformers' fast ``read_gguf_metadata`` reads the metadata quickly but does not
validate the tensor table. A model file is input, so every tensor is checked here, once, against the
file: a known ggml type, a shape whose rows are whole blocks, an offset aligned as the file says
and inside the file, no two tensors overlapping. Each failure is one :class:`ModelLoadError` that names
the file and the tensor. Nothing is read from the data section until a tensor is asked for.
Metadata arrays the header's reading only counts (a vocabulary, its scores) are read in full on
demand, from where each item lies (:meth:`GGUFFile.read_metadata`); :meth:`GGUFFile.metadata_bytes`
gives items as stored, which the tokenizer's cache hashes.

Tensor bytes come through a read-only memory map (:meth:`GGUFFile.rows`): the packer reads a tensor's
blocks from the page cache in place, one tensor at a time, and its map goes with its last view, so the
file's pages do not stay mapped into the process's resident set beside the packed copy; rows of a tensor
that stays in the file (the embedding table) are read as they are looked up (:meth:`GGUFFile.read_rows`). :meth:`GGUFFile.read`
reads a tensor with ``pread`` into memory of its own (where its values are dequantized).
"""

from __future__ import annotations

import os
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastdecode.errors import ModelLoadError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
# Keys whose string arrays a loader needs in full (the tokenizer's); other string arrays are counted.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml's ne: shape[0] is the row length (columns)
    ggml_type: int
    offset: int  # absolute, from the start of the file
    nbytes: int

    @property
    def cols(self) -> int:
        return int(self.shape[0])

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(ggml_type)).name
    except ValueError:
        return f"type {ggml_type}"


def _block_size(ggml_type: int) -> tuple[int, int] | None:
    """(weights a block, bytes a block) of a ggml type gguf-py knows, else None."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
    except (ValueError, KeyError):
        return None


_U64 = struct.Struct("<Q")


class _Cursor:
    """Reads the header's little-endian fields; running past the end is a truncated file."""

    def __init__(self, buf, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelLoadError(
                f"{self.path}: corrupt or truncated GGUF file (its header ends at byte {len(self.buf)})"
            )
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (n,) = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (a string runs past its end)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", "replace")

    def _skip_strings(self, count: int) -> None:
        """Step over ``count`` strings (a vocabulary's ~100k: one length read each, as :meth:`take` reads it)."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.take("<Q")  # raises: the header ends here
            pos += 8 + length(buf, pos)[0]
        self.pos = pos

    def _strings(self, count: int) -> list[str]:
        """``count`` strings in full (a vocabulary: strict UTF-8, as transformers' reader decodes them)."""
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end or pos + 8 + length(buf, pos)[0] > end:
                raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (a string runs past its end)")
            stop = pos + 8 + length(buf, pos)[0]
            try:
                out.append(str(buf[pos + 8 : stop], "utf-8"))
            except UnicodeDecodeError:
                raise ModelLoadError(f"{self.path}: a string in a metadata array is not UTF-8") from None
            pos = stop
        self.pos = pos
        return out

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALARS:
            return self.take("<" + _SCALARS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ModelLoadError(f"{self.path}: metadata value of unknown type {vtype}")
        etype, count = self.take("<IQ")
        if etype in _SCALARS:
            width = struct.calcsize(_SCALARS[etype])
            if self.pos + width * count > len(self.buf):
                raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file (an array runs past its end)")
            values = np.frombuffer(self.buf, dtype="<" + _SCALARS[etype], count=count, offset=self.pos)
            self.pos += width * count
            return values.tolist() if count <= 4096 or keep else count
        if etype == _STRING:
            if keep:
                return self._strings(count)
            self._skip_strings(count)
            return count
        raise ModelLoadError(f"{self.path}: metadata array of unknown element type {etype}")


class GGUFFile:
    """A GGUF v2/v3 file's metadata and tensor table, validated (see the module's docstring)."""

    def __init__(self, path: str | os.PathLike, keep_arrays: tuple[str, ...] = ()) -> None:
        import mmap

        self.path = str(path)
        try:
            self.size = os.path.getsize(self.path)
            with open(self.path, "rb") as fh:
                if fh.read(4) != b"GGUF":
                    raise ModelLoadError(f"{self.path}: not a GGUF file (it does not start with the GGUF magic)")
                if self.size < 24:
                    raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file ({self.size} bytes)")
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise ModelLoadError(f"{self.path}: cannot read the model file ({exc.strerror or exc})") from None
        try:
            self.metadata, self.tensors, self.data_start = self._parse(buf, keep_arrays)
        finally:
            buf.close()
        self._validate()

    def _parse(self, buf, keep_arrays) -> tuple[dict, dict[str, TensorInfo], int]:
        cur = _Cursor(buf, self.path)
        magic, version, n_tensors, n_kv = cur.take("<4sIQQ")
        if magic != b"GGUF":
            raise ModelLoadError(f"{self.path}: not a GGUF file (it does not start with the GGUF magic)")
        if version not in (2, 3):
            raise ModelLoadError(
                f"{self.path}: corrupt or truncated GGUF file (version {version}; fastdecode reads versions 2 and 3)"
            )
        if n_tensors > 1_000_000 or n_kv > 1_000_000:
            raise ModelLoadError(
                f"{self.path}: corrupt or truncated GGUF file ({n_tensors} tensors, {n_kv} metadata keys)"
            )
        meta: dict[str, object] = {}
        spans: dict[str, tuple[int, int]] = {}  # each item's bytes in the file: key, type and value
        for _ in range(n_kv):
            start = cur.pos
            key = cur.string()
            (vtype,) = cur.take("<I")
            meta[key] = cur.value(vtype, key in keep_arrays)
            spans[key] = (start, cur.pos)
        self.metadata_spans = spans
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.take("<I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has {n_dims} dimensions")
            shape = cur.take(f"<{n_dims}Q")
            ggml_type, offset = cur.take("<IQ")
            raw.append((name, tuple(int(s) for s in shape), int(ggml_type), int(offset)))
        align = meta.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ModelLoadError(f"{self.path}: general.alignment {align!r} is not a power of two")
        self.alignment = align
        data_start = -(-cur.pos // align) * align
        tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in raw:
            if name in tensors:
                raise ModelLoadError(f"{self.path}: tensor {name!r} appears twice")
            tensors[name] = TensorInfo(
                name, shape, ggml_type, data_start + offset, self._nbytes(name, shape, ggml_type)
            )
            if offset % align:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} starts at data offset {offset}, not a multiple of the "
                    f"file's alignment {align}: the file is corrupt or truncated"
                )
        return meta, tensors, data_start

    def _nbytes(self, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
        size = _block_size(ggml_type)
        if size is None:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}")
        weights, nbytes = size
        if any(s <= 0 for s in shape) or shape[0] % weights:
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} of type {type_name(ggml_type)} has shape {list(shape)}: "
                f"rows must be whole blocks of {weights} weights"
            )
        count = int(np.prod(shape, dtype=np.int64))
        return count // weights * nbytes

    def _validate(self) -> None:
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        end_prev, prev = self.data_start, None
        for start, end, name in spans:
            if end > self.size:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} runs to byte {end}, past the end of the file "
                    f"({self.size} bytes): the file is corrupt or truncated"
                )
            if start < end_prev:
                raise ModelLoadError(
                    f"{self.path}: tensors {prev!r} and {name!r} overlap: the file is corrupt or truncated"
                )
            end_prev, prev = end, name

    # ------------------------------------------------------------------ access

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def metadata_bytes(self, keys) -> dict[str, bytes]:
        """Metadata items ``keys`` (those the file has) as the file stores them: key, type and value."""
        spans = {key: self.metadata_spans[key] for key in keys if key in self.metadata_spans}
        if not spans:
            return {}
        first, last = min(s for s, _ in spans.values()), max(e for _, e in spans.values())
        with open(self.path, "rb", buffering=0) as fh:
            raw = os.pread(fh.fileno(), last - first, first)
        if len(raw) != last - first:
            raise ModelLoadError(f"{self.path}: the file changed while it was read (its header is shorter)")
        return {key: raw[s - first : e - first] for key, (s, e) in spans.items()}

    def read_metadata(self, keys) -> dict:
        """Metadata items ``keys`` (those the file has) with every array in full: a vocabulary, its
        scores and types, which the header's first reading counts but does not keep."""
        out = {}
        for key, raw in self.metadata_bytes(keys).items():
            cur = _Cursor(raw, self.path)
            if cur.string() != key:
                raise ModelLoadError(f"{self.path}: the file changed while it was read (metadata {key!r} moved)")
            (vtype,) = cur.take("<I")
            out[key] = cur.value(vtype, keep=True)
        return out

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelLoadError(f"{self.path}: the file has no tensor {name!r}") from None

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as stored: uint8 [rows, row bytes], in memory of its own (pread)."""
        t = self.info(name)
        out = np.empty(t.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as fh:
            fh.seek(t.offset)
            got = fh.readinto(memoryview(out))
        if got != t.nbytes:
            raise ModelLoadError(f"{self.path}: tensor {name!r} is truncated ({got} of {t.nbytes} bytes)")
        return out.reshape(t.rows, t.nbytes // t.rows)

    def rows(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes as a read-only memory map, uint8 [rows, row bytes]: only the rows
        indexed are read (an embedding table looked up a few rows at a time)."""
        t = self.info(name)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.rows, t.nbytes // t.rows))

    def read_rows(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` (int64 [n], in range) of tensor ``name``'s stored bytes, uint8 [n, row bytes], read
        into memory of their own, a run of consecutive rows at a time: an embedding table's rows looked up
        for a step's tokens. A positioned read (a few microseconds, through a descriptor opened on the
        first call and kept) costs less than mapping the file for each lookup (~0.1 ms a step at 1B), and a
        file truncated since its header was read gives an error here rather than a SIGBUS from a memory map."""
        t = self.info(name)
        width = t.nbytes // t.rows
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        out = np.empty((index.size, width), dtype=np.uint8)
        if index.size == 1:  # a decode step's one token
            runs = [(0, 1)]
        else:
            starts = np.flatnonzero(np.diff(index, prepend=-2) != 1).tolist()  # the first row of each run
            runs = list(zip(starts, [*starts[1:], index.size]))
        reader = self._reader()
        for a, b in runs:
            if reader(memoryview(out[a:b]).cast("B"), t.offset + int(index[a]) * width) != (b - a) * width:
                raise ModelLoadError(f"{self.path}: tensor {name!r} is truncated (rows {index[a]}..{index[b - 1]})")
        return out

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_read"}  # its descriptor is this process's own

    def _reader(self):
        """``read(buffer, offset) -> bytes read``, made on the first call and kept: positioned reads through
        a descriptor of this file's own (closed with the object), or a seek and a read where the platform
        has no ``preadv``."""
        read = self.__dict__.get("_read")
        if read is None:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
            weakref.finalize(self, os.close, fd)
            if hasattr(os, "preadv"):

                def read(buf, offset):
                    return os.preadv(fd, [buf], offset)

            else:
                fh = open(fd, "rb", buffering=0, closefd=False)  # noqa: SIM115 (the finalizer closes the descriptor)

                def read(buf, offset):
                    fh.seek(offset)
                    return fh.readinto(buf)

            self._read = read
        return read

    def values(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 numpy, shaped as stored (ggml's ne reversed): gguf-py's
        ``dequantize``, the values transformers' GGUF loader gives."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.info(name)
        data = self.read(name)
        flat = dequantize(data.reshape(-1), GGMLQuantizationType(t.ggml_type)).astype(np.float32, copy=False)
        return flat.reshape(tuple(reversed(t.shape)))


def file_size_bytes(path: str | Path) -> int:
    return os.path.getsize(path)
