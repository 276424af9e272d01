// PyTorch's CUDA caching allocator (c10) on memres's benchmark workloads (workloads.hpp):
// the "torch" rows beside RMM's. Built by benches/anchor/run.sh against the installed torch.
#include "workloads.hpp"

#include <c10/cuda/CUDACachingAllocator.h>

struct Torch {
  void* alloc(std::size_t n, cudaStream_t s)
  {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(n, s);
  }
  void free(void* p, std::size_t, cudaStream_t) { c10::cuda::CUDACachingAllocator::raw_delete(p); }
};

int main()
{
  c10::cuda::CUDACachingAllocator::init(1);
  Torch a;
  anchor::suite("torch", "caching_allocator", a, false);
  return 0;
}
