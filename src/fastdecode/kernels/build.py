"""How fastdecode's C library is built: on first use, with the machine's C compiler
(``$CC`` or ``cc``), into the fastdecode cache (:func:`cache_root`, ``kernels/``),
named by a hash of the source and flags. ``cpu.c`` includes ``quant.c`` (which includes ``quant_decode.c``,
``quant_ymm.c`` and ``quant_avx512.c``), ``quant_pack.c``, ``kv.c``, ``sparse.c``, ``w8a8.c`` and ``experts.c``: one library.

It links OpenMP as ``libgomp.so.1``; torch's CPU wheels load their own
``libgomp.so.1`` first, so the dynamic loader resolves ours to that same runtime
and the kernel shares torch's thread pool and thread count
(``torch.set_num_threads``). Where it cannot be had (not x86-64, no AVX2/FMA/F16C,
no compiler, a failed build) the loader (``fastdecode.kernels.cpu``) says why and
callers fall back to torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.c")
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "cpu.c",
        "quant.c",
        "quant_decode.c",
        "quant_ymm.c",
        "quant_avx512.c",
        "quant_pack.c",
        "kv.c",
        "kv_avx512.c",
        "sparse.c",
        "sparse_f32.c",
        "w8a8.c",
        "experts.c",
    )
)  # cpu.c includes them
# -ffp-contract=off: a compiler must not fuse a * b + c where the C code does not
# (gcc's -std=c11 implies it; clang's default would not).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# quant.c's AVX-VNNI and AVX-512 VNNI kernels are compiled by function attributes and taken at run
# time where the CPU has them; a compiler that knows neither target builds without them.
NO_VNNI_FLAGS = ("-DFD_NO_VNNI",)
# The first build compiles every format's specialized GEMM loops for three instruction sets (~80 s of
# CPU on an idle core); on a loaded 2-core machine it took ~4 minutes, near the old 300 s limit, and a
# build killed there leaves no library at all (every caller falls back to torch). The limit guards
# against a hung compiler only, so it is generous.
BUILD_TIMEOUT_S = 900


def cache_root() -> Path:
    """fastdecode's cache directory: ``$FASTDECODE_CACHE``, default ``~/.cache/fastdecode``
    (built kernels under ``kernels/``; ``fastdecode.loading`` keeps converted GGUF models under ``gguf/``)."""
    return Path(os.environ.get("FASTDECODE_CACHE", Path.home() / ".cache" / "fastdecode")).expanduser()


def find_compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line for line in fh if line.startswith("flags")), "")
    except OSError:
        return ""


def cflags() -> tuple[str, ...]:
    """The flags the library is built with (:data:`CFLAGS`: the same on every x86-64 CPU; the kernels
    for wider instruction sets are chosen at run time)."""
    return CFLAGS


def cpu_reason() -> str | None:
    """None when this CPU runs the library, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the row-invariant kernel is written for x86-64, this CPU is {platform.machine()}"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the row-invariant kernel needs AVX2 and FMA; torch reports CPU capability {capability}"
    flags = _cpu_flags()  # F16C (fp16 scales of the block formats) comes with every AVX2 CPU we know; Linux says so
    if flags and " f16c" not in flags:
        return "the row-invariant kernel needs F16C, which this CPU lacks"
    return None


def build(cc: str, source: Path = SOURCE, extra: tuple[str, ...] = ()) -> Path:
    """The shared library built from ``source`` with ``cc`` (cached: built once per source, flags and compiler);
    ``extra``: flags added to :func:`cflags` (a test build's ``-D``)."""
    key_source = b"".join(s.read_bytes() for s in SOURCES)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{cc} --version did not answer") from None
    flags = cflags() + tuple(extra)
    key = hashlib.sha256(key_source + repr((flags, version)).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target.with_suffix(".lock")):  # a concurrent caller waits, then finds the library
        if target.is_file():
            return target
        return _build_into(cc, flags, source, target)


@contextlib.contextmanager
def _build_lock(path: Path):
    """One build of a key at a time, across processes (a cold build takes minutes of a core: test
    runs and servers started together would each compile it). Where ``fcntl`` is missing, no lock:
    concurrent builds are then only wasted work (each lands atomically)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build_into(cc: str, flags: tuple[str, ...], source: Path, target: Path) -> Path:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".cpu-", suffix=".so")
    os.close(fd)
    try:
        proc = _compile(cc, flags, source, tmp)
        if proc.returncode != 0:  # a compiler without the AVX-VNNI or AVX-512 VNNI targets
            proc = _compile(cc, flags + NO_VNNI_FLAGS, source, tmp)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {source.name}: {proc.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compile(cc: str, flags: tuple[str, ...], source: Path, out: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [cc, *flags, str(source), "-o", out], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{cc} took over {BUILD_TIMEOUT_S} s to build {source.name}") from None
