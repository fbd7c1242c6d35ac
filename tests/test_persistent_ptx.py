"""native/persistent.cu's safety properties, read from its PTX for sm_90a (nvcc here and in CI; no GPU):

- the grid barrier is bounded: the kernel reads %globaltimer (a barrier that waits past its limit
  records the phase and every block leaves; the engine reports an error instead of hanging);
- the tensor maps, which live in global memory written by a host copy, are acquired by the
  tensormap proxy before the copy engine uses them (fence.proxy.tensormap::generic.acquire: without
  it a descriptor cached from a freed engine's program at the same address may be used);
- the optional L2 prefetch of the next matvec phase's weights (OJ_PERSISTENT_PREFETCH) is in it;
- writes of one phase are ordered before the copy engine's reads of the next
  (fence.proxy.async.global at the barrier) and the barrier's fences are gpu-scoped.
The GPU behaviour is tests/test_native_persistent_gpu.py's.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cuda_tools import find_nvcc

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kernel_ptx(tmp_path_factory) -> str:
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (PATH or /usr/local/cuda/bin): the check reads the kernel's PTX")
    out = tmp_path_factory.mktemp("pptx") / "persistent.ptx"
    r = subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_90a", "-Inative", "-ptx", "native/persistent.cu", "-o", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"nvcc failed:\n{r.stdout}\n{r.stderr}"
    ptx = out.read_text()
    entries = [m.start() for m in re.finditer(r"^(?:\.visible )?\.entry ", ptx, re.M)]
    for i, at in enumerate(entries):
        header = ptx[at:ptx.index("(", at)]
        if "persistent_kernel" in header:
            end = entries[i + 1] if i + 1 < len(entries) else len(ptx)
            return ptx[at:end]
    pytest.fail("no persistent_kernel entry in the PTX")


def test_the_barrier_is_bounded_by_the_global_timer(kernel_ptx):
    assert "%globaltimer" in kernel_ptx
    assert re.search(r"ld\.acquire\.gpu\.global\.u32", kernel_ptx)   # the generation spin
    assert re.search(r"st\.release\.gpu\.global\.u32", kernel_ptx)   # the last arrival's release
    assert "membar.gl" in kernel_ptx or "fence.sc.gpu" in kernel_ptx or "fence.acq_rel.gpu" in kernel_ptx


def test_tensor_maps_are_acquired_before_the_copy_engine_reads(kernel_ptx):
    fence = kernel_ptx.find("fence.proxy.tensormap::generic.acquire.gpu")
    copy = kernel_ptx.find("cp.async.bulk.tensor")
    assert fence >= 0, "no tensormap acquire in the persistent kernel"
    assert copy >= 0, "the persistent kernel issues no tensor copy (its matvec is not on the copy engine?)"


def test_the_l2_prefetch_of_the_next_matvec_phase_is_there(kernel_ptx):
    """OJ_PERSISTENT_PREFETCH=1's tensor prefetches (into L2, no shared memory, no barrier)."""
    assert "cp.async.bulk.prefetch.tensor.2d.L2.global" in kernel_ptx


def test_phase_writes_are_fenced_for_the_copy_engine(kernel_ptx):
    assert kernel_ptx.count("fence.proxy.async.global") >= 2           # writer side and reader side
    assert "fence.proxy.async.shared::cta" in kernel_ptx                # rings reused across items


def test_host_copies_are_ordered_on_the_engine_stream():
    """The engine's stream is non-blocking: a plain cudaMemcpy / cudaMemset runs on the legacy stream,
    unordered with it, and a pageable host-to-device cudaMemcpy returns once the bytes are staged. The
    program upload did that at bb68e4e, and the first launch read a program still in flight when other
    processes shared the GPU (wrong logits, all-zero logits). Every copy and fill in persistent.cu goes
    on the engine's stream."""
    src = (REPO / "native" / "persistent.cu").read_text()
    code = re.sub(r"//[^\n]*", "", src)
    bad = [m.group(0) for m in re.finditer(r"\bcuda(?:Memcpy|Memset)\s*\(", code)]
    assert not bad, f"synchronous legacy-stream copies in persistent.cu: {bad}"
    asyncs = re.findall(r"\bcuda(?:Memcpy|Memset)Async\s*\(([^;]*)\)\s*,\s*\"", code)
    assert asyncs, "no async copy found: the check reads nothing"
    for args in asyncs:
        assert re.search(r",\s*(?:e\.stream|st)\s*$", args.strip()), f"an async copy not on the engine stream: {args}"
