// RAPIDS RMM on memres's benchmark workloads (workloads.hpp, docs/workloads.md): the RMM
// column of BENCHMARKS.md's speed tables. Each stack is built as benches/workloads.rs
// builds memres's: pools and arenas of 16 GiB over cuda_memory_resource, binning with bins
// 2^8..2^22 over such a pool, fixed-size blocks of 1 MiB 1024 at a time (pairs up to 64 KiB
// only), cuda and cuda_async as they come.
//
//   benches/anchor/run.sh [stack]    builds this (and the other anchors) and runs it
//
// stack: cuda, cuda_async, pool, arena, binning, fixed, statistics, logging; none: all of
// them; "build": nothing (only builds). Output: the CSV rows of `memres bench`.
#include "rmm_adapter.hpp"
#include "workloads.hpp"

#include <rmm/mr/arena_memory_resource.hpp>
#include <rmm/mr/binning_memory_resource.hpp>
#include <rmm/mr/cuda_async_memory_resource.hpp>
#include <rmm/mr/cuda_memory_resource.hpp>
#include <rmm/mr/fixed_size_memory_resource.hpp>
#include <rmm/mr/logging_resource_adaptor.hpp>
#include <rmm/mr/pool_memory_resource.hpp>
#include <rmm/mr/statistics_resource_adaptor.hpp>

#include <string>

template <typename Resource>
void bench(char const* name, Resource& mr, bool slow, bool small_only = false)
{
  RmmAdapter<Resource> a{mr};
  anchor::suite("rmm", name, a, slow, small_only);
}

int main(int argc, char** argv)
{
  std::string const only = argc > 1 ? argv[1] : "";
  if (only == "build") return 0;
  auto want                    = [&](char const* stack) { return only.empty() || only == stack; };
  std::size_t const pool_bytes = std::size_t{16} << 30;
  using rmm::mr::cuda_memory_resource;
  if (want("cuda")) {
    cuda_memory_resource mr;
    bench("cuda", mr, true);
  }
  if (want("cuda_async")) {
    rmm::mr::cuda_async_memory_resource mr;
    bench("cuda_async", mr, false);
  }
  if (want("pool")) {
    rmm::mr::pool_memory_resource mr{cuda_memory_resource{}, pool_bytes};
    bench("pool", mr, false);
  }
  if (want("arena")) {
    rmm::mr::arena_memory_resource mr{cuda_memory_resource{}, pool_bytes};
    bench("arena", mr, false);
  }
  if (want("binning")) {
    rmm::mr::pool_memory_resource pool{cuda_memory_resource{}, pool_bytes};
    rmm::mr::binning_memory_resource mr{pool, 8, 22};
    bench("binning(pool)", mr, false);
  }
  if (want("fixed")) {
    rmm::mr::fixed_size_memory_resource mr{cuda_memory_resource{}, std::size_t{1} << 20, 1024};
    bench("fixed_size_1MiB", mr, false, true);
  }
  if (want("statistics")) {
    rmm::mr::pool_memory_resource pool{cuda_memory_resource{}, pool_bytes};
    rmm::mr::statistics_resource_adaptor mr{pool};
    bench("statistics(pool)", mr, false);
  }
  if (want("logging")) {
    rmm::mr::pool_memory_resource pool{cuda_memory_resource{}, pool_bytes};
    rmm::mr::logging_resource_adaptor mr{pool, std::string{"/tmp/rmm_log.csv"}};
    bench("logging(pool)", mr, false);
  }
  return 0;
}
