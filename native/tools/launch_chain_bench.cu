// launch_chain_bench.cu: what a kernel in a chain of dependent launches costs on this GPU, beside
// the bytes it streams (issue 25). `openjet bench` fits ms = a x launches + bytes / B over the
// decode pass's projection phases (report.launch_fit: ~6.9 us a launch, 2.5 TB/s on an H100 at
// 43d7cd9); this measures the floor of a and B for kernels that do nothing else, as the decode pass
// launches them: one stream, each kernel depending on the one before.
//
//   - empty: each kernel runs pdl_launch_dependents, pdl_wait and one store, on 1, n_sm and 4 n_sm
//     blocks of 256 threads;
//   - stream S: each kernel reads S bytes (16-byte loads, grid-stride, 4 n_sm blocks of 256
//     threads) of a buffer 20x the L2, a different slice each, before its pdl_wait (as the matvecs
//     issue their weight copies before theirs), and one conditional store: S = 1, 4, 16, 64 MB;
// each launched plainly (stream order), with programmatic dependent launch (pdl.cuh's launch), and
// the PDL chain captured once into a CUDA graph and replayed; then dependent pairs (a prep kernel
// before each stream, as before each projection of the decode pass; dep_stream_kernel below). Time per kernel = the chain's CUDA
// event time / its length, median of RUNS chains. Last, per launch mode, the least-squares fit of
// the stream kernels' time t = a + S / B: a is what a launch costs beyond its bytes.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Inative native/tools/launch_chain_bench.cu -o lcb
//   ./lcb                                  (scripts/gpu.sh launch-chain builds and runs it)
// Exit status 1 on a CUDA error.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "pdl.cuh"   // pdl_launch_dependents, pdl_wait, launch (the PDL attribute where cc >= 9.0)

namespace {

constexpr int RUNS = 7;
constexpr int THREADS = 256;

void check(cudaError_t err, const char *what) {
    if (err != cudaSuccess) {
        std::fprintf(stderr, "launch_chain_bench: %s: %s\n", what, cudaGetErrorString(err));
        std::exit(1);
    }
}
#define CK(call) check((call), #call)

__global__ void empty_kernel(unsigned *out) {
    oj::pdl_launch_dependents();
    oj::pdl_wait();
    if (threadIdx.x == 0) out[blockIdx.x] = blockIdx.x;
}

__global__ void stream_kernel(const uint4 *__restrict__ src, size_t n16, unsigned *out) {
    oj::pdl_launch_dependents();
    unsigned acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {   // four loads in flight per thread
        const uint4 a = __ldg(src + i), b = __ldg(src + i + stride), c = __ldg(src + i + 2 * stride),
                    d = __ldg(src + i + 3 * stride);
        acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < n16; i += stride) acc ^= __ldg(src + i).x;
    oj::pdl_wait();
    if (acc == 0x9E3779B9u) out[blockIdx.x] = acc;   // practically never: keeps the loads
}

// The decode pass's dependency between projections, reduced to copies: a "prep" kernel (one block
// per SM; it waits for the stream before it and writes the 20 KB vector the next one reads) and a
// stream kernel whose block copies its first PRE bytes into shared memory (cp.async) BEFORE its
// pdl_wait, as a matvec may issue weight copies before its input exists, then waits, reads the
// vector and streams the rest of its contiguous segment (four 16-byte loads in flight a thread).
// How much of a projection's restart a deeper pre-wait copy recovers: the question issue 25's next
// design turns on.
__global__ void dep_prep_kernel(const unsigned *in, float *x, int n_x) {
    oj::pdl_launch_dependents();
    oj::pdl_wait();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_x; i += gridDim.x * blockDim.x)
        x[i] = (float)(in[i & 1023] & 0xFF);
}

__global__ void dep_stream_kernel(const uint4 *__restrict__ src, size_t n16, int pre16, const float *__restrict__ x,
                                  int n_x, unsigned *out) {
    oj::pdl_launch_dependents();
    extern __shared__ __align__(16) uint4 stage[];
    const size_t seg = n16 / gridDim.x, s0 = (size_t)blockIdx.x * seg;
    const int pre = (size_t)pre16 < seg ? pre16 : (int)seg;
    for (int i = threadIdx.x; i < pre; i += blockDim.x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(stage + i)),
                     "l"(src + s0 + i));
#else
        stage[i] = src[s0 + i];
#endif
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
    oj::pdl_wait();
    unsigned acc = 0;
    for (int i = threadIdx.x; i < n_x; i += blockDim.x) acc += (unsigned)x[i];   // the input it needs
    const size_t stride = blockDim.x;
    size_t i = s0 + pre + threadIdx.x;
    const size_t end = s0 + seg;
    for (; i + 3 * stride < end; i += 4 * stride) {
        const uint4 a = __ldg(src + i), b = __ldg(src + i + stride), c = __ldg(src + i + 2 * stride),
                    d = __ldg(src + i + 3 * stride);
        acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < end; i += stride) acc ^= __ldg(src + i).x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
    __syncthreads();
    for (int k = threadIdx.x; k < pre; k += blockDim.x) acc ^= stage[k].y;
    if (acc == 0x9E3779B9u) out[blockIdx.x] = acc;
}

// Median over RUNS chains of `pairs` (prep, stream) pairs, or streams alone (with_prep false), in
// microseconds per pair; every stream on a slice not in L2.
double dep_pair_us(const uint4 *buf, size_t n_slices, size_t slice16, int blocks, int pre16, bool with_prep, float *x,
                   int n_x, unsigned *out, int n_sm, cudaStream_t st) {
    const int pairs = (int)std::min<size_t>(n_slices, 200);
    const size_t smem = (size_t)pre16 * 16;
    if (smem > 48 * 1024)
        CK(cudaFuncSetAttribute(dep_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    cudaEvent_t t0, t1;
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    std::vector<double> us;
    for (int r = -1; r < RUNS; ++r) {
        CK(cudaEventRecord(t0, st));
        for (int i = 0; i < pairs; ++i) {
            if (with_prep) CK(oj::launch(dep_prep_kernel, dim3(n_sm), dim3(THREADS), 0, st, (const unsigned *)out, x, n_x));
            CK(oj::launch(dep_stream_kernel, dim3(blocks), dim3(THREADS), smem, st, buf + (size_t)(i % n_slices) * slice16,
                          slice16, pre16, (const float *)x, n_x, out));
        }
        CK(cudaEventRecord(t1, st));
        CK(cudaEventSynchronize(t1));
        CK(cudaGetLastError());
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, t0, t1));
        if (r >= 0) us.push_back(1e3 * ms / pairs);
    }
    CK(cudaEventDestroy(t0));
    CK(cudaEventDestroy(t1));
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

enum Mode { PLAIN, PDL, GRAPH };
const char *const MODE_NAMES[] = {"plain", "pdl", "pdl graph"};

struct Chain {
    const uint4 *buf = nullptr;   // nullptr: empty kernels
    size_t slice16 = 0;           // uint4 per kernel
    size_t n_slices = 1;
    int blocks = 1;
    int length = 0;
    unsigned *out = nullptr;
};

void launch_one(const Chain &c, int i, Mode m, cudaStream_t st) {
    if (c.buf == nullptr) {
        if (m == PLAIN) empty_kernel<<<c.blocks, THREADS, 0, st>>>(c.out);
        else CK(oj::launch(empty_kernel, dim3(c.blocks), dim3(THREADS), 0, st, c.out));
    } else {
        const uint4 *src = c.buf + (size_t)(i % c.n_slices) * c.slice16;
        if (m == PLAIN) stream_kernel<<<c.blocks, THREADS, 0, st>>>(src, c.slice16, c.out);
        else CK(oj::launch(stream_kernel, dim3(c.blocks), dim3(THREADS), 0, st, src, c.slice16, c.out));
    }
}

// Median over RUNS chains of (chain time / length), in microseconds.
double per_kernel_us(const Chain &c, Mode m, cudaStream_t st) {
    cudaGraphExec_t exec = nullptr;
    if (m == GRAPH) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < c.length; ++i) launch_one(c, i, PDL, st);
        CK(cudaStreamEndCapture(st, &g));
        CK(cudaGraphInstantiate(&exec, g, 0));
        CK(cudaGraphDestroy(g));
    }
    cudaEvent_t t0, t1;
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    std::vector<double> us;
    for (int r = -1; r < RUNS; ++r) {   // r = -1: warm-up
        CK(cudaEventRecord(t0, st));
        if (m == GRAPH) CK(cudaGraphLaunch(exec, st));
        else for (int i = 0; i < c.length; ++i) launch_one(c, i, m, st);
        CK(cudaEventRecord(t1, st));
        CK(cudaEventSynchronize(t1));
        CK(cudaGetLastError());
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, t0, t1));
        if (r >= 0) us.push_back(1e3 * ms / c.length);
    }
    CK(cudaEventDestroy(t0));
    CK(cudaEventDestroy(t1));
    if (exec) CK(cudaGraphExecDestroy(exec));
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

}  // namespace

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int n_sm = prop.multiProcessorCount;
    std::printf("device %s sm_%d%d, %d SMs, L2 %d MB; PDL %s\n", prop.name, prop.major, prop.minor, n_sm,
                prop.l2CacheSize >> 20, oj::pdl_device() ? "on" : "off (cc < 9.0: plain order)");
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    unsigned *out;
    CK(cudaMalloc(&out, 64 * 1024 * sizeof(unsigned)));

    std::printf("\nempty kernels (2,000 a chain): us per kernel\n%-10s", "blocks");
    for (Mode m : {PLAIN, PDL, GRAPH}) std::printf(" %12s", MODE_NAMES[m]);
    std::printf("\n");
    for (int blocks : {1, n_sm, 4 * n_sm}) {
        Chain c;
        c.blocks = blocks, c.length = 2000, c.out = out;
        std::printf("%-10d", blocks);
        for (Mode m : {PLAIN, PDL, GRAPH}) std::printf(" %12.2f", per_kernel_us(c, m, st));
        std::printf("\n");
    }

    const size_t buf_bytes = std::max<size_t>((size_t)prop.l2CacheSize * 20, (size_t)1 << 30);
    uint4 *buf;
    CK(cudaMalloc(&buf, buf_bytes));
    CK(cudaMemset(buf, 0x5A, buf_bytes));
    const double sizes_mb[] = {1, 4, 16, 64};
    double t[3][4];
    std::printf("\nstream kernels (%d blocks of %d threads; a different slice of a %.1f GB buffer each): us per kernel\n%-10s",
                4 * n_sm, THREADS, buf_bytes / 1e9, "MB");
    for (Mode m : {PLAIN, PDL, GRAPH}) std::printf(" %12s", MODE_NAMES[m]);
    std::printf(" %14s\n", "GB/s (pdl)");
    for (int k = 0; k < 4; ++k) {
        Chain c;
        c.buf = buf, c.blocks = 4 * n_sm, c.out = out;
        c.slice16 = (size_t)(sizes_mb[k] * 1e6) / 16;
        c.n_slices = buf_bytes / 16 / c.slice16;
        c.length = (int)std::min<size_t>(c.n_slices, 400);   // every kernel of a chain on bytes not in L2
        std::printf("%-10g", sizes_mb[k]);
        for (Mode m : {PLAIN, PDL, GRAPH}) std::printf(" %12.2f", t[m][k] = per_kernel_us(c, m, st));
        std::printf(" %14.0f\n", sizes_mb[k] * 1e6 / (t[PDL][k] * 1e-6) / 1e9);
    }
    std::printf("\nfit t = a + S / B over the stream kernels:\n");
    for (Mode m : {PLAIN, PDL, GRAPH}) {
        double sx = 0, sy = 0, sxx = 0, sxy = 0;
        for (int k = 0; k < 4; ++k) {
            const double x = sizes_mb[k] * 1e6, y = t[m][k];
            sx += x, sy += y, sxx += x * x, sxy += x * y;
        }
        const double slope = (4 * sxy - sx * sy) / (4 * sxx - sx * sx);   // us per byte
        const double a = (sy - slope * sx) / 4;
        std::printf("  %-10s a = %6.2f us a launch, B = %6.0f GB/s\n", MODE_NAMES[m], a, 1e-3 / slope);
    }

    // dependent pairs: (blocks per SM, shared memory per block) as a matvec's rings take them
    const int n_x = 5120;   // the 27B's hidden size: a prep's vector
    float *x;
    CK(cudaMalloc(&x, n_x * sizeof(float)));
    std::printf("\ndependent pairs (PDL; prep: %d blocks; stream: PRE KB a block copied to shared memory before its\n"
                "pdl_wait, the rest after it): us per pair, and the stream's GB/s over the pair's time\n", n_sm);
    std::printf("%-6s %-14s %8s %10s %10s %10s %10s\n", "MB", "blocks x PRE", "", "pair us", "GB/s", "alone us", "GB/s");
    struct Cfg { int per_sm, pre_kb; };
    const Cfg cfgs[] = {{4, 0}, {4, 16}, {4, 48}, {1, 0}, {1, 96}, {1, 192}};
    for (double mb : {16.0, 64.0}) {
        const size_t slice16 = (size_t)(mb * 1e6) / 16, n_slices = buf_bytes / 16 / slice16;
        for (const Cfg &c : cfgs) {
            const int blocks = c.per_sm * n_sm, pre16 = c.pre_kb * 1024 / 16;
            const double pair = dep_pair_us(buf, n_slices, slice16, blocks, pre16, true, x, n_x, out, n_sm, st);
            const double alone = dep_pair_us(buf, n_slices, slice16, blocks, pre16, false, x, n_x, out, n_sm, st);
            std::printf("%-6g %4d x %4d KB %8s %10.2f %10.0f %10.2f %10.0f\n", mb, blocks, c.pre_kb, "", pair,
                        mb * 1e6 / (pair * 1e-6) / 1e9, alone, mb * 1e6 / (alone * 1e-6) / 1e9);
        }
    }
    CK(cudaFree(x));
    CK(cudaFree(buf));
    CK(cudaFree(out));
    CK(cudaStreamDestroy(st));
    return 0;
}
