// The fused loops with AVX2 and FMA (see fused_kernels.h). CMake compiles this file, and only this one, with
// -mavx2 -mfma -mf16c on x86-64; elsewhere it builds the generic loops under this name and use_avx2() is false.
#if defined(TRAINER_KERNELS_AVX2)
#define CPU_CAPABILITY_AVX2
#endif
#define CPU_CAPABILITY AVX2
#include "models/fused_kernels_impl.h"

