//! A forked child's trims never wait for threads that do not exist there (issue 49):
//! forked while another thread is inside a pool call, the child trims the pool.
//! (A test binary of its own: the child of a fork runs only the forking thread.)
#![cfg(target_os = "linux")]

use std::time::{Duration, Instant};

use memres::suballoc::{Pool, PoolConfig};
use memres::upstream::Callback;
use memres::{Host, HostHeap, Resource, StreamRef, SyncResource, layout};

/// What the child does, its exit status telling how it went: 0 when the trim returned
/// (and freed a list), 2 when it did not free one, 3 when a call failed. An alarm ends
/// it if the trim hangs.
fn in_the_child<U: Resource>(pool: &Pool<U>) -> i32 {
    // SAFETY: `alarm` only arms a timer; its signal's default action ends the process.
    unsafe { libc::alarm(10) };
    let l = layout(4096).unwrap();
    let Ok(p) = pool.allocate(StreamRef::host(5), l) else {
        return 3;
    };
    // SAFETY: allocated just above with `l` on the same stream; unused.
    unsafe { pool.deallocate(StreamRef::host(5), p, l) };
    let before = pool.stats().stream_lists;
    if pool.trim().is_err() {
        return 3;
    }
    if pool.stats().stream_lists < before {
        0
    } else {
        2
    }
}

/// The main thread forks from inside a growth of the pool (its upstream), while another
/// thread is pinned in a call of the same pool (waiting for the growth lock the main
/// thread holds). In the child that thread does not exist; its trim must not wait for it.
#[test]
fn a_trim_in_a_forked_child_does_not_wait_for_a_thread_of_the_parent() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let (armed, in_growth, calling) = (
        AtomicBool::new(true),
        AtomicBool::new(false),
        AtomicBool::new(false),
    );
    let child = std::sync::Mutex::new(None::<libc::pid_t>);
    let allocate = |l: std::alloc::Layout, _: StreamRef<'_>| {
        if armed.swap(false, SeqCst) {
            in_growth.store(true, SeqCst);
            while !calling.load(SeqCst) {
                std::thread::yield_now();
            }
            // Time for the other thread to pin and block on the growth lock this
            // thread holds.
            std::thread::sleep(Duration::from_millis(200));
            // SAFETY: `fork` duplicates the process; the child runs only this thread,
            // which goes on with the pool (whose locks it holds, or are free) and
            // `_exit`s.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid > 0 {
                *child.lock().unwrap() = Some(pid);
            }
        }
        HostHeap::new().allocate_sync(l)
    };
    let deallocate = |p: std::ptr::NonNull<u8>, l: std::alloc::Layout, _: StreamRef<'_>| {
        // SAFETY: the block came from the heap with `l` (the closure above).
        unsafe { HostHeap::new().deallocate_sync(p, l) }
    };
    // SAFETY: the closures hand out and take back heap blocks, host memory, used at once.
    let upstream = unsafe { Callback::<Host>::new(allocate, deallocate) };
    let pool = Pool::new(upstream, PoolConfig::new()).unwrap();
    let (small, big) = (layout(4096).unwrap(), layout(64 << 20).unwrap());
    std::thread::scope(|s| {
        let other = s.spawn(|| {
            while !in_growth.load(SeqCst) {
                std::thread::yield_now();
            }
            calling.store(true, SeqCst);
            // A new stream's list is made under the growth lock, which the main thread
            // holds while it forks: this call waits there, pinned.
            let p = pool.allocate(StreamRef::host(9), small).unwrap();
            // SAFETY: allocated just above with `small` on the same stream; unused.
            unsafe { pool.deallocate(StreamRef::host(9), p, small) };
        });
        let p = pool.allocate(StreamRef::host(1), big).unwrap();
        let pid = *child.lock().unwrap();
        let Some(pid) = pid else {
            // The child, back from the growth: trim, and end with the result.
            let code = in_the_child(&pool);
            // SAFETY: ends the child at once (no destructors, no test harness).
            unsafe { libc::_exit(code) };
        };
        // SAFETY: allocated just above with `big` on the same stream; unused.
        unsafe { pool.deallocate(StreamRef::host(1), p, big) };
        other.join().unwrap();
        let started = Instant::now();
        let status = loop {
            let mut status = 0;
            // SAFETY: waits for our own child, without blocking.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break status;
            }
            assert!(r == 0, "waitpid failed");
            if started.elapsed() > Duration::from_secs(20) {
                // SAFETY: ends our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                panic!("the child's trim never returned");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(
            libc::WIFEXITED(status),
            "the child's trim never returned (ended by signal {})",
            libc::WTERMSIG(status)
        );
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child's trim returned but went wrong (2: no list freed, 3: a call failed)"
        );
    });
}
