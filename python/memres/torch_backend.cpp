// memres as PyTorch's CUDA allocator, natively: a subclass of torch's
// CUDAPluggableAllocator whose hooks torch's pluggable allocator leaves out ("does not
// yet support ...") reach memres. Built once per torch version and libmemres by
// memres/_torch.py (g++ and torch's headers), loaded with ctypes, installed with
// memres_torch_install() before torch's first CUDA allocation.
//
// What it adds over the pluggable allocator (python/README.md lists it too):
// - Tensor.record_stream -> memres_record_stream: a freed block is not handed out again
//   before the recorded streams' work is complete.
// - memory_allocated / max_memory_allocated / memory_reserved / max_memory_reserved /
//   memory_stats / reset_peak_memory_stats / reset_accumulated_memory_stats /
//   memory_summary: memres's exact C ABI figures in torch's keys (live bytes as
//   allocated, active and requested; the pool's size as reserved).
// - empty_cache -> memres_trim on every device memres serves.
// - cacheInfo (cudnn.benchmark's workspace bound): the pool's largest free block or the
//   device's free memory, whichever is larger (memres can grow into the latter).
// - Out of memory stays torch.OutOfMemoryError, with memres's message.

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "memres.h"

namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr int kMaxDevices = 64;

void* memres_torch_malloc(size_t size, int device, cudaStream_t stream) {
  void* ptr = memres_malloc(static_cast<ssize_t>(size), device, stream);
  if (ptr == nullptr && size != 0) {
    std::string why = memres_last_error();
    TORCH_CHECK_WITH(OutOfMemoryError, why.rfind("out of memory", 0) != 0, "memres: ", why);
    TORCH_CHECK(false, "memres: ", why);
  }
  return ptr;
}

void memres_torch_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  memres_free(ptr, static_cast<ssize_t>(size), device, stream);
}

memres_stats_t stats_of(c10::DeviceIndex device) {
  memres_stats_t s;
  std::memset(&s, 0, sizeof s);
  TORCH_CHECK(memres_stats(device, &s) == MEMRES_OK, "memres: ", memres_last_error());
  return s;
}

// torch's accumulated figures ("allocated" and "freed" of a Stat) count from the last
// reset_accumulated_memory_stats; memres's C ABI counts from the start.
struct Baseline {
  int64_t allocated_bytes = 0;
  int64_t freed_bytes = 0;
  int64_t allocations = 0;
  int64_t frees = 0;
  int64_t out_of_memory = 0;
};

void set_all(StatArray& array, const Stat& value) {
  // memres keeps no small and large pools: every figure is the aggregate's.
  array[static_cast<size_t>(StatType::AGGREGATE)] = value;
}

class MemresAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  MemresAllocator() : CUDAPluggableAllocator(memres_torch_malloc, memres_torch_free) {}

  std::string name() override {
    return "memres";
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr) {
      return;  // an empty tensor: nothing to keep
    }
    int code = memres_record_stream(ptr.get(), ptr.device().index(), stream.stream());
    TORCH_CHECK(code == MEMRES_OK, "memres: ", memres_last_error());
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    memres_stats_t s = stats_of(device);
    Baseline base;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      base = baseline_.at(device);
    }
    DeviceStats out;
    Stat bytes;
    bytes.current = s.live_bytes;
    bytes.peak = s.peak_live_bytes;
    bytes.allocated = s.allocated_bytes - base.allocated_bytes;
    bytes.freed = (s.allocated_bytes - s.live_bytes) - base.freed_bytes;
    set_all(out.allocated_bytes, bytes);
    set_all(out.active_bytes, bytes);
    set_all(out.requested_bytes, bytes);
    Stat blocks;
    blocks.current = s.live_allocations;
    blocks.peak = s.peak_live_allocations;
    blocks.allocated = s.allocations - base.allocations;
    blocks.freed = (s.allocations - s.live_allocations) - base.frees;
    set_all(out.allocation, blocks);
    set_all(out.active, blocks);
    Stat reserved;
    if (s.has_pool) {
      reserved.current = static_cast<int64_t>(s.pool_size);
      reserved.peak = std::max<int64_t>(static_cast<int64_t>(s.pool_peak_size), reserved.current);
    } else {
      // A stack without a pool ("cuda") holds exactly what is live.
      reserved.current = s.live_bytes;
      reserved.peak = s.peak_live_bytes;
    }
    set_all(out.reserved_bytes, reserved);
    out.num_ooms = s.out_of_memory - base.out_of_memory;
    return out;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(memres_reset_peak(device) == MEMRES_OK, "memres: ", memres_last_error());
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    memres_stats_t s = stats_of(device);
    std::lock_guard<std::mutex> lock(mutex_);
    Baseline& base = baseline_.at(device);
    base.allocated_bytes = s.allocated_bytes;
    base.freed_bytes = s.allocated_bytes - s.live_bytes;
    base.allocations = s.allocations;
    base.frees = s.allocations - s.live_allocations;
    base.out_of_memory = s.out_of_memory;
  }

  void emptyCache(c10::cuda::MempoolId_t /*mempool_id*/) override {
    for (int device = 0; device < kMaxDevices; ++device) {
      // A device memres never allocated on has nothing to trim (MEMRES_OK).
      TORCH_CHECK(memres_trim(device) == MEMRES_OK, "memres: ", memres_last_error());
    }
  }

  // Copies between devices go through cudaMemcpyPeerAsync: memres's default pool maps
  // memory with cuMemMap, which a plain cudaMemcpyAsync cannot copy between devices
  // without peer access (PyTorch's own allocator does the same for its expandable
  // segments). The pool also grants access to every peer-capable device.
  cudaError_t memcpyAsync(
      void* dst,
      int dst_device,
      const void* src,
      int src_device,
      size_t count,
      cudaStream_t stream,
      bool /*p2p_enabled*/) override {
    if (dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    memres_stats_t s = stats_of(device);
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the pool's figure is still good
      free_bytes = 0;
    }
    *largest_block = std::max<size_t>(static_cast<size_t>(s.pool_largest_free_block), free_bytes);
  }

 private:
  std::mutex mutex_;
  std::array<Baseline, kMaxDevices> baseline_{};
};

}  // namespace

// Installs memres as torch's CUDA allocator. NULL on success, else a message (valid until
// the next call on this thread); never throws into its caller (ctypes).
extern "C" const char* memres_torch_install() {
  static thread_local std::string error;
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(std::make_shared<MemresAllocator>());
    return nullptr;
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "an unknown C++ exception";
  }
  return error.c_str();
}
