// Which of the driver's per-granule calls a wake or a sleep pays, and which of them run
// at once on several threads (issue 51 item 3, BENCHMARKS.md): N GiB (20) of 2 MiB (or G
// MiB) granules, each step timed alone, on 1 thread and on T threads (each taking the next
// granule not taken yet):
//
//   nvcc -O2 -o map_parts benches/gpu/map_parts.cu -lcuda -lpthread
//   ./map_parts [GiB, 20] [granule MiB, 2] [threads, 4] [export, 0]
//
// create:  cuMemCreate of every granule (physical memory, no address)
// map:     cuMemMap of every created granule into one reservation (then one
//          cuMemSetAccess of it all, timed apart)
// unmap:   cuMemUnmap of every granule (its handle still held: nothing freed)
// release: cuMemRelease of every handle (now unmapped: frees the memory)
// pipe:    T - 1 threads create while this thread maps each granule as its handle is
//          ready (a wake that backs granules ahead of its maps)
// whole:   create + map + release + access each on one thread (what a wake does now)
// Then 128 granules' memory from one cuMemCreate, mapped as 128 mappings or as one.
#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define CK(x) do{int e=(int)(x); if(e){printf("%s:%d error %d\n",__FILE__,__LINE__,e); exit(1);}}while(0)
static size_t TOTAL, G, N; static int T = 4, EXPORT; static CUdeviceptr va;
static CUmemGenericAllocationHandle *h; static volatile int *ready; static size_t nexti;
static CUmemAllocationProp prop; static CUcontext ctx;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
enum { CREATE, MAP, UNMAP, RELEASE };
static int step;
static void one(size_t i){
  switch (step) {
    case CREATE: CK(cuMemCreate(&h[i], G, &prop, 0)); __atomic_store_n(&ready[i], 1, __ATOMIC_RELEASE); break;
    case MAP: CK(cuMemMap(va + i * G, G, 0, h[i], 0)); break;
    case UNMAP: CK(cuMemUnmap(va + i * G, G)); break;
    case RELEASE: CK(cuMemRelease(h[i])); break;
  }
}
static void *worker(void *arg){ (void)arg; CK(cuCtxSetCurrent(ctx));
  for (;;) { size_t i = __atomic_fetch_add(&nexti, 1, __ATOMIC_RELAXED); if (i >= N) break; one(i); } return 0; }
static double run(int s, int threads){ pthread_t th[64]; step = s; nexti = 0; double t0 = now();
  for (int i = 1; i < threads; i++) pthread_create(&th[i], 0, worker, 0); worker(0);
  for (int i = 1; i < threads; i++) pthread_join(th[i], 0); return now() - t0; }
static void *creator(void *arg){ (void)arg; CK(cuCtxSetCurrent(ctx));
  for (;;) { size_t i = __atomic_fetch_add(&nexti, 1, __ATOMIC_RELAXED); if (i >= N) break;
    CK(cuMemCreate(&h[i], G, &prop, 0)); __atomic_store_n(&ready[i], 1, __ATOMIC_RELEASE); } return 0; }
static double pipe_run(int threads){ pthread_t th[64]; nexti = 0; for (size_t i = 0; i < N; i++) ready[i] = 0; double t0 = now();
  for (int i = 1; i < threads; i++) pthread_create(&th[i], 0, creator, 0);
  for (size_t i = 0; i < N; i++) { while (!__atomic_load_n(&ready[i], __ATOMIC_ACQUIRE)) ; CK(cuMemMap(va + i * G, G, 0, h[i], 0)); CK(cuMemRelease(h[i])); }
  for (int i = 1; i < threads; i++) pthread_join(th[i], 0); return now() - t0; }
static double access_by(size_t per){ double t0 = now(); CUmemAccessDesc a = {}; a.location = prop.location; a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (size_t o = 0; o < TOTAL; o += per * G) CK(cuMemSetAccess(va + o, per * G, &a, 1)); return now() - t0; }
static double touch(void){ double t0 = now(); CK(cuMemsetD8(va, 1, TOTAL)); CK(cuCtxSynchronize()); return now() - t0; }
static double access_all(void){ return access_by(N) + touch(); }
int main(int argc, char **argv){
  TOTAL = (size_t)(argc > 1 ? atoi(argv[1]) : 20) << 30; G = (size_t)(argc > 2 ? atoi(argv[2]) : 2) << 20; T = argc > 3 ? atoi(argv[3]) : 4; EXPORT = argc > 4 && atoi(argv[4]);
  N = TOTAL / G; CK(cudaFree(0)); CK(cuCtxGetCurrent(&ctx)); CK(cuMemAddressReserve(&va, TOTAL, 0, 0, 0));
  h = (CUmemGenericAllocationHandle*)calloc(N, sizeof *h); ready = (volatile int*)calloc(N, sizeof *ready);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  if (EXPORT) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  printf("%zu granules of %zu MiB, export %d\n", N, G >> 20, EXPORT);
  int ts[2] = {1, T};
  for (int rep = 0; rep < 2; rep++) for (int k = 0; k < 2; k++) { int t = ts[k];
    size_t per = rep == 0 ? N : (k == 0 ? 1 : 128);
    double c = run(CREATE, t), m = run(MAP, t), a = access_by(per), mm = touch(), u = run(UNMAP, t), r = run(RELEASE, t);
    printf("threads %2d: create %.3f s (%.1f us), map %.3f (%.1f), access by %zu granules %.3f (%.1f us a granule), memset %.3f, unmap %.3f (%.1f), release %.3f (%.1f)\n",
           t, c, c / N * 1e6, m, m / N * 1e6, per, a, a / N * 1e6, mm, u, u / N * 1e6, r, r / N * 1e6);
    double p = pipe_run(t > 1 ? t : 2); access_all(); double u2 = run(UNMAP, 1);
    printf("  pipe, %d creating: %.3f s (%.1f us a granule); then unmap (frees) %.3f\n", (t > 1 ? t : 2) - 1, p, p / N * 1e6, u2);
    fflush(stdout);
  }
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  double w0 = now();
  for (size_t i = 0; i < N; i++) { CK(cuMemCreate(&h[i], G, &prop, 0)); CK(cuMemMap(va + i * G, G, 0, h[i], 0)); CK(cuMemRelease(h[i])); CK(cuMemSetAccess(va + i * G, G, &acc, 1)); }
  double w = now() - w0; printf("whole with access, granule by granule, one thread: %.3f s (%.1f us a granule)\n", w, w / N * 1e6);
  run(UNMAP, 1);
  /* one physical allocation of 128 granules mapped as 128 mappings of a granule each */
  size_t B = 128; w0 = now();
  for (size_t i = 0; i < N; i += B) { CUmemGenericAllocationHandle big; CK(cuMemCreate(&big, B * G, &prop, 0));
    for (size_t j = 0; j < B; j++) CK(cuMemMap(va + (i + j) * G, G, j * G, big, 0)); CK(cuMemRelease(big)); CK(cuMemSetAccess(va + i * G, B * G, &acc, 1)); }
  w = now() - w0; printf("one create of 128 granules, mapped granule by granule, access by 128: %.3f s (%.1f us a granule); memset %.3f\n", w, w / N * 1e6, touch());
  w0 = now(); run(UNMAP, 1); printf("  unmap granule by granule %.3f\n", now() - w0);
  /* one physical allocation of 128 granules, one mapping */
  w0 = now();
  for (size_t i = 0; i < N; i += B) { CUmemGenericAllocationHandle big; CK(cuMemCreate(&big, B * G, &prop, 0));
    CK(cuMemMap(va + i * G, B * G, 0, big, 0)); CK(cuMemRelease(big)); CK(cuMemSetAccess(va + i * G, B * G, &acc, 1)); }
  w = now() - w0; printf("one create and map of 128 granules, access by 128: %.3f s (%.1f us a granule); memset %.3f\n", w, w / N * 1e6, touch());
  return 0;
}
