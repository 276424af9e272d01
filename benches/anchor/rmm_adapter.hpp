// The workloads' adapter (workloads.hpp) over any RAPIDS RMM resource: blocks aligned to
// 256 bytes, as memres's layouts are, on the caller's stream.
#pragma once
#include <cuda/stream_ref>

#include <cstddef>

template <typename Resource>
struct RmmAdapter {
  Resource& mr;
  void* alloc(std::size_t n, cudaStream_t s) { return mr.allocate(cuda::stream_ref{s}, n, 256); }
  void free(void* p, std::size_t n, cudaStream_t s) { mr.deallocate(cuda::stream_ref{s}, p, n, 256); }
};
