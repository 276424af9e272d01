// A subset of the RMM anchor (benches/anchor/rmm_bench.cu): only `pair-256B` and
// `random` on RMM's cuda_async_memory_resource, so that many short runs can alternate with
// memres's `benches/workloads.rs cuda_async` (MEMRES_WORKLOADS=pair-256B,random) and the
// comparison is not at the mercy of one slow minute. Built on the GPU machine with the
// same flags by benches/anchor/run.sh (BUILD=rmm_cuda_async_subset); uses workloads.hpp.
#include "rmm_adapter.hpp"
#include "workloads.hpp"

#include <rmm/mr/cuda_async_memory_resource.hpp>

int main()
{
  rmm::mr::cuda_async_memory_resource mr;
  RmmAdapter<rmm::mr::cuda_async_memory_resource> a{mr};
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  anchor::report("rmm", "cuda_async", "pair-256B", 1, 1000000,
                 [&] { return anchor::pairs(a, s, 256, 1000000); });
  anchor::report("rmm", "cuda_async", "random", 1, 200000,
                 [&] { return anchor::random_ops(a, s, 42, 200000); });
}
