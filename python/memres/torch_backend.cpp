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
//   allocated and active, the default pool's blocks asked for at torch's block sizes;
//   requested bytes without that rounding; the pool's size as reserved; the pools' calls to
//   the driver as num_device_alloc and num_device_free).
// - empty_cache -> memres_trim on every device memres serves.
// - cacheInfo (cudnn.benchmark's workspace bound): the pool's largest free block or the
//   device's free memory, whichever is larger (memres can grow into the latter).
// - Out of memory stays torch.OutOfMemoryError, in torch's words ("CUDA out of memory.
//   Tried to allocate ...", the device's capacity and free memory, what is allocated and
//   reserved) with memres's reason after them; the out-of-memory observers
//   (torch._C._cuda_attach_out_of_memory_observer) are called first, as torch calls them.
// - set_per_process_memory_fraction / get_per_process_memory_fraction: the fraction of
//   the device's memory becomes a limit on what memres's pools on it hold
//   (memres_set_limit); a request past it is torch.OutOfMemoryError.
// - torch.profiler(profile_memory=True): every allocation and free is reported to the
//   profiler (its memory events, export_memory_timeline).
// - Private pools for CUDA graphs (torch.cuda.graph, its pool= sharing, and the
//   cudagraph trees of torch.compile(mode="reduce-overhead")): while a capture routes to a
//   pool, allocations it selects come from that pool's segments (taken from memres) and
//   go back to it when freed, never to other allocations, since replays write them again;
//   a pool whose graphs are gone returns its segments to memres once its last block is
//   freed. checkPoolLiveAllocations, getCheckpointState and setCheckpointPoolState work
//   on a pool's block table. The pools themselves are memres's segment pools
//   (memres_segment_pool_*: blocks, record_stream's held blocks, capture reuse, saved
//   tables, and which pool holds an address: memres_segment_pool_holding); this file
//   routes torch's calls to them and keeps no table of blocks.
// - enablePeerAccess -> memres_enable_peer_access: the in-place and cuda_async pools of
//   the device whose memory is reached grant the other device access (until then they
//   serve their own device alone, as PyTorch's expandable segments and cudaMallocAsync
//   pools do: memres_peer_access_on_demand at install).
// - IPC: shareIpcHandle / getIpcDevPtr through memres_ipc_export / memres_ipc_open, so
//   torch.multiprocessing sends CUDA tensors of memres in torch's own handle forms (the
//   default in-place pool's blocks as expandable segments, chunked pools' as CUDA IPC
//   handles): a receiver on torch's allocator opens them, and memres opens torch's.
// - MemPool(another allocator): the pool's segments come from that allocator and go
//   back to it when the pool is released.

#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "memres.h"

namespace {

using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingAllocator::StatType;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr int kMaxDevices = 64;

void* routed_to_private_pool(size_t size, int device, cudaStream_t stream, bool* routed);
void reclaim_graph_pools(int device);
void* from_pools_on_oom(size_t size, int device, cudaStream_t stream);

// Per device: torch's num_alloc_retries (requests memres could not serve at first, so
// graph pools were reclaimed and memres asked again) and num_ooms (requests that failed
// after that).
std::array<std::atomic<int64_t>, 64> g_retries{};
std::array<std::atomic<int64_t>, 64> g_ooms{};

bool is_out_of_memory(const std::string& why) {
  return why.rfind("out of memory", 0) == 0;
}

using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::TraceEntry;

// torch.compile's regions on this thread (pushCompileContext), innermost last: each
// recorded event carries the innermost one ("N/A" outside any), as torch's do.
thread_local std::vector<std::string> t_compile_context;

// The trace actions by torch's names (_record_memory_history's skip_actions).
TraceEntry::Action trace_action(const std::string& name) {
  static const std::pair<const char*, TraceEntry::Action> kNames[] = {
      {"alloc", TraceEntry::ALLOC},
      {"free_requested", TraceEntry::FREE_REQUESTED},
      {"free_completed", TraceEntry::FREE_COMPLETED},
      {"segment_alloc", TraceEntry::SEGMENT_ALLOC},
      {"segment_free", TraceEntry::SEGMENT_FREE},
      {"segment_map", TraceEntry::SEGMENT_MAP},
      {"segment_unmap", TraceEntry::SEGMENT_UNMAP},
      {"snapshot", TraceEntry::SNAPSHOT},
      {"oom", TraceEntry::OOM},
  };
  for (const auto& [text, action] : kNames) {
    if (name == text) {
      return action;
    }
  }
  TORCH_CHECK_VALUE(false, "memres: no trace action is called '" + name + "'");
}

// torch.cuda.memory._record_memory_history: the allocation and free events of every
// device in a ring of max_entries each, with the stacks torch's recorder gathers, and the
// stack of each live block's allocation (what _snapshot() draws). Off, it costs one
// relaxed load per call.
struct History {
  std::atomic<bool> on{false};
  std::mutex mutex;
  c10::cuda::CUDACachingAllocator::CreateContextFn recorder = nullptr;
  RecordContext when = RecordContext::NEVER;
  size_t max_entries = 0;
  std::array<std::vector<TraceEntry>, kMaxDevices> traces;
  std::array<size_t, kMaxDevices> next{};  // where the ring writes next, once full
  std::unordered_map<void*, std::shared_ptr<c10::GatheredContext>> contexts;
  // _record_memory_history(skip_actions=..): actions the ring does not keep.
  std::unordered_set<int> skipped;
  // torch.cuda.memory._set_memory_metadata: written into every event recorded after it.
  std::string user_metadata;

  // The stack to keep for an event of `action`, gathered now if the settings want one
  // (the settings are read under the lock, the recorder called outside it: it may take
  // the GIL).
  std::shared_ptr<c10::GatheredContext> gather(TraceEntry::Action action) {
    c10::cuda::CUDACachingAllocator::CreateContextFn fn = nullptr;
    RecordContext now = RecordContext::NEVER;
    {
      std::lock_guard<std::mutex> lock(mutex);
      fn = recorder;
      now = when;
    }
    RecordContext wanted = action == TraceEntry::ALLOC ? RecordContext::STATE : RecordContext::ALL;
    return fn != nullptr && now >= wanted ? fn() : nullptr;
  }

  void record(TraceEntry::Action action, int device, void* ptr, size_t size, cudaStream_t stream) {
    record_with(action, device, ptr, size, stream, gather(action));
  }

  void record_with(
      TraceEntry::Action action,
      int device,
      void* ptr,
      size_t size,
      cudaStream_t stream,
      std::shared_ptr<c10::GatheredContext> context) {
    if (device < 0 || device >= kMaxDevices) {
      return;
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (!on.load(std::memory_order_relaxed)) {
      return;
    }
    if (action == TraceEntry::ALLOC && when >= RecordContext::STATE) {
      contexts[ptr] = context;
    } else if (action == TraceEntry::FREE_COMPLETED) {
      contexts.erase(ptr);
    }
    auto& ring = traces[device];
    TraceEntry entry(
        action,
        static_cast<c10::DeviceIndex>(device),
        reinterpret_cast<size_t>(ptr),
        size,
        stream,
        {0, 0},
        c10::getApproximateTime(),
        when >= RecordContext::ALLOC ? context : nullptr);
    if (max_entries == 0 || skipped.count(static_cast<int>(action)) != 0) {
      return;
    }
    entry.compile_context_ = t_compile_context.empty() ? "N/A" : t_compile_context.back();
    entry.user_metadata_ = user_metadata;
    if (ring.size() < max_entries) {
      ring.push_back(std::move(entry));
    } else {
      ring[next[device]] = std::move(entry);
      next[device] = (next[device] + 1) % max_entries;
    }
  }

  // The ring of `device` oldest first.
  std::vector<TraceEntry> trace(int device) {
    std::lock_guard<std::mutex> lock(mutex);
    const auto& ring = traces[device];
    std::vector<TraceEntry> out(ring.begin() + next[device], ring.end());
    out.insert(out.end(), ring.begin(), ring.begin() + next[device]);
    return out;
  }

  std::shared_ptr<c10::GatheredContext> context_of(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = contexts.find(ptr);
    return it == contexts.end() ? nullptr : it->second;
  }
};
History g_history;

// torch's size pretty-printer's form (what log parsers and tests match): bytes up to
// 1 KiB, then KiB, MiB, GiB with two decimals.
std::string torch_size(uint64_t n) {
  char text[64];
  if (n <= 1024) {
    std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(n));
  } else if (n <= (1ull << 20)) {
    std::snprintf(text, sizeof text, "%.2f KiB", static_cast<double>(n) / 1024.0);
  } else if (n <= (1ull << 30)) {
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(n) / 1048576.0);
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(n) / 1073741824.0);
  }
  return text;
}

// Per device: the memory fraction set (1 until set) and the bytes it allows (0: none
// set); the out-of-memory observers of every device.
struct Limits {
  std::mutex mutex;
  std::array<double, kMaxDevices> fraction;
  // Whether a fraction below 1 is set, and the bytes it allows (torch's "reserved":
  // memres's pools and other allocators' MemPools together).
  std::array<bool, kMaxDevices> limited{};
  std::array<uint64_t, kMaxDevices> allowed{};
  // Bytes other allocators' MemPools hold (their segments), per device.
  std::array<uint64_t, kMaxDevices> foreign{};
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;

  Limits() {
    fraction.fill(1.0);
  }

  // Under `mutex`: memres's pools on `device` may hold what the fraction allows less
  // what other allocators' pools hold (no bound without a fraction).
  void apply(int device) {
    int64_t bound = -1;
    if (limited[device]) {
      bound = static_cast<int64_t>(allowed[device] > foreign[device] ? allowed[device] - foreign[device] : 0);
    }
    int code = memres_set_limit(device, bound);
    TORCH_CHECK(code == MEMRES_OK, "memres: " + std::string(memres_last_error()));
  }
};
Limits g_limits;

// Why a graph or MemPool allocation on this thread found no memory ("out of memory: .."),
// for the error raised after it; empty when memres's own last error says why.
thread_local std::string t_pool_failure;

// The device's total and free bytes (zeros if the driver cannot say).
std::pair<size_t, size_t> device_memory(int device) {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return {0, 0};
  }
  return {total_bytes, free_bytes};
}

// Bytes live through memres and bytes its pools hold on `device` (torch's "allocated"
// and "reserved"); zeros if memres cannot say.
std::pair<uint64_t, uint64_t> allocated_and_reserved(int device) {
  memres_stats_t s;
  std::memset(&s, 0, sizeof s);
  if (memres_stats(device, &s) != MEMRES_OK) {
    return {0, 0};
  }
  uint64_t live = static_cast<uint64_t>(std::max<int64_t>(s.live_bytes, 0));
  return {live, s.has_pool ? s.pool_size : live};
}

// Out of memory, as torch's allocator says it, after its observers are told: torch's
// text first (what tools match), memres's reason after it.
[[noreturn]] void raise_out_of_memory(int device, size_t size, const std::string& why) {
  auto [total, free_bytes] = device_memory(device);
  bool limited = false;
  uint64_t allowed = 0;
  uint64_t foreign = 0;
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(g_limits.mutex);
    limited = g_limits.limited.at(device);
    allowed = g_limits.allowed.at(device);
    foreign = g_limits.foreign.at(device);
    observers = g_limits.observers;
  }
  // torch passes the allowed bytes where a fraction is set, else the capacity.
  for (const auto& observer : observers) {
    observer(device, size, limited ? allowed : total, free_bytes);
  }
  auto [allocated, reserved] = allocated_and_reserved(device);
  reserved += foreign;
  std::string allowed_text = limited ? torch_size(allowed) + " allowed; " : "";
  // The message is put together here: c10::str with a number among its parts crashed
  // in this translation unit (torch 2.11, g++ 13: a segmentation fault inside it).
  std::string message = "CUDA out of memory. Tried to allocate " + torch_size(size) + ". GPU " +
      std::to_string(device) + " has a total capacity of " + torch_size(total) + " of which " +
      torch_size(free_bytes) + " is free. " + allowed_text + "Of the allocated memory " +
      torch_size(allocated) + " is allocated by PyTorch, and " +
      torch_size(reserved > allocated ? reserved - allocated : 0) +
      " is reserved by PyTorch but unallocated. memres: " + why;
  TORCH_CHECK_WITH(OutOfMemoryError, false, message);
}

// torch.profiler's memory events (profile_memory=True): `delta` bytes at `ptr`.
void report_to_profiler(void* ptr, int64_t delta, int device) {
  if (!c10::memoryProfilingEnabled()) {
    return;
  }
  auto [allocated, reserved] = allocated_and_reserved(device);
  c10::reportMemoryUsageToProfiler(
      ptr,
      delta,
      allocated,
      reserved,
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

// Counts `bytes` more held by another allocator's MemPool on `device`; false (nothing
// counted) where that would pass the memory fraction's bound with what memres holds.
bool reserve_foreign(int device, size_t bytes) {
  if (device < 0 || device >= kMaxDevices) {
    return true;
  }
  uint64_t reserved = allocated_and_reserved(device).second;
  std::lock_guard<std::mutex> lock(g_limits.mutex);
  if (g_limits.limited[device] &&
      reserved + g_limits.foreign[device] + bytes > g_limits.allowed[device]) {
    return false;
  }
  g_limits.foreign[device] += bytes;
  if (g_limits.limited[device]) {
    g_limits.apply(device);
  }
  return true;
}

// Another allocator's MemPool gave `bytes` back on `device`.
void release_foreign(int device, size_t bytes) {
  if (device < 0 || device >= kMaxDevices) {
    return;
  }
  std::lock_guard<std::mutex> lock(g_limits.mutex);
  g_limits.foreign[device] -= std::min<uint64_t>(bytes, g_limits.foreign[device]);
  if (g_limits.limited[device]) {
    g_limits.apply(device);
  }
}

// torch.cuda.caching_allocator_enable(False): requests go straight to cudaMalloc and
// frees to cudaFree, outside memres and its figures, as torch's allocator does; those
// blocks by address, so their frees go back the same way after caching is on again.
struct Uncached {
  std::atomic<bool> caching{true};
  std::atomic<size_t> count{0};  // blocks.size(): frees look only while it is not 0
  std::mutex mutex;
  std::unordered_set<void*> blocks;

  void add(void* ptr) {
    std::lock_guard<std::mutex> lock(mutex);
    blocks.insert(ptr);
    count.store(blocks.size(), std::memory_order_release);
  }

  bool contains(void* ptr) {
    if (count.load(std::memory_order_acquire) == 0) {
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex);
    return blocks.count(ptr) != 0;
  }

  // Whether `ptr` was one (it is forgotten).
  bool take(void* ptr) {
    if (count.load(std::memory_order_acquire) == 0) {
      return false;
    }
    std::lock_guard<std::mutex> lock(mutex);
    bool found = blocks.erase(ptr) != 0;
    count.store(blocks.size(), std::memory_order_release);
    return found;
  }
};
Uncached g_uncached;

// PYTORCH_CUDA_ALLOC_CONF's roundup_power2_divisions (also set with
// torch.cuda.memory._set_allocator_settings): a request of more than 512 bytes per
// division is rounded up to the next of `divisions` equal steps between the powers of two
// around it (a power of two stays), so that sizes that vary a little reuse blocks.
size_t rounded_request(size_t size) {
  size_t divisions = c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
  if (divisions < 2 || size <= 512 * divisions || (size & (size - 1)) == 0) {
    return size;
  }
  size_t floor = size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(size)));
  size_t step = floor / divisions;
  if (step == 0) {
    return floor << 1;
  }
  return (size + step - 1) / step * step;
}

// `size` rounded up to a multiple of torch's smallest block, 512 bytes, at least one.
size_t whole_min_blocks(size_t size) {
  constexpr size_t kMinBlockSize = 512;
  return std::max(kMinBlockSize, (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize);
}

// The bytes added to requests of memres's default pool, as torch's allocator rounds them
// (its round_size), so that allocated_bytes and active_bytes (torch.cuda.memory_allocated())
// count what they count under torch's allocator and requested_bytes what was asked for:
// per device the bytes added to blocks alive now and ever, and each block that
// roundup_power2_divisions rounded with the bytes it added (the setting may change before
// the block is freed; the map is empty unless it is used). Every other block is rounded
// to whole_min_blocks, which its free works out again from the size asked for.
struct Rounding {
  std::atomic<size_t> count{0};
  std::mutex mutex;
  std::unordered_map<void*, size_t> extra;
  std::array<std::atomic<int64_t>, kMaxDevices> live{};
  std::array<std::atomic<int64_t>, kMaxDevices> total{};

  void add(void* ptr, size_t bytes, int device) {
    std::lock_guard<std::mutex> lock(mutex);
    extra[ptr] = bytes;
    count.store(extra.size(), std::memory_order_release);
    live[device].fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    total[device].fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  }

  // The bytes added to the block at `ptr` (0: none), forgotten.
  size_t take(void* ptr, int device) {
    if (count.load(std::memory_order_acquire) == 0) {
      return 0;
    }
    std::lock_guard<std::mutex> lock(mutex);
    auto it = extra.find(ptr);
    if (it == extra.end()) {
      return 0;
    }
    size_t bytes = it->second;
    extra.erase(it);
    count.store(extra.size(), std::memory_order_release);
    live[device].fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    return bytes;
  }

  // A block of `requested` bytes rounded up to whole 512-byte blocks (`padded`).
  void pad(size_t requested, size_t padded, int device) {
    if (padded != requested) {
      live[device].fetch_add(static_cast<int64_t>(padded - requested), std::memory_order_relaxed);
      total[device].fetch_add(static_cast<int64_t>(padded - requested), std::memory_order_relaxed);
    }
  }

  // The size of the block given for `requested` bytes at `ptr`, its rounding forgotten.
  size_t block_size(void* ptr, size_t requested, int device) {
    size_t added = take(ptr, device);
    if (added != 0) {
      return requested + added;
    }
    size_t padded = whole_min_blocks(requested);
    live[device].fetch_sub(static_cast<int64_t>(padded - requested), std::memory_order_relaxed);
    return padded;
  }

  // The size of the live block given for `requested` bytes at `ptr` (kept).
  size_t size_of(void* ptr, size_t requested) {
    if (count.load(std::memory_order_acquire) != 0) {
      std::lock_guard<std::mutex> lock(mutex);
      if (auto it = extra.find(ptr); it != extra.end()) {
        return requested + it->second;
      }
    }
    return whole_min_blocks(requested);
  }
};
Rounding g_rounding;

void* memres_torch_malloc(size_t size, int device, cudaStream_t stream) {
  // torch's own bound and words for a size no device has.
  constexpr size_t kOneExbibyte = size_t{1} << 60;
  TORCH_CHECK_WITH(
      OutOfMemoryError,
      size < kOneExbibyte,
      "CUDA out of memory. Tried to allocate more than 1EB memory. memres: " + std::to_string(size) +
          " bytes");
  if (!g_uncached.caching.load(std::memory_order_relaxed)) {
    void* raw = nullptr;
    if (size != 0) {
      cudaError_t code = cudaMalloc(&raw, size);
      if (code == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        raise_out_of_memory(device, size, "out of memory: cudaMalloc (caching is off)");
      }
      C10_CUDA_CHECK(code);
      g_uncached.add(raw);
    }
    return raw;
  }
  size_t requested = size;
  if (size == 0) {
    return nullptr;  // an empty tensor: no block, in no pool (as in torch's allocator)
  }
  bool pooled = false;  // served by a use_on_oom pool after memres ran out
  bool routed = false;
  void* ptr = routed_to_private_pool(size, device, stream, &routed);
  std::string why;
  if (!routed) {
    size = rounded_request(size);
    if (size == requested) {
      size = whole_min_blocks(size);
    }
    ptr = memres_malloc(static_cast<ssize_t>(size), device, stream);
    if (ptr == nullptr && size != 0) {
      why = memres_last_error();
      if (is_out_of_memory(why) && device >= 0 && device < 64) {
        // Graph pools that no graph holds, and blocks waiting for other streams, first;
        // then the free blocks of pools made with use_on_oom=True.
        g_retries[device].fetch_add(1, std::memory_order_relaxed);
        reclaim_graph_pools(device);
        ptr = memres_malloc(static_cast<ssize_t>(size), device, stream);
        if (ptr == nullptr) {
          why = memres_last_error();
          // A pool's block (its own rounding; its frees never reach memres_torch_free).
          ptr = from_pools_on_oom(requested, device, stream);
          pooled = ptr != nullptr;
        }
      }
    }
  } else if (ptr == nullptr && size != 0) {
    why = t_pool_failure.empty() ? std::string(memres_last_error()) : std::exchange(t_pool_failure, {});
  }
  if (ptr == nullptr && size != 0) {
    if (is_out_of_memory(why) && device >= 0 && device < 64) {
      g_ooms[device].fetch_add(1, std::memory_order_relaxed);
      if (g_history.on.load(std::memory_order_relaxed)) {
        size_t free_bytes = 0;
        size_t total_bytes = 0;
        if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
          (void)cudaGetLastError();
        }
        // torch's OOM entry carries the device's free bytes as its address.
        g_history.record(TraceEntry::OOM, device, reinterpret_cast<void*>(free_bytes), size, stream);
      }
    }
    if (is_out_of_memory(why) && device >= 0 && device < kMaxDevices) {
      raise_out_of_memory(device, size, why);
    }
    TORCH_CHECK(false, "memres: ", why);
  }
  if (g_history.on.load(std::memory_order_relaxed) && ptr != nullptr) {
    // The size asked for, as torch's allocator records it (its trace's frees too).
    g_history.record(TraceEntry::ALLOC, device, ptr, requested, stream);
  }
  if (ptr != nullptr) {
    if (!routed && !pooled && device >= 0 && device < kMaxDevices) {
      if (size != whole_min_blocks(requested)) {
        g_rounding.add(ptr, size - requested, device);
      } else {
        g_rounding.pad(requested, size, device);
      }
    }
    // (A use_on_oom pool's block: its free reports the bytes asked for, so this does.)
    report_to_profiler(ptr, static_cast<int64_t>(pooled ? requested : size), device);
  }
  return ptr;
}

void memres_torch_free(void* ptr, size_t size, int device, cudaStream_t stream) {
  if (g_uncached.take(ptr)) {
    C10_CUDA_CHECK(cudaFree(ptr));
    return;
  }
  if (device >= 0 && device < kMaxDevices) {
    size = g_rounding.block_size(ptr, size, device);
  }
  memres_free(ptr, static_cast<ssize_t>(size), device, stream);
  report_to_profiler(ptr, -static_cast<int64_t>(size), device);
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
  int64_t retries = 0;
  int64_t device_allocs = 0;  // the driver calls that took and gave back memory
  int64_t device_frees = 0;
  int64_t rounding_added = 0;  // bytes roundup_power2_divisions added, ever and freed
  int64_t rounding_freed = 0;
  // What the pools' correction (their blocks less their segments) was at the last
  // reset_peak_memory_stats, in bytes and blocks: memres's peaks move by it.
  int64_t peak_correction = 0;
  int64_t peak_block_correction = 0;
};

// torch's num_device_alloc and num_device_free, ever: the calls memres's chunked and
// in-place pools made to take memory from the driver and give it back (a chunk; granules
// mapped or unmapped). Other layers' calls (a `cuda` stack's blocks, an arena's one
// allocation, a driver pool's) are not counted.
std::pair<int64_t, int64_t> device_calls(const memres_stats_t& s) {
  return {static_cast<int64_t>(s.pool_alloc_calls), static_cast<int64_t>(s.pool_free_calls)};
}

void set_all(StatArray& array, const Stat& value) {
  // memres keeps no small and large pools: every figure is the aggregate's.
  array[static_cast<size_t>(StatType::AGGREGATE)] = value;
}

// ---- Private pools for CUDA graphs -------------------------------------------------

struct Block {
  size_t size = 0;
  bool allocated = false;
};

// A segment of a graph or MemPool pool as memres's table lists it
// (memres_segment_pool_blocks): blocks of one segment are used in the order of the stream
// it was taken on (as PyTorch's own private pools do).
struct Segment {
  char* base = nullptr;
  size_t size = 0;
  cudaStream_t stream = nullptr;
  std::map<size_t, Block> blocks;  // by offset; they tile the segment
};

// A pool's table, for torch's cudagraph trees to restore later.
struct PoolCheckpoint final : c10::cuda::CUDACachingAllocator::AllocatorState {
  c10::DeviceIndex device = 0;
  c10::MempoolId_t id{0, 0};
  std::vector<memres_block_t> table;
};

// An exception the allocator of a MemPool(allocator) threw while memres asked it for a
// segment: memres gets a null (no exception crosses into memres), the backend throws it
// again once memres returns.
thread_local std::exception_ptr t_source_exception;

struct PrivatePool {
  c10::DeviceIndex device = 0;
  int use_count = 0;
  // MemPool(use_on_oom=True): other allocations may take its free blocks when memres
  // runs out. MemPool(no_split=True): a block is handed out whole, never split.
  bool use_on_oom = false;
  bool no_split = false;
  // A pool a user made (torch.cuda.MemPool(); torch gives those ids {0, n}, graphs'
  // own {n, 0}): its segments are sized as torch's for requests of 1 to 10 MiB (20 MiB,
  // so that several such blocks share one); graph pools keep 2 MiB steps.
  bool user_pool = false;
  // MemPool(allocator): the allocator its segments come from and go back to (vLLM's
  // CuMemAllocator, NCCL's, any CUDAPluggableAllocator); null: memres.
  std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> source;
  // memres's segment pool holding the blocks (memres_segment_pool_*), made on the first
  // allocation with the flags and source set by then.
  struct Destroy {
    void operator()(memres_segment_pool_t* p) const {
      memres_segment_pool_destroy(p);
    }
  };
  std::unique_ptr<memres_segment_pool_t, Destroy> table;
  // Blocks freed while other streams used them (Tensor.record_stream) are held by memres's
  // segment pool until that work is complete (memres_segment_pool_settle).
  void settle(int how) {
    if (table != nullptr) {
      (void)memres_segment_pool_settle(table.get(), how);
    }
  }

  // memres's segment pool of this pool, made on first use; null on failure (memres's last
  // error says why).
  memres_segment_pool_t* blocks_table() {
    if (table == nullptr) {
      int flags = (no_split ? MEMRES_SEGMENTS_NO_SPLIT : 0) | (user_pool ? MEMRES_SEGMENTS_MEDIUM : 0);
      table.reset(
          source == nullptr
              ? memres_segment_pool_new(device, flags, nullptr, nullptr, nullptr)
              : memres_segment_pool_new(device, flags, &source_alloc, &source_free, this));
    }
    return table.get();
  }

  // MemPool(allocator)'s segments: from its allocator, within the memory fraction (which
  // counts what other allocators' pools hold, as torch's does). Its failure is torch's
  // exception with its message, thrown again once memres returns; a null without one is
  // out of memory.
  // Called from memres (Rust): nothing may unwind out of them, so every exception is
  // caught and carried in t_source_exception.
  static void* source_alloc(void* ctx, size_t size, void* stream) noexcept {
    auto* pool = static_cast<PrivatePool*>(ctx);
    bool reserved = false;
    try {
      if (!reserve_foreign(pool->device, size)) {
        t_pool_failure = "out of memory: " + torch_size(size) +
            " more for a MemPool would pass the memory fraction's bound";
        return nullptr;
      }
      reserved = true;
      void* base = pool->source->raw_alloc_with_stream(size, static_cast<cudaStream_t>(stream));
      if (base == nullptr) {
        release_foreign(pool->device, size);
        t_pool_failure = "out of memory: the MemPool's own allocator (" + pool->source->name() +
            ") returned no memory for " + torch_size(size);
      }
      return base;
    } catch (...) {
      if (reserved) {
        try {
          release_foreign(pool->device, size);
        } catch (...) {
        }
      }
      t_source_exception = std::current_exception();
      return nullptr;
    }
  }

  static void source_free(void* ctx, void* ptr, size_t size) noexcept {
    auto* pool = static_cast<PrivatePool*>(ctx);
    try {
      pool->source->raw_delete(ptr);
    } catch (...) {
      // Nothing may cross into memres: the allocator keeps what it could not free.
    }
    try {
      release_foreign(pool->device, size);
    } catch (...) {
    }
  }

  // A block of `size` bytes for `stream`: the best fit among its segments' free blocks,
  // else (`may_grow`) a new segment (memres_segment_pool_malloc, which first frees held
  // blocks whose work is done unless `capturing`, a capture underway on the device, and
  // inside a capture takes back blocks the graph orders first). nullptr when there is
  // none (memres's last error, or t_pool_failure for a MemPool's allocator, says why).
  void* allocate(size_t size, cudaStream_t stream, bool may_grow, bool capturing) {
    memres_segment_pool_t* pool = blocks_table();
    if (pool == nullptr) {
      return nullptr;
    }
    t_source_exception = nullptr;
    void* ptr = memres_segment_pool_malloc(
        pool, std::max<size_t>(size, 1), stream, may_grow ? 1 : 0, capturing ? 1 : 0);
    if (ptr == nullptr && t_source_exception != nullptr) {
      std::exception_ptr thrown = std::exchange(t_source_exception, nullptr);
      std::rethrow_exception(thrown);
    }
    return ptr;
  }

  // Frees the block at `ptr` if it is one of this pool's (held while streams recorded for
  // it may use it).
  bool free(void* ptr, bool capturing) {
    return table != nullptr && memres_segment_pool_free(table.get(), ptr, capturing ? 1 : 0) == MEMRES_OK;
  }

  // The table memres keeps: every block of every segment.
  std::vector<memres_block_t> entries() const {
    std::vector<memres_block_t> out;
    if (table == nullptr) {
      return out;
    }
    int64_t n = memres_segment_pool_blocks(table.get(), nullptr, 0);
    if (n > 0) {
      out.resize(static_cast<size_t>(n));
      n = memres_segment_pool_blocks(table.get(), out.data(), out.size());
      out.resize(static_cast<size_t>(std::max<int64_t>(n, 0)));
    }
    return out;
  }

  // The segments with their blocks, in the order they were taken.
  std::vector<Segment> segments() const {
    std::vector<Segment> out;
    for (const memres_block_t& b : entries()) {
      char* base = reinterpret_cast<char*>(static_cast<uintptr_t>(b.segment));
      if (out.empty() || out.back().base != base) {
        out.push_back(Segment{base, static_cast<size_t>(b.segment_size), static_cast<cudaStream_t>(b.stream), {}});
      }
      out.back().blocks[static_cast<size_t>(b.offset)] = Block{static_cast<size_t>(b.size), b.allocated != 0};
    }
    return out;
  }

  // The blocks handed out and not freed.
  size_t live_blocks() const {
    size_t n = 0;
    for (const memres_block_t& b : entries()) {
      n += b.allocated != 0 ? 1 : 0;
    }
    return n;
  }

  bool has_segments() const {
    return table != nullptr && memres_segment_pool_blocks(table.get(), nullptr, 0) > 0;
  }

  // The blocks handed out and not freed (held blocks are freed: their tensors are gone,
  // as in PyTorch's pools).
  std::vector<void*> allocated_blocks() const {
    std::vector<void*> out;
    for (const memres_block_t& b : entries()) {
      if (b.allocated != 0 && b.held == 0) {
        out.push_back(reinterpret_cast<char*>(static_cast<uintptr_t>(b.segment + b.offset)));
      }
    }
    return out;
  }

  // The segment holding `ptr` (no blocks listed), if the pool has it.
  std::optional<Segment> segment_of(void* ptr) const {
    uint64_t base = 0;
    uint64_t size = 0;
    void* stream = nullptr;
    if (table == nullptr || memres_segment_pool_segment_of(table.get(), ptr, &base, &size, &stream) != 1) {
      return std::nullopt;
    }
    return Segment{
        reinterpret_cast<char*>(static_cast<uintptr_t>(base)), static_cast<size_t>(size),
        static_cast<cudaStream_t>(stream), {}};
  }

  // Gives back the segments with no allocated block. The caller has waited for the
  // device: graph replays that wrote these segments may have run on any stream.
  void release_free_segments() {
    if (table != nullptr) {
      (void)memres_segment_pool_release_free(table.get(), nullptr);
    }
  }

  // Gives every segment back (the pool goes; the caller has waited for the device, and no
  // block is live). They are freed on the default stream first, as the free ones are: a
  // stream a segment was taken for may be gone by now.
  void release_segments() {
    release_free_segments();
    table.reset();
  }
};

// A record of torch's table of live blocks (`allocation_metadata_`), made here: libtorch
// exports none of `_AllocationMetadata`'s constructors (a backend that calls one does not
// load: an undefined symbol), but the struct is trivially copyable, so its bytes are
// written from a struct of the same layout.
torch::cuda::CUDAPluggableAllocator::_AllocationMetadata allocation_metadata(
    size_t size,
    c10::DeviceIndex device,
    cudaStream_t stream) {
  struct Same {
    size_t size;
    c10::DeviceIndex device_idx;
    cudaStream_t stream;
  };
  using Meta = torch::cuda::CUDAPluggableAllocator::_AllocationMetadata;
  static_assert(std::is_trivially_copyable_v<Meta>);
  static_assert(sizeof(Same) == sizeof(Meta) && alignof(Same) == alignof(Meta));
  static_assert(offsetof(Meta, size) == offsetof(Same, size));
  static_assert(offsetof(Meta, device_idx) == offsetof(Same, device_idx));
  static_assert(offsetof(Meta, stream) == offsetof(Same, stream));
  return std::bit_cast<Meta>(Same{size, device, stream});
}

struct PoolIdHash {
  size_t operator()(const c10::MempoolId_t& id) const noexcept {
    return std::hash<unsigned long long>()(id.first) * 31 + std::hash<unsigned long long>()(id.second);
  }
};

class MemresAllocator;
MemresAllocator* g_allocator = nullptr;

class MemresAllocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  MemresAllocator() : CUDAPluggableAllocator(memres_torch_malloc, memres_torch_free) {}

  // ---- CUDA graph pools ----

  // The pool a capture routes this request to, if any (`routed` says so), and its block.
  void* route(size_t size, int device, cudaStream_t stream, bool* routed) {
    if (routing_.load(std::memory_order_acquire) == 0) {
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(pools_mutex_);
    // The pool begun last first: inside nested use_mem_pool contexts, the innermost.
    auto& captures = captures_[device];
    for (auto capture = captures.rbegin(); capture != captures.rend(); ++capture) {
      auto& [id, filter] = *capture;
      if (filter(stream)) {
        *routed = true;
        PrivatePool& pool = pools_.at(id);
        return pool.allocate(size, stream, /*may_grow=*/true, is_capturing(device));
      }
    }
    return nullptr;
  }

  void beginAllocateToPool(
      c10::DeviceIndex device,
      c10::MempoolId_t id,
      std::function<bool(cudaStream_t)> filter) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    for (auto& capture : captures_[device]) {
      TORCH_CHECK(capture.first != id, "memres: already allocating to this graph pool");
    }
    PrivatePool& pool = pools_[id];
    pool.device = device;
    pool.user_pool = id.first == 0;
    ++pool.use_count;
    captures_[device].emplace_back(id, std::move(filter));
    routing_.fetch_add(1, std::memory_order_release);
  }

  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    auto& list = captures_[device];
    for (auto it = list.begin(); it != list.end(); ++it) {
      if (it->first == id) {
        list.erase(it);
        routing_.fetch_sub(1, std::memory_order_release);
        for (auto& [pid, pool] : pools_) {
          if (pool.device == device && !is_capturing(device)) {
            pool.settle(MEMRES_SETTLE_POLL);
          }
        }
        return;
      }
    }
    TORCH_CHECK(false, "memres: endAllocateToPool of a graph pool that is not being allocated to");
  }

  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    auto it = pools_.find(id);
    TORCH_CHECK(
        it != pools_.end() && it->second.use_count > 0,
        "memres: releasePool of a graph pool that is not held (released twice?)");
    --it->second.use_count;
    release_unused_pools(device);
  }

  void createOrIncrefPool(
      c10::DeviceIndex device,
      c10::MempoolId_t id,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator) override {
    // Another allocator's pool (MemPool(allocator)): its segments come from it.
    std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> source;
    if (allocator != nullptr && allocator.get() != this) {
      source = std::move(allocator);
    }
    std::lock_guard<std::mutex> lock(pools_mutex_);
    auto [it, made] = pools_.try_emplace(id);
    PrivatePool& pool = it->second;
    pool.user_pool = id.first == 0;
    TORCH_CHECK_VALUE(
        made || pool.source == source || !pool.has_segments(),
        "memres: a memory pool used again with another allocator");
    if (!pool.has_segments() && pool.source != source) {
      pool.release_segments();  // memres's pool is made again over the new source
      pool.source = std::move(source);
    }
    pool.device = device;
    ++pool.use_count;
  }

  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t id, bool use_on_oom) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    PrivatePool& pool = pools_[id];
    pool.device = device;
    pool.user_pool = id.first == 0;
    pool.use_on_oom = use_on_oom;
  }

  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    PrivatePool& pool = pools_[id];
    pool.device = device;
    pool.user_pool = id.first == 0;
    pool.no_split = true;
  }

  // After memres ran out: a free block of a pool made with use_on_oom=True, if one fits.
  void* take_from_pools_on_oom(size_t size, c10::DeviceIndex device, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    for (auto& [id, pool] : pools_) {
      if (pool.device != device || !pool.use_on_oom) {
        continue;
      }
      void* ptr = pool.allocate(size, stream, /*may_grow=*/false, is_capturing(device));
      if (ptr != nullptr) {
        return ptr;
      }
    }
    return nullptr;
  }

  int getPoolUseCount(c10::DeviceIndex /*device*/, c10::MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    auto it = pools_.find(id);
    return it == pools_.end() ? 0 : it->second.use_count;
  }

  bool checkPoolLiveAllocations(
      c10::DeviceIndex /*device*/,
      c10::MempoolId_t id,
      const std::unordered_set<void*>& expected) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    auto it = pools_.find(id);
    if (it == pools_.end()) {
      return expected.empty();
    }
    std::vector<void*> live = it->second.allocated_blocks();
    if (live.size() != expected.size()) {
      return false;
    }
    for (void* ptr : live) {
      if (expected.count(ptr) == 0) {
        return false;
      }
    }
    return true;
  }

  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device,
      c10::MempoolId_t id) override {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    auto it = pools_.find(id);
    TORCH_CHECK(it != pools_.end(), "memres: getCheckpointState of an unknown graph pool");
    auto state = std::make_shared<PoolCheckpoint>();
    state->device = device;
    state->id = id;
    state->table = it->second.entries();
    return state;
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override {
    auto state = std::dynamic_pointer_cast<PoolCheckpoint>(pps);
    TORCH_CHECK(state != nullptr, "memres: a checkpoint that memres did not make");
    c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
    std::vector<void*> freed;
    {
      std::lock_guard<std::mutex> lock(pools_mutex_);
      auto it = pools_.find(state->id);
      TORCH_CHECK(it != pools_.end(), "memres: setCheckpointPoolState of an unknown graph pool");
      PrivatePool& pool = it->second;
      // Blocks freed while other streams used them are freed first (outside a capture,
      // waiting for those streams), so that no such free lands later on a block the
      // checkpoint makes live (the address would be handed out twice). Inside a capture
      // nothing may wait: they are forgotten, the checkpoint's table replacing theirs.
      // Every block allocated now (held ones are freed already) is freed; the
      // checkpoint's blocks are allocated again, at the same addresses (segments stay
      // while the pool lives).
      freed = pool.allocated_blocks();
      // (Inside a capture they are left to the restore, which drops them with the table
      // they would free into; a refused restore leaves them as they were.)
      if (!is_capturing(device)) {
        pool.settle(MEMRES_SETTLE_WAIT);
      }
      // memres lays the checkpoint's table out again in the pool's segments (a table
      // naming a segment the pool gave back is refused, nothing changed).
      if (!state->table.empty() || pool.table != nullptr) {
        memres_segment_pool_t* table = pool.blocks_table();
        TORCH_CHECK(
            table != nullptr &&
                memres_segment_pool_restore(table, state->table.data(), state->table.size()) == MEMRES_OK,
            "memres: cannot restore a graph pool's checkpoint: ",
            memres_last_error());
      }
      for (const memres_block_t& b : state->table) {
        if (b.allocated != 0) {
          void* ptr = reinterpret_cast<char*>(static_cast<uintptr_t>(b.segment + b.offset));
          delta.dataptrs_allocd.emplace_back(
              ptr, ptr, raw_deleter(), c10::Device(c10::DeviceType::CUDA, device));
        }
      }
      {
        // The base class's records, under pools_mutex_ (so no allocation of the pool is
        // handed one of these addresses meanwhile): the freed blocks' go (torch released
        // their storages without the deleter), the restored blocks' are made (their
        // frees, the history and IPC read them).
        std::lock_guard<std::mutex> meta(allocator_mutex_);
        for (void* ptr : freed) {
          allocation_metadata_.erase(ptr);
        }
        for (const memres_block_t& b : state->table) {
          if (b.allocated != 0) {
            allocation_metadata_.insert_or_assign(
                reinterpret_cast<char*>(static_cast<uintptr_t>(b.segment + b.offset)),
                allocation_metadata(static_cast<size_t>(b.size), device, static_cast<cudaStream_t>(b.stream)));
          }
        }
      }
      // memres keeps the streams recorded for the blocks the restore made live, and drops
      // the others' (a later block there is another tensor).
    }
    if (g_history.on.load(std::memory_order_relaxed)) {
      std::lock_guard<std::mutex> lock(g_history.mutex);
      for (void* ptr : freed) {
        g_history.contexts.erase(ptr);
      }
    }
    delta.ptrs_freed = std::move(freed);
    return delta;
  }

  void raw_delete(void* ptr) override {
    if (ptr == nullptr) {
      return;  // an empty tensor's: nothing was handed out (as torch's allocator ignores it)
    }
    if (g_history.on.load(std::memory_order_relaxed)) {
      trace_free(ptr);
    }
    // A graph or MemPool pool's block: memres answers which pool's segment holds it (one
    // load while no pool holds a segment).
    if (memres_segment_pool_t* table = memres_segment_pool_holding(ptr); table != nullptr) {
      std::unique_lock<std::mutex> lock(pools_mutex_);
      if (PrivatePool* owner = pool_of_table(table); owner != nullptr) {
        PrivatePool& pool = *owner;
        // memres frees it, or holds it while streams recorded for it may use it (inside
        // the capture that made it, until the graph orders their work first).
        TORCH_CHECK(pool.free(ptr, is_capturing(pool.device)), "memres: a graph pool's block freed twice");
        size_t size = 0;
        int device = pool.device;
        {
          // Under pools_mutex_, so the address cannot be handed out (and its new record
          // made) before the old record goes.
          std::lock_guard<std::mutex> meta(allocator_mutex_);
          auto found = allocation_metadata_.find(ptr);
          if (found != allocation_metadata_.end()) {
            size = found->second.size;
            allocation_metadata_.erase(found);
          }
        }
        lock.unlock();  // the profiler's code runs under no lock of the backend's
        report_to_profiler(ptr, -static_cast<int64_t>(size), device);
        return;
      }
    }
    CUDAPluggableAllocator::raw_delete(ptr);
  }

  std::string name() override {
    return "memres";
  }

  // ---- memory history and snapshots ----

  void recordHistory(
      bool enabled,
      c10::cuda::CUDACachingAllocator::CreateContextFn context_recorder,
      size_t alloc_trace_max_entries,
      RecordContext when,
      bool clear_history,
      const std::vector<std::string>& skip_actions) override {
    std::unordered_set<int> skipped;
    for (const auto& name : skip_actions) {
      skipped.insert(static_cast<int>(trace_action(name)));
    }
    std::lock_guard<std::mutex> lock(g_history.mutex);
    g_history.skipped = std::move(skipped);
    g_history.recorder = context_recorder;
    g_history.when = enabled ? when : RecordContext::NEVER;
    if (clear_history || g_history.max_entries != alloc_trace_max_entries) {
      for (int d = 0; d < kMaxDevices; ++d) {
        g_history.traces[d].clear();
        g_history.next[d] = 0;
      }
    }
    g_history.max_entries = alloc_trace_max_entries;
    if (!enabled) {
      g_history.contexts.clear();
    }
    g_history.on.store(enabled, std::memory_order_relaxed);
  }

  bool isHistoryEnabled() override {
    return g_history.on.load(std::memory_order_relaxed);
  }

  void pushCompileContext(std::string& md) override {
    t_compile_context.push_back(md);
  }

  void popCompileContext() override {
    if (!t_compile_context.empty()) {
      t_compile_context.pop_back();
    }
  }

  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> lock(g_history.mutex);
    g_history.user_metadata = metadata;
  }

  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> lock(g_history.mutex);
    return g_history.user_metadata;
  }

  // ---- snapshots (torch.cuda.memory._snapshot, memory_snapshot, MemPool.snapshot) ----

  // The device's traces, one list per device (empty lists without `include_traces`).
  static std::vector<std::vector<TraceEntry>> device_traces(bool include_traces) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) {
      (void)cudaGetLastError();
      devices = 0;
    }
    std::vector<std::vector<TraceEntry>> out;
    for (int device = 0; device < std::min(devices, kMaxDevices); ++device) {
      out.push_back(include_traces ? g_history.trace(device) : std::vector<TraceEntry>{});
    }
    return out;
  }

  static c10::CachingDeviceAllocator::BlockInfo block_info(
      size_t size,
      bool allocated,
      std::shared_ptr<c10::GatheredContext> context,
      size_t requested = SIZE_MAX) {
    c10::CachingDeviceAllocator::BlockInfo b;
    b.size = size;
    b.requested_size = allocated ? std::min(size, requested) : 0;
    b.allocated = allocated;
    b.active = allocated;
    b.context_when_allocated = std::move(context);
    return b;
  }

  // Under pools_mutex_: one segment of a graph or MemPool pool as torch draws it, its
  // block table with the pool's id.
  static c10::CachingDeviceAllocator::SegmentInfo private_segment(
      const PrivatePool& pool,
      const Segment& seg,
      c10::MempoolId_t id) {
    c10::CachingDeviceAllocator::SegmentInfo info;
    info.device = pool.device;
    info.address = reinterpret_cast<size_t>(seg.base);
    info.total_size = seg.size;
    info.stream = seg.stream;
    info.is_large = true;
    info.owner_private_pool_id = id;
    for (const auto& [offset, block] : seg.blocks) {
      auto context = block.allocated ? g_history.context_of(seg.base + offset) : nullptr;
      info.blocks.push_back(block_info(block.size, block.allocated, std::move(context)));
      if (block.allocated) {
        info.allocated_size += block.size;
        info.active_size += block.size;
        info.requested_size += block.size;
      }
    }
    return info;
  }

  // One pool's segments (MemPool.snapshot(), memory_snapshot(pool.id)).
  c10::cuda::CUDACachingAllocator::SnapshotInfo pool_snapshot(c10::cuda::MempoolId_t id, bool include_traces) {
    c10::cuda::CUDACachingAllocator::SnapshotInfo out;
    {
      std::lock_guard<std::mutex> lock(pools_mutex_);
      auto it = pools_.find(id);
      if (it != pools_.end()) {
        for (const Segment& seg : it->second.segments()) {
          out.segments.push_back(private_segment(it->second, seg, id));
        }
      }
    }
    out.device_traces = device_traces(include_traces);
    out.config_metadata.expandable_segments = true;
    out.config_metadata.last_allocator_settings = "memres";
    return out;
  }

  // torch.cuda.memory._snapshot() / memory_snapshot(): memres's pool memory as segments
  // (the chunks of a chunked pool, the mapped runs of the in-place pool; every live block
  // its own segment where the stack keeps no such list), with the live blocks in them
  // allocated and the rest free; the segments of graph and MemPool pools (taken from
  // memres's pool, so cut out of its runs) as their own, with their pools' ids and block
  // tables; and the recorded history.
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(
      c10::cuda::MempoolId_t mempool_id,
      bool include_traces) override {
    if (mempool_id.first != 0 || mempool_id.second != 0) {
      return pool_snapshot(mempool_id, include_traces);
    }
    using SegmentInfo = c10::CachingDeviceAllocator::SegmentInfo;
    struct Live {
      size_t size;  // the block's, rounded as torch's allocator rounds it
      cudaStream_t stream;
      std::shared_ptr<c10::GatheredContext> context;
      std::shared_ptr<SegmentInfo> pool_segment;  // a graph or MemPool pool's segment
      size_t requested = SIZE_MAX;  // the bytes asked for (a pool's segment: its size)
    };
    std::array<std::map<size_t, Live>, kMaxDevices> live;
    std::vector<SegmentInfo> foreign;  // pool segments from other allocators
    {
      std::lock_guard<std::mutex> pools(pools_mutex_);
      {
        std::lock_guard<std::mutex> meta(allocator_mutex_);
        for (const auto& [ptr, m] : allocation_metadata_) {
          if (ptr != nullptr && memres_segment_pool_holding(ptr) == nullptr && m.device_idx >= 0 &&
              m.device_idx < kMaxDevices) {
            live[m.device_idx][reinterpret_cast<size_t>(ptr)] =
                Live{g_uncached.contains(ptr) ? m.size : g_rounding.size_of(ptr, m.size),
                     m.stream, nullptr, nullptr, m.size};
          }
        }
      }
      for (const auto& [id, pool] : pools_) {
        if (pool.device < 0 || pool.device >= kMaxDevices) {
          continue;
        }
        for (const Segment& seg : pool.segments()) {
          auto info = std::make_shared<SegmentInfo>(private_segment(pool, seg, id));
          if (pool.source != nullptr) {
            foreign.push_back(std::move(*info));
          } else {
            live[pool.device][reinterpret_cast<size_t>(seg.base)] = Live{seg.size, seg.stream, nullptr, info};
          }
        }
      }
    }
    c10::cuda::CUDACachingAllocator::SnapshotInfo out;
    out.segments = std::move(foreign);
    out.device_traces = device_traces(include_traces);
    for (int device = 0; device < static_cast<int>(out.device_traces.size()); ++device) {
      auto& blocks = live[device];
      for (auto& [addr, block] : blocks) {
        if (block.pool_segment == nullptr) {
          block.context = g_history.context_of(reinterpret_cast<void*>(addr));
        }
      }
      int64_t n = memres_segments(device, nullptr, 0);
      TORCH_CHECK(n >= 0, "memres: ", memres_last_error());
      std::vector<uint64_t> pairs(2 * static_cast<size_t>(n));
      if (n > 0) {
        n = std::min<int64_t>(n, memres_segments(device, pairs.data(), static_cast<size_t>(n)));
      }
      // The runs of memres's pool as segments at their true addresses. The segments of
      // graph and MemPool pools cut from a run are their own (as torch's private pools'
      // are), so a run they were cut from is drawn as the pieces around them.
      for (int64_t i = 0; i < n; ++i) {
        size_t start = pairs[2 * i];
        size_t end = start + pairs[2 * i + 1];
        SegmentInfo piece;
        size_t at = start;  // where the piece's blocks reach
        auto open_piece = [&](size_t from) {
          piece = SegmentInfo{};
          piece.device = static_cast<c10::DeviceIndex>(device);
          piece.address = from;
          piece.is_large = true;
          piece.is_expandable = true;  // memres's pool grows in place, as expandable segments do
          at = from;
        };
        auto close_piece = [&](size_t to) {
          if (to > at) {
            piece.blocks.push_back(block_info(to - at, false, nullptr));
          }
          piece.total_size = to - piece.address;
          if (piece.total_size > 0) {
            out.segments.push_back(std::move(piece));
          }
        };
        open_piece(start);
        for (auto it = blocks.lower_bound(start); it != blocks.end() && it->first < end;) {
          size_t size = std::min(it->second.size, end - it->first);
          if (it->second.pool_segment != nullptr) {
            close_piece(it->first);
            out.segments.push_back(std::move(*it->second.pool_segment));
            open_piece(it->first + size);
          } else {
            if (it->first > at) {
              piece.blocks.push_back(block_info(it->first - at, false, nullptr));
            }
            piece.blocks.push_back(block_info(size, true, it->second.context, it->second.requested));
            piece.allocated_size += size;
            piece.active_size += size;
            piece.requested_size += std::min(size, it->second.requested);
            if (piece.stream == nullptr) {
              piece.stream = it->second.stream;
            }
            at = it->first + size;
          }
          it = blocks.erase(it);
        }
        close_piece(end);
      }
      // Blocks outside any listed segment: each is its own allocation.
      for (auto& [addr, block] : blocks) {
        if (block.pool_segment != nullptr) {
          out.segments.push_back(std::move(*block.pool_segment));
          continue;
        }
        SegmentInfo seg;
        seg.device = static_cast<c10::DeviceIndex>(device);
        seg.address = addr;
        seg.total_size = block.size;
        seg.is_large = true;
        seg.stream = block.stream;
        seg.allocated_size = seg.active_size = block.size;
        seg.requested_size = std::min(block.size, block.requested);
        seg.blocks.push_back(block_info(block.size, true, block.context, block.requested));
        out.segments.push_back(std::move(seg));
      }
    }
    std::sort(out.segments.begin(), out.segments.end(), [](const auto& a, const auto& b) {
      return std::make_pair(a.device, a.address) < std::make_pair(b.device, b.address);
    });
    out.config_metadata.expandable_segments = true;
    out.config_metadata.last_allocator_settings = "memres";
    return out;
  }

  // ---- IPC (torch.multiprocessing's CUDA tensors) ----

  // The handle another process opens for the block at ptr: the in-place pool's granules
  // as file descriptors (kept open until the block is freed), or the cudaIpcMemHandle_t
  // of cuMemAlloc memory, which torch's own allocator opens too.
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    size_t size = 0;
    c10::DeviceIndex device = -1;
    {
      std::lock_guard<std::mutex> lock(allocator_mutex_);
      auto it = allocation_metadata_.find(ptr);
      TORCH_CHECK(
          it != allocation_metadata_.end(),
          "memres: shareIpcHandle of a pointer that is not a live block of memres");
      size = it->second.size;
      device = it->second.device_idx;
    }
    TORCH_CHECK(size > 0, "memres: shareIpcHandle of a zero-byte block");
    // A graph pool's block is shared as its segment (a block memres handed out, whose
    // exported descriptors close when the segment goes back to memres).
    void* block = ptr;
    size_t into = 0;
    {
      std::lock_guard<std::mutex> lock(pools_mutex_);
      if (PrivatePool* pool = pool_holding(ptr); pool != nullptr) {
        auto seg = pool->segment_of(ptr);
        TORCH_CHECK(seg.has_value(), "memres: a graph pool's block outside its segments");
        block = seg->base;
        into = static_cast<size_t>(static_cast<char*>(ptr) - seg->base);
        size = seg->size;
      }
    }
    int64_t len = memres_ipc_export(block, static_cast<ssize_t>(size), device, nullptr, 0, nullptr);
    TORCH_CHECK(len > 0, "memres: ", memres_last_error());
    std::string handle(static_cast<size_t>(len), '\0');
    size_t offset = 0;
    int64_t written = memres_ipc_export(
        block, static_cast<ssize_t>(size), device, handle.data(), handle.size(), &offset);
    TORCH_CHECK(written == len, "memres: ", memres_last_error());
    return {static_cast<ptrdiff_t>(offset + into), std::move(handle)};
  }

  // Maps another process's handle on the current device (memres's own, or a 64-byte CUDA
  // IPC handle from torch's allocator); the range is unmapped when the last tensor on it
  // goes. Torch adds the sender's offset.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    void* base = nullptr;
    int code = memres_ipc_open(handle.data(), handle.size(), device, &base);
    TORCH_CHECK(code == MEMRES_OK, "memres: cannot open an IPC handle: ", memres_last_error());
    return std::shared_ptr<void>(base, [](void* p) {
      if (memres_ipc_close(p) != MEMRES_OK) {
        TORCH_WARN("memres: ", memres_last_error());
      }
    });
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    if (ptr.get() == nullptr || ptr.get_deleter() != raw_deleter() || g_uncached.contains(ptr.get())) {
      // An empty tensor, memory memres did not hand out (an IPC receiver's, from_blob's)
      // or cudaMalloc's while caching was off: nothing to keep, as in torch's allocator.
      return;
    }
    {
      // A graph pool's block: its pool keeps the stream and holds the block back when it
      // is freed (memres's own record covers memory memres hands out).
      std::lock_guard<std::mutex> lock(pools_mutex_);
      if (PrivatePool* found = pool_holding(ptr.get()); found != nullptr) {
        PrivatePool& pool = *found;
        int code = pool.table == nullptr
            ? MEMRES_ERROR_INVALID_ARGUMENT
            : memres_segment_pool_record_stream(pool.table.get(), ptr.get(), stream.stream());
        TORCH_CHECK(code == MEMRES_OK, "memres: ", memres_last_error());
        return;
      }
    }
    int code = memres_record_stream(ptr.get(), ptr.device().index(), stream.stream());
    TORCH_CHECK(code == MEMRES_OK, "memres: ", memres_last_error());
  }

  // What the graph and MemPool pools of a device hold: memres's segments (bytes, count),
  // other allocators' segments (bytes, count), and the blocks handed out of them.
  struct PoolFigures {
    int64_t segment_bytes = 0;
    int64_t segments = 0;
    int64_t foreign_bytes = 0;
    int64_t foreign_segments = 0;
    int64_t block_bytes = 0;
    int64_t blocks = 0;
  };

  PoolFigures pool_figures(c10::DeviceIndex device) {
    PoolFigures out;
    std::lock_guard<std::mutex> lock(pools_mutex_);
    for (const auto& [id, pool] : pools_) {
      if (pool.device != device) {
        continue;
      }
      for (const Segment& seg : pool.segments()) {
        if (pool.source == nullptr) {
          out.segment_bytes += static_cast<int64_t>(seg.size);
          ++out.segments;
        } else {
          out.foreign_bytes += static_cast<int64_t>(seg.size);
          ++out.foreign_segments;
        }
        for (const auto& [offset, block] : seg.blocks) {
          if (block.allocated) {
            out.block_bytes += static_cast<int64_t>(block.size);
            ++out.blocks;
          }
        }
      }
    }
    return out;
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    memres_stats_t s = stats_of(device);
    Baseline base;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      base = baseline_.at(device);
    }
    PoolFigures pools = pool_figures(device);
    DeviceStats out;
    Stat bytes;
    // memres counts a graph or MemPool pool's segment as one live block; torch counts
    // the blocks handed out inside it (current figures; peaks and totals stay memres's).
    // The peak is memres's less whichever of the pools' corrections (at the last reset,
    // now) takes off less: exact right after a reset while the pools stay as they were;
    // otherwise it may count pools' unused segment bytes, never falling below the true
    // peak.
    bytes.current = s.live_bytes - pools.segment_bytes + pools.block_bytes;
    int64_t correction = std::max(base.peak_correction, pools.block_bytes - pools.segment_bytes);
    bytes.peak = std::max(s.peak_live_bytes + correction, bytes.current);
    bytes.allocated = s.allocated_bytes - base.allocated_bytes;
    bytes.freed = (s.allocated_bytes - s.live_bytes) - base.freed_bytes;
    set_all(out.allocated_bytes, bytes);
    set_all(out.active_bytes, bytes);
    // What was asked for: less what roundup_power2_divisions added (its peak is the
    // blocks' peak, rounding included).
    int64_t rounding_live = g_rounding.live.at(device).load(std::memory_order_relaxed);
    int64_t rounding_added = g_rounding.total.at(device).load(std::memory_order_relaxed);
    Stat requested = bytes;
    requested.current -= rounding_live;
    requested.allocated -= rounding_added - base.rounding_added;
    requested.freed -= (rounding_added - rounding_live) - base.rounding_freed;
    set_all(out.requested_bytes, requested);
    Stat blocks;
    blocks.current = s.live_allocations - pools.segments + pools.blocks;
    int64_t block_correction = std::max(base.peak_block_correction, pools.blocks - pools.segments);
    blocks.peak = std::max(s.peak_live_allocations + block_correction, blocks.current);
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
    // Other allocators' MemPools hold memory for torch too.
    reserved.current += pools.foreign_bytes;
    reserved.peak = std::max(reserved.peak + pools.foreign_bytes, reserved.current);
    set_all(out.reserved_bytes, reserved);
    // Segments: the runs (or chunks) of memres's pool, and the pools' own segments.
    int64_t runs = memres_segments(device, nullptr, 0);
    Stat segments;
    segments.current = std::max<int64_t>(runs, 0) + pools.segments + pools.foreign_segments;
    segments.peak = segments.current;
    set_all(out.segment, segments);
    out.num_ooms = g_ooms.at(device).load(std::memory_order_relaxed) - base.out_of_memory;
    out.num_alloc_retries = g_retries.at(device).load(std::memory_order_relaxed) - base.retries;
    auto [device_allocs, device_frees] = device_calls(s);
    out.num_device_alloc = device_allocs - base.device_allocs;
    out.num_device_free = device_frees - base.device_frees;
    return out;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    PoolFigures pools = pool_figures(device);
    TORCH_CHECK(memres_reset_peak(device) == MEMRES_OK, "memres: ", memres_last_error());
    std::lock_guard<std::mutex> lock(mutex_);
    Baseline& base = baseline_.at(device);
    base.peak_correction = pools.block_bytes - pools.segment_bytes;
    base.peak_block_correction = pools.blocks - pools.segments;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    memres_stats_t s = stats_of(device);
    std::lock_guard<std::mutex> lock(mutex_);
    Baseline& base = baseline_.at(device);
    base.allocated_bytes = s.allocated_bytes;
    base.freed_bytes = s.allocated_bytes - s.live_bytes;
    base.allocations = s.allocations;
    base.frees = s.allocations - s.live_allocations;
    base.out_of_memory = g_ooms.at(device).load(std::memory_order_relaxed);
    base.retries = g_retries.at(device).load(std::memory_order_relaxed);
    std::tie(base.device_allocs, base.device_frees) = device_calls(s);
    int64_t rounding_live = g_rounding.live.at(device).load(std::memory_order_relaxed);
    base.rounding_added = g_rounding.total.at(device).load(std::memory_order_relaxed);
    base.rounding_freed = base.rounding_added - rounding_live;
  }

  // torch.cuda.caching_allocator_enable: off, requests go to cudaMalloc and frees to
  // cudaFree, outside memres and its figures (as torch's allocator does).
  void enable(bool value) override {
    g_uncached.caching.store(value, std::memory_order_relaxed);
  }

  bool isEnabled() const override {
    return g_uncached.caching.load(std::memory_order_relaxed);
  }

  void emptyCache(c10::cuda::MempoolId_t mempool_id) override {
    if (mempool_id.first != 0 || mempool_id.second != 0) {
      // One pool (torch.cuda.empty_cache of a MemPool): its wholly free segments go back
      // to where they came from, once the device's work on them is done.
      std::lock_guard<std::mutex> lock(pools_mutex_);
      auto it = pools_.find(mempool_id);
      if (it != pools_.end() && !is_capturing(it->second.device)) {
        PrivatePool& pool = it->second;
        pool.settle(MEMRES_SETTLE_POLL);
        c10::cuda::CUDAGuard guard(pool.device);
        C10_CUDA_CHECK(cudaDeviceSynchronize());
        pool.release_free_segments();
      }
      return;
    }
    {
      // Blocks of graph and MemPool pools waiting for other streams are waited for
      // first (torch's empty_cache waits for its blocks' events too), so that pools whose
      // last blocks they were can go.
      std::lock_guard<std::mutex> lock(pools_mutex_);
      for (auto& [id, pool] : pools_) {
        if (!is_capturing(pool.device)) {
          pool.settle(MEMRES_SETTLE_WAIT);
        }
      }
      for (int device = 0; device < kMaxDevices; ++device) {
        release_unused_pools(static_cast<c10::DeviceIndex>(device));
      }
    }
    for (int device = 0; device < kMaxDevices; ++device) {
      // A device memres never allocated on has nothing to trim (MEMRES_OK). Not one
      // whose streams are being captured: a trim may wait for the device (a cuda_async
      // pool's always does), which would end the capture; torch's own allocator refuses
      // empty_cache during a capture.
      if (is_capturing(static_cast<c10::DeviceIndex>(device))) {
        continue;
      }
      TORCH_CHECK(memres_trim(device) == MEMRES_OK, "memres: ", memres_last_error());
    }
  }

  // torch asks this before its first copy or kernel between two devices
  // (at::cuda::get_p2p_access): `dev` may then use the memory of `dev_to_access`. The
  // base class enables the contexts' peer access (cudaMalloc memory); memres's in-place
  // and cuda_async pools on `dev_to_access` then grant `dev` access to what they hold, as
  // PyTorch's expandable segments and cudaMallocAsync pools add a peer (memres_torch_install asked for peers on demand, so
  // until then they map for their own device alone, which makes growth cheaper). torch
  // notes the pair as enabled before it calls this, and does not ask again: a failure
  // here raises, and the copy or kernel that asked is not run.
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    CUDAPluggableAllocator::enablePeerAccess(dev, dev_to_access);
    TORCH_CHECK(
        memres_enable_peer_access(dev_to_access, dev) == MEMRES_OK, "memres: ", memres_last_error());
  }

  // Copies between devices go through cudaMemcpyPeerAsync: memres's default pool maps
  // memory with cuMemMap, which a plain cudaMemcpyAsync cannot copy between devices
  // without peer access (PyTorch's own allocator does the same for its expandable
  // segments).
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

  // ---- memory fraction and out-of-memory observers ----

  // The fraction of the device's memory its pools may hold: a limit on every memres pool
  // of the device (1: none). torch checks the type and range in Python; checked again.
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK_VALUE(
        fraction >= 0.0 && fraction <= 1.0,
        "memres: a memory fraction is from 0 to 1, not " + std::to_string(fraction));
    TORCH_CHECK_VALUE(
        device >= 0 && device < kMaxDevices, "memres: no device " + std::to_string(device));
    auto [total, free_bytes] = device_memory(device);
    (void)free_bytes;
    TORCH_CHECK(
        total > 0, "memres: the driver does not say the memory of device " + std::to_string(device));
    std::lock_guard<std::mutex> lock(g_limits.mutex);
    g_limits.limited[device] = fraction < 1.0;
    g_limits.allowed[device] = static_cast<uint64_t>(fraction * static_cast<double>(total));
    g_limits.apply(device);
    g_limits.fraction[device] = fraction;
  }

  double getMemoryFraction(c10::DeviceIndex device) override {
    TORCH_CHECK_VALUE(
        device >= 0 && device < kMaxDevices, "memres: no device " + std::to_string(device));
    std::lock_guard<std::mutex> lock(g_limits.mutex);
    return g_limits.fraction[device];
  }

  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(g_limits.mutex);
    g_limits.observers.push_back(std::move(observer));
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

 public:
  // Before memres reports out of memory: held graph-pool blocks are waited for and
  // pools no graph holds give their segments back. Not while a capture is underway on
  // the device (no wait is allowed then).
  void reclaim(c10::DeviceIndex device) {
    std::lock_guard<std::mutex> lock(pools_mutex_);
    if (device < 0 || device >= kMaxDevices || !captures_[device].empty()) {
      return;
    }
    for (auto& [id, pool] : pools_) {
      if (pool.device == device) {
        pool.settle(MEMRES_SETTLE_WAIT);
      }
    }
    release_unused_pools(device);
  }

 private:
  // The history's free events of a block torch is freeing (memres frees at once, or holds
  // the block for recorded streams without telling: both events are written here).
  void trace_free(void* ptr) {
    size_t size = 0;
    int device = -1;
    cudaStream_t stream = nullptr;
    {
      std::lock_guard<std::mutex> lock(allocator_mutex_);
      auto it = allocation_metadata_.find(ptr);
      if (it == allocation_metadata_.end()) {
        return;
      }
      size = it->second.size;
      device = it->second.device_idx;
      stream = it->second.stream;
    }
    auto context = g_history.gather(TraceEntry::FREE_REQUESTED);  // one stack for both
    g_history.record_with(TraceEntry::FREE_REQUESTED, device, ptr, size, stream, context);
    g_history.record_with(TraceEntry::FREE_COMPLETED, device, ptr, size, stream, context);
  }

  // Under pools_mutex_: whether a capture routes to a pool of `device` now.
  bool is_capturing(c10::DeviceIndex device) const {
    return device < 0 || device >= kMaxDevices || !captures_[device].empty();
  }

  // The pool whose memres segment pool is `table`, if it is still one of pools_ (under
  // pools_mutex_): from by_table_, filled here on a pool's first lookup (a program with a
  // graph per shape has hundreds of pools, and every free of their blocks asks).
  PrivatePool* pool_of_table(memres_segment_pool_t* table) {
    if (auto hit = by_table_.find(table); hit != by_table_.end()) {
      return hit->second;
    }
    for (auto& [id, pool] : pools_) {
      if (pool.table.get() == table) {
        by_table_.emplace(table, &pool);  // pools_'s elements stay where they are
        return &pool;
      }
    }
    return nullptr;
  }

  // The graph or MemPool pool one of whose segments holds `ptr` (under pools_mutex_):
  // memres keeps every pool's segments by address (memres_segment_pool_holding), so the
  // backend keeps no table of blocks.
  PrivatePool* pool_holding(void* ptr) {
    memres_segment_pool_t* table = memres_segment_pool_holding(ptr);
    return table == nullptr ? nullptr : pool_of_table(table);
  }

  // Under pools_mutex_: gives back the segments of `device`'s pools that no graph holds
  // and no block uses, after waiting for the device (their graphs' replays may have run
  // on any stream). Not while a capture is underway on the device (no wait is allowed).
  void release_unused_pools(c10::DeviceIndex device) {
    if (!captures_[device].empty()) {
      return;
    }
    for (auto& [id, pool] : pools_) {
      if (pool.device == device) {
        pool.settle(MEMRES_SETTLE_POLL);
      }
    }
    bool waited = false;
    for (auto it = pools_.begin(); it != pools_.end();) {
      PrivatePool& pool = it->second;
      if (pool.device != device || pool.use_count > 0 || pool.live_blocks() > 0) {
        ++it;
        continue;
      }
      if (pool.has_segments() && !waited) {
        c10::cuda::CUDAGuard guard(device);
        if (cudaDeviceSynchronize() != cudaSuccess) {
          (void)cudaGetLastError();
          return;  // keep the segments: a later release tries again
        }
        waited = true;
      }
      by_table_.erase(pool.table.get());  // before its address can name a new pool's
      pool.release_segments();
      it = pools_.erase(it);
    }
  }

  std::mutex mutex_;
  std::array<Baseline, kMaxDevices> baseline_{};

  std::mutex pools_mutex_;
  std::unordered_map<c10::MempoolId_t, PrivatePool, PoolIdHash> pools_;
  // pool_of_table's answers: a pool by its memres segment pool (entries go as pools do).
  std::unordered_map<memres_segment_pool_t*, PrivatePool*> by_table_;
  std::array<std::vector<std::pair<c10::MempoolId_t, std::function<bool(cudaStream_t)>>>, kMaxDevices>
      captures_;
  // Captures routing now (the allocation path reads only this while it is 0).
  std::atomic<int> routing_{0};
};

void* routed_to_private_pool(size_t size, int device, cudaStream_t stream, bool* routed) {
  return g_allocator == nullptr ? nullptr : g_allocator->route(size, device, stream, routed);
}

void reclaim_graph_pools(int device) {
  if (g_allocator != nullptr) {
    g_allocator->reclaim(static_cast<c10::DeviceIndex>(device));
  }
}

void* from_pools_on_oom(size_t size, int device, cudaStream_t stream) {
  return g_allocator == nullptr
      ? nullptr
      : g_allocator->take_from_pools_on_oom(size, static_cast<c10::DeviceIndex>(device), stream);
}

}  // namespace

// Installs memres as torch's CUDA allocator. NULL on success, else a message (valid until
// the next call on this thread); never throws into its caller (ctypes).
extern "C" const char* memres_torch_install() {
  static thread_local std::string error;
  try {
    auto allocator = std::make_shared<MemresAllocator>();
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
    g_allocator = allocator.get();  // torch keeps the allocator for the process's life
    // torch.accelerator's memory functions ask the allocator registered for the device
    // type (c10::GetAllocator), which changeCurrentAllocator leaves on torch's own: they
    // would read an allocator that never ran (an empty memory_stats(), a no-op
    // empty_cache()). memres is registered there too, above torch's priority.
    c10::SetAllocator(c10::DeviceType::CUDA, allocator.get(), /*priority=*/1);
    // torch says when a device needs another's memory (enablePeerAccess, above): the
    // in-place pools made from now on map for their own device until then.
    memres_peer_access_on_demand();
    return nullptr;
  } catch (const std::exception& e) {
    error = e.what();
  } catch (...) {
    error = "an unknown C++ exception";
  }
  return error.c_str();
}
