"""The decode roofline: the card's streaming read rate over the bytes one decoded position must read.

Decoding one position reads every weight of the main model once (all tensors but the token
embedding table, which is only indexed, and the MTP block, which plain decoding does not run),
plus the per-conversation state: the K and V of every earlier position in the attention layers
and the Gated DeltaNet recurrent state, which is read and written back. At depth d:

    bytes(d) = weight_bytes + kv_bytes_per_token * d + 2 * recurrent_state_bytes
    roofline_tps(d) = read_rate / bytes(d)

The read rate is measured here, in the same run, by a small CUDA program (compiled with nvcc,
source below): a read-only kernel streaming several GB with 16-byte non-coherent loads
(`ld.global.nc.v4`), timed with CUDA events; and a device-to-device copy, counted as bytes read
plus bytes written. The kernel first proves it reads every element exactly once: the XOR of all
words it loads equals the XOR the host computes for the same (hash-filled, never zero) data.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

KERNEL_SOURCE = r"""
// roofline probe: streaming read rate (16-byte loads) and device-to-device copy rate.
// Usage: roofline READ_MIB COPY_MIB REPS   -> one JSON object on stdout.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CHECK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, \
            cudaGetErrorString(e_)); exit(2); } } while (0)

__host__ __device__ inline uint32_t mix(uint32_t x) {   // a bijective integer hash; never all-zero data
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x | 1U;
}

__global__ void fill(uint4 *p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t b = (uint32_t)(i * 4);
        p[i] = make_uint4(mix(b), mix(b + 1), mix(b + 2), mix(b + 3));
    }
}

// Each thread XORs the words it loads; UNROLL independent 16-byte loads are in flight per thread.
// VERIFY: fold every thread's value into *sink (the check); otherwise write only on an impossible
// value, which keeps the loads alive without adding traffic.
template <int UNROLL, bool VERIFY>
__global__ void read_stream(const uint4 *__restrict__ p, size_t n, uint32_t *__restrict__ sink) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    uint32_t acc = 0;
    for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = __ldg(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) { uint4 v = __ldg(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
    if (VERIFY) atomicXor(sink, acc);
    else if (acc == 0x9E3779B9U) sink[1] = acc;   // rare and harmless: the compiler must keep the loads
}

static float time_ms(cudaEvent_t a, cudaEvent_t b) { float ms = 0; CHECK(cudaEventElapsedTime(&ms, a, b)); return ms; }

int main(int argc, char **argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s READ_MIB COPY_MIB REPS\n", argv[0]); return 1; }
    size_t read_bytes = (size_t)atoll(argv[1]) << 20, copy_bytes = (size_t)atoll(argv[2]) << 20;
    int reps = atoi(argv[3]);
    int dev = 0; CHECK(cudaGetDevice(&dev));
    cudaDeviceProp prop; CHECK(cudaGetDeviceProperties(&prop, dev));
    size_t free_b = 0, total_b = 0; CHECK(cudaMemGetInfo(&free_b, &total_b));
    size_t need = std::max(read_bytes, 2 * copy_bytes) + ((size_t)256 << 20);
    if (need > free_b) { fprintf(stderr, "not enough free device memory: need %zu, free %zu\n", need, free_b); return 3; }

    cudaEvent_t e0, e1; CHECK(cudaEventCreate(&e0)); CHECK(cudaEventCreate(&e1));
    uint32_t *sink; CHECK(cudaMalloc(&sink, 8));

    // --- check: the read kernel sees every word exactly once (XOR over a small buffer) ---
    {
        size_t n = (size_t)(16 << 20) / 16;
        uint4 *p; CHECK(cudaMalloc(&p, n * 16));
        fill<<<1024, 256>>>(p, n); CHECK(cudaGetLastError());
        CHECK(cudaMemset(sink, 0xAB, 4));       // poison
        uint32_t zero = 0; CHECK(cudaMemcpy(sink, &zero, 4, cudaMemcpyHostToDevice));
        read_stream<4, true><<<prop.multiProcessorCount * 4, 256>>>(p, n, sink); CHECK(cudaGetLastError());
        uint32_t got = 0; CHECK(cudaMemcpy(&got, sink, 4, cudaMemcpyDeviceToHost));
        uint32_t want = 0; for (size_t w = 0; w < n * 4; ++w) want ^= mix((uint32_t)w);
        CHECK(cudaFree(p));
        if (got != want) { fprintf(stderr, "read kernel check failed: xor %08x, expected %08x\n", got, want); return 4; }
    }

    // --- streaming read over read_bytes, a few launch shapes; the best median wins ---
    size_t n = read_bytes / 16;
    uint4 *buf; CHECK(cudaMalloc(&buf, n * 16));
    fill<<<prop.multiProcessorCount * 8, 256>>>(buf, n); CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    const int shapes[][2] = {{2, 512}, {4, 256}, {8, 256}, {16, 128}};   // blocks per SM, threads
    double best_median = -1; int best = 0; std::vector<double> best_samples;
    for (int s = 0; s < 4; ++s) {
        int grid = prop.multiProcessorCount * shapes[s][0], block = shapes[s][1];
        std::vector<double> gbps;
        for (int r = -2; r < reps; ++r) {            // two warm-up launches
            CHECK(cudaEventRecord(e0));
            read_stream<4, false><<<grid, block>>>(buf, n, sink);
            CHECK(cudaEventRecord(e1)); CHECK(cudaEventSynchronize(e1)); CHECK(cudaGetLastError());
            if (r >= 0) gbps.push_back((double)(n * 16) / (time_ms(e0, e1) * 1e-3) / 1e9);
        }
        std::vector<double> sorted = gbps; std::sort(sorted.begin(), sorted.end());
        double med = sorted.size() % 2 ? sorted[sorted.size() / 2]
                                       : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]);
        if (med > best_median) { best_median = med; best = s; best_samples = gbps; }
    }
    CHECK(cudaFree(buf));

    // --- device-to-device copy: bytes read + bytes written ---
    std::vector<double> copy;
    {
        void *a, *b; CHECK(cudaMalloc(&a, copy_bytes)); CHECK(cudaMalloc(&b, copy_bytes));
        fill<<<prop.multiProcessorCount * 8, 256>>>((uint4 *)a, copy_bytes / 16); CHECK(cudaGetLastError());
        for (int r = -2; r < reps; ++r) {
            CHECK(cudaEventRecord(e0));
            CHECK(cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice));
            CHECK(cudaEventRecord(e1)); CHECK(cudaEventSynchronize(e1));
            if (r >= 0) copy.push_back(2.0 * (double)copy_bytes / (time_ms(e0, e1) * 1e-3) / 1e9);
        }
        CHECK(cudaFree(a)); CHECK(cudaFree(b));
    }

    printf("{\"device\": {\"name\": \"%s\", \"sm_count\": %d, \"compute_cap\": \"%d.%d\", "
           "\"total_memory_bytes\": %zu, \"l2_bytes\": %d, \"memory_bus_bits\": %d}, ",
           prop.name, prop.multiProcessorCount, prop.major, prop.minor, total_b, prop.l2CacheSize,
           prop.memoryBusWidth);
    printf("\"read_bytes\": %zu, \"copy_bytes\": %zu, \"read_shape\": {\"blocks_per_sm\": %d, "
           "\"threads\": %d, \"loads_in_flight_per_thread\": 4}, \"read_gbps\": [",
           n * 16, copy_bytes, shapes[best][0], shapes[best][1]);
    for (size_t i = 0; i < best_samples.size(); ++i) printf("%s%.3f", i ? ", " : "", best_samples[i]);
    printf("], \"copy_gbps\": [");
    for (size_t i = 0; i < copy.size(); ++i) printf("%s%.3f", i ? ", " : "", copy[i]);
    printf("]}\n");
    return 0;
}
"""


class RooflineError(RuntimeError):
    pass


# --- bytes per decoded position --------------------------------------------------------------------

def weight_bytes_per_position(model_file) -> dict:
    """Bytes of the weights one plain decode step reads, from the GGUF's own tensor sizes.

    Counted: every tensor of the main layers, `output_norm` and the output head. Not counted:
    `token_embd` (decode reads one row of it), unless the file has no `output.weight` — the head
    is then tied to the embedding table and reads all of it; the MTP block `blk.{n_layer}.*`.
    """
    c = model_file.config
    mtp_prefixes = tuple(f"blk.{il}." for il in range(c.n_layer, c.block_count))
    tied = "output.weight" not in model_file.tensors
    counted, excluded = 0, {}
    for name, t in model_file.tensors.items():
        n = int(t.n_bytes)
        if name == "token_embd.weight" and not tied:
            excluded[name] = n
        elif name.startswith(mtp_prefixes):
            excluded[name] = n
        else:
            counted += n
    return {"weight_bytes": counted, "excluded_bytes": sum(excluded.values()),
            "n_excluded_tensors": len(excluded), "tied_output": tied}


def state_bytes(config, depth: int, kv_bytes_per_value: int = 2) -> dict:
    """Per-position state traffic at `depth`: K and V of every earlier position (f16 by default,
    both engines' default), and the recurrent DeltaNet state (f32) read and written back."""
    n_attn = len(config.attention_layers())
    kv_per_token = n_attn * 2 * config.kv_dim * kv_bytes_per_value
    recurrent = len(config.deltanet_layers()) * config.ssm_dt_rank * config.ssm_d_state ** 2 * 4
    return {"kv_bytes_per_token": kv_per_token, "kv_bytes": kv_per_token * depth,
            "recurrent_bytes_read_written": 2 * recurrent}


def bytes_per_position(weight_bytes: int, config, depth: int) -> int:
    s = state_bytes(config, depth)
    return int(weight_bytes + s["kv_bytes"] + s["recurrent_bytes_read_written"])


# --- the probe -------------------------------------------------------------------------------------

def build_probe(cache: Path, arch: str) -> Path:
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)
    if nvcc is None:
        raise RooflineError("nvcc not found: the roofline probe is compiled on the machine it measures")
    key = hashlib.sha256((KERNEL_SOURCE + arch).encode()).hexdigest()[:12]
    exe = cache / f"roofline-probe-sm{arch}-{key}"
    if exe.is_file():
        return exe
    cache.mkdir(parents=True, exist_ok=True)
    src = exe.with_suffix(".cu")
    src.write_text(KERNEL_SOURCE)
    cmd = [nvcc, "-O3", "-std=c++17", f"-arch=sm_{arch}", "-o", str(exe) + ".tmp", str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RooflineError(f"compiling the roofline probe failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    Path(str(exe) + ".tmp").rename(exe)
    return exe


def run_probe(exe: Path, read_mib: int, copy_mib: int, reps: int, timeout: float) -> dict:
    try:
        r = subprocess.run([str(exe), str(read_mib), str(copy_mib), str(reps)], capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"the roofline probe ran past {timeout:.0f} s") from None
    if r.returncode != 0:
        raise RooflineError(f"the roofline probe failed (exit {r.returncode}): {r.stderr.strip()[-1000:]}")
    try:
        return json.loads(r.stdout)
    except json.JSONDecodeError as exc:
        raise RooflineError(f"the roofline probe printed no JSON ({exc}): {r.stdout[:300]!r}") from None
