// int8_mma.cuh: the integer tensor-core primitives of the int8 prefill GEMM (gemm_prefill.cuh).
#pragma once

#include <cstdint>

namespace oj {

// Logical shift by a compile-time amount that may be negative (left).
template <int S>
__device__ __forceinline__ uint32_t shr(uint32_t v) {
    if constexpr (S >= 0) return v >> S;
    else return v << (-S);
}

// Byte k of a word as a float (0..255); k is a constant after unrolling.
__device__ __forceinline__ float byte_fr(uint32_t word, int k) {
    return __uint_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | k)) - 8388608.0f;
}

constexpr uint32_t MAGIC_I2F = 0x4B400000u;   // 1.5 * 2^23: int -> float in 2 full-rate ops

// exact for |c| < 2^22 (every dot here: at most 32 * 255 * 127)
__device__ __forceinline__ float i2f(int c) { return __int_as_float(c + (int)MAGIC_I2F) - 12582912.0f; }

__device__ __forceinline__ void mma_k32(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1, bool a_unsigned) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (a_unsigned)
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

__device__ __forceinline__ void mma_k16(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
#else
    __trap();
#endif
}

}  // namespace oj
