"""One registry class for everything fastdecode builds or looks up by name.

Drafters, quantization handlers, benchmark datasets, sweeps and peers each keep a
:class:`Registry`; a component adds itself with ``@REGISTRY.register(name)`` when
its module is imported, and front ends find it with ``REGISTRY.get(name)``.

A name registered twice is a bug in the code registering it, so it raises
``ValueError`` at import. An unknown name is the user's mistake, so ``get`` raises
:class:`~fastdecode.errors.ConfigError` listing the choices.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from fastdecode.errors import ConfigError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def _label(key: Hashable) -> str:
    # Keys are names, or (for quantization handlers) config classes, shown by class name.
    return key.__name__ if isinstance(key, type) else str(key)


class Registry(Generic[K, V]):
    """Entries of one ``kind`` ("drafter", "sweep", ...) keyed by name."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[K, V] = {}

    def register(self, name: K) -> Callable[[V], V]:
        """Decorator adding its argument under ``name``; returns it unchanged."""

        def add(entry: V) -> V:
            if name in self._entries:
                raise ValueError(f"{self.kind} {_label(name)!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def unregister(self, name: K) -> None:
        """Remove ``name`` (a test's temporary entry); KeyError when it is not registered."""
        del self._entries[name]

    def get(self, name: K) -> V:
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(f"unknown {self.kind} {_label(name)!r}; choose from: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(_label(key) for key in self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
