// What the CUDA driver's virtual-memory calls cost, per granule: the price of a virtual
// pool's growth and of the remaps its give-back makes (issue 51 item 2, BENCHMARKS.md).
//
//   nvcc -O2 -o vm_cost benches/gpu/vm_cost.cu -lcuda
//   ./vm_cost [granule MiB, default 2] [devices given access, default 1]
//             [exportable as POSIX descriptors 0|1, default 0] [device busy 0|1, default 0]
//
// 64 granules, each its own allocation (as `CudaVirtual` makes them), three rounds:
// cuMemCreate; cuMemMap of kept allocations; one cuMemSetAccess over all 64 mappings or
// one per mapping; cuMemUnmap one mapping at a time, in one call over all 64, and in runs
// of 8. Microseconds, host clock. With 2 devices given access, device 1 is named in the
// access descriptors too (a peer, as `CudaVirtualConfig::peers` and the C ABI's
// `memres_enable_peer_access` give it); with the device busy, a kernel of about 100 ms
// runs on a stream of its own through each round (its time left is printed).
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

__global__ void spin(long long cycles)
{
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

static double micros()
{
  using namespace std::chrono;
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv)
{
  const std::size_t g = (argc > 1 ? std::atol(argv[1]) : 2) << 20;
  const int devices = argc > 2 ? std::atoi(argv[2]) : 1;
  const bool exportable = argc > 3 && std::atoi(argv[3]) != 0;
  const bool busy = argc > 4 && std::atoi(argv[4]) != 0;
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
  if (exportable) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::vector<CUmemAccessDesc> access(devices);
  for (int d = 0; d < devices; d++) {
    access[d].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[d].location.id = d;
    access[d].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  CUstream side;
  CHECK(cuStreamCreate(&side, CU_STREAM_NON_BLOCKING));
  std::printf("access for %d device(s), %s, device %s\n", devices,
              exportable ? "exportable" : "not exportable", busy ? "busy" : "idle");
  CUdeviceptr base;
  CHECK(cuMemAddressReserve(&base, g * n, 0, 0, 0));
  std::vector<CUmemGenericAllocationHandle> handle(n);
  double t = micros();
  for (int i = 0; i < n; i++) CHECK(cuMemCreate(&handle[i], g, &prop, 0));
  std::printf("granule %zu MiB: cuMemCreate %.1f us each\n", g >> 20, (micros() - t) / n);
  auto map_all = [&] {
    for (int i = 0; i < n; i++) CHECK(cuMemMap(base + i * g, g, 0, handle[i], 0));
  };
  CUstream work;
  CHECK(cuStreamCreate(&work, CU_STREAM_NON_BLOCKING));
  // Writes every mapping and waits for that alone (not for a busy round's kernel).
  auto touch = [&] {
    CHECK(cuMemsetD8Async(base, 1, g * n, work));
    CHECK(cuStreamSynchronize(work));
  };
  for (int round = 1; round <= 3; round++) {
    if (busy) spin<<<1, 1, 0, side>>>(200000000LL);
    t = micros();
    map_all();
    double mapped = micros();
    CHECK(cuMemSetAccess(base, g * n, access.data(), devices));
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
      CHECK(cuMemSetAccess(base + i * g, g, access.data(), devices));
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
    CHECK(cuMemSetAccess(base, g * n, access.data(), devices));
    touch();
    u = micros();
    for (int i = 0; i < n; i += 8) CHECK(cuMemUnmap(base + i * g, 8 * g));
    std::printf("round %d: cuMemUnmap of 8 mappings %.0f us a call\n", round,
                (micros() - u) / (n / 8));
    if (busy) {
      u = micros();
      CHECK(cuStreamSynchronize(side));
      std::printf("round %d: the kernel ran on %.0f us after the round\n", round, micros() - u);
    }
  }
  for (auto h : handle) CHECK(cuMemRelease(h));
  CHECK(cuStreamDestroy(side));
  CHECK(cuStreamDestroy(work));
  CHECK(cuMemAddressFree(base, g * n));
  return 0;
}
