// The workloads of memres's benchmarks (docs/workloads.md), in C++ for the anchors that run
// them on other allocators (RAPIDS RMM: rmm_bench.cu and the other .cu files here; PyTorch's
// caching allocator: torch_bench.cpp). A port of workloads/src/lib.rs: the same generator,
// the same draws in the same order, so both sides run the same sequences of requests.
//
// An adapter `A` has: void* alloc(std::size_t bytes, cudaStream_t); and
// void free(void* p, std::size_t bytes, cudaStream_t).
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

namespace anchor {

// SplitMix64, as `memres_workloads::splitmix64`.
struct Rng {
  uint64_t state;
  uint64_t next()
  {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = state;
    z          = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z          = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
};

using clk = std::chrono::steady_clock;

// Nanoseconds per op since `t0`.
inline double since(clk::time_point t0, std::size_t ops)
{
  auto ns = std::chrono::duration<double, std::nano>(clk::now() - t0).count();
  return ns / static_cast<double>(ops == 0 ? 1 : ops);
}

// `pair-<bytes>`: n allocate + free pairs on one stream; ns per pair.
template <typename A>
double pairs(A& a, cudaStream_t s, std::size_t bytes, std::size_t n)
{
  auto t0 = clk::now();
  for (std::size_t i = 0; i < n; ++i) {
    void* p = a.alloc(bytes, s);
    a.free(p, bytes, s);
  }
  return since(t0, n);
}

struct Live {
  void* p;
  std::size_t n;
};

// At most this many blocks live in `random`.
constexpr std::size_t random_cap = 10000;

// One step of `random` (`random_step` in workloads/src/lib.rs): a size to allocate, or 0
// to free a live block (which the caller then picks with the next draw). No coin is drawn
// when nothing is live or the cap is reached.
inline std::size_t random_step(Rng& rng, std::size_t live)
{
  bool allocate = live == 0 || (live < random_cap && rng.next() % 2 == 0);
  if (!allocate) return 0;
  uint64_t e = 8 + rng.next() % 15;  // 256 B .. 4 MiB, plus up to as much again
  return (std::size_t{1} << e) + static_cast<std::size_t>(rng.next() % (uint64_t{1} << e));
}

// `random`: `ops` steps of the walk from `seed` on stream `s`; ns per op. What is live at
// the end is freed untimed.
template <typename A>
double random_ops(A& a, cudaStream_t s, uint64_t seed, std::size_t ops)
{
  Rng rng{seed};
  std::vector<Live> live;
  live.reserve(random_cap);
  auto t0 = clk::now();
  for (std::size_t i = 0; i < ops; ++i) {
    if (std::size_t n = random_step(rng, live.size())) {
      live.push_back({a.alloc(n, s), n});
    } else {
      std::size_t k = rng.next() % live.size();
      a.free(live[k].p, live[k].n, s);
      live[k] = live.back();  // swap_remove
      live.pop_back();
    }
  }
  double ns = since(t0, ops);
  for (auto& l : live) a.free(l.p, l.n, s);
  return ns;
}

// `random` on one thread per entry of `streams` (seeds 42, 43, ...), `ops` each; ns per
// op over all threads (`random_mt` in workloads/src/lib.rs).
template <typename A>
double random_threads(A& a, std::vector<cudaStream_t> const& streams, std::size_t ops)
{
  std::vector<std::thread> threads;
  auto t0 = clk::now();
  for (std::size_t t = 0; t < streams.size(); ++t) {
    threads.emplace_back([&, t] { random_ops(a, streams[t], 42 + t, ops); });
  }
  for (auto& t : threads) t.join();
  return since(t0, ops * streams.size());
}

// `handoff`: a training step's hand-over between two threads taking turns on one stream
// (`memres_workloads::handoff`, docs/workloads.md): the forward pass on the calling thread,
// the backward pass on a second thread that lives for the run, the parameter gradients
// freed on the calling thread. ns per op, counting only the time inside the passes.
template <typename A>
double handoff(A& a, cudaStream_t s, std::size_t layers, std::size_t steps)
{
  Rng rng{42};
  auto size = [&] {
    uint64_t e = 8 + rng.next() % 15;
    return static_cast<std::size_t>((1ull << e) + rng.next() % (1ull << e));
  };
  std::vector<std::size_t> act(layers), work(layers);
  for (std::size_t i = 0; i < layers; ++i) {
    act[i]  = size();
    work[i] = size();
  }
  std::vector<void*> acts(layers);
  std::vector<Live> params;
  double spent = 0;  // ns, written by one thread at a time (the turn's lock orders them)
  std::mutex m;
  std::condition_variable cv;
  int turn = 0;  // 0: forward's, 1: backward's, 2: the end
  std::thread backward([&] {
    for (;;) {
      std::unique_lock<std::mutex> lock(m);
      cv.wait(lock, [&] { return turn != 0; });
      if (turn == 2) return;
      auto t0     = clk::now();
      void* after = nullptr;
      std::size_t after_n = 0;
      for (std::size_t i = layers; i-- > 0;) {
        void* grad = a.alloc(act[i], s);
        a.free(acts[i], act[i], s);
        if (after != nullptr) a.free(after, after_n, s);
        after   = grad;
        after_n = act[i];
        if (i % 4 == 0) params.push_back(Live{a.alloc(act[i], s), act[i]});
      }
      if (after != nullptr) a.free(after, after_n, s);
      spent += std::chrono::duration<double, std::nano>(clk::now() - t0).count();
      turn = 0;
      cv.notify_all();
    }
  });
  for (std::size_t step = 0; step < steps; ++step) {
    std::unique_lock<std::mutex> lock(m);
    auto t0 = clk::now();
    for (std::size_t i = 0; i < layers; ++i) {
      acts[i] = a.alloc(act[i], s);
      a.free(a.alloc(work[i], s), work[i], s);
    }
    spent += std::chrono::duration<double, std::nano>(clk::now() - t0).count();
    turn = 1;
    cv.notify_all();
    cv.wait(lock, [&] { return turn == 0; });
    t0 = clk::now();
    for (auto& p : params) a.free(p.p, p.n, s);
    params.clear();
    spent += std::chrono::duration<double, std::nano>(clk::now() - t0).count();
  }
  {
    std::lock_guard<std::mutex> lock(m);
    turn = 2;
  }
  cv.notify_all();
  backward.join();
  std::size_t ops = steps * (layers * 6 + 2 * ((layers + 3) / 4));
  return spent / static_cast<double>(ops == 0 ? 1 : ops);
}

// One warm-up run, three timed; prints the CSV row of `memres_workloads::Row` (min and
// median ns per op).
template <typename F>
void report(char const* impl, char const* resource, char const* workload, std::size_t threads,
            std::size_t ops, F&& run)
{
  run();
  double r[3] = {run(), run(), run()};
  std::sort(r, r + 3);
  std::printf("%s,%s,%s,%zu,%zu,%.1f,%.1f\n", impl, resource, workload, threads, ops, r[0], r[1]);
  std::fflush(stdout);
}

// The suite of `memres_workloads::suite` with 8 worker streams: the pairs and `random` on
// one stream, `random-mt` on 8 threads with a stream each, `random-1stream` on 8 and 16
// threads sharing the first stream, `handoff` on two threads taking turns on it. `slow` (a resource that calls the driver on every
// allocation): 20,000 ops, no threaded workloads. `small_only`: the pairs up to 64 KiB.
template <typename A>
void suite(char const* impl, char const* name, A& a, bool slow, bool small_only = false)
{
  std::vector<cudaStream_t> streams(9);
  for (auto& s : streams) cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cudaStream_t s    = streams[0];
  std::size_t np    = slow ? 20000 : 1000000;
  std::size_t nr    = slow ? 20000 : 200000;
  report(impl, name, "pair-256B", 1, np, [&] { return pairs(a, s, 256, np); });
  report(impl, name, "pair-64KiB", 1, np, [&] { return pairs(a, s, 64 << 10, np); });
  if (small_only) return;
  report(impl, name, "pair-4MiB", 1, np, [&] { return pairs(a, s, 4 << 20, np); });
  report(impl, name, "random", 1, nr, [&] { return random_ops(a, s, 42, nr); });
  if (slow) return;
  std::size_t const nt = 100000;
  std::vector<cudaStream_t> own(streams.begin() + 1, streams.end());
  report(impl, name, "random-mt", own.size(), nt * own.size(),
         [&] { return random_threads(a, own, nt); });
  for (std::size_t threads : {own.size(), 2 * own.size()}) {
    std::vector<cudaStream_t> shared(threads, s);
    report(impl, name, "random-1stream", threads, nt * threads,
           [&] { return random_threads(a, shared, nt); });
  }
  std::size_t const layers = 160, steps = 200;
  report(impl, name, "handoff", 2, steps * (layers * 6 + 2 * ((layers + 3) / 4)),
         [&] { return handoff(a, s, layers, steps); });
}

}  // namespace anchor
