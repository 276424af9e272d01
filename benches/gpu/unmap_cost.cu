// What a sleep's unmaps cost, and whether they can run under its copies (issue 51 item 3,
// BENCHMARKS.md "First sleep"): N GiB (20) of device memory mapped granule by granule
// (2 MiB, or G MiB), as a VirtualPool maps it, then given back four ways, each on a
// fresh mapping:
//
//   nvcc -O2 -o unmap_cost benches/gpu/unmap_cost.cu -lcuda -lpthread
//   ./unmap_cost [GiB, 20] [granule MiB, 2] [copy threads, 16] [export, 0]
//
// export 1: the allocations exportable as POSIX file descriptors, as the C ABI's are
// (PyTorch's tensors sent to other processes). The maps' time is printed too.
// A: cuMemUnmap of each granule on one thread (its handle released when mapped, so the
//    unmap frees it): what a sleep does after its copies.
// B: the same split in two: retain + unmap (the handle kept), then cuMemRelease of each.
// C: the copies alone: T threads copy another N GiB of device memory into pinned host
//    memory, 4 MiB a call on two streams each.
// D: A on one thread while C's copies run on T others: both times.
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CK(x) do{int e=(int)(x); if(e){printf("%s:%d error %d\n",__FILE__,__LINE__,e); exit(1);}}while(0)
static size_t TOTAL, G, CH = 4 << 20; static int T = 16, EXPORT; static char *src, *host;
static volatile size_t nexti; static CUdeviceptr va; static CUmemGenericAllocationHandle *kept;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double map_all(void){ double t0 = now();
  CUmemAllocationProp p = {}; p.type = CU_MEM_ALLOCATION_TYPE_PINNED; p.location.type = CU_MEM_LOCATION_TYPE_DEVICE; p.location.id = 0;
  if (EXPORT) p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc a = {}; a.location = p.location; a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (size_t o = 0; o < TOTAL; o += G) { CUmemGenericAllocationHandle h; CK(cuMemCreate(&h, G, &p, 0)); CK(cuMemMap(va + o, G, 0, h, 0)); CK(cuMemRelease(h)); }
  CK(cuMemSetAccess(va, TOTAL, &a, 1)); double t = now() - t0; CK(cuMemsetD8(va, 1, TOTAL)); CK(cuCtxSynchronize()); return t;
}
static double unmap_all(int keep){ double t0 = now();
  for (size_t i = 0; i < TOTAL / G; i++) { if (keep) CK(cuMemRetainAllocationHandle(&kept[i], (void*)(va + i * G))); CK(cuMemUnmap(va + i * G, G)); }
  return now() - t0; }
static void *copy(void *arg){ (void)arg; cudaStream_t s[2]; CK(cudaStreamCreateWithFlags(&s[0], cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s[1], cudaStreamNonBlocking)); int k = 0;
  for (;;) { size_t c = __sync_fetch_and_add(&nexti, 1); if (c * CH >= TOTAL) break; CK(cudaMemcpyAsync(host + c * CH, src + c * CH, CH, cudaMemcpyDeviceToHost, s[k++ % 2])); }
  CK(cudaStreamSynchronize(s[0])); CK(cudaStreamSynchronize(s[1])); return 0; }
static double copies(void){ pthread_t th[64]; nexti = 0; double t0 = now(); for (long i = 0; i < T; i++) pthread_create(&th[i], 0, copy, 0); for (int i = 0; i < T; i++) pthread_join(th[i], 0); return now() - t0; }
static void *unmapper(void *out){ *(double*)out = unmap_all(0); return 0; }
int main(int argc, char **argv){
  TOTAL = (size_t)(argc > 1 ? atoi(argv[1]) : 20) << 30; G = (size_t)(argc > 2 ? atoi(argv[2]) : 2) << 20; T = argc > 3 ? atoi(argv[3]) : 16; EXPORT = argc > 4 && atoi(argv[4]);
  CK(cudaFree(0)); CK(cuMemAddressReserve(&va, TOTAL, 0, 0, 0)); kept = (CUmemGenericAllocationHandle*)malloc(sizeof *kept * (TOTAL / G));
  CK(cudaMalloc((void**)&src, TOTAL)); CK(cudaMemset(src, 2, TOTAL)); CK(cudaHostAlloc((void**)&host, TOTAL, 0));
  double gib = (double)(TOTAL >> 30); size_t n = TOTAL / G;
  for (int rep = 0; rep < 2; rep++) {
    double m = map_all(), a = unmap_all(0);
    printf("A unmap (frees)          %6zu granules of %zu MiB (export %d): %.3f s (%.1f us each); the maps took %.3f s (%.1f us each)\n", n, G >> 20, EXPORT, a, a / n * 1e6, m, m / n * 1e6);
    map_all(); double b1 = unmap_all(1), t0 = now(); for (size_t i = 0; i < n; i++) CK(cuMemRelease(kept[i])); double b2 = now() - t0;
    printf("B retain+unmap, release  %6zu granules: %.3f s + %.3f s (%.1f + %.1f us each)\n", n, b1, b2, b1 / n * 1e6, b2 / n * 1e6);
    double c = copies(); printf("C copies alone          %2d threads: %.3f s = %.1f GiB/s\n", T, c, gib / c);
    map_all(); double u = 0; pthread_t th; t0 = now(); pthread_create(&th, 0, unmapper, &u); double d = copies(); pthread_join(th, 0); double all = now() - t0;
    printf("D copies under unmaps    copies %.3f s = %.1f GiB/s, unmaps %.3f s, both %.3f s (A + C: %.3f)\n", d, gib / d, u, all, a + c);
    fflush(stdout);
  }
  return 0;
}
