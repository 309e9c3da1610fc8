// MOE_CLONES compiles a function once per x86-64 level (v4 with AVX-512, v3 with AVX2, and the
// baseline) and runs the copy for this CPU, picked when the program loads: for plain loops that
// the compiler vectorizes. There is one copy per CPU, so every caller on a CPU rounds the same way.
#pragma once

#define MOE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
