// `random-1stream` of benches/workloads.rs on RAPIDS RMM: WORKLOADS.md's `random` on 8
// and then 16 threads (seeds 42 + t, 100,000 ops each) that all use ONE non-blocking
// stream, for RMM's pool and arena over cuda_memory_resource (16 GiB, as the shared
// anchors build them). Same sequences as memres's (random_ops of the shared
// workloads.hpp). Built by benches/anchor/run.sh (BUILD=rmm_random_1stream; see
// benches/anchor/README in BENCHMARKS.md). Output: the anchors' CSV rows.
#include "workloads.hpp"

#include <rmm/mr/arena_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>

#include <thread>
#include <vector>

template <typename MR>
struct Rmm {
  MR& mr;
  void* alloc(std::size_t n, cudaStream_t s) { return mr.allocate(cuda::stream_ref{s}, n, 256); }
  void free(void* p, std::size_t n, cudaStream_t s) { mr.deallocate(cuda::stream_ref{s}, p, n, 256); }
};

template <typename MR>
void shared_stream(char const* name, MR& mr)
{
  Rmm<MR> a{mr};
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const std::size_t nt = 100000;
  for (int threads : {8, 16}) {
    anchor::report("rmm", name, "random-1stream", threads, nt * threads, [&] {
      std::vector<std::thread> ts;
      auto t0 = anchor::clk::now();
      for (int t = 0; t < threads; ++t) {
        ts.emplace_back([&, t] { anchor::random_ops(a, s, 42 + t, nt); });
      }
      for (auto& t : ts) {
        t.join();
      }
      return anchor::since(t0, nt * threads);
    });
  }
}

int main()
{
  std::size_t const pool_bytes = std::size_t{16} << 30;
  {
    rmm::mr::pool_memory_resource mr{rmm::mr::cuda_memory_resource{}, pool_bytes};
    shared_stream("pool", mr);
  }
  {
    rmm::mr::arena_memory_resource mr{rmm::mr::cuda_memory_resource{}, pool_bytes};
    shared_stream("arena", mr);
  }
  return 0;
}
