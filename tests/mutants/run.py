#!/usr/bin/env python3
"""One-line mutations of the sub-allocators and adaptors, each of which a test must kill.

    python3 tests/mutants/run.py [NAME ...]     # from the repository root
    python3 tests/mutants/run.py --check        # only: is each snippet in its file once?

Each mutation replaces one snippet of the source (it must occur exactly once), runs the
host tests that cover it in release mode (their own target folder, target/mutants), and
puts the source back. A mutation whose tests all still pass "survived": a feature whose
removal no test notices. The list began with the survivors an audit found (issue 33,
finding 9). Prints one line per mutation and exits 1 if any survived; docs/mutation-
testing.md records the last run.
"""

import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = [
    "--lib",
    "--test", "pool", "--test", "virtual_pool", "--test", "arena", "--test", "fixed_size",
    "--test", "reliability", "--test", "growth_race", "--test", "adaptors",
    "--test", "fault_injection", "--test", "conformance_host", "--test", "stream_lists",
]

# The C ABI's own tests (host ones: its tables, the stack's pools over host memory, the
# IPC handle form), for the mutations of capi/.
CAPI = ["-p", "memres-capi", "--lib"]
# The virtual pool's sleep and wake: the library's virtual-pool tests (host pages).
VIRTUAL_POOL = ["-p", "memres", "--lib", "virtual_pool::"]
# The library's StreamUse layer: its own tests.
STREAM_USE = ["-p", "memres", "--lib", "stream_use"]
# SegmentPool (PyTorch's graph and MemPool pools): its host tests and the conformance suite.
SEGMENTS = ["-p", "memres", "--test", "segment_pool", "--test", "conformance_host"]

# name, file, snippet, replacement[, the tests to run: the library's by default]
MUTATIONS = [
    ("lanes off: every thread in lane 0", "src/sync/threads.rs",
     "fn this_lane() -> u64 {\n", "fn this_lane() -> u64 {\n    return 0;\n"),
    ("lanes never spread: waits not counted", "src/sync/threads.rs",
     "    if cfg!(memres_loom) || this_lane() != 0 {\n        return;",
     "    if true {\n        return;"),
    ("lanes: waits far apart add up", "src/sync/threads.rs",
     "    let waits = if quiet {\n", "    let waits = if quiet && false {\n"),
    ("lanes: a thread takes its own lane at once", "src/sync/threads.rs",
     "    if per_thread {\n        take_a_lane()", "    if true {\n        take_a_lane()"),
    ("Pool: no take_from_lanes on the slow path", "src/suballoc/coalescing.rs",
     "            .or_else(|| lanes::take_all(&self.lists, own, fit.size, fit.align, false));",
     "            .or(None);"),
    # Issue 51, item 1: the pool's thread caches.
    ("Pool: other threads' cached blocks stay cached at out-of-memory",
     "src/suballoc/coalescing.rs",
     "            self.cache().reclaim();\n            fit.merged = false;",
     "            fit.merged = false;"),
    ("Pool: thread caches with a release threshold", "src/suballoc/coalescing.rs",
     "H::THREAD_CACHES && self.release_threshold.is_none()", "H::THREAD_CACHES"),
    # Issue 51, item 1: the arena's thread caches.
    ("Arena: other threads' cached blocks stay cached at out-of-memory",
     "src/suballoc/arena.rs",
     "            return Ok(None); // larger than the arena: nothing can serve it\n        }\n        self.cache().reclaim();\n",
     "            return Ok(None); // larger than the arena: nothing can serve it\n        }\n"),
    ("Arena: a trim leaves other threads' cached blocks", "src/suballoc/arena.rs",
     "        self.cache().reclaim();\n        let host = ordered::list_of",
     "        let host = ordered::list_of"),
    ("Arena: a superblock handed out leaves the caches off", "src/suballoc/arena.rs",
     "        // turned off come back (a load when they are on).\n        self.cache().resume();",
     "        // turned off come back (a load when they are on)."),
    ("Arena: thread_caches(false) keeps caching", "src/suballoc/arena.rs",
     "        self.caches = on;", "        self.caches = on || true;"),
    ("Arena: free_bytes leaves the calling thread's cache out", "src/suballoc/arena.rs",
     "global.free_bytes() + pending + streams + cached", "global.free_bytes() + pending + streams"),
    ("Pool: a trim leaves other threads' cached blocks", "src/suballoc/coalescing.rs",
     "        self.reclaim_caches();\n        let released", "        let released"),
    ("Pool: stats leave the calling thread's cache out", "src/suballoc/coalescing.rs",
     "            stats.free_bytes += bytes;\n", ""),
    # Issue 51, item 4: an idle stream's list passed over without its lock.
    ("Arena: no list marked idle", "src/suballoc/arena.rs",
     "                    list.idle.store(true, Ordering::Relaxed);\n", ""),
    ("Arena: an idle list's slow path leaves the hint set", "src/suballoc/arena.rs",
     "            busy(own);\n            s.flush();\n            // (Not the index's search",
     "            s.flush();\n            // (Not the index's search"),
    ("Arena: no take_from_lanes", "src/suballoc/arena.rs",
     "        Ok(lanes::take_all(&self.lists, own, fit.size, fit.align, true))",
     "        Ok(None)"),
    ("VirtualPool: no unmapping before growing", "src/suballoc/virtual_pool/grow.rs",
     "if may_wait && near_peak && surplus >= g && surplus > keep && whole_granule_free() {",
     "if false && may_wait && near_peak && surplus >= g && surplus > keep && whole_granule_free() {"),
    # Issue 51, item 2: well below its peak a growth keeps the free granules.
    ("VirtualPool: a growth gives back whatever the pool held before",
     "src/suballoc/virtual_pool/grow.rs",
     "        let near_peak = grown > mark - mark / 8;",
     "        let near_peak = true;"),
    # A growth site of no bytes is served from the free block beside it (else a map of
    # no bytes: CUDA_ERROR_INVALID_VALUE on a GPU, out of memory on the host).
    ("VirtualPool: a site of no bytes is mapped",
     "src/suballoc/virtual_pool/grow.rs",
     "        .find(|&b| fits(b, size, align))",
     "        .find(|_| false)"),
    ("VirtualPool: a trim does not restart the pool's peak",
     "src/suballoc/virtual_pool/grow.rs",
     "        growth.memory.high_water = growth.size;\n",
     "\n"),
    # Issue 51, item 5: a growth gives back every whole free granule it does not join.
    ("VirtualPool: a growth gives back only as many bytes as it maps (67e8274's rule)",
     "src/suballoc/virtual_pool/grow.rs",
     "            if waited.is_ok() && self.unmap_in(growth, &mut s, keep + joined, spare) > 0 {",
     "            let keep = s.free_bytes().saturating_sub(best.len);\n"
     "            if waited.is_ok() && self.unmap_in(growth, &mut s, keep, spare) > 0 {"),
    ("VirtualPool: a host stream's miss takes one block of a list only freed into (no merge)",
     "src/suballoc/virtual_pool/grow.rs",
     "    const MERGES_FREEING_HOST_LISTS: bool = true;",
     "    const MERGES_FREEING_HOST_LISTS: bool = false;"),
    ("Pool: a pending release never runs", "src/suballoc/coalescing.rs",
     "    fn release_if_pending(&self) {\n", "    fn release_if_pending(&self) {\n        return;\n"),
    ("Tracking: a double free is passed on", "src/adaptor/tracking.rs",
     "not passed on\"\n                );\n                None", "not passed on\"\n                );\n                Some(layout)"),
    ("FixedSize: no merge of other streams' blocks before growing", "src/suballoc/fixed.rs",
     "        self.merge_leaving(own, 1)\n", "        Ok(None)\n"),
    ("Pool: the release at a threshold makes the thread's own host list (deadlock)", "src/suballoc/coalescing.rs",
     "            self.release_into(&mut growth, self.host_list(), keep);",
     "            self.release_into(&mut growth, ordered::list_of(self, StreamRef::HOST), keep);"),
    ("held blocks: freed before their events complete", "src/suballoc/core/held.rs",
     "            if !h.is_complete() {", "            if false {"),
    ("Growth::Eighth under a maximum: chunks not whole requests", "src/suballoc/pool_config.rs",
     "                    Some(whole) if whole <= self.remaining => whole,", "                    Some(whole) if false && whole <= self.remaining => whole,"),
    ("FixedSize: a host list's last block is taken too (the steal cascade)", "src/suballoc/core/stream_key.rs",
     "usize::from(self.stream() != StreamKey::host(0))",
     "0 * usize::from(self.stream() != StreamKey::host(0))"),
    ("trim frees no lists (the core's trim: the pools, Arena, FixedSize)", "src/suballoc/core/ordered.rs",
     "    retire_empty_lists(r);\n", ""),
    ("core: a trim retires the lists it should keep (the pool's host list)", "src/suballoc/core/ordered.rs",
     "|list| !r.keeps_list(list) && list.state.lock().holds_nothing(),",
     "|list| list.state.lock().holds_nothing(),"),
    ("core: nothing is tried after growth fails (no release, no last merge)", "src/suballoc/core/ordered.rs",
     "    if let Some(addr) = r.take_last(&mut growth, stream, own, req)? {\n        return Ok(addr);\n    }\n", ""),
    ("FixedSize::trim leaves other streams' blocks in their lists", "src/suballoc/fixed.rs",
     ".merge_into(host, Contents::drain, Contents::absorb)",
     ".merge_into(host, |_: &mut Vec<usize>| Vec::new(), Contents::absorb)"),
    ("FixedSize: a reclaim does not take idle threads' cached blocks", "src/suballoc/thread_cache.rs",
     "            if barrier::heavy_available() {\n", "            if false && barrier::heavy_available() {\n"),
    ("VirtualPool: a sleeping pool serves its free blocks", "src/suballoc/coalescing.rs",
     "        if self.holding.is_asleep() {", "        if false && self.holding.is_asleep() {"),
    ("VirtualPool: a sleeping pool gives its copies back to nothing (offload restores nothing)", "src/upstream/virtual_memory/staged.rs",
     "            unsafe { backend.copy_in(&slot.lane, c.addr, buffer, c.len)? }", "            let _ = buffer;",
     VIRTUAL_POOL),
    ("Fallback: a first range sends every free to the first tier", "src/adaptor/fallback.rs",
     "            owner != Some(FIRST) // outside `first`'s range: `then`'s", "            false"),
    ("VirtualPool: a failed wake leaves what it mapped", "src/upstream/virtual_memory/staged.rs",
     "    if !outcome.unsettled {\n        let mapped: Vec<(usize, usize)> = ranges",
     "    if false {\n        let mapped: Vec<(usize, usize)> = ranges", VIRTUAL_POOL),
    ("free lists: an emptied class keeps its bit", "src/suballoc/core/free_blocks.rs",
     "        self.classes_in_use[group] &= !(empty << (class % LINEAR));", "        let _ = empty;"),
    ("free lists: a removed block's successor keeps its old link", "src/suballoc/core/free_blocks.rs",
     "        self.lists[next as usize].prev = prev;", "        let _ = prev;"),
    ("free lists: a merge with both neighbours leaves the end key naming the one after",
     "src/suballoc/core/free_blocks.rs",
     "                self.by_end.insert(next_end, NodeRef::of(b));", "                let _ = next_end;"),
    # Issue 49: list retirement and the wait before out-of-memory.
    ("retire: no second grace period", "src/suballoc/core/list_table/retire.rs",
     "        // going on.\n        grace::wait_for_readers(&waiter, &self.domain);\n",
     "        // going on.\n"),
    ("retire: the retired mark is never set", "src/suballoc/core/list_table/retire.rs",
     "unsafe { self.at(p) }.retired.store(true, Ordering::Relaxed);", "let _ = p;"),
    ("retire: iterations skip limbo", "src/suballoc/core/list_table.rs",
     "            .chain(limbo)\n", "            .chain(limbo.into_iter().take(0))\n"),
    ("held blocks: the retry after waiting frees nothing", "src/suballoc/core/held.rs",
     "            held.wait_all();\n            free_ready(r, held, stream);\n", ""),
    # Was the PyTorch backend's (tests/mutants/torch_backend.py) until the in-capture reuse
    # moved into the library (09baf92, 02944dd): SegmentPool::allocate_ordered takes back
    # what Deferred::take_ordered gives.
    ("held blocks: a block freed in a capture is never taken again in it", "src/suballoc/core/held.rs",
     "            let ordered = of_this_capture(h)\n", "            let ordered = false && of_this_capture(h)\n"),
    ("StreamUse: record_stream records for any address, not only a live block's start", "src/adaptor/stream_use.rs",
     "        let Some(streams) = map.get_mut(&address) else {\n            return false;\n        };",
     "        let streams = map.entry(address).or_insert(None);", STREAM_USE),
    ("StreamUse: a freed block stays in the live-block table", "src/adaptor/stream_use.rs",
     "        let streams = self.shard(address).remove(&address)?;",
     "        let streams = self.shard(address).get(&address).cloned()?;", STREAM_USE),
    ("C ABI: an export's release leaves its count (frees keep taking the lock)", "capi/src/exports.rs",
     "        if map.remove(&address).is_some() {\n            self.blocks.fetch_sub(1, Ordering::Relaxed);\n        }",
     "        map.remove(&address);", CAPI),
    ("C ABI: a granules handle without the export number (reused fds repeat a handle)", "capi/src/ipc.rs",
     "        out.extend_from_slice(&number.to_le_bytes());\n", "        let _ = number;\n        out.extend_from_slice(&[0; 8]);\n", CAPI),
    ("C ABI: an expandable segment's handle of 0 granules is accepted", "capi/src/ipc.rs",
     "        if n == 0 || granule == 0 {", "        if granule == 0 {", CAPI),
    ("C ABI: the stack keeps one virtual pool (each tier overwrites the last)", "capi/src/stack.rs",
     "Built::VirtualPool(pool) => self.in_place.push(Arc::clone(pool)),",
     "Built::VirtualPool(pool) => self.in_place = vec![Arc::clone(pool)],", CAPI),
    ("C ABI: memres_trim does not reach binning's bins", "capi/src/stack.rs",
     "        for bins in &self.bins {\n            note(bins.trim().map(|()| 0));\n        }\n", "", CAPI),
    ("C ABI: a pinned_pool tier is left out of the figures", "capi/src/stack.rs",
     "        for pool in &self.pinned {\n            // Host memory: not the device's calls.\n"
     "            all.push(PoolFigures {\n                upstream_alloc_calls: 0,\n"
     "                upstream_free_calls: 0,\n                ..pool_figures(pool.stats())\n"
     "            });\n        }\n", "", CAPI),
    ("C ABI: memres_set_limit does not bound virtual pools", "capi/src/stack.rs",
     "        for pool in &self.in_place {\n            pool.set_limit(bytes);\n        }\n", "", CAPI),
    # PyTorch's num_device_alloc / num_device_free (PoolStats::upstream_alloc_calls / _frees).
    ("VirtualPool: a run a trim unmaps is not counted", "src/suballoc/virtual_pool/grow.rs",
     "            growth.frees += 1;\n", ""),
    ("Pool: a chunk is not counted", "src/suballoc/pool.rs",
     "    growth.allocs += 1;\n", ""),
    ("Pool::set_limit is ignored by growth", "src/suballoc/pool.rs",
     "            maximum: pool.maximum(growth),", "            maximum: pool.holding.config.maximum(),"),
    ("IPC import: the reservation aligned to the piece size (20 MiB pieces refused)", "src/upstream/ipc.rs",
     "    1 << granule.trailing_zeros()", "    granule"),
    ("SegmentPool: first fit instead of best fit", "src/suballoc/segment_pool.rs",
     "best.is_none_or(|(b, ..)| block < b)", "best.is_none()", SEGMENTS),
    ("SegmentPool: a stream takes blocks of another stream's segments", "src/suballoc/segment_pool.rs",
     "        if segment.stream != stream {\n            continue;\n        }\n        for (&offset, &(block, allocated)) in &segment.blocks {",
     "        for (&offset, &(block, allocated)) in &segment.blocks {", SEGMENTS),
    ("SegmentPool: a free never merges with the block before it", "src/suballoc/segment_pool.rs",
     "    if let Some((&prev, &(prev_size, false))) = blocks.range(..offset).next_back() {",
     "    if let Some((&prev, &(prev_size, false))) = None::<(&usize, &(usize, bool))> {", SEGMENTS),
    ("SegmentPool: segments of whole granules taken at the leaves' alignment", "src/suballoc/segment_pool.rs",
     "        let align = self.config.alignment_of(segment_size);",
     "        let align = DEFAULT_ALIGNMENT;", SEGMENTS),
    ("VirtualPool: an aligned growth maps for the alignment's worst case", "src/suballoc/virtual_pool/grow.rs",
     "        let from_before = end.saturating_sub(lo).next_multiple_of(g);",
     "        let from_before = (end + align - GRANULE).saturating_sub(lo).next_multiple_of(g);"),
    ("SegmentPool: a restored table's blocks off the block grid accepted", "src/suballoc/segment_pool.rs",
     "                && block.is_multiple_of(rounding)\n", "", SEGMENTS),
    ("SegmentPool: held blocks polled while a capture is underway", "src/suballoc/segment_pool.rs",
     "        if !capturing {\n            self.poll(&mut table);\n        }\n        Ok(size)",
     "        self.poll(&mut table);\n        Ok(size)", SEGMENTS),
]


def snippet_count(path, snippet):
    """How many times `snippet` occurs in `path` (0 if the file is gone)."""
    file = ROOT / path
    return file.read_text().count(snippet) if file.exists() else 0


def check():
    """Lists each mutation whose snippet is not in its file exactly once; runs no test."""
    stale = [(name, path) for name, path, snippet, *_ in MUTATIONS
             if snippet_count(path, snippet) != 1]
    for name, path in stale:
        print(f"STALE     {name}: the snippet is not in {path} exactly once")
    print(f"{len(MUTATIONS) - len(stale)} of {len(MUTATIONS)} snippets found once")
    return 1 if stale else 0


def run(selected):
    survived = []
    for name, path, snippet, replacement, *tests in MUTATIONS:
        tests = tests[0] if tests else ["-p", "memres", *TESTS]
        if selected and not any(s.lower() in name.lower() for s in selected):
            continue
        if snippet_count(path, snippet) != 1:
            print(f"STALE     {name}: the snippet is not in {path} exactly once")
            survived.append(name)
            continue
        file = ROOT / path
        original = file.read_text()
        file.write_text(original.replace(snippet, replacement))
        start = time.time()
        try:
            # Every test under a time limit: a mutation that makes a test hang is killed.
            done = subprocess.run(
                ["cargo", "test", "--release", "-q", "--target-dir", "target/mutants", *tests],
                cwd=ROOT, capture_output=True, text=True, timeout=900,
            )
            killed = done.returncode != 0
        except subprocess.TimeoutExpired:
            killed = True
        finally:
            file.write_text(original)
        verdict = "killed" if killed else "SURVIVED"
        print(f"{verdict:9} {name} ({time.time() - start:.0f} s)", flush=True)
        if not killed:
            survived.append(name)
    print(f"{len(survived)} survived" + (": " + "; ".join(survived) if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    sys.exit(run(sys.argv[1:]))
