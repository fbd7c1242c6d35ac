// pdl.cuh: programmatic dependent launch (PDL, sm_90+) for the decode pass's kernels, and the
// launch count the per-phase profile reads (oj_profile, engine.cu).
//
// A decode pass is ~770-1,000 dependent launches (issue 25). Launched plainly, each kernel starts only
// after the one before it has finished and its completion has gone through the front end. Launched
// by `launch` below (pdl_device), a kernel is scheduled as soon as every block of the one before it has
// executed pdl_launch_dependents (each of these kernels does that first), its blocks wait in
// pdl_wait until that grid has finished and its writes are visible, and whatever a kernel does
// before pdl_wait (the matvecs issue their first weight copies: weights never depend on the
// previous kernel) overlaps the previous kernel's tail. The rule that keeps this correct: every
// kernel launched here executes pdl_wait in every block before it touches memory that an earlier
// kernel of the stream writes or reads, so a grid never completes before its predecessor did and
// the ordering stays transitive along the stream. On GPUs before cc 9.0 the attribute is left off
// and both instructions are compiled out: plain stream order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace oj {

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Kernel launches by this thread since it started (the profile's launches per phase).
inline thread_local uint64_t g_launches = 0;

// Whether launches here get the PDL attribute: the current device takes it (cc 9.0+, asked once per
// device). Measured on H100s, q27b, preps fused, one pass over 1 position against plain launches:
// 10.47 -> 9.54 ms (a13fc39), 10.70 -> 10.31 ms (43d7cd9, the GPU suite passing on this path).
inline bool pdl_device() {
    static thread_local int dev_seen = -1;
    static thread_local bool ok = false;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (dev != dev_seen) {
        int major = 0;
        ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess && major >= 9;
        dev_seen = dev;
    }
    return ok;
}

// kernel<<<grid, block, smem, st>>>(args...), with the PDL attribute when `pdl` is set (the caller
// has checked the device and the kernel's code). Returns the launch's error.
template <typename... Params, typename... Args>
inline cudaError_t launch_pdl_if(bool pdl, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                 Args &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    ++g_launches;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, smem, st>>>(args...) with the PDL attribute where the device has it; the
// kernel must follow the rule above. Returns the launch's error (callers check_launch).
template <typename... Params, typename... Args>
inline cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args &&...args) {
    return launch_pdl_if(pdl_device(), kernel, grid, block, smem, st, std::forward<Args>(args)...);
}

}  // namespace oj
