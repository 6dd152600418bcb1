"""A model directory's safetensors files, read by name (safetensors only, never pickle).

:class:`Tensors` opens ``model.safetensors`` or the shards ``model.safetensors.index.json``
names (else every ``*.safetensors`` file in the directory) and remembers which tensors were
taken, so the loader can refuse a checkpoint holding tensors nothing read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fastdecode.errors import ModelLoadError


class Tensors:
    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        files = self._files()
        if not files:
            raise ModelLoadError(f"{self.path}: no .safetensors weights (fastdecode never loads pickled weights)")
        self._where: dict[str, object] = {}
        self._handles = []
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises SafetensorError, OSError, ...
                raise ModelLoadError(f"{file}: unreadable safetensors file ({exc})") from None
            self._handles.append(handle)
            names = handle.keys()  # a safe_open handle is not iterable itself
            for key in names:
                self._where[key] = handle
        self.taken: set[str] = set()

    def _files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"{index}: corrupt index ({exc})") from None
            for name in names:  # a shard is a file beside the index, never a path elsewhere
                if not isinstance(name, str) or Path(name).name != name or not (self.path / name).is_file():
                    raise ModelLoadError(f"{index}: names a missing or unsafe shard {name!r}")
            return [self.path / n for n in names]
        return sorted(self.path.glob("*.safetensors"))

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> list[str]:
        return list(self._where)

    def get(self, key: str) -> torch.Tensor:
        """Tensor ``key`` (marked taken); a missing one is a ModelLoadError naming it."""
        if key not in self._where:
            raise ModelLoadError(f"{self.path}: the checkpoint has no tensor {key!r}")
        self.taken.add(key)
        try:
            return self._where[key].get_tensor(key)
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: cannot read tensor {key!r} ({exc})") from None

    def optional(self, key: str) -> torch.Tensor | None:
        return self.get(key) if key in self._where else None

    def skip(self, key: str) -> None:
        """Mark ``key`` as read on purpose though unused (a static activation scale)."""
        if key in self._where:
            self.taken.add(key)

    def left(self) -> list[str]:
        """The tensors nothing took."""
        return sorted(k for k in self._where if k not in self.taken)
