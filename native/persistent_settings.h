// persistent_settings.h: the persistent kernel's switches (persistent.cu), read once at engine
// creation. Host code only, so that tools/persistent_settings_check.cu can check the rules on the CPU
// (tests/test_persistent_settings.py):
//   OJ_PERSISTENT           unset or 0: the multi-kernel path; 1: the persistent kernel where model
//                           and GPU fit; require: an error at creation where they do not
//   OJ_PERSISTENT_STAGES    2 (default) or 3: the matvec rings' depth
//   OJ_PERSISTENT_SPLIT     pick (default: the multi-kernel path's split-K) or model (persistent_split)
//   OJ_PERSISTENT_PREFETCH  0 (default) or 1: the phase before each matvec phase prefetches into L2
//   OJ_PERSISTENT_PROFILE   a file: one JSON line of per-phase times per launch appended to it
// A value outside these is refused (OJ_ERR_INVALID_ARGUMENT) naming the variable and the value; a
// profile file that cannot be opened for appending is refused naming the path and the reason.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "engine.cuh"

namespace oj {

struct PersistentSettings {
    int mode = 0;                 // 0 off, 1 where it fits, 2 required
    int stages = 2;
    bool split_model = false;
    bool prefetch = false;
    std::string profile;          // "" = no profile
};

inline PersistentSettings persistent_settings() {
    PersistentSettings s;
    // the variable's value if it is set, and whether it is one of `allowed` (else fail naming both)
    auto read = [](const char *name, std::initializer_list<const char *> allowed, const char *expect) -> const char * {
        const char *v = std::getenv(name);
        if (!v) return nullptr;
        for (const char *a : allowed)
            if (std::strcmp(v, a) == 0) return v;
        fail(OJ_ERR_INVALID_ARGUMENT, std::string(name) + " must be " + expect + ", not '" + v + "'");
    };
    if (const char *v = read("OJ_PERSISTENT", {"0", "1", "require"}, "0, 1 or require"))
        s.mode = std::strcmp(v, "require") == 0 ? 2 : v[0] - '0';
    if (const char *v = read("OJ_PERSISTENT_STAGES", {"2", "3"}, "2 or 3")) s.stages = v[0] - '0';
    if (const char *v = read("OJ_PERSISTENT_SPLIT", {"pick", "model"}, "pick or model")) s.split_model = v[0] == 'm';
    if (const char *v = read("OJ_PERSISTENT_PREFETCH", {"0", "1"}, "0 or 1")) s.prefetch = v[0] == '1';
    if (const char *v = std::getenv("OJ_PERSISTENT_PROFILE")) {
        FILE *fp = *v ? std::fopen(v, "a") : nullptr;   // append: what the file holds stays
        if (!fp)
            fail(OJ_ERR_INVALID_ARGUMENT, std::string("OJ_PERSISTENT_PROFILE: cannot append to '") + v + "'" +
                                              (*v ? std::string(": ") + std::strerror(errno) : std::string(" (empty path)")));
        std::fclose(fp);
        s.profile = v;
    }
    return s;
}

}  // namespace oj
