// What the CUDA driver's virtual-memory calls cost, per granule: the price of a virtual
// pool's growth and of the remaps its give-back makes (issue 51 item 2, BENCHMARKS.md).
//
//   nvcc -O2 -o vm_cost benches/gpu/vm_cost.cu -lcuda && ./vm_cost [granule MiB, default 2]
//
// 64 granules, each its own allocation (as `CudaVirtual` makes them), three rounds:
// cuMemCreate; cuMemMap of kept allocations; one cuMemSetAccess over all 64 mappings or
// one per mapping; cuMemUnmap one mapping at a time, in one call over all 64, and in runs
// of 8. Microseconds, host clock.
#include <cuda.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                    \
  do {                                                              \
    CUresult r_ = (x);                                              \
    if (r_ != CUDA_SUCCESS) {                                       \
      const char* s_ = nullptr;                                     \
      cuGetErrorString(r_, &s_);                                    \
      std::printf("%s failed: %d %s\n", #x, int(r_), s_ ? s_ : ""); \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

static double micros()
{
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv)
{
  const std::size_t g = (argc > 1 ? std::atol(argv[1]) : 2) << 20;
  const int n = 64;
  CHECK(cuInit(0));
  CUdevice dev;
  CHECK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CHECK(cuCtxSetCurrent(ctx));
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  CUmemAccessDesc access = {};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUdeviceptr base;
  CHECK(cuMemAddressReserve(&base, g * n, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> handle(n);
  double t = micros();
  for (int i = 0; i < n; i++) CHECK(cuMemCreate(&handle[i], g, &prop, 0));
  std::printf("granule %zu MiB: cuMemCreate %.1f us each\n", g >> 20, (micros() - t) / n);
  auto map_all = [&] {
    for (int i = 0; i < n; i++) CHECK(cuMemMap(base + i * g, g, 0, handle[i], 0));
  };
  auto touch = [&] {
    CHECK(cuMemsetD8(base, 1, g * n));
    CHECK(cuCtxSynchronize());
  };
  for (int round = 1; round <= 3; round++) {
    t = micros();
    map_all();
    double mapped = micros();
    CHECK(cuMemSetAccess(base, g * n, &access, 1));
    double accessed = micros();
    touch();
    double u = micros();
    for (int i = 0; i < n; i++) CHECK(cuMemUnmap(base + i * g, g));
    double unmapped = micros();
    std::printf("round %d: cuMemMap %.1f us each; one cuMemSetAccess over %d mappings %.0f us; "
                "cuMemUnmap one at a time %.1f us each\n",
                round, (mapped - t) / n, n, accessed - mapped, (unmapped - u) / n);
    t = micros();
    for (int i = 0; i < n; i++) {
      CHECK(cuMemMap(base + i * g, g, 0, handle[i], 0));
      CHECK(cuMemSetAccess(base + i * g, g, &access, 1));
    }
    mapped = micros();
    touch();
    u = micros();
    CHECK(cuMemUnmap(base, g * n));
    unmapped = micros();
    std::printf("round %d: cuMemMap + cuMemSetAccess per mapping %.1f us each; one cuMemUnmap "
                "over %d mappings %.0f us\n",
                round, (mapped - t) / n, n, unmapped - u);
    map_all();
    CHECK(cuMemSetAccess(base, g * n, &access, 1));
    touch();
    u = micros();
    for (int i = 0; i < n; i += 8) CHECK(cuMemUnmap(base + i * g, 8 * g));
    std::printf("round %d: cuMemUnmap of 8 mappings %.0f us a call\n", round,
                (micros() - u) / (n / 8));
  }
  for (auto h : handle) CHECK(cuMemRelease(h));
  CHECK(cuMemAddressFree(base, g * n));
  return 0;
}
