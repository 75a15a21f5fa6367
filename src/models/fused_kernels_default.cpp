// The fused loops for any CPU (see fused_kernels.h): compiled with the project's flags only.
#define CPU_CAPABILITY DEFAULT
#include "models/fused_kernels_impl.h"
