// Probe (benches/anchor/cuda_async_probe.cu): where does CudaAsync's pair-4MiB gap to RMM's cuda_async come from? Times
// 4 MiB (and 256 B) alloc/free pairs on a non-blocking stream from a cuMemPoolCreate pool
// through the driver API (as memres) and the runtime API (as RMM), with release
// thresholds UINT64_MAX (memres) and total device memory (RMM), with and without a
// cuCtxGetCurrent per call. Alternating, min of 5 rounds of 1M pairs.
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <algorithm>

using clk = std::chrono::steady_clock;

static CUmemoryPool make_pool(uint64_t threshold) {
  CUmemPoolProps p{};
  p.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  CUmemoryPool pool;
  cuMemPoolCreate(&pool, &p);
  cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold);
  return pool;
}

template <typename F>
static double time_pairs(F f, size_t n) {
  auto t0 = clk::now();
  for (size_t i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::nano>(clk::now() - t0).count() / n;
}

int main() {
  cudaFree(0);
  CUstream s; cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  size_t fr, total; cudaMemGetInfo(&fr, &total);
  CUmemoryPool pmax = make_pool(UINT64_MAX), ptot = make_pool(total);
  const size_t N = 1000000;
  for (size_t bytes : {size_t(256), size_t(4) << 20}) {
    double best[6]; std::fill(best, best + 6, 1e18);
    for (int round = 0; round < 5; ++round) {
      CUdeviceptr d;
      best[0] = std::min(best[0], time_pairs([&] { cuMemAllocFromPoolAsync(&d, bytes, pmax, s); cuMemFreeAsync(d, s); }, N));
      best[1] = std::min(best[1], time_pairs([&] { cuMemAllocFromPoolAsync(&d, bytes, ptot, s); cuMemFreeAsync(d, s); }, N));
      best[2] = std::min(best[2], time_pairs([&] { CUcontext c; cuCtxGetCurrent(&c); cuMemAllocFromPoolAsync(&d, bytes, pmax, s); cuCtxGetCurrent(&c); cuMemFreeAsync(d, s); }, N));
      void* v;
      best[3] = std::min(best[3], time_pairs([&] { cudaMallocFromPoolAsync(&v, bytes, (cudaMemPool_t)ptot, (cudaStream_t)s); cudaFreeAsync(v, (cudaStream_t)s); }, N));
      best[4] = std::min(best[4], time_pairs([&] { cudaMallocFromPoolAsync(&v, bytes, (cudaMemPool_t)pmax, (cudaStream_t)s); cudaFreeAsync(v, (cudaStream_t)s); }, N));
      cuStreamSynchronize(s);
    }
    printf("%zu bytes: driver/max %.1f  driver/total %.1f  driver/max+ctx %.1f  runtime/total %.1f  runtime/max %.1f\n",
           bytes, best[0], best[1], best[2], best[3], best[4]);
  }
}
