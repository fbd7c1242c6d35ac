"""The native engine builds and binds on a machine without a GPU (CI has nvcc 13.0, no GPU).

- the cffi binding parses native/openjet.h (the single source of truth for the C API) and its
  struct layouts equal the C compiler's;
- the header's type ids are ggml's and cover config.SUPPORTED_TENSOR_TYPES;
- build_native picks architectures as documented and exits 0 without nvcc;
- with nvcc present, the CUDA sources compile for sm_90, the library loads, and without a GPU it
  answers with an error code and a message (no abort), so the backend selection falls back.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from openjet_plugin import _native, build_native
from openjet_plugin.config import SUPPORTED_TENSOR_TYPES

HEADER = Path(__file__).resolve().parent.parent / "native" / "openjet.h"


def _constants():
    """The header's enum constants (ABI mode resolves them from the cdef; libc stands in for the library)."""
    ffi = _native.make_ffi()
    return ffi, ffi.dlopen(None)


def test_cdef_source_drops_preprocessor_and_cplusplus_guard():
    text = _native.cdef_source(HEADER.read_text())
    assert "#" not in "".join(line.split("/*")[0] for line in text.splitlines() if not line.lstrip().startswith("*"))
    assert 'extern "C"' not in text
    assert "oj_eval" in text and "oj_engine_create" in text


def test_header_parses_with_cffi():
    ffi, consts = _constants()
    # the Python side's copies of the header's limits
    from openjet_plugin.backends import native
    assert consts.OJ_MAX_POSITIONS == native.MAX_POSITIONS == 16
    assert consts.OJ_MAX_TREE_NODES == native.MAX_TREE_NODES == 8
    assert consts.OJ_OK == 0
    assert ffi.sizeof("oj_tensor") >= 8 + 4 + 4 + 32 + 8 + 8
    # every function the C API promises is declared
    declared = set(re.findall(r"\b(oj_[a-z_]+)\s*\(", _native.cdef_source(HEADER.read_text())))
    for name in ("oj_engine_create", "oj_engine_free", "oj_last_error", "oj_reset", "oj_eval", "oj_get_argmax",
                 "oj_get_logits", "oj_mtp_eval", "oj_get_draft_logits", "oj_read_ssm_state", "oj_read_kv",
                 "oj_debug_fault", "oj_device_info", "oj_prefill"):
        assert name in declared, name


def test_header_type_ids_are_ggml_ids_and_cover_supported_types():
    _, consts = _constants()
    for name in SUPPORTED_TENSOR_TYPES:
        assert getattr(consts, f"OJ_TYPE_{name}") == GGMLQuantizationType[name].value, name


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_struct_layout_equals_the_c_compilers(tmp_path):
    ffi = _native.make_ffi()
    fields = {"oj_tensor": ["name", "type", "n_dims", "ne", "data", "n_bytes"],
              "oj_model_desc": ["hparams", "tensors", "n_tensors", "n_ctx", "kv_type", "device", "n_checkpoints", "prefill_chunk"],
              "oj_hparams": ["rope_sections", "rope_freq_base", "rms_eps", "n_layer_nextn"],
              "oj_memory_report": ["weights", "checkpoints", "prefill", "total"]}
    lines = ['#include <stdio.h>', '#include <stddef.h>', f'#include "{HEADER}"', "int main(void) {"]
    expect = []
    for struct, names in fields.items():
        lines.append(f'printf("%zu\\n", sizeof({struct}));')
        expect.append(ffi.sizeof(struct))
        for f in names:
            lines.append(f'printf("%zu\\n", offsetof({struct}, {f}));')
            expect.append(ffi.offsetof(struct, f))
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, str(src), "-o", str(tmp_path / "layout")], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                                          check=True).stdout.split()]
    assert got == expect


def test_parse_archs():
    assert build_native.parse_archs("86;89, 90 sm_120") == ["86", "89", "90", "120"]
    assert build_native.parse_archs("compute_90a") == ["90a"]
    with pytest.raises(ValueError, match="sm_9x"):
        build_native.parse_archs("sm_9x")


def test_hopper_gets_the_arch_specific_code():
    """cc 9.0 builds sm_90a (gemm_wgmma.cuh's wgmma / TMA kernels exist only there); the others as
    named; the PTX of the newest for a newer GPU's JIT."""
    flags = " ".join(build_native.nvcc_flags(["86", "90", "120"]))
    assert "arch=compute_90a,code=sm_90a" in flags and "code=sm_90 " not in flags + " "
    assert "arch=compute_86,code=sm_86" in flags and "arch=compute_120,code=compute_120" in flags
    assert "arch=compute_90,code=compute_90" in " ".join(build_native.nvcc_flags(["90"]))


def test_arch_default_without_gpu(monkeypatch):
    monkeypatch.delenv(build_native.ARCH_ENV, raising=False)
    monkeypatch.setattr(build_native, "local_gpu_archs", lambda: [])
    archs, why = build_native.choose_archs()
    assert archs == ["86", "89", "90", "120"] and "default" in why
    monkeypatch.setenv(build_native.ARCH_ENV, "90")
    assert build_native.choose_archs()[0] == ["90"]


def test_build_without_nvcc_succeeds_quietly(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(build_native.ARCH_ENV, "90")      # asked for: without nvcc, a clear skip
    monkeypatch.setattr(build_native, "find_nvcc", lambda: None)
    assert build_native.main(["--out-dir", str(tmp_path)]) == 0
    assert "nvcc not found" in capsys.readouterr().err
    assert not (tmp_path / build_native.LIB_NAME).exists()


# Not marked slow on purpose (~1 minute on 2 cores): CI must compile the CUDA sources on every run.
@pytest.mark.skipif(build_native.find_nvcc() is None, reason="nvcc not installed")
def test_compiles_for_sm90_and_fails_cleanly_without_gpu(tmp_path, monkeypatch):
    lib = build_native.build(tmp_path, ["90"], verbose=False)
    assert lib is not None and lib.is_file()
    assert build_native.is_current(tmp_path)
    ffi = _native.make_ffi()
    native = ffi.dlopen(str(lib))
    assert native.oj_abi_version() == native.OJ_ABI_VERSION
    # any GPU here or not, a bad request is an error code and a message, never an abort
    out = ffi.new("oj_engine **")
    assert native.oj_engine_create(ffi.NULL, out) == native.OJ_ERR_INVALID_ARGUMENT
    assert ffi.string(native.oj_last_error(ffi.NULL)) == b"desc is NULL"
    replayed = ffi.new("int64_t *", -1)
    assert native.oj_graph_stats(ffi.NULL, replayed, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL) == native.OJ_ERR_INVALID_ARGUMENT
    assert ffi.string(native.oj_last_error(ffi.NULL)) == b"engine is NULL" and replayed[0] == -1
    cc = ffi.new("int32_t[2]")
    rc = native.oj_device_info(0, cc, cc + 1, ffi.NULL, ffi.NULL, ffi.NULL, 0)
    if rc != native.OJ_OK:
        assert rc == native.OJ_ERR_NO_DEVICE and ffi.string(native.oj_last_error(ffi.NULL))
        # the backend selection sees the same answer and falls back, saying why
        from openjet_plugin.backends import native as native_backend
        monkeypatch.setenv(_native.LIB_ENV, str(lib))
        monkeypatch.setattr(_native, "_cached", None)

        class _NoModel:
            config = None
            tensors: dict = {}

        ok, reason = native_backend.native_status(_NoModel(), 64)
        assert not ok and "CUDA" in reason


def test_a_library_elsewhere_is_read_with_the_header_beside_it(tmp_path, monkeypatch):
    """OPENJET_NATIVE_LIB's folder holding an openjet.h (a library built from another tree, an A/B's
    candidate of another ABI): that header declares it; without one, the package's or the source
    tree's does."""
    from cffi import FFI

    other = tmp_path / "other"
    other.mkdir()
    text = _native.SOURCE_HEADER.read_text()
    abi = int(re.search(r"OJ_ABI_VERSION = (\d+)", text).group(1))
    (other / "openjet.h").write_text(text.replace(f"OJ_ABI_VERSION = {abi}", f"OJ_ABI_VERSION = {abi - 1}"))
    monkeypatch.setenv(_native.LIB_ENV, str(other / "libopenjet.so"))
    assert _native.header_path() == other / "openjet.h"
    assert _native.make_ffi().dlopen(None).OJ_ABI_VERSION == abi - 1
    bare = tmp_path / "bare"
    bare.mkdir()
    monkeypatch.setenv(_native.LIB_ENV, str(bare / "libopenjet.so"))
    assert _native.header_path() in (_native.PACKAGE_NATIVE_DIR / "openjet.h", _native.SOURCE_HEADER)
    ffi = FFI()
    ffi.cdef(_native.cdef_source(_native.header_path().read_text()))
    assert ffi.dlopen(None).OJ_ABI_VERSION == abi
