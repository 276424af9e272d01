//! loom models: the spin lock excludes, the stream map hands every thread the same,
//! fully built list, two streams of one pool share its growth without overlap, memory
//! freed on one stream goes to one other stream at a time, the release threshold gives
//! memory back while another stream allocates, and a free reads an arena's superblock
//! table while another stream takes a superblock; FixedSize's thread caches give their blocks back
//! when their thread exits, also while their owner drops, and when a starving thread
//! reclaims them.

use std::alloc::Layout;

use loom::sync::Arc;
use loom::thread;

use super::core::list_table::ListTable;
use super::core::stream_key::StreamKey;
use super::{Arena, FixedSize, Pool, PoolConfig, VirtualPoolConfig};
use crate::resource::Resource;
use crate::stream::StreamRef;
use crate::sync::spin::SpinLock;
use crate::upstream::HostHeap;

#[test]
fn loom_spin_lock_excludes() {
    loom::model(|| {
        let lock = Arc::new(SpinLock::new(0u32));
        let other = Arc::clone(&lock);
        let t = thread::spawn(move || {
            let mut v = other.lock();
            *v += 1;
        });
        {
            let mut v = lock.lock();
            *v += 1;
        }
        t.join().unwrap();
        assert_eq!(*lock.lock(), 2);
    });
}

#[test]
fn loom_list_table_hands_out_one_built_list_per_stream() {
    loom::model(|| {
        let map = Arc::new(ListTable::<Vec<u32>>::default());
        let key = StreamKey::host(7);
        let other = Arc::clone(&map);
        let t = thread::spawn(move || {
            let list = other.get_or_insert_with(key, || vec![1]);
            list.state.lock().push(2);
            list as *const _ as usize
        });
        // A reader racing the insertion sees no list or a whole one.
        if let Some(list) = map.get(key) {
            assert_eq!(list.state.lock()[0], 1);
        }
        let mine = map.get_or_insert_with(key, || vec![1]) as *const _ as usize;
        assert_eq!(t.join().unwrap(), mine);
        let list = map.get(key).unwrap();
        let items = list.state.lock().clone();
        assert_eq!(items[0], 1);
        assert!(items.contains(&2));
        assert_eq!(map.all().len(), 1);
    });
}

/// The table doubles while another thread inserts and a third looks up: every list is
/// found by every thread, once, fully built, and the map ends with all of them.
#[test]
fn loom_list_table_grows_while_others_insert_and_look_up() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let map = Arc::new(ListTable::<u32>::default());
        // A table of two slots holds one list; the second insertion doubles it.
        let first = map.get_or_insert_with(StreamKey::host(1), || 1) as *const _ as usize;
        let (m1, m2) = (Arc::clone(&map), Arc::clone(&map));
        let inserter = thread::spawn(move || {
            let s = m1.get_or_insert_with(StreamKey::host(2), || 2);
            assert_eq!(*s.state.lock(), 2);
            s as *const _ as usize
        });
        let reader = thread::spawn(move || {
            // Found in the old table or the new one, never a second list.
            let s = m2.get(StreamKey::host(1)).expect("an inserted list");
            assert_eq!(*s.state.lock(), 1);
            let again = m2.get_or_insert_with(StreamKey::host(1), || 9);
            assert!(std::ptr::eq(s, again));
            if let Some(s) = m2.get(StreamKey::host(2)) {
                assert_eq!(*s.state.lock(), 2, "seen only fully built");
            }
            s as *const _ as usize
        });
        let mine = map.get_or_insert_with(StreamKey::host(3), || 3) as *const _ as usize;
        let second = inserter.join().unwrap();
        assert_eq!(reader.join().unwrap(), first);
        assert_eq!(map.len(), 3);
        assert_eq!(map.all().len(), 3);
        for (k, p) in [(1, first), (2, second), (3, mine)] {
            assert_eq!(map.get(StreamKey::host(k)).unwrap() as *const _ as usize, p);
        }
    });
}

/// A table's slots pair each key with its own list: a lookup racing an insertion, and
/// the growth that insertion makes, never finds a list under another stream's key. The
/// key looked up for nothing is the CUDA default stream's (lane 0), zero, what an
/// unwritten slot key reads as: it fails if a slot's pointer is published before its
/// key, or if a growth moves a pointer without its key.
#[test]
fn loom_list_table_slots_pair_each_key_with_its_own_list() {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let map = Arc::new(ListTable::<u32>::default());
        let none = StreamKey::of(StreamRef::DEFAULT);
        // Where the default stream's probe starts, in tables of two and four slots.
        let first = StreamKey::host(6);
        assert_eq!((first.slot(1), first.slot(3), none.slot(3)), (0, 0, 0));
        // A table of two slots holds one list; the second insertion doubles it.
        map.get_or_insert_with(first, || 1);
        let (m1, m2) = (Arc::clone(&map), Arc::clone(&map));
        let inserter =
            thread::spawn(move || *m1.get_or_insert_with(StreamKey::host(1), || 2).state.lock());
        let reader = thread::spawn(move || {
            assert!(
                m2.find(none).is_none(),
                "a list under the default stream's key"
            );
            let list = m2.find(first).expect("the first list, in either table");
            assert_eq!(*list.state.lock(), 1);
            if let Some(list) = m2.find(StreamKey::host(1)) {
                assert_eq!(*list.state.lock(), 2);
            }
        });
        assert_eq!(inserter.join().unwrap(), 2);
        reader.join().unwrap();
        assert!(map.find(none).is_none());
        assert_eq!(*map.find(StreamKey::host(1)).unwrap().state.lock(), 2);
    });
}

/// The bounds of the models over whole pools and arenas: two preemptions, and room for
/// the branches their slow paths take.
fn pools_model() -> loom::model::Builder {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.max_branches = 100_000;
    builder
}

#[test]
fn loom_two_streams_grow_one_pool_without_overlap() {
    pools_model().check(|| {
        let pool = Arc::new(Pool::new(HostHeap::new(), PoolConfig::new()).unwrap());
        // 1.5 MiB: each chunk is 2 MiB, so neither request fits what the other's growth
        // leaves over, and both streams grow.
        let n = 3 << 19;
        let l = Layout::from_size_align(n, 256).unwrap();
        let other = Arc::clone(&pool);
        let t = thread::spawn(move || {
            let s = StreamRef::host(1);
            let p = other.allocate(s, l).unwrap();
            (p.as_ptr() as usize, s)
        });
        let s = StreamRef::host(2);
        let mine = pool.allocate(s, l).unwrap();
        let (theirs, their_stream) = t.join().unwrap();
        let (a, b) = (mine.as_ptr() as usize, theirs);
        assert!(a + n <= b || b + n <= a, "blocks overlap: {a:#x} {b:#x}");
        let stats = pool.stats();
        assert_eq!(stats.upstream_allocations, 2, "{stats:?}");
        assert_eq!(stats.free_bytes + 2 * n, stats.pool_size);
        // SAFETY: both came from `pool` with `l`; host streams are always done.
        unsafe {
            pool.deallocate(s, mine, l);
            pool.deallocate(their_stream, crate::suballoc::chunks::to_ptr(theirs), l);
        }
        pool.coalesce().unwrap();
        let stats = pool.stats();
        assert_eq!(stats.free_bytes, stats.pool_size);
        assert_eq!(stats.free_blocks, stats.upstream_allocations);
    });
}

#[test]
fn loom_two_streams_take_superblocks_of_one_arena_without_overlap() {
    pools_model().check(|| {
        let arena = Arc::new(Arena::with_size(HostHeap::new(), 2 << 20).unwrap());
        let l = Layout::from_size_align(1000, 256).unwrap();
        let other = Arc::clone(&arena);
        let t = thread::spawn(move || {
            let p = other.allocate(StreamRef::host(1), l).unwrap();
            p.as_ptr() as usize
        });
        let mine = arena.allocate(StreamRef::host(2), l).unwrap();
        let theirs = t.join().unwrap();
        let a = mine.as_ptr() as usize;
        assert!(a + 1024 <= theirs || theirs + 1024 <= a, "blocks overlap");
        assert_eq!(arena.superblocks(), 2);
        assert_eq!(arena.free_bytes(), (2 << 20) - 2048);
        // SAFETY: both came from `arena` with `l`; host streams are always done.
        unsafe {
            arena.deallocate(StreamRef::host(2), mine, l);
            arena.deallocate(
                StreamRef::host(1),
                crate::suballoc::chunks::to_ptr(theirs),
                l,
            );
        }
        assert_eq!(arena.free_bytes(), 2 << 20);
        super::thread_cache::exit_thread();
    });
}

/// A list marked idle (`List::idle`: its superblock taken back by another stream's
/// request) while its own stream allocates and frees: each request either finds the one
/// superblock free (on its list, or taken back from the idle one) or, while the other
/// stream holds a block of it, runs out; no block is handed out twice, none is lost, and
/// the list's hint never keeps its stream from the superblock once it is free. (One
/// superblock: the order in which `take_idle_superblocks` visits several depends on their
/// addresses, which change between the model's runs.)
#[test]
fn loom_an_idle_list_races_its_own_streams_allocation() {
    pools_model().check(|| {
        const MIB: usize = 1 << 20;
        let arena = Arc::new(
            Arena::with_size(HostHeap::new(), MIB)
                .unwrap()
                .thread_caches(false),
        );
        let l = Layout::from_size_align(1000, 256).unwrap();
        // Stream 1 holds the one superblock, idle.
        let p = arena.allocate(StreamRef::host(1), l).unwrap();
        // SAFETY: from the arena with `l`; host streams are always done.
        unsafe { arena.deallocate(StreamRef::host(1), p, l) };
        // A block held with a stamp across a scheduling point, checked before its free.
        let pair = move |arena: &Arena<HostHeap>, stream: u32| {
            let s = StreamRef::host(stream);
            let Ok(p) = arena.allocate(s, l) else {
                return false; // the other stream holds a block of the superblock
            };
            // SAFETY: the block holds 1000 bytes; ours until the free below.
            unsafe { p.as_ptr().cast::<u32>().write(stream) };
            thread::yield_now();
            // SAFETY: as above.
            assert_eq!(unsafe { p.as_ptr().cast::<u32>().read() }, stream);
            // SAFETY: from the arena with `l`; host streams are always done.
            unsafe { arena.deallocate(s, p, l) };
            true
        };
        let other = Arc::clone(&arena);
        let t = thread::spawn(move || pair(&other, 3));
        let mine = pair(&arena, 1);
        let theirs = t.join().unwrap();
        assert!(mine || theirs, "one of the two got the superblock");
        assert_eq!(arena.free_bytes(), MIB);
        // The superblock comes back whole: stream 1 (its list maybe marked idle) gets a
        // block, and the arena serves its whole size once that is freed.
        assert!(pair(&arena, 1));
        let all = Layout::from_size_align(MIB, 256).unwrap();
        let p = arena.allocate(StreamRef::host(4), all).unwrap();
        // SAFETY: from the arena with `all`.
        unsafe { arena.deallocate(StreamRef::host(4), p, all) };
    });
}

/// The arena's superblock table is read without a lock, one word per MiB. A block that
/// lies in the same MiB as the start of another stream's superblock, but is not a
/// superblock's start, is freed on a third stream while that superblock is taken (its
/// word written under the global lock): the free must not take the block for a
/// superblock's start, or it would not merge with its neighbour, its superblock would
/// never be whole again, and the arena could not be taken whole at the end.
#[test]
fn loom_a_free_reads_the_superblock_table_while_a_superblock_is_taken() {
    pools_model().check(|| {
        const MIB: usize = 1 << 20;
        let arena = Arc::new(Arena::with_size(HostHeap::new(), 3 * MIB).unwrap());
        let l = |size| Layout::from_size_align(size, 256).unwrap();
        let one = StreamRef::host(1);
        // Superblock S1 = [base, base + 1 MiB + T), kept by stream 1, then cut in two:
        // 1 MiB at its start, T bytes in the next MiB (T above the thread caches' sizes,
        // so that its free reaches the list and reads the table).
        const T: usize = (64 << 10) + 256;
        let whole = arena.allocate(one, l(MIB + T)).unwrap();
        // SAFETY: from the arena with this layout; host streams are always done.
        unsafe { arena.deallocate(one, whole, l(MIB + T)) };
        let head = arena.allocate(one, l(MIB)).unwrap();
        let tail = arena.allocate(one, l(T)).unwrap();
        assert_eq!(tail.as_ptr() as usize, whole.as_ptr() as usize + MIB);
        let other = Arc::clone(&arena);
        let t = thread::spawn(move || {
            // S2 starts right after S1, in the MiB that holds `tail`.
            let s = StreamRef::host(3);
            let p = other.allocate(s, l(MIB)).unwrap();
            // SAFETY: from the arena with this layout; host streams are always done.
            unsafe { other.deallocate(s, p, l(MIB)) };
        });
        let two = StreamRef::host(2);
        // SAFETY: from the arena with these layouts; host streams are always done.
        unsafe {
            arena.deallocate(two, tail, l(T));
            arena.deallocate(two, head, l(MIB));
        }
        t.join().unwrap();
        assert_eq!(arena.free_bytes(), 3 * MIB);
        let all = arena.allocate(StreamRef::host(4), l(3 * MIB)).unwrap();
        // SAFETY: from the arena with this layout.
        unsafe { arena.deallocate(StreamRef::host(4), all, l(3 * MIB)) };
    });
}

/// Cross-stream hand-off: a pool that cannot grow (its maximum is one block) holds one
/// block, freed on another stream than the one it was taken on while a third stream
/// asks for memory. Whoever gets the block, no two threads ever hold it at once, and at
/// the end every byte is free again.
#[test]
fn loom_memory_freed_on_one_stream_is_taken_by_another_once() {
    pools_model().check(|| {
        let config = PoolConfig::new().initial_size(1024).maximum_size(1024);
        let pool = Arc::new(Pool::new(HostHeap::new(), config).unwrap());
        let l = Layout::from_size_align(1024, 256).unwrap();
        let block = pool.allocate(StreamRef::host(1), l).unwrap();
        let addr = block.as_ptr() as usize;
        let held = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
        let (other, other_held) = (Arc::clone(&pool), Arc::clone(&held));
        let t = thread::spawn(move || {
            let s = StreamRef::host(2);
            // SAFETY: from the pool with `l`; host streams are always done.
            unsafe { other.deallocate(s, crate::suballoc::chunks::to_ptr(addr), l) };
            let got = other.allocate(s, l).ok();
            if got.is_some() {
                assert_eq!(
                    other_held.fetch_add(1, loom::sync::atomic::Ordering::SeqCst),
                    0
                );
                other_held.fetch_sub(1, loom::sync::atomic::Ordering::SeqCst);
            }
            // (The free above went to this thread's cache, unless the main thread's
            // reclaim took it.)
            super::thread_cache::exit_thread();
            got.map(|got| (got.as_ptr() as usize, s))
        });
        let s = StreamRef::host(3);
        let mine = pool.allocate(s, l).ok();
        if mine.is_some() {
            assert_eq!(held.fetch_add(1, loom::sync::atomic::Ordering::SeqCst), 0);
            held.fetch_sub(1, loom::sync::atomic::Ordering::SeqCst);
        }
        let theirs = t.join().unwrap();
        assert!(mine.is_none() || theirs.is_none(), "one block, held twice");
        for (p, stream) in [
            mine.map(|p| (p, s)),
            theirs.map(|(a, s)| (crate::suballoc::chunks::to_ptr(a), s)),
        ]
        .into_iter()
        .flatten()
        {
            assert_eq!(p.as_ptr() as usize, addr, "the pool's only block");
            // SAFETY: from the pool with `l`; host streams are always done.
            unsafe { pool.deallocate(stream, p, l) };
        }
        let stats = pool.stats();
        assert_eq!(stats.pool_size, 1024);
        assert_eq!(stats.free_bytes, stats.pool_size);
        super::thread_cache::exit_thread();
    });
}

/// The release threshold: two streams allocate and free at once in a pool that keeps no
/// free memory, while one also reads the pool's figures (which takes the growth lock); a
/// free that finds the growth lock busy leaves the release to whoever holds it, which
/// runs it on unlock. Once both frees are done the pool holds nothing.
#[test]
fn loom_release_threshold_gives_back_while_another_stream_allocates() {
    pools_model().check(|| {
        let config = PoolConfig::new().release_threshold(0);
        let pool = Arc::new(Pool::new(HostHeap::new(), config).unwrap());
        let l = Layout::from_size_align(1000, 256).unwrap();
        let other = Arc::clone(&pool);
        let t = thread::spawn(move || {
            let s = StreamRef::host(1);
            let p = other.allocate(s, l).unwrap();
            // SAFETY: from the pool with `l`; host streams are always done.
            unsafe { other.deallocate(s, p, l) };
        });
        let s = StreamRef::host(2);
        let mine = pool.allocate(s, l).unwrap();
        let stats = pool.stats();
        assert!(stats.pool_size >= 1024 + stats.free_bytes, "{stats:?}");
        // SAFETY: from the pool with `l`; host streams are always done.
        unsafe { pool.deallocate(s, mine, l) };
        t.join().unwrap();
        assert_eq!(pool.stats().pool_size, 0, "a release was left behind");
    });
}

/// 256-byte blocks, 8 to a chunk: thread caches of 64 blocks (on).
fn cached_fixed() -> FixedSize<HostHeap> {
    FixedSize::with_block_size(HostHeap::new(), 256, 8).unwrap()
}

/// Allocates `n` blocks on the host stream and frees them all (into the calling thread's
/// cache).
fn churn(fixed: &FixedSize<HostHeap>, n: usize) {
    let l = Layout::from_size_align(256, 256).unwrap();
    let blocks: Vec<_> = (0..n)
        .map(|_| fixed.allocate(StreamRef::HOST, l).unwrap())
        .collect();
    for p in blocks {
        // SAFETY: allocated above on the host stream with `l`.
        unsafe { fixed.deallocate(StreamRef::HOST, p, l) };
    }
}

/// A thread's cache holds blocks of a FixedSize when the thread exits while the last
/// owner of the FixedSize drops it: the exiting thread gives the blocks back only while
/// the resource is registered (under the registry's lock), the resource leaves the
/// registry before freeing, and everything is freed once (loom checks the locks, the
/// lists' atomics and that nothing leaks).
#[test]
fn loom_a_thread_cache_exits_while_its_owner_drops() {
    loom::model(|| {
        let fixed = Arc::new(cached_fixed());
        let other = Arc::clone(&fixed);
        let t = thread::spawn(move || {
            churn(&other, 2);
            drop(other);
            // What the thread's exit does (see `exit_thread`).
            super::thread_cache::exit_thread();
        });
        drop(fixed);
        t.join().unwrap();
    });
}

/// The blocks an exited thread had cached are free for everyone afterwards: the thread
/// takes the whole first chunk into its cache (a refill takes up to half a cache), exits
/// while another thread counts the free blocks, and once it is joined the main thread
/// gets all 8 blocks without the resource growing.
#[test]
fn loom_an_exited_threads_cached_blocks_come_back() {
    loom::model(|| {
        let fixed = Arc::new(cached_fixed());
        let (a, b) = (Arc::clone(&fixed), Arc::clone(&fixed));
        let cacher = thread::spawn(move || {
            churn(&a, 3);
            super::thread_cache::exit_thread();
        });
        let counter = thread::spawn(move || b.free_blocks());
        cacher.join().unwrap();
        assert!(counter.join().unwrap() <= 8);
        let l = Layout::from_size_align(256, 256).unwrap();
        let blocks: Vec<_> = (0..8)
            .map(|_| fixed.allocate(StreamRef::HOST, l).unwrap())
            .collect();
        assert_eq!(
            fixed.upstream_allocations(),
            1,
            "no growth: all 8 came back"
        );
        for p in blocks {
            // SAFETY: allocated above on the host stream with `l`.
            unsafe { fixed.deallocate(StreamRef::HOST, p, l) };
        }
        super::thread_cache::exit_thread();
    });
}

/// A thread that finds no free block while another thread caches every block of the
/// resource starts a reclaim, which takes the caching thread's blocks, maybe while that
/// thread is using its cache (the flags and fences of `thread_cache`; loom checks the
/// cache's cell is never used by both); the caching thread keeps none while the caches
/// are off. Whatever the interleaving, no block is held
/// by both threads at once, every failure is `OutOfMemory`, and once both are done every
/// block is free in a list without the resource growing.
#[test]
fn loom_a_reclaim_takes_blocks_back_from_a_busy_threads_cache() {
    loom::model(|| {
        let fixed = busy_cache_scenario(Arc::new(two_block_fixed()), |f| {
            assert_eq!(f.upstream_allocations(), 1, "not grown");
        });
        assert_eq!(fixed.magazines(), 0, "every magazine counted out once");
    });
}

/// A `FixedSize` of 256-byte blocks with one chunk of two and no room for another (its
/// thread caches on).
fn two_block_fixed() -> FixedSize<crate::adaptor::Limiting<HostHeap>> {
    let upstream = crate::adaptor::Limiting::new(HostHeap::new(), 512);
    FixedSize::with_block_size(upstream, 256, 2).unwrap()
}

/// The busy cache's scenario over `r` (two 256-byte blocks and no room for more): a
/// thread takes both blocks, frees them into its cache and calls once more, while this
/// thread takes one and frees it, each allocation checking that no other thread holds
/// its block and that a failure is `OutOfMemory`. Once both are done this thread takes
/// both blocks (`not_grown` then checks that `r` did not grow), frees them and leaves;
/// returns `r`.
fn busy_cache_scenario<R: Resource + Send + Sync + 'static>(
    r: Arc<R>,
    not_grown: impl Fn(&R),
) -> Arc<R> {
    use crate::error::Error;
    use loom::sync::Mutex;
    use std::collections::HashSet;

    type Held = Mutex<HashSet<usize>>;
    let l = Layout::from_size_align(256, 256).unwrap();
    let take = move |r: &R, held: &Held| match r.allocate(StreamRef::HOST, l) {
        Ok(p) => {
            assert!(
                held.lock().unwrap().insert(p.as_ptr() as usize),
                "held twice"
            );
            Some(p)
        }
        Err(Error::OutOfMemory { .. }) => None,
        Err(e) => panic!("{e:?}"),
    };
    let give = move |r: &R, held: &Held, p: std::ptr::NonNull<u8>| {
        held.lock().unwrap().remove(&(p.as_ptr() as usize));
        // SAFETY: from `r` with `l` on the host stream, not used afterwards.
        unsafe { r.deallocate(StreamRef::HOST, p, l) };
    };
    let held = Arc::new(Mutex::new(HashSet::new()));
    let (other, other_held) = (Arc::clone(&r), Arc::clone(&held));
    let cacher = thread::spawn(move || {
        let got: Vec<_> = (0..2).filter_map(|_| take(&other, &other_held)).collect();
        for p in got {
            give(&other, &other_held, p);
        }
        // Its next call.
        if let Some(p) = take(&other, &other_held) {
            give(&other, &other_held, p);
        }
        super::thread_cache::exit_thread();
    });
    if let Some(p) = take(&r, &held) {
        give(&r, &held, p);
    }
    cacher.join().unwrap();
    let both: Vec<_> = (0..2).filter_map(|_| take(&r, &held)).collect();
    assert_eq!(both.len(), 2, "every block free once both threads are done");
    not_grown(&r);
    for p in both {
        give(&r, &held, p);
    }
    super::thread_cache::exit_thread();
    r
}

/// A thread caches both blocks of the resource and then makes no further call while
/// another thread needs them: the reclaim takes them out of its cache (the `busy` /
/// `taken` flags and the two fences of `thread_cache`), so both allocations succeed
/// without the resource growing, and the idle thread's exit gives back nothing twice.
#[test]
fn loom_a_reclaim_takes_blocks_from_an_idle_threads_cache() {
    loom::model(|| {
        let fixed = idle_cache_scenario(Arc::new(two_block_fixed()), |f| {
            assert_eq!(f.upstream_allocations(), 1, "taken, not grown");
        });
        assert_eq!(fixed.magazines(), 0, "every magazine counted out once");
        assert_eq!(fixed.free_blocks(), 2, "each block free once");
    });
}

/// A thread that ran its work over a resource (freeing blocks into its caches) and now
/// waits, making no call, until [`exit`](Self::exit) lets it leave (its caches go then).
struct IdleThread {
    done: Arc<loom::sync::atomic::AtomicBool>,
    thread: thread::JoinHandle<()>,
}

impl IdleThread {
    /// Starts the thread on `work` over `r`; returns once the work is done.
    fn after<R: Send + Sync + 'static>(
        r: &Arc<R>,
        work: impl FnOnce(&R) + Send + 'static,
    ) -> IdleThread {
        use loom::sync::atomic::{AtomicBool, Ordering};
        let worked = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let (r, worked2, done2) = (Arc::clone(r), Arc::clone(&worked), Arc::clone(&done));
        let thread = thread::spawn(move || {
            work(&r);
            worked2.store(true, Ordering::Release);
            while !done2.load(Ordering::Acquire) {
                loom::thread::yield_now();
            }
            super::thread_cache::exit_thread();
        });
        while !worked.load(Ordering::Acquire) {
            loom::thread::yield_now();
        }
        IdleThread { done, thread }
    }

    /// Lets the thread leave, and waits until it has.
    fn exit(self) {
        self.done.store(true, loom::sync::atomic::Ordering::Release);
        self.thread.join().unwrap();
    }
}

/// The idle cache's scenario over `r` (two 256-byte blocks and no room for more): a
/// thread takes both blocks, frees them into its cache and waits, making no call, while
/// this thread takes both (the reclaim must take them from the idle cache; `not_grown`
/// checks that `r` did not grow instead); then this thread frees them, the idle thread
/// exits, and this one leaves; returns `r`.
fn idle_cache_scenario<R: Resource + Send + Sync + 'static>(
    r: Arc<R>,
    not_grown: impl Fn(&R),
) -> Arc<R> {
    let l = Layout::from_size_align(256, 256).unwrap();
    let idle = IdleThread::after(&r, move |other| {
        let a = other.allocate(StreamRef::HOST, l).unwrap();
        let b = other.allocate(StreamRef::HOST, l).unwrap();
        // SAFETY: from `other` with `l` on the host stream, not used afterwards.
        unsafe {
            other.deallocate(StreamRef::HOST, a, l);
            other.deallocate(StreamRef::HOST, b, l);
        }
    });
    let a = r
        .allocate(StreamRef::HOST, l)
        .expect("taken from the idle cache");
    let b = r
        .allocate(StreamRef::HOST, l)
        .expect("taken from the idle cache");
    assert_ne!(a, b);
    not_grown(&r);
    idle.exit();
    // SAFETY: from `r` with `l` on the host stream, not used afterwards.
    unsafe {
        r.deallocate(StreamRef::HOST, a, l);
        r.deallocate(StreamRef::HOST, b, l);
    }
    super::thread_cache::exit_thread();
    r
}

/// The trim scenario over `r`: a thread allocates and frees a block of layout `l` twice
/// on host stream 7, through its cache (whose magazine keeps the stream's list across
/// calls), while this thread trims `r` (`trim`); once that thread has exited, `r` is
/// trimmed again and the stream's list must be gone (`has_list`), freed only once no
/// magazine can touch it (loom checks every access).
fn trim_scenario<R: Resource + Send + Sync + 'static>(
    r: &Arc<R>,
    l: Layout,
    trim: impl Fn(&R),
    has_list: impl Fn(&R, StreamRef<'_>) -> bool,
) {
    let other = Arc::clone(r);
    let user = thread::spawn(move || {
        let s = StreamRef::host(7);
        for _ in 0..2 {
            let a = other.allocate(s, l).unwrap();
            // SAFETY: from `other` with `l` on `s`, not used afterwards.
            unsafe { other.deallocate(s, a, l) };
        }
        super::thread_cache::exit_thread();
    });
    trim(r);
    user.join().unwrap();
    trim(r);
    assert!(
        !has_list(r, StreamRef::host(7)),
        "the stream's list is freed"
    );
}

/// An arena of one superblock: a thread frees a small block into its cache (splitting
/// the superblock, its stream's) and then makes no further call while another thread,
/// on another stream, asks for the whole superblock. The out-of-memory path reclaims
/// the block from the idle cache (the `busy` / `taken` flags and the two fences of
/// `thread_cache`), the superblock is whole again and serves the request, and the idle
/// thread's exit gives back nothing twice: at the end the arena is whole.
#[test]
fn loom_a_reclaim_takes_an_arenas_blocks_from_an_idle_threads_cache() {
    const MIB: usize = 1 << 20;
    let small = Layout::from_size_align(4096, 256).unwrap();
    let whole = Layout::from_size_align(MIB, 256).unwrap();
    pools_model().check(move || {
        let arena = Arc::new(Arena::with_size(HostHeap::new(), MIB).unwrap());
        let idle = IdleThread::after(&arena, move |other| {
            let p = other.allocate(StreamRef::HOST, small).unwrap();
            // SAFETY: from `other` with `small` on the host stream, not used afterwards.
            unsafe { other.deallocate(StreamRef::HOST, p, small) };
        });
        let two = StreamRef::host(2);
        let p = arena
            .allocate(two, whole)
            .expect("taken from the idle cache");
        idle.exit();
        // SAFETY: from `arena` with `whole` on `two`, not used afterwards.
        unsafe { arena.deallocate(two, p, whole) };
        assert_eq!(arena.magazines(), 0, "every magazine counted out once");
        assert_eq!(arena.free_bytes(), MIB, "every byte free once");
        super::thread_cache::exit_thread();
    });
}

/// An arena of one superblock while a thread allocates and frees small blocks through
/// its cache, calling throughout (so a reclaim may take its blocks while it uses its
/// cache), and another thread asks for the whole superblock: whatever the interleaving,
/// no byte is held by both threads at once, every failure is `OutOfMemory`, and once
/// both are done the whole superblock serves a request.
#[test]
fn loom_a_reclaim_takes_an_arenas_blocks_from_a_busy_threads_cache() {
    use crate::error::Error;
    use loom::sync::Mutex;
    const MIB: usize = 1 << 20;
    type Held = Mutex<Vec<(usize, usize)>>;
    let small = Layout::from_size_align(4096, 256).unwrap();
    let whole = Layout::from_size_align(MIB, 256).unwrap();
    let take =
        |a: &Arena<HostHeap>, held: &Held, s: StreamRef<'_>, l: Layout| match a.allocate(s, l) {
            Ok(p) => {
                let (lo, hi) = (p.as_ptr() as usize, p.as_ptr() as usize + l.size());
                let mut held = held.lock().unwrap();
                assert!(held.iter().all(|&(a, b)| hi <= a || b <= lo), "held twice");
                held.push((lo, hi));
                Some(p)
            }
            Err(Error::OutOfMemory { .. }) => None,
            Err(e) => panic!("{e:?}"),
        };
    let give = |a: &Arena<HostHeap>, held: &Held, s: StreamRef<'_>, p: std::ptr::NonNull<u8>, l| {
        held.lock()
            .unwrap()
            .retain(|&(lo, _)| lo != p.as_ptr() as usize);
        // SAFETY: from `a` with `l` on `s`, not used afterwards.
        unsafe { a.deallocate(s, p, l) };
    };
    pools_model().check(move || {
        let arena = Arc::new(Arena::with_size(HostHeap::new(), MIB).unwrap());
        let held: Arc<Held> = Arc::new(Mutex::new(Vec::new()));
        let (other, other_held) = (Arc::clone(&arena), Arc::clone(&held));
        let busy = thread::spawn(move || {
            for _ in 0..2 {
                if let Some(p) = take(&other, &other_held, StreamRef::HOST, small) {
                    give(&other, &other_held, StreamRef::HOST, p, small);
                }
            }
            super::thread_cache::exit_thread();
        });
        let two = StreamRef::host(2);
        if let Some(p) = take(&arena, &held, two, whole) {
            give(&arena, &held, two, p, whole);
        }
        busy.join().unwrap();
        let p = take(&arena, &held, two, whole).expect("the whole superblock once both are done");
        give(&arena, &held, two, p, whole);
        super::thread_cache::exit_thread();
    });
}

/// `Arena::trim` while another thread uses a stream's list through its thread cache (a
/// magazine keeps the list across calls): the list is freed only once no magazine can
/// touch it, and no block is lost or handed out twice (the superblock comes back whole).
#[test]
fn loom_a_trim_frees_a_list_an_arenas_thread_cache_was_using() {
    const MIB: usize = 1 << 20;
    let small = Layout::from_size_align(4096, 256).unwrap();
    pools_model().check(move || {
        let arena = Arc::new(Arena::with_size(HostHeap::new(), MIB).unwrap());
        trim_scenario(&arena, small, |a| a.trim().unwrap(), Arena::has_list);
        assert_eq!(arena.superblocks(), 0, "the superblock is whole again");
        assert_eq!(arena.free_bytes(), MIB);
        super::thread_cache::exit_thread();
    });
}

/// A thread's cache holds an arena's block when the thread exits while the last owner
/// of the arena drops it: the exiting thread gives it back only while the arena is
/// registered, the arena leaves the registry before freeing, and everything is freed
/// once.
#[test]
fn loom_an_arenas_thread_cache_exits_while_its_owner_drops() {
    let small = Layout::from_size_align(4096, 256).unwrap();
    pools_model().check(move || {
        let arena = Arena::with_size(HostHeap::new(), 1 << 20).unwrap();
        exit_while_dropping(Arc::new(arena), small);
    });
}

/// A thread frees a block of layout `l` into its cache and exits while this thread drops
/// the last other owner of `r`.
fn exit_while_dropping<R: Resource + Send + Sync + 'static>(r: Arc<R>, l: Layout) {
    let other = Arc::clone(&r);
    let t = thread::spawn(move || {
        let a = other.allocate(StreamRef::HOST, l).unwrap();
        // SAFETY: from `other` with `l` on the host stream, not used afterwards.
        unsafe { other.deallocate(StreamRef::HOST, a, l) };
        drop(other);
        super::thread_cache::exit_thread();
    });
    drop(r);
    t.join().unwrap();
}

/// A `Pool` that cannot grow past two 256-byte blocks (its thread caches on).
fn two_block_pool() -> Pool<HostHeap> {
    let config = PoolConfig::new().initial_size(512).maximum_size(512);
    Pool::new(HostHeap::new(), config).unwrap()
}

/// The pool's thread caches (`thread_cache`'s `SmallBlocks`): a thread frees both blocks
/// of a pool that cannot grow into its cache and then makes no further call while
/// another thread needs them. The other thread's out-of-memory path reclaims them (the
/// `busy` / `taken` flags and the two fences), so both allocations succeed without the
/// pool growing, no block is handed out twice, and the idle thread's exit gives back
/// nothing twice: at the end both blocks are free once.
#[test]
fn loom_a_reclaim_takes_a_pools_blocks_from_an_idle_threads_cache() {
    pools_model().check(|| {
        let pool = idle_cache_scenario(Arc::new(two_block_pool()), |p| {
            assert_eq!(p.pool_size(), 512, "taken, not grown");
        });
        assert_eq!(pool.stats().free_bytes, 512, "each block free once");
    });
}

/// A thread caches a pool's blocks while another thread also needs them, the caching
/// thread making calls throughout (so a reclaim may take its blocks while it uses its
/// cache): whatever the interleaving, no block is held by both threads at once, every
/// failure is `OutOfMemory`, and once both are done both blocks are free without the
/// pool growing.
#[test]
fn loom_a_reclaim_takes_a_pools_blocks_from_a_busy_threads_cache() {
    pools_model().check(|| {
        busy_cache_scenario(Arc::new(two_block_pool()), |p| {
            assert_eq!(p.pool_size(), 512, "not grown");
        });
    });
}

/// `Pool::trim` while another thread uses a stream's list through its thread cache (a
/// magazine keeps the list across calls): the list is freed only once no magazine can
/// touch it, and no block is lost or handed out twice (both blocks come back and serve
/// the main thread without the pool growing).
#[test]
fn loom_a_trim_frees_a_list_a_pools_thread_cache_was_using() {
    let l = Layout::from_size_align(256, 256).unwrap();
    pools_model().check(move || {
        let pool = Arc::new(two_block_pool());
        // (A trim may give the pool's one chunk back when it finds it whole: the pool
        // then grows again, up to its maximum.)
        trim_scenario(&pool, l, |p| _ = p.trim().unwrap(), Pool::has_list);
        let a = pool.allocate(StreamRef::HOST, l).unwrap();
        let b = pool.allocate(StreamRef::HOST, l).unwrap();
        assert_ne!(a, b);
        assert!(pool.pool_size() <= 512, "not grown past its maximum");
        // SAFETY: from `pool` with `l` on the host stream, not used afterwards.
        unsafe {
            pool.deallocate(StreamRef::HOST, a, l);
            pool.deallocate(StreamRef::HOST, b, l);
        }
        super::thread_cache::exit_thread();
    });
}

/// A thread's cache holds a pool's blocks when the thread exits while the last owner of
/// the pool drops it: the exiting thread gives them back only while the pool is
/// registered, the pool leaves the registry before freeing, and everything is freed once.
#[test]
fn loom_a_pools_thread_cache_exits_while_its_owner_drops() {
    let l = Layout::from_size_align(256, 256).unwrap();
    pools_model().check(move || exit_while_dropping(Arc::new(two_block_pool()), l));
}

/// Records what is freed through it (for the held-blocks model).
#[derive(Default)]
struct FreedLog(loom::sync::Mutex<Vec<usize>>);

impl PartialEq for FreedLog {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

// SAFETY: hands out nothing; it only records frees (the model never allocates from it).
unsafe impl crate::resource::SyncResource for FreedLog {
    type Properties = crate::property::HostAccessible;
    fn allocate_sync(&self, _: Layout) -> Result<std::ptr::NonNull<u8>, crate::Error> {
        Err(crate::Error::invalid_argument("the model only frees"))
    }
    unsafe fn deallocate_sync(&self, ptr: std::ptr::NonNull<u8>, _: Layout) {
        self.0.lock().unwrap().push(ptr.as_ptr() as usize);
    }
}

// SAFETY: as above.
unsafe impl Resource for FreedLog {
    fn allocate(&self, _: StreamRef<'_>, l: Layout) -> Result<std::ptr::NonNull<u8>, crate::Error> {
        crate::resource::SyncResource::allocate_sync(self, l)
    }
    unsafe fn deallocate(&self, _: StreamRef<'_>, ptr: std::ptr::NonNull<u8>, l: Layout) {
        // SAFETY: records only.
        unsafe { crate::resource::SyncResource::deallocate_sync(self, ptr, l) }
    }
}

/// Blocks held for other streams (`Resource::deallocate_used_on`) are freed exactly
/// once, and only after their marks complete, while one thread completes a mark and
/// frees what is ready, another holds a block (already complete) and frees what is
/// ready, and a third (this one) frees what is ready as well.
#[test]
fn loom_held_blocks_are_freed_once_after_their_marks() {
    use super::core::held::{Deferred, Mark, free_ready};
    use crate::sync::atomic::{AtomicBool, Ordering};

    loom::model(|| {
        let log = Arc::new(FreedLog::default());
        let held = Arc::new(Deferred::default());
        let l = Layout::from_size_align(256, 256).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        held.push_marked(0x1000, l, vec![Mark::Flag(done.clone())]);
        let t1 = {
            let (log, held, done) = (log.clone(), held.clone(), done.clone());
            thread::spawn(move || {
                done.store(true, Ordering::Release);
                free_ready(&*log, &held, StreamRef::HOST);
            })
        };
        let t2 = {
            let (log, held) = (log.clone(), held.clone());
            thread::spawn(move || {
                let complete = Arc::new(AtomicBool::new(true));
                held.push_marked(0x2000, l, vec![Mark::Flag(complete)]);
                free_ready(&*log, &held, StreamRef::HOST);
            })
        };
        free_ready(&*log, &held, StreamRef::HOST);
        if log.0.lock().unwrap().contains(&0x1000) {
            assert!(
                done.load(Ordering::Acquire),
                "freed before its mark completed"
            );
        }
        t1.join().unwrap();
        t2.join().unwrap();
        // Both threads freed what was ready after their last change: nothing is left.
        assert!(!held.any());
        let mut freed = log.0.lock().unwrap().clone();
        freed.sort_unstable();
        assert_eq!(freed, [0x1000, 0x2000], "each block freed once");
    });
}

/// A segment pool's held blocks (`Deferred::hold_later`, events recorded at a later
/// look; `take_ordered`, taken back in the capture that freed them): a block that both
/// kinds of look may take (freed in capture 7, its stream's event recorded and complete
/// at the first look: a host stream) goes to exactly one of them, while a third thread
/// holds another block and looks; afterwards `any` is clear only once every block is
/// taken. Fails (checked by hand) if `take_ordered` chooses its blocks under one hold of
/// the lock and removes them under another: both looks then take the block.
#[test]
fn loom_held_blocks_for_later_are_taken_once() {
    use super::core::held::Deferred;
    use crate::stream::Frontier;

    loom::model(|| {
        let held = Arc::new(Deferred::default());
        let l = Layout::from_size_align(256, 256).unwrap();
        let in_seven = || {
            Some(Frontier {
                capture: 7,
                nodes: vec![],
            })
        };
        held.hold_later(0x1000, l, None, vec![StreamRef::host(2)], in_seven());
        let ready = {
            let held = held.clone();
            thread::spawn(move || {
                held.take_ready()
                    .into_iter()
                    .map(|(a, _)| a)
                    .collect::<Vec<_>>()
            })
        };
        let ordered = {
            let held = held.clone();
            thread::spawn(move || {
                let frontier = in_seven().unwrap();
                held.take_ordered(&frontier, |_| true)
            })
        };
        let other = {
            let held = held.clone();
            thread::spawn(move || {
                held.hold_later(0x2000, l, None, vec![StreamRef::host(3)], None);
                held.take_ready()
                    .into_iter()
                    .map(|(a, _)| a)
                    .collect::<Vec<_>>()
            })
        };
        let mut taken = ready.join().unwrap();
        taken.extend(ordered.join().unwrap());
        taken.extend(other.join().unwrap());
        // Whatever a look missed is still held, and found.
        assert_eq!(
            held.any(),
            taken.len() < 2,
            "`any` says whether a block is held"
        );
        taken.extend(held.take_ready().into_iter().map(|(a, _)| a));
        taken.sort_unstable();
        assert_eq!(taken, [0x1000, 0x2000], "each block taken once");
        assert!(!held.any());
    });
}

/// A grace period (`crate::sync::grace`): a reclaimer that unlinks a value of its domain
/// and waits for the domain's readers may then write it (free it), and no reader that
/// pinned in the domain before the wait is still reading it; a reader that pins later
/// finds the new value. The reader pins in the domain directly, or nested in a pin of
/// another domain (a pool whose upstream is a pool), or in three domains at once (the
/// word then says "every domain"). loom reports a data race on the cell if the wait does
/// not order the reader's last read before the write (it fails if the wait for pinned
/// threads is removed, or a nested pin's domain is not stored before its light fence).
#[test]
fn loom_a_grace_period_outlasts_every_reader_of_what_was_unlinked() {
    for nesting in 0..3 {
        grace_period_outlasts_readers(nesting, 0);
    }
}

/// The reader pins another domain after its load and before its read (a pool's call into
/// an upstream pool in another domain): the nested pin changes the reader's word, which
/// must not end the grace period (it did when the wait stopped at any change of the word).
#[test]
fn loom_a_pin_nested_after_the_load_keeps_the_grace_period() {
    for nested in 1..3 {
        grace_period_outlasts_readers(0, nested);
    }
}

/// [`loom_a_grace_period_outlasts_every_reader_of_what_was_unlinked`], the reader's pin of
/// the value's domain nested in `nesting` pins of other domains, and `nested_after` pins
/// of other domains taken after its load, before its read.
fn grace_period_outlasts_readers(nesting: usize, nested_after: usize) {
    use crate::sync::atomic::{AtomicPtr, Ordering};
    use crate::sync::cell::UnsafeCell;
    use crate::sync::grace::{self, Domain};

    struct Value(UnsafeCell<u32>);

    loom::model(move || {
        let domain = Arc::new(Domain::new());
        let first = Box::into_raw(Box::new(Value(UnsafeCell::new(1))));
        let current = Arc::new(AtomicPtr::new(first));
        let (reader, in_domain) = (Arc::clone(&current), Arc::clone(&domain));
        let t = thread::spawn(move || {
            let others: Vec<Domain> = (0..nesting).map(|_| Domain::new()).collect();
            let _outer: Vec<grace::Pin> = others.iter().map(grace::pin).collect();
            let _pin = grace::pin(&in_domain);
            let p = reader.load(Ordering::Acquire);
            let later: Vec<Domain> = (0..nested_after).map(|_| Domain::new()).collect();
            let _inner: Vec<grace::Pin> = later.iter().map(grace::pin).collect();
            // SAFETY: loaded while pinned in the value's domain: freed only after a grace
            // period of that domain that this pin is inside of.
            let value = unsafe { &*p };
            value.0.get().with(|v| {
                // SAFETY: read under the pin; the only write comes after the grace period.
                let v = unsafe { *v };
                assert!(v == 1 || v == 2);
            });
        });
        let second = Box::into_raw(Box::new(Value(UnsafeCell::new(2))));
        let old = current.swap(second, Ordering::AcqRel);
        let waiter = grace::can_wait().expect("loom offers grace periods");
        grace::wait_for_readers(&waiter, &domain);
        // SAFETY: unlinked before the grace period; no reader is left.
        unsafe { &*old }.0.get_mut().with(|v| {
            // SAFETY: as above: this thread alone reaches it now.
            unsafe { *v = 0 };
        });
        // SAFETY: made by `Box::into_raw` above, unlinked, and no reader is left.
        drop(unsafe { Box::from_raw(old) });
        t.join().unwrap();
        // SAFETY: made by `Box::into_raw` above; every thread is done.
        drop(unsafe { Box::from_raw(current.load(Ordering::Acquire)) });
    });
}

/// `FixedSize::trim` while another thread uses a stream's list through its thread cache
/// (a magazine, which keeps the list across calls): the list is freed only once no
/// magazine can touch it, and no block is lost or handed out twice (both blocks of the
/// one chunk come back, and both serve the main thread without growing).
#[test]
fn loom_a_trim_frees_a_list_a_thread_cache_was_using() {
    use crate::adaptor::Limiting;

    type Fixed = FixedSize<Limiting<HostHeap>>;
    let l = Layout::from_size_align(256, 256).unwrap();
    loom::model(move || {
        let fixed: Arc<Fixed> = Arc::new(two_block_fixed());
        trim_scenario(&fixed, l, |f| f.trim().unwrap(), Fixed::has_list);
        assert_eq!(fixed.free_blocks(), 2, "every block back");
        let a = fixed.allocate(StreamRef::HOST, l).unwrap();
        let b = fixed.allocate(StreamRef::HOST, l).unwrap();
        assert_ne!(a, b);
        assert_eq!(fixed.upstream_allocations(), 1, "not grown");
        // SAFETY: from `fixed` with `l` on the host stream, not used afterwards.
        unsafe {
            fixed.deallocate(StreamRef::HOST, a, l);
            fixed.deallocate(StreamRef::HOST, b, l);
        }
        super::thread_cache::exit_thread();
    });
}

/// A stream's list retired while another thread looks at it as the `recent` list and
/// frees into it: the free lands in the stream's list either way (the old one's late item
/// is moved to the new one), and the old list is freed only after the other thread is
/// done with it.
#[test]
fn loom_a_retired_list_keeps_a_free_made_into_it_while_it_went() {
    loom::model(|| {
        let map = Arc::new(ListTable::<Vec<u32>>::default());
        let key = StreamKey::host(7);
        // The list is the first a search looks at (as after a free into it).
        map.note_free(map.get_or_insert_with(key, Vec::new));
        let other = Arc::clone(&map);
        let t = thread::spawn(move || {
            let _pin = other.pin();
            // A search's first look, at whatever list is `recent`.
            if let Some(recent) = other.recent() {
                drop(recent.state.lock());
            }
            // A free on the stream: into whatever list the stream has.
            let list = match other.get(key) {
                Some(list) => list,
                None => other.get_or_insert_with(key, Vec::new),
            };
            list.state.lock().push(5);
        });
        // SAFETY: the only other user pins around its use; this thread is not pinned and
        // holds no lock.
        let retired = unsafe {
            map.retire(
                |list| list.state.lock().is_empty(),
                Vec::is_empty,
                |old| match map.find(old.key) {
                    Some(list) => list,
                    None => map.get_or_insert_like(old, Vec::new),
                },
                std::mem::take,
                |list: &mut Vec<u32>, items| list.extend(items),
                |_| {},
                || (),
            )
        };
        t.join().unwrap();
        assert!(retired <= 1);
        let items: Vec<u32> = map
            .all()
            .iter()
            .flat_map(|s| s.state.lock().clone())
            .collect();
        assert_eq!(items, vec![5], "the free is in the stream's list, once");
        assert_eq!(map.all().len(), 1);
    });
}

/// Issue 49: a free into a stream's list that `retire` is taking away (the freeing call
/// looked the list up before it went) stays in reach of every search for free memory that
/// begins after the free: in that list while it is in the table or in limbo, then in the
/// stream's current list, to which it moves while the old one is still in limbo, under
/// the searches' lock. Fails if the move waits for the second grace period (the free is
/// then in no list a search visits from the moment limbo is emptied) or is made without
/// the searches' lock (a search can then pass the new list before the move and limbo
/// after it).
#[test]
fn loom_a_free_into_a_retiring_list_stays_in_reach_of_searches() {
    use crate::sync::{Mutex, lock};

    loom::model(|| {
        let map = Arc::new(ListTable::<Vec<u32>>::default());
        let searches = Arc::new(Mutex::new(()));
        let key = StreamKey::host(7);
        map.get_or_insert_with(key, Vec::new);
        let (other, other_searches) = (Arc::clone(&map), Arc::clone(&searches));
        let t = thread::spawn(move || {
            {
                // A free on the stream: into whatever list the stream has.
                let _pin = other.pin();
                let list = match other.get(key) {
                    Some(list) => list,
                    None => other.get_or_insert_with(key, Vec::new),
                };
                list.state.lock().push(5);
            }
            // A search through every list (as a merge before growing), after the free.
            let _pin = other.pin();
            let _search = lock(&other_searches);
            let found: Vec<u32> = other.iter().flat_map(|s| s.state.lock().clone()).collect();
            assert_eq!(found, vec![5], "the search finds the free");
        });
        // SAFETY: the only other user pins around its uses; this thread is not pinned and
        // holds no lock.
        unsafe {
            map.retire(
                |list| list.state.lock().is_empty(),
                Vec::is_empty,
                |old| match map.find(old.key) {
                    Some(list) => list,
                    None => map.get_or_insert_like(old, Vec::new),
                },
                std::mem::take,
                |list: &mut Vec<u32>, items| list.extend(items),
                |_| {},
                || lock(&searches),
            )
        };
        t.join().unwrap();
        let items: Vec<u32> = map
            .all()
            .iter()
            .flat_map(|s| s.state.lock().clone())
            .collect();
        assert_eq!(items, vec![5], "the free is in the stream's list, once");
    });
}

/// Issue 49: a per-thread list retired while its thread makes its last call (a free
/// into the list it found, or into a new list of its stream if the old one had gone),
/// and, once that thread has exited, a new thread with its number that finds or makes
/// the stream's list while the retirement may still be moving late blocks: the block
/// freed by the exited thread reaches a list the new thread owns only after the exited
/// thread's work was waited for (by the new thread's take-over of a list the exited one
/// owned, or by the move itself). Fails without the wait in `move_late` (the new thread
/// then pops the block from a list it made, unwaited for).
#[test]
fn loom_a_retired_per_thread_lists_blocks_reach_a_new_owner_only_after_a_wait() {
    use super::core::list_table::waits;
    use crate::sync::threads::new_generation;

    loom::model(|| {
        let map = Arc::new(ListTable::<Vec<u32>>::default());
        // A number no real thread has (loom's threads share the process's numbers).
        let key = StreamKey::per_thread(1 << 40);
        let (exited, new) = (new_generation(), new_generation());
        map.get_or_insert_as(key, exited, Vec::new);
        let m = Arc::clone(&map);
        let last_call = thread::spawn(move || {
            let _pin = m.pin();
            let list = match m.find(key) {
                Some(list) => list,
                None => m.get_or_insert_as(key, exited, Vec::new),
            };
            list.state.lock().push(5);
        });
        let m = Arc::clone(&map);
        let retirement = thread::spawn(move || {
            // SAFETY: every other use of the map's lists is inside a pin; this thread is
            // not pinned and holds no lock.
            unsafe {
                m.retire(
                    |list| list.state.lock().is_empty(),
                    Vec::is_empty,
                    |old| match m.find(old.key) {
                        Some(list) => list,
                        None => m.get_or_insert_like(old, Vec::new),
                    },
                    std::mem::take,
                    |list: &mut Vec<u32>, items| list.extend(items),
                    |_| {},
                    || (),
                )
            }
        });
        last_call.join().unwrap();
        let m = Arc::clone(&map);
        let new_thread = thread::spawn(move || {
            let _pin = m.pin();
            let list = m.get_or_insert_as(key, new, Vec::new);
            if list.state.lock().pop() == Some(5) {
                assert!(
                    waits::waited(exited),
                    "the new thread reused an unwaited block"
                );
            }
        });
        retirement.join().unwrap();
        new_thread.join().unwrap();
        let _pin = map.pin();
        if let Some(list) = map.find(key)
            && list.state.lock().contains(&5)
        {
            // The next call of the new thread would take it.
            let _ = map.get_or_insert_as(key, new, Vec::new);
            assert!(
                waits::waited(exited),
                "the block is in the new thread's list, unwaited for"
            );
        }
    });
}

/// An allocation that read the pool awake races `sleep`: it is served before the pool
/// sleeps (and its memory goes to sleep with the rest) or refused with `Asleep`; it never
/// maps memory into a sleeping pool. Fails if the slow path does not look at the sleep
/// under the growth lock.
#[test]
fn loom_an_allocation_racing_sleep_maps_nothing_into_the_sleeping_pool() {
    use crate::error::Error;
    use crate::suballoc::SleepMode;
    use crate::upstream::HostVirtual;

    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(|| {
        let pool = Arc::new(
            HostVirtual::new(1 << 20, 64 << 10)
                .and_then(|v| v.virtual_pool(VirtualPoolConfig::new()))
                .unwrap(),
        );
        let other = Arc::clone(&pool);
        let l = Layout::from_size_align(1000, 256).unwrap();
        let t = thread::spawn(move || match other.allocate(StreamRef::host(1), l) {
            Ok(p) => Some(p.as_ptr() as usize),
            Err(Error::Asleep) => None,
            Err(e) => panic!("{e}"),
        });
        // SAFETY: the other thread never touches the memory it gets.
        unsafe { pool.sleep(SleepMode::Discard) }.unwrap();
        assert_eq!(pool.upstream().mapped_bytes(), 0, "asleep: nothing mapped");
        let got = t.join().unwrap();
        assert_eq!(pool.upstream().mapped_bytes(), 0, "still nothing mapped");
        pool.wake().unwrap();
        if let Some(addr) = got {
            let p = std::ptr::NonNull::new(addr as *mut u8).unwrap();
            // SAFETY: allocated by the other thread with `l`; never touched.
            unsafe { pool.deallocate(StreamRef::host(1), p, l) };
        }
        pool.trim().unwrap();
        assert_eq!(pool.upstream().mapped_bytes(), 0);
    });
}
