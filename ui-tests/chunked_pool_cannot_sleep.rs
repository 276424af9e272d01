// Rule: only a `VirtualPool` sleeps and wakes (its addresses stay reserved while its memory
// goes back); a chunked `Pool` has no `sleep` or `wake` to call.
use memres::{HostHeap, Pool, PoolConfig, suballoc::SleepMode};

fn main() {
    let pool = Pool::new(HostHeap::new(), PoolConfig::new()).unwrap();
    // SAFETY: the pool has handed nothing out.
    let _ = unsafe { pool.sleep(SleepMode::Discard) };
    let _ = pool.wake();
}
