// The footprint workloads of benches/workloads.rs (`footprints`: random, fragmenting,
// cross-stream) on RAPIDS RMM's pool (over cuda_memory_resource, grown from nothing) and
// on its cuda_async resource, so that memres's peak held / peak live sits beside RMM's in
// one run. Same sequences as memres's (splitmix64 from the shared workloads.hpp):
// - random: WORKLOADS.md's `random`, seed 42, 200,000 ops, on stream A;
// - fragmenting: 8 rounds of 400 blocks of 2^(16 + r/2) bytes plus a random part below
//   that (seed 7), every other block of a round freed after it;
// - cross-stream: `random`'s sequence, every allocation on stream A, every free on B;
// - serve: requests of varying batch and length through a 12-layer model (see `serve`).
// - mixed: 64 blocks live of 512 B to 64 MiB, the oldest replaced at each step (`mixed`).
// Held: the pool's upstream bytes (a statistics adaptor under the pool), or the driver
// pool's reserved memory high-water mark for cuda_async. Each workload on a fresh resource.
// Built by benches/anchor/run.sh (BUILD=rmm_footprint). Output: CSV
// impl,resource,workload,peak_held_bytes,peak_live_bytes,ratio
#include "workloads.hpp"

#include <rmm/mr/cuda_async_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/pool_memory_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>

#include <cstdio>
#include <deque>
#include <functional>
#include <vector>

using Alloc = std::function<void*(std::size_t, cudaStream_t)>;
using Free  = std::function<void(void*, std::size_t, cudaStream_t)>;

struct Run {
  std::size_t peak_live = 0;
};

// `random` with allocations on `a` and frees on `b` (a == b: plain `random`).
Run random_seq(Alloc const& alloc, Free const& free, cudaStream_t a, cudaStream_t b)
{
  anchor::Rng rng{42};
  std::vector<anchor::Live> live;
  std::size_t bytes = 0;
  Run r;
  for (int i = 0; i < 200000; ++i) {
    bool do_alloc = live.empty() ? true : live.size() == 10000 ? false : rng.next() % 2 == 0;
    if (do_alloc) {
      uint64_t e    = 8 + rng.next() % 15;
      std::size_t n = (1ull << e) + rng.next() % (1ull << e);
      live.push_back({alloc(n, a), n});
      bytes += n;
      r.peak_live = std::max(r.peak_live, bytes);
    } else {
      std::size_t k = rng.next() % live.size();
      free(live[k].p, live[k].n, b);
      bytes -= live[k].n;
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (auto& l : live) {
    free(l.p, l.n, b);
  }
  return r;
}

Run fragmenting(Alloc const& alloc, Free const& free, cudaStream_t a)
{
  anchor::Rng rng{7};
  std::vector<anchor::Live> kept;
  std::size_t bytes = 0;
  Run r;
  for (int round = 0; round < 8; ++round) {
    int e = 16 + round / 2;
    std::vector<anchor::Live> now;
    for (int i = 0; i < 400; ++i) {
      std::size_t n = (std::size_t{1} << e) + rng.next() % (std::size_t{1} << e);
      now.push_back({alloc(n, a), n});
      bytes += n;
      r.peak_live = std::max(r.peak_live, bytes);
    }
    for (std::size_t i = 0; i < now.size(); ++i) {
      if (i % 2 == 0) {
        free(now[i].p, now[i].n, a);
        bytes -= now[i].n;
      } else {
        kept.push_back(now[i]);
      }
    }
  }
  for (auto& l : kept) {
    free(l.p, l.n, a);
  }
  return r;
}

// `serve` (docs/workloads.md v1.2, workloads/src/lib.rs `serve_with`): 1,000 requests of
// batch 1..32 x 16..1024 tokens through 12 layers on stream `a`; a request's KV cache (24
// blocks of batch * tokens * 1536 bytes) lives until 4 newer requests hold theirs; per
// layer the output (a) and the MLP's hidden activations (4a), the hidden ones and the
// previous output freed as it goes.
Run serve(Alloc const& alloc, Free const& free, cudaStream_t a)
{
  anchor::Rng rng{42};
  std::deque<std::vector<anchor::Live>> in_flight;
  std::size_t bytes = 0;
  Run r;
  auto take = [&](std::size_t n) {
    anchor::Live l{alloc(n, a), n};
    bytes += n;
    r.peak_live = std::max(r.peak_live, bytes);
    return l;
  };
  auto give = [&](anchor::Live l) {
    free(l.p, l.n, a);
    bytes -= l.n;
  };
  for (int q = 0; q < 1000; ++q) {
    std::size_t batch  = 1 + rng.next() % 32;
    std::size_t tokens = 16 + rng.next() % 1009;
    std::size_t act    = batch * tokens * 1536;
    std::vector<anchor::Live> kv;
    for (int i = 0; i < 24; ++i) {
      kv.push_back(take(act));
    }
    bool have = false;
    anchor::Live out{};
    for (int layer = 0; layer < 12; ++layer) {
      anchor::Live hidden = take(4 * act);
      anchor::Live next   = take(act);
      give(hidden);
      if (have) give(out);
      out  = next;
      have = true;
    }
    give(out);
    in_flight.push_back(std::move(kv));
    if (in_flight.size() > 4) {
      for (auto& l : in_flight.front()) {
        give(l);
      }
      in_flight.pop_front();
    }
  }
  for (auto& kv : in_flight) {
    for (auto& l : kv) {
      give(l);
    }
  }
  return r;
}

// `mixed` (docs/workloads.md v1.4, workloads/src/lib.rs `mixed_with`): 64 blocks live on
// stream `a`; each of 20,000 steps frees the oldest and allocates 2^e + x % 2^e bytes,
// e = 9 + x % 17 (512 B to just under 64 MiB), seed 7.
Run mixed(Alloc const& alloc, Free const& free, cudaStream_t a)
{
  anchor::Rng rng{7};
  std::deque<anchor::Live> live;
  std::size_t bytes = 0;
  Run r;
  for (int step = 0; step < 64 + 20000; ++step) {
    if (step >= 64) {
      free(live.front().p, live.front().n, a);
      bytes -= live.front().n;
      live.pop_front();
    }
    std::size_t e = 9 + rng.next() % 17;
    std::size_t n = (std::size_t{1} << e) + rng.next() % (std::size_t{1} << e);
    live.push_back({alloc(n, a), n});
    bytes += n;
    r.peak_live = std::max(r.peak_live, bytes);
  }
  for (auto& l : live) {
    free(l.p, l.n, a);
  }
  return r;
}

// Workload `w` (0 random, 1 fragmenting, 2 cross-stream, 3 serve, 4 mixed) through
// `alloc` and `free`.
Run workload(int w, Alloc const& alloc, Free const& free, cudaStream_t a, cudaStream_t b)
{
  Run r = w == 0 ? random_seq(alloc, free, a, a)
          : w == 1 ? fragmenting(alloc, free, a)
          : w == 2 ? random_seq(alloc, free, a, b)
          : w == 3 ? serve(alloc, free, a)
                   : mixed(alloc, free, a);
  cudaDeviceSynchronize();
  return r;
}

void print(char const* resource, char const* workload, std::size_t held, Run r)
{
  std::printf("rmm,%s,%s,%zu,%zu,%.3f\n", resource, workload, held, r.peak_live,
              double(held) / double(r.peak_live));
  std::fflush(stdout);
}

int main()
{
  cudaStream_t a, b;
  cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking);
  cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking);
  std::printf("impl,resource,workload,peak_held_bytes,peak_live_bytes,ratio\n");
  char const* names[] = {"random", "fragmenting", "cross-stream", "serve", "mixed"};
  for (int w = 0; w < 5; ++w) {
    rmm::mr::cuda_memory_resource cuda;
    rmm::mr::statistics_resource_adaptor up{cuda};
    rmm::mr::pool_memory_resource pool{up, 0};
    Alloc alloc = [&](std::size_t n, cudaStream_t s) {
      return pool.allocate(cuda::stream_ref{s}, n, 256);
    };
    Free free = [&](void* p, std::size_t n, cudaStream_t s) {
      pool.deallocate(cuda::stream_ref{s}, p, n, 256);
    };
    Run r = workload(w, alloc, free, a, b);
    print("pool", names[w], std::size_t(up.get_bytes_counter().peak), r);
  }
  for (int w = 0; w < 5; ++w) {
    rmm::mr::cuda_async_memory_resource mr;
    Alloc alloc = [&](std::size_t n, cudaStream_t s) {
      return mr.allocate(cuda::stream_ref{s}, n, 256);
    };
    Free free = [&](void* p, std::size_t n, cudaStream_t s) {
      mr.deallocate(cuda::stream_ref{s}, p, n, 256);
    };
    Run r = workload(w, alloc, free, a, b);
    cuuint64_t high = 0;
    cudaMemPoolGetAttribute(mr.pool_handle(), cudaMemPoolAttrReservedMemHigh, &high);
    print("cuda_async", names[w], std::size_t(high), r);
  }
}
