/*
 * memres: per-device GPU memory pools behind a C ABI (libmemres.so / libmemres.a).
 *
 * Each CUDA device gets one resource stack, built on the first allocation on it from
 * the spec given to memres_configure (or in env MEMRES_RESOURCE, or "virtual_pool"):
 *
 *   "cuda"                          cuMemAlloc per request
 *   "cuda_async[:initial=..,release=..]"  a driver pool (cuMemAllocFromPoolAsync)
 *   "managed"                       cuMemAllocManaged per request
 *   "pinned" / "pinned_pool"        pinned host memory per request / a pool over it
 *   "virtual_pool[:initial=..,max=..,step=..,release=..,reserve=..,granule=..]"  the
 *                                   default: a pool growing in place over CUDA virtual
 *                                   memory (holds least; release= gives memory back
 *                                   above it, and a growth keeps that much free rather
 *                                   than remap it: for sizes that vary widely, set above
 *                                   how much what is live swings within a step, else
 *                                   each step gives back and maps again what it swings
 *                                   (GPT-2 inference at 256 MiB: its step 2.2x); granule=
 *                                   is what it maps and gives back at a time, for it
 *                                   and the tags' pools (those take the spec's first
 *                                   virtual_pool's): 2 MiB by default, the driver's
 *                                   minimum, so that max= and memres_set_limit, which
 *                                   count whole granules, bound to 2 MiB as torch's
 *                                   allocator does; each mapping costs the driver the
 *                                   same, and granule=16MiB took the cost of GPT-2
 *                                   DDP's growth steps to that of its other steps, for
 *                                   at most 1% of live more held; granule=32MiB halves
 *                                   a sleep's and wake's driver calls again, see
 *                                   memres_sleep)
 *   "pool[:initial=8GiB,max=60GiB,growth=eighth]"  memres's coalescing pool over
 *                                   cuMemAlloc; each growth takes what the request
 *                                   needs, at least 1/8 of the pool, rounded up to
 *                                   2 MiB (GPT-2 training: 1.13x of live held).
 *                                   growth=rmm: RMM's doubling (1.67x there, up to
 *                                   2x without max=). virtual_pool holds least
 *                                   (1.09x)
 *   "arena[:size=40GiB]"            RMM's arena (default: half the free memory)
 *   "binning[:min=10,max=22]"       fixed-size bins of 2^min..2^max bytes; larger
 *                                   requests and the bins' chunks from a default
 *                                   virtual_pool
 *   "fixed_size[:block=1MiB,blocks=128]"  blocks of one size, taken 128 at a time
 *                                   from cuMemAlloc; larger requests fail
 *   "statistics(SPEC)"              counts bytes and allocations (see memres_stats)
 *   "logging(SPEC[,file=PATH])"     a CSV event log in RMM's format (default: the
 *                                   path in env MEMRES_LOG_FILE); exact_times=true
 *                                   reads the clock for every event (by default a
 *                                   thread's reading may stamp its next 7 events)
 *   "limiting(SPEC,limit=10GiB)"    a byte limit
 *   "fallback(SPEC,SPEC)"           the second serves what the first has no memory
 *                                   for, e.g. fallback(virtual_pool, pinned_pool)
 *
 * Sizes take units (KiB, MiB, GiB, TiB, kB, MB, GB, TB). memres_malloc and memres_free
 * have the signatures PyTorch's CUDAPluggableAllocator calls. No function unwinds or
 * aborts: failures return a code (or NULL) and memres_last_error() says what went wrong.
 * Kept in sync with capi/src/lib.rs by a test.
 */
#ifndef MEMRES_H
#define MEMRES_H

#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MEMRES_OK 0
#define MEMRES_ERROR_INVALID_ARGUMENT (-1)
#define MEMRES_ERROR_IN_USE (-2)
#define MEMRES_ERROR_CUDA (-3)
#define MEMRES_ERROR_PANIC (-4)
#define MEMRES_ERROR_OUT_OF_MEMORY (-5)
#define MEMRES_ERROR_ASLEEP (-6)

/* What memres_sleep does with the contents of the memory it gives back. */
#define MEMRES_SLEEP_DISCARD 0
#define MEMRES_SLEEP_OFFLOAD 1

typedef struct memres_stats_t {
    int32_t has_statistics;  /* 1 when the stack has a statistics layer */
    int32_t has_pool;        /* 1 when it has a pool (any kind), arena or driver pool */
    int64_t current_bytes;
    int64_t peak_bytes;
    int64_t total_bytes;
    int64_t current_allocations;
    int64_t peak_allocations;
    int64_t total_allocations;
    uint64_t pool_size;               /* bytes held from the driver */
    uint64_t pool_free_bytes;         /* held but not handed out */
    uint64_t pool_largest_free_block; /* 0 where the layer does not know it */
    int64_t live_bytes;      /* live through memres_malloc/free, exact, any spec */
    int64_t peak_live_bytes; /* its highest point since build or memres_reset_peak */
    int64_t allocated_bytes;       /* bytes ever allocated through memres_malloc */
    int64_t live_allocations;      /* blocks live, counted as live_bytes */
    int64_t peak_live_allocations; /* its highest point since build or memres_reset_peak */
    int64_t allocations;           /* blocks ever allocated */
    int64_t out_of_memory;         /* memres_malloc calls that ran out of memory */
    uint64_t pool_peak_size;       /* most bytes held at once since build or reset_peak */
    uint64_t pool_host_copy_bytes; /* host copies of pool contents: during an offload
                                      sleep, and after its wake until memres_trim */
    uint64_t pool_alloc_calls;     /* calls of the chunked and in-place pools that took
                                      device memory from the driver since built (a chunk
                                      allocated; granules mapped: a growth, a wake's
                                      piece of up to 256 MiB): num_device_alloc */
    uint64_t pool_free_calls;      /* their calls that gave it back (a chunk freed;
                                      granules unmapped: a run a trim or give-back
                                      frees, a sleep's piece): num_device_free. Neither
                                      counts an arena's one allocation, fixed_size's
                                      chunks, a cuda tier's blocks or a driver pool's */
} memres_stats_t;

/* Chooses every device's stack; call before the first allocation. MEMRES_OK, or
 * MEMRES_ERROR_INVALID_ARGUMENT for a bad spec (not UTF-8, longer than 4096 bytes, ...;
 * the message quotes at most 200 characters of it, with its size), MEMRES_ERROR_IN_USE
 * once allocated. The spec ends at its first NUL. */
int memres_configure(const char* spec);

/* Builds device's stack now instead of on its first allocation (so a spec the device
 * cannot serve fails here). MEMRES_OK or a failure code. */
int memres_init_device(int device);

/* size bytes on device, stream-ordered on stream (NULL: the legacy default stream).
 * NULL on failure, out of memory included (memres_last_error says why). A zero-byte
 * request returns NULL and is no failure (memres_last_error is then ""); freeing NULL is a
 * no-op. */
void* memres_malloc(ssize_t size, int device, void* stream);

/* Frees ptr (from memres_malloc with the same size and device) in order on stream. A
   pointer outside the reservation of an in-place pool (virtual_pool, the default, and
   binning's) is refused (memres_last_error) and not freed; other misuse is not
   detected. */
void memres_free(void* ptr, ssize_t size, int device, void* stream);

/* Records that work on stream uses ptr (a live block of memres_malloc on device), as
   PyTorch's Tensor.record_stream: once ptr is freed (on any stream), it is not handed
   out again before the work stream has enqueued by then is complete (the pools record
   an event there and hold the block until it completes; no stream waits for another;
   once it completes, the next allocation on the stream that freed the block, a
   millisecond later at most, gets it back, as under PyTorch's allocator).
   stream must stay live until ptr is freed. MEMRES_OK; MEMRES_ERROR_INVALID_ARGUMENT,
   with nothing recorded and memres_last_error naming the address, for NULL, a device
   memres never allocated on, or any ptr that is not the start of a block memres_malloc
   handed out on device and memres_free has not freed yet (from its stack or a tag's
   pool, whatever the spec): an address inside a block, a freed block, memory memres
   never handed out. A record belongs to its block: the block's free consumes it. */
int memres_record_stream(void* ptr, int device, void* stream);

/* Sharing blocks with other processes (PyTorch's CUDA tensors in torch.multiprocessing).
 *
 * memres_ipc_export writes into out (at most capacity bytes) a handle with which another
 * process maps the live block ptr (size bytes from memres_malloc on device), and the
 * block's offset in the mapped range into *offset; it returns the handle's length (with
 * out NULL only the length, nothing exported) or a negative code. Blocks of the in-place
 * pool (the default) export their granules as POSIX file descriptors, kept open until
 * the block is freed: the receiver takes them with pidfd_getfd, which needs the right to
 * ptrace the sender (same user; yama ptrace_scope 0 or CAP_SYS_PTRACE), as PyTorch's
 * expandable segments do. Blocks of cuMemAlloc memory (pool, arena, cuda) give the
 * 64-byte cudaIpcMemHandle_t of their allocation, which PyTorch's own allocator opens
 * too. Driver pools (cuda_async) are refused.
 *
 * memres_ipc_open maps such a handle (or any 64-byte CUDA IPC handle) on device and
 * writes the range's first address into *base (add the sender's offset); opening the
 * same handle again gives the same address. Each open is closed by memres_ipc_close,
 * the last one waiting for the device before unmapping. */
int64_t memres_ipc_export(void* ptr, ssize_t size, int device, void* out, size_t capacity, size_t* offset);
int memres_ipc_open(const void* handle, size_t len, int device, void** base);
int memres_ipc_close(void* base);

/* The statistics and pool figures of device's stack (zeros where it lacks the layer).
   The pool figures are those of every pool of the stack summed (every tier of a
   fallback(..), a pinned_pool's pinned host memory included, and the tags' pools); the
   largest free block is the largest of any, the peak the sum of their peaks. The
   statistics are the spec's outermost statistics(..)'s, which counts the tags' blocks
   too (the tags' pools sit under the spec's wrappers: a limiting(..) bounds them with
   the rest and a logging(..) logs them). */
int memres_stats(int device, memres_stats_t* out);

/* The figures of each tier of device's fallback(first, then) (the outermost one): writes
   at most capacity entries into out (the first tier first; out may be NULL with capacity
   0), each with the statistics fields filled (has_statistics 1) and the rest 0, and
   returns how many tiers there are: 2, or 0 for a stack without a fallback. */
int64_t memres_tier_stats(int device, memres_stats_t* out, size_t capacity);

/* Writes the memory device's pools hold as {address, bytes} pairs in address order into
   out (at most capacity pairs; out may be NULL with capacity 0) and returns how many
   there are: the chunks of a chunked pool (pool, pinned_pool), the mapped runs of an
   in-place pool (what PyTorch's memory snapshots draw as segments), for every pool of
   the stack (every tier of a fallback(..)) and every tag's. 0 for a device memres never
   allocated on and for stacks that keep no such list (arena, fixed_size, cuda_async,
   cuda). */
int64_t memres_segments(int device, uint64_t* out, size_t capacity);

/* Gives entirely free pool memory back to the driver (torch.cuda.empty_cache()), and the
   host memory a wake kept for the next MEMRES_SLEEP_OFFLOAD (the copies, pageable and
   registered with the driver in the background after each sleep and wake, so page-locked
   once registered, and the pinned staging buffers, so that a loop that sleeps every step
   only copies): every
   pool of the stack (every tier of a fallback(..), a pinned_pool too) and every tag's.
   binning's bins and fixed_size give back their streams' lists and thread caches (their
   chunks stay until the stack goes); then the pool under the bins gives back what is
   free. An arena holds one allocation of its whole size while it lives: trimming it
   frees nothing. A cuda_async pool that holds memory is trimmed once the device's work
   is waited for (blocks freed in stream order are pending until then), as PyTorch's
   cudaMallocAsync backend does: so not while a stream of the device is being captured
   (the wait would end the capture). Every pool is trimmed even if one fails; the first failure is
   returned. */
int memres_trim(int device);

/* Lets peer read and write the memory memres's in-place pools map on device (the default
   stack's and every tag's) and its cuda_async pools hold (cuMemPoolSetAccess, as
   PyTorch's cudaMallocAsync backend does): what they hold now and all they map later.
   Needed only where peers come on demand (memres_peer_access_on_demand); by default
   every peer-capable device has access from the start, in both kinds of pool. The native
   PyTorch backend forwards torch's enablePeerAccess here. Does not call
   cudaDeviceEnablePeerAccess (cudaMalloc memory's peer access is the caller's).
   MEMRES_OK, also for a device and itself; MEMRES_ERROR_CUDA where peer cannot reach
   device's memory or there is no driver; MEMRES_ERROR_INVALID_ARGUMENT for an ordinal
   with no device or of 64 and above. Waits for the maps and unmaps of those pools under
   way, and they wait for it (one cuMemSetAccess a run of mapped memory). */
int memres_enable_peer_access(int device, int peer);

/* From now on, the in-place and cuda_async pools memres makes give access to their own
   device alone, and to a peer once memres_enable_peer_access names it, as PyTorch's
   expandable segments and cudaMallocAsync pools do: the in-place pools' maps and unmaps
   are then cheaper (on two H200s a peer tripled a granule's cuMemSetAccess). For a caller that forwards every need of peer access (the
   native PyTorch backend calls it when installed); pools made before keep their peers.
   MEMRES_PEER_ACCESS=all or =on_demand chooses for the whole process instead. Always
   MEMRES_OK. */
int memres_peer_access_on_demand(void);

/* Bounds what memres's pools on device hold to bytes (below 0: no bound; 0: no growth):
   torch.cuda.set_per_process_memory_fraction. Each device-memory pool of the stack
   (every tier of a fallback(..), the pool under binning) and every tag's pool, those made
   later too, grows no further than bytes, after giving back what it holds free; a request
   past the bound is out of memory. The in-place pools grow by whole granules (2 MiB
   unless the spec says granule=): a bound below one lets them serve nothing. Pinned host pools, arena, cuda_async and plain cuda
   stacks are not bounded. Builds the stack if it does not exist yet. */
int memres_set_limit(int device, int64_t bytes);

/* Starts device's peaks (peak_live_bytes, peak_live_allocations, pool_peak_size) afresh
   from what is live and held now (torch.cuda.reset_peak_memory_stats). */
int memres_reset_peak(int device);

/* Tagged memory and sleep/wake: giving a device's memory back to the driver while its
 * addresses stay reserved, so that every block (and a CUDA graph that recorded its
 * address) is where it was after waking.
 *
 * memres_set_tag makes memres_malloc serve every device from the pool of tag (process-
 * wide, until the next call): a pool that grows in place over its own reservation, made
 * on the tag's first allocation on the device. NULL, "" and "default" go back to the
 * device's own stack. Frees find the pool by address, whatever tag is set then.
 *
 * memres_sleep waits for all work on device, gives back the memory of the pool of tag
 * ("default": the device's own stack, every in-place pool of it, spec virtual_pool, the
 * default, on every tier of a fallback(..); see below for the stacks that cannot; NULL:
 * every pool of the device that can sleep and is awake), MEMRES_SLEEP_DISCARD losing
 * what the blocks hold, MEMRES_SLEEP_OFFLOAD copying it to host memory first (pageable
 * copies, registered as they are copied into, else through pinned staging buffers; on
 * several threads, by default one per 256 MiB up to
 * the cores and 16: MEMRES_OFFLOAD_THREADS; the memory
 * is mapped again on MEMRES_OFFLOAD_MAP_THREADS threads, 1 unless set, and unmapped on
 * as many by a discarding sleep (an offloading sleep unmaps each 256 MiB as soon as it
 * is copied, while the rest is copied, and gives the memory to the device once all is);
 * the copying threads register the copies with the driver as they go, 32 MiB at a time,
 * and the device copies into them directly (what a failed registration left is staged,
 * and registered by a thread of its own once the call returns); a wake copies the
 * registered part back directly, at the bus's speed; MEMRES_OFFLOAD_REGISTER=0 stages
 * everything; the copies ask for transparent huge pages
 * unless the kernel says [never] or MEMRES_OFFLOAD_HUGE_PAGES=0); it returns the bytes
 * given back or a negative code. The driver's cost is per granule (a cuMemUnmap at the
 * sleep, a cuMemCreate and cuMemMap at the wake, about 45 us each on an H100, one at a
 * time): with the default 2 MiB granules 20 GiB take about 0.45 s each way for that
 * alone, with virtual_pool:granule=16MiB 0.04-0.07 s, with granule=32MiB 0.03-0.06 s
 * (BENCHMARKS.md, "Sleep and wake").
 * Until the pool wakes its memory is not mapped: nothing may use it (a kernel that does
 * faults), memres_malloc from it fails with MEMRES_ERROR_ASLEEP, frees are taken. Sleeping
 * a sleeping pool by name, or a tag with no memory, is MEMRES_ERROR_INVALID_ARGUMENT; out
 * of host memory MEMRES_ERROR_OUT_OF_MEMORY; on any failure the pools this call put to
 * sleep wake again. memres_wake maps the memory again at the same addresses (restoring
 * offloaded contents) and returns the bytes mapped: tag by tag for a staged wake (the
 * weights before the KV cache), NULL for every sleeping pool. Waking by name a tag none
 * of whose pools sleeps is MEMRES_ERROR_INVALID_ARGUMENT; a device that cannot back the
 * memory (another process holds it) gives MEMRES_ERROR_OUT_OF_MEMORY and the pool stays
 * asleep, its copies kept, for a later try. */
int memres_set_tag(const char* tag);
int64_t memres_sleep(int device, const char* tag, int mode);
int64_t memres_wake(int device, const char* tag);
/* Makes ahead, for the awake pools of tag on device (NULL: every awake pool that can
   sleep), the host memory a MEMRES_SLEEP_OFFLOAD of what they hold now would make: the
   copies (pageable, their pages backed now, then registered in the background) and,
   with MEMRES_OFFLOAD_REGISTER=0, the pinned staging buffers, less what they keep
   already; the first sleep then only copies. Returns the bytes made; the
   memory stays until memres_trim (counted in pool_host_copy_bytes). A sleeping pool
   named is MEMRES_ERROR_INVALID_ARGUMENT, too little host memory
   MEMRES_ERROR_OUT_OF_MEMORY. */
int64_t memres_prepare_offload(int device, const char* tag);
/* 1 if the pool of tag on device sleeps (for "default", any of the stack's in-place
   pools), 0 if it is awake; MEMRES_ERROR_INVALID_ARGUMENT for a tag with no memory on
   device ("default": the device's own stack).
 *
 * The device's own stack sleeps only where every part of it that holds device memory is
 * an in-place pool: pinned host memory beside them (a pinned or pinned_pool tier, as in
 * fallback(virtual_pool, pinned_pool)) stays as it is, its blocks usable, since it holds
 * no device memory. A stack with binning (its bins would hand out the pool's blocks
 * unmapped) or with any other part holding device memory (pool, arena, fixed_size, cuda,
 * cuda_async, managed: they cannot give it back and keep its addresses) cannot sleep:
 * memres_sleep of "default" is refused with a message naming the part, and NULL skips
 * the stack. Nor can a pool sleep while blocks of it are exported to other processes
 * (memres_ipc_export): refused with a message. */
int memres_is_asleep(int device, const char* tag);

/* Segment pools: whole segments split into blocks best-fit, each segment belonging to the
 * stream it was taken for, with the table of segments and blocks readable and restorable
 * (PyTorch's CUDA graph pools and torch.cuda.MemPool; memres's PyTorch backend builds
 * them from these). 512-byte blocks in 2 MiB-rounded segments; flags:
 * MEMRES_SEGMENTS_NO_SPLIT (each block a segment of its own) and MEMRES_SEGMENTS_MEDIUM
 * (requests of 1 to 10 MiB get 20 MiB segments).
 *
 * memres_segment_pool_new makes a pool on device whose segments come from device's stack
 * (alloc and free NULL; counted as memres_malloc blocks; where the stack's base is an
 * in-place pool, "virtual_pool", a segment of whole granules is taken aligned to its
 * granule, so that the default pool's blocks stay together around it, as torch's private
 * pools' segments never share memory with its default pool's) or from alloc(ctx, size,
 * stream) and back to free(ctx, ptr, size), callable from any thread; NULL on failure.
 * memres_segment_pool_malloc hands out a block of size bytes for stream from the free
 * blocks of stream's segments, or (may_grow != 0) a new segment; NULL on failure (out of
 * memory, size 0). stream stays live while the pool holds a segment taken for it.
 * memres_segment_pool_free frees a block (every use ordered before on its segment's
 * stream); MEMRES_ERROR_INVALID_ARGUMENT, nothing freed, for what is not a live block.
 * memres_segment_pool_record_stream records that work on another stream uses a live
 * block (Tensor.record_stream): its free then holds it until that work is complete, as
 * events recorded at the free say (capturing != 0, a capture underway on the device:
 * recorded by memres_segment_pool_settle after it; a block made in that same capture
 * comes back to later allocations of the capture on its segment's stream once the graph
 * orders its streams' work first). malloc's capturing says the same of the device.
 * memres_segment_pool_settle frees the held blocks whose work is done (MEMRES_SETTLE_POLL,
 * never waiting), waits for all (MEMRES_SETTLE_WAIT) or forgets them unfreed
 * (MEMRES_SETTLE_FORGET: inside a capture, before a restore).
 * memres_segment_pool_blocks writes the table (at most capacity entries; out may be
 * NULL) and returns its length; memres_segment_pool_segment_of writes the first address,
 * size and stream of the segment holding ptr and returns 1, 0 when none does;
 * memres_segment_pool_holding returns the pool (of any device) one of whose segments
 * holds ptr, NULL for none (one load while no pool holds a segment, else a search under
 * a lock; a free of a block of a graph or MemPool pool finds its pool so, with no table
 * of blocks kept beside memres; the pool returned is only valid while the caller keeps
 * it from being destroyed, as the PyTorch backend does by looking it up in its own
 * table under its lock); memres_segment_pool_restore puts such a table back in
 * place (the blocks live before freed), refusing one that names a segment the pool no
 * longer holds or does not tile its segments. memres_segment_pool_release_free gives
 * wholly free segments back, freed on stream (wait for the device first), and returns
 * the bytes; memres_segment_pool_destroy gives every segment back. */
#define MEMRES_SEGMENTS_NO_SPLIT 1
#define MEMRES_SEGMENTS_MEDIUM 2
#define MEMRES_SETTLE_POLL 0
#define MEMRES_SETTLE_WAIT 1
#define MEMRES_SETTLE_FORGET 2
typedef struct memres_segment_pool memres_segment_pool_t;
typedef struct memres_block_t {
  uint64_t segment;      /* the segment's first address */
  uint64_t segment_size; /* its size in bytes */
  uint64_t offset;       /* the block's offset in it */
  uint64_t size;         /* the block's size in bytes */
  void* stream;          /* the stream the segment belongs to */
  int32_t allocated;     /* 1 handed out, 0 free */
  int32_t held;          /* 1: freed, held for other streams' work (allocated stays 1) */
} memres_block_t;
typedef void* (*memres_segment_alloc_fn)(void* ctx, size_t size, void* stream);
typedef void (*memres_segment_free_fn)(void* ctx, void* ptr, size_t size);
memres_segment_pool_t* memres_segment_pool_new(int device, int flags, memres_segment_alloc_fn alloc, memres_segment_free_fn free, void* ctx);
void* memres_segment_pool_malloc(memres_segment_pool_t* pool, size_t size, void* stream, int may_grow, int capturing);
int memres_segment_pool_free(memres_segment_pool_t* pool, void* ptr, int capturing);
int memres_segment_pool_record_stream(memres_segment_pool_t* pool, void* ptr, void* stream);
int memres_segment_pool_settle(memres_segment_pool_t* pool, int how);
int64_t memres_segment_pool_blocks(memres_segment_pool_t* pool, memres_block_t* out, size_t capacity);
int memres_segment_pool_segment_of(memres_segment_pool_t* pool, const void* ptr, uint64_t* base, uint64_t* size, void** stream);
memres_segment_pool_t* memres_segment_pool_holding(const void* ptr);
int memres_segment_pool_restore(memres_segment_pool_t* pool, const memres_block_t* blocks, size_t count);
int64_t memres_segment_pool_release_free(memres_segment_pool_t* pool, void* stream);
void memres_segment_pool_destroy(memres_segment_pool_t* pool);

/* The message of the last failure on this thread, "" if none. */
const char* memres_last_error(void);

/* The scope profiler. Every memres_malloc/memres_free counts towards the open scopes of
 * the calling thread, and towards every open all-threads scope. memres_profile_push opens
 * a scope (all_threads != 0: counting every thread) and returns its id (> 0; a negative
 * failure code otherwise); memres_profile_pop closes it, on the thread that opened it,
 * and adds its figures to the record of its name. */
int64_t memres_profile_push(const char* name, int all_threads);
int memres_profile_pop(int64_t id);

/* Writes the records into buf (at most len bytes, NUL included) and returns the length of
 * the whole text without its NUL (call again with a larger buffer if that is >= len), or a
 * negative failure code. One line per name, highest peak first, tab-separated: name (with
 * backslash, tab and newline escaped as \\, \t, \n), calls, allocations, bytes, peak
 * bytes, retained bytes. */
ssize_t memres_profile_report(char* buf, size_t len);

/* Forgets every record. */
void memres_profile_reset(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMRES_H */
