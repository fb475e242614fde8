/* The 8 NCCL 2.29 entry points torch 2.13's libtorch_cuda.so links to and NCCL 2.28 (the GPU
 * host image's, by torch 2.11's pin) lacks; without them `import torch` fails ("undefined symbol:
 * ncclCommResume"). Preloaded by install_bundle.sh instead of carrying NCCL 2.29 (4 more parts):
 * they are comm suspend/resume, memory stats and symmetric-memory signals, which one-GPU serving
 * never calls. If anything does call one, it says so on stderr and gets ncclInvalidUsage, never a
 * silent success; install_bundle.sh's check runs a real NCCL all_reduce before any server. */
#include <stdio.h>

enum { NCCL_INVALID_USAGE = 5 }; /* ncclResult_t's ncclInvalidUsage */

#define NCCL_2_29_ONLY(name)                                                              \
  int name(void) {                                                                        \
    fprintf(stderr, "nccl_compat: %s is not in this NCCL (2.28); carry the bundle's NCCL " \
                    "2.29 group (benchmarks/gpu/offline/README.md)\n", #name);            \
    return NCCL_INVALID_USAGE;                                                            \
  }

NCCL_2_29_ONLY(ncclCommSuspend)
NCCL_2_29_ONLY(ncclCommResume)
NCCL_2_29_ONLY(ncclCommMemStats)
NCCL_2_29_ONLY(ncclSignal)
NCCL_2_29_ONLY(ncclWaitSignal)
NCCL_2_29_ONLY(ncclPutSignal)
NCCL_2_29_ONLY(ncclGetPeerDevicePointer)
NCCL_2_29_ONLY(ncclGetLsaMultimemDevicePointer)
