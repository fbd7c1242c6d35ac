// attn_chunk_setting_check.cu: OJ_ATTN_CHUNK's parsing (attention.cu's attention_chunk_setting) on
// the CPU: prints the chunk each argument gives ("unset" for no value); a refused value exits 2
// with the message (harness.cuh's fail). tests/test_attn_decode_chunked.py runs it.
//
//   nvcc -std=c++17 -arch=sm_90 -Inative native/tools/attn_chunk_setting_check.cu native/attention.cu -o acs
#include <cstdio>
#include <cstring>

#include "engine.cuh"

#include "tools/harness.cuh"

namespace oj {
int attention_chunk_setting(const char *value);
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; ++i) {
        const char *v = std::strcmp(argv[i], "unset") == 0 ? nullptr : argv[i];
        std::printf("%s %d\n", argv[i], oj::attention_chunk_setting(v));
        std::fflush(stdout);
    }
    return 0;
}
