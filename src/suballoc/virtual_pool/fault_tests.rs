//! A pool that grows in place over host pages whose maps fail every k-th time (a device
//! that runs out of memory now and then): every failure is `OutOfMemory`, no block is ever
//! handed out over memory that did not get mapped (each is written at both ends), the pool
//! serves again once the faults stop, and after everything is freed and trimmed nothing
//! stays mapped.

use std::alloc::Layout;
use std::ptr::NonNull;

use crate::error::Error;
use crate::resource::{Resource, layout};
use crate::stream::StreamRef;
use crate::suballoc::VirtualPoolConfig;
use crate::upstream::virtual_memory::faults;
use crate::upstream::{GrowInPlace, HostVirtual};

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn a_virtual_pool_whose_maps_fail_stays_exact_and_usable() {
    for every in [1, 2, 3, 5, 8] {
        let pool = HostVirtual::new(1 << 30, 2 << 20)
            .and_then(|v| v.virtual_pool(VirtualPoolConfig::new().release_threshold(64 << 20)))
            .unwrap();
        faults::fail_every(pool.upstream().reservation().0, every);
        let mut rng = every;
        let mut live: Vec<(NonNull<u8>, Layout, StreamRef<'static>)> = Vec::new();
        let mut failures = 0;
        for _ in 0..3000 {
            if live.is_empty() || !splitmix(&mut rng).is_multiple_of(3) {
                let e = 8 + splitmix(&mut rng) % 15;
                let n = (1usize << e) + (splitmix(&mut rng) % (1 << e)) as usize;
                let l = layout(n).unwrap();
                let s = StreamRef::host((splitmix(&mut rng) % 3) as u32);
                match pool.allocate(s, l) {
                    Ok(p) => {
                        // SAFETY: `n` bytes just handed out; writing both ends shows they
                        // are mapped (an unmapped page would fault).
                        unsafe {
                            p.as_ptr().write(1);
                            p.as_ptr().add(n - 1).write(2);
                        }
                        live.push((p, l, s));
                    }
                    Err(Error::OutOfMemory { requested, .. }) => {
                        assert_eq!(requested, n);
                        failures += 1;
                    }
                    Err(other) => panic!("every {every}: {other}"),
                }
            } else {
                let k = (splitmix(&mut rng) % live.len() as u64) as usize;
                let (p, l, s) = live.swap_remove(k);
                // SAFETY: allocated above with `l` on `s`; host streams are always done.
                unsafe { pool.deallocate(s, p, l) };
            }
        }
        assert!(failures > 0, "every {every}: the faults were met");
        faults::fail_every(pool.upstream().reservation().0, 0);
        let l = layout(16 << 20).unwrap();
        let p = pool
            .allocate(StreamRef::HOST, l)
            .expect("usable once the faults stop");
        // SAFETY: allocated just above with `l`.
        unsafe { pool.deallocate(StreamRef::HOST, p, l) };
        for (p, l, s) in live.drain(..) {
            // SAFETY: as above.
            unsafe { pool.deallocate(s, p, l) };
        }
        pool.trim().unwrap();
        assert_eq!(pool.stats().pool_size, 0, "every {every}");
        assert_eq!(
            pool.upstream().mapped_bytes(),
            0,
            "every {every}: nothing left mapped"
        );
    }
}
