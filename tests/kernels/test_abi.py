"""The ctypes declarations (``kernels/abi.py``) match the C source they describe, and bind every function."""

import ctypes
import re
from pathlib import Path

import pytest

from fastdecode.kernels import abi, cpu

SOURCE_DIR = Path(abi.__file__).parent


def _c_signature(source: str, name: str) -> tuple[str, list[str]]:
    m = re.search(rf"^(\w+) {name}\(([^)]*)\)", source, re.M)
    assert m, name
    return m.group(1), [" ".join(a.split()) for a in m.group(2).split(",")]


def _kind(c_arg: str) -> type:
    if "*" in c_arg:
        return abi.PTR
    return {"int64_t": abi.I64, "float": abi.F32}[c_arg.replace("const ", "").split()[0]]


@pytest.mark.parametrize(
    "file, table",
    [
        ("cpu.c", abi.CPU_FUNCTIONS),
        ("quant.c", abi.QUANT_FUNCTIONS),
        ("quant_pack.c", abi.PACK_FUNCTIONS),
        ("w8a8.c", abi.W8A8_FUNCTIONS),
        ("experts.c", abi.EXPERTS_FUNCTIONS),
    ],
)
def test_every_declared_function_matches_its_c_signature(file, table):
    source = (SOURCE_DIR / file).read_text()
    for name, (restype, args) in table.items():
        result, c_args = _c_signature(source, name)
        assert (result == "void") == (restype is None), name
        assert [a.split()[-1].lstrip("*") for a in c_args] == [a for a, _ in args], name
        assert [_kind(a) for a in c_args] == [t for _, t in args], name


def test_every_exported_cpu_function_is_declared():
    source = (SOURCE_DIR / "cpu.c").read_text()
    exported = set(re.findall(r"^\w+ (fd_\w+)\(", source, re.M)) - {"fd_layer"}  # fd_layer: called by fd_layer_stack
    assert exported == set(abi.CPU_FUNCTIONS)


@pytest.mark.parametrize(
    "file, table",
    [("quant_pack.c", abi.PACK_FUNCTIONS), ("w8a8.c", abi.W8A8_FUNCTIONS), ("experts.c", abi.EXPERTS_FUNCTIONS)],
)
def test_every_exported_function_of_a_file_is_declared(file, table):
    source = (SOURCE_DIR / file).read_text()
    assert set(re.findall(r"^\w+ (fd_\w+)\(", source, re.M)) == set(table)


def test_the_layer_descriptor_and_constants_match_cpu_c():
    source = (SOURCE_DIR / "cpu.c").read_text()
    body = re.search(r"typedef struct \{([^{}]*)\} fd_layer_desc;", source).group(1)
    fields = [name.split()[-1].lstrip("*") for decl in body.split(";") if decl.strip() for name in decl.split(",")]
    assert fields == [f for f, _ in abi.CLayerDesc._fields_]
    assert f"#define MAX_HEAD_DIM {abi.MAX_HEAD_DIM}" in source
    for code, activation in enumerate(abi.GLU_ACTIVATIONS):
        assert f"#define ACT_{activation.upper()} {code}" in source
    for code, kind in enumerate(abi.FFN_KINDS):
        assert f"#define FFN_{kind.upper()} {code}" in source


def test_the_experts_descriptor_matches_experts_c():
    source = (SOURCE_DIR / "experts.c").read_text()
    body = re.search(r"typedef struct \{([^{}]*)\} fd_experts_desc;", source).group(1)
    fields = [name.split()[-1].lstrip("*") for decl in body.split(";") if decl.strip() for name in decl.split(",")]
    assert fields == [f for f, _ in abi.CExperts._fields_]


@pytest.mark.skipif(cpu.rowgemm_unavailable() is not None, reason=str(cpu.rowgemm_unavailable()))
def test_the_loaded_library_has_every_function_typed():
    lib = cpu._kernel()
    for name, (restype, args) in {
        **abi.CPU_FUNCTIONS,
        **abi.QUANT_FUNCTIONS,
        **abi.PACK_FUNCTIONS,
        **abi.W8A8_FUNCTIONS,
        **abi.EXPERTS_FUNCTIONS,
    }.items():
        fn = getattr(lib, name)
        assert fn.restype is restype and list(fn.argtypes) == [t for _, t in args], name
    assert isinstance(lib, ctypes.CDLL)
