// The `capi` target's code, shared by the fuzz target (`fuzz/fuzz_targets/capi.rs`) and
// the corpus replay of `cargo test` (`fuzz/common/capi_replay.rs`, a test module of the C
// ABI), which `include!` it where `capi` names the C ABI's crate and `mr` the library.
//
// The C ABI as a C program (or the Python package) reaches it, driven by the input: an
// operation per byte, its arguments from the bytes after it. Configure (arbitrary spec
// text), allocate, free (of blocks, of foreign and made-up pointers), record_stream,
// trim, set_limit, reset_peak, stats, tier_stats and segments (buffers of every size,
// null ones), set_tag, sleep, wake, is_asleep, IPC export of foreign pointers, IPC open of
// arbitrary handle bytes (which `Handle::decode` reads: PyTorch's 64-byte form, the
// versioned forms, expandable segments naming a process and its descriptors), IPC close,
// the profiler's push, pop, report and reset, and last_error.
//
// Only where there is no CUDA driver (the development VM and CI): no stack can be built,
// so device work fails with the driver's error and no pointer given is ever used, which
// is what makes made-up pointers safe to pass. Every call answers with one of the header's
// codes (never MEMRES_ERROR_PANIC: a caught panic is a finding, and under the fuzzer the
// panic itself aborts), a failure leaves a message of bounded length in last_error, a
// success none that says otherwise, and the output buffers hold what the answer says.

use std::ffi::{CStr, CString, c_char, c_int, c_void};

use capi::{
    MEMRES_ERROR_ASLEEP, MEMRES_ERROR_CUDA, MEMRES_ERROR_IN_USE, MEMRES_ERROR_INVALID_ARGUMENT,
    MEMRES_ERROR_OUT_OF_MEMORY, MEMRES_ERROR_PANIC, MEMRES_OK, memres_stats_t,
};

/// The longest message a failure may leave: the C ABI quotes at most 200 characters of a
/// caller's text (each escaped as `{:?}` writes it: at most 10 bytes), with its size.
const LONGEST_MESSAGE: usize = 4096;

/// At most this many calls per input.
const MOST_CALLS: usize = 64;

/// Tag names: a fixed few (the process keeps every name ever set, so names made up from
/// the input would grow its list for the rest of the run).
const TAGS: [&[u8]; 8] = [
    b"",
    b"default",
    b"weights",
    b"kv_cache",
    b"\xff\xfe not UTF-8",
    b"a tag of a name longer than any message quotes: 0123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789012345678901234567890123456789",
    b"\\t\tab\nnewline",
    b"w",
];

/// The bytes of one input, read front to back; zeros once they run out.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.byte();
        }
        u64::from_le_bytes(b)
    }

    /// Up to `n` bytes (fewer at the end of the input).
    fn bytes(&mut self, n: usize) -> &[u8] {
        let (taken, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        taken
    }

    /// True for one byte value in `n`.
    fn one_in(&mut self, n: u8) -> bool {
        self.byte().is_multiple_of(n)
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A device ordinal: mostly one memres serves, sometimes one it does not.
    fn device(&mut self) -> c_int {
        match self.byte() {
            b @ 0..=7 => c_int::from(b % 4),
            8 => 63,
            9 => 64,
            10 => -1,
            11 => c_int::MIN,
            12 => c_int::MAX,
            _ => self.u64() as c_int,
        }
    }

    /// A size: small, at the edges of `isize`, or any.
    fn size(&mut self) -> isize {
        match self.byte() % 8 {
            0 => 0,
            1 => 1 + isize::from(self.byte()),
            2 => 1 << (self.byte() % 63),
            3 => -1 - isize::from(self.byte()),
            4 => isize::MAX,
            5 => isize::MIN,
            _ => self.u64() as isize,
        }
    }

    /// A stream handle: null (legacy), `CU_STREAM_LEGACY` (1) or `CU_STREAM_PER_THREAD`
    /// (2), as the C ABI's callers pass when they have no stream of their own.
    fn stream(&mut self) -> *mut c_void {
        std::ptr::without_provenance_mut(usize::from(self.byte() % 3))
    }

    /// Text up to a length byte long, NUL-terminated (the C string ends at the first NUL
    /// of the bytes, as a C caller's would).
    fn text(&mut self) -> CString {
        let n = usize::from(self.byte());
        let bytes = self.bytes(n);
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        CString::new(&bytes[..end]).expect("no NUL before `end`")
    }

    fn tag(&mut self) -> CString {
        let name = TAGS[usize::from(self.byte()) % TAGS.len()];
        CString::new(name).expect("no NUL in the names")
    }
}

/// What the run holds: blocks it was given (none without a driver), the profiler scopes
/// it opened, the IPC ranges it opened, and memory of its own to pass as foreign pointers.
struct Held {
    blocks: Vec<(*mut c_void, isize, c_int)>,
    scopes: Vec<i64>,
    opened: Vec<*mut c_void>,
    own: Vec<u8>,
}

impl Held {
    /// A pointer memres never handed out: into the run's own memory, a made-up address,
    /// or (where the run holds any) a block it was given.
    fn pointer(&mut self, input: &mut Input<'_>) -> *mut c_void {
        match input.byte() % 4 {
            0 => self.own.as_mut_ptr().cast(),
            1 => {
                let at = usize::from(input.byte()) % self.own.len();
                self.own[at..].as_mut_ptr().cast()
            }
            2 if !self.blocks.is_empty() => {
                let i = usize::from(input.byte()) % self.blocks.len();
                self.blocks[i].0
            }
            _ => std::ptr::without_provenance_mut(input.u64() as usize),
        }
    }
}

/// The thread's last error.
fn last_error() -> String {
    // SAFETY: `memres_last_error` returns a NUL-terminated string that stays valid until
    // the next memres call on this thread; it is copied before any.
    let text = unsafe { CStr::from_ptr(capi::memres_last_error()) };
    text.to_str()
        .unwrap_or_else(|e| panic!("last_error is not UTF-8 ({e}): {text:?}"))
        .to_owned()
}

/// Checks the answer `code` of `call`: one of the header's codes, or a count where
/// `counts` (non-negative), never a caught panic; a failure has a message and that
/// message is bounded.
fn answered(call: &str, code: i64, counts: bool) {
    let codes = [
        MEMRES_OK,
        MEMRES_ERROR_INVALID_ARGUMENT,
        MEMRES_ERROR_IN_USE,
        MEMRES_ERROR_CUDA,
        MEMRES_ERROR_OUT_OF_MEMORY,
        MEMRES_ERROR_ASLEEP,
    ];
    let message = last_error();
    assert_ne!(
        code,
        i64::from(MEMRES_ERROR_PANIC),
        "{call}: a caught panic: {message}"
    );
    assert!(
        codes.iter().any(|&c| i64::from(c) == code) || (counts && code >= 0),
        "{call}: {code}, not a code of the header ({message})"
    );
    assert!(
        message.len() <= LONGEST_MESSAGE,
        "{call}: a {}-byte message: {:?}...",
        message.len(),
        &message[..message.floor_char_boundary(300)]
    );
    if code < 0 {
        assert!(!message.is_empty(), "{call}: {code} without a message");
    }
}

/// The `memres_stats_t` of a device whose stack was never built: all zeros.
fn unbuilt(stats: &memres_stats_t) -> bool {
    *stats == memres_stats_t::default()
}

/// Runs the calls `data` names.
fn run(data: &[u8]) {
    assert!(
        !mr::driver::is_present(),
        "the capi target runs only where there is no CUDA driver: with one, its calls \
         would allocate device memory and write log files the input names"
    );
    let mut input = Input(data);
    let mut held = Held {
        blocks: Vec::new(),
        scopes: Vec::new(),
        opened: Vec::new(),
        own: vec![0x5a; 4096],
    };
    for _ in 0..MOST_CALLS {
        if input.is_empty() {
            break;
        }
        call(&mut input, &mut held);
    }
    // What the run opened, closed; what it was given, freed; the process as it was.
    for (ptr, size, device) in held.blocks.drain(..) {
        // SAFETY: a block `memres_malloc(size, device, ..)` returned, not freed yet; the
        // legacy stream.
        unsafe { capi::memres_free(ptr, size, device, std::ptr::null_mut()) };
    }
    for id in held.scopes.drain(..).rev() {
        answered(
            "memres_profile_pop",
            capi::memres_profile_pop(id).into(),
            false,
        );
    }
    for base in held.opened.drain(..) {
        answered(
            "memres_ipc_close",
            capi::memres_ipc_close(base).into(),
            false,
        );
    }
    // SAFETY: NULL is a valid tag (none).
    answered(
        "memres_set_tag",
        unsafe { capi::memres_set_tag(std::ptr::null()) }.into(),
        false,
    );
    capi::memres_profile_reset();
}

/// One call, picked and given its arguments by the input.
fn call(input: &mut Input<'_>, held: &mut Held) {
    match input.byte() % 24 {
        0 => {
            let spec = input.text();
            let null = input.one_in(16);
            let text: *const c_char = if null {
                std::ptr::null()
            } else {
                spec.as_ptr()
            };
            // SAFETY: null or a NUL-terminated string.
            let code = unsafe { capi::memres_configure(text) };
            answered("memres_configure", code.into(), false);
        }
        1 => {
            let code = capi::memres_init_device(input.device());
            answered("memres_init_device", code.into(), false);
        }
        2 | 3 => {
            let (size, device, stream) = (input.size(), input.device(), input.stream());
            // SAFETY: the stream is a default-stream handle.
            let ptr = unsafe { capi::memres_malloc(size, device, stream) };
            let message = last_error();
            if ptr.is_null() {
                // A zero-byte request is no failure; every other null says why.
                assert_eq!(message.is_empty(), size == 0, "malloc({size}): {message:?}");
                answered("memres_malloc", if size == 0 { 0 } else { -1 }, false);
            } else {
                assert!(size > 0, "malloc({size}) gave {ptr:p}");
                held.blocks.push((ptr, size, device));
            }
        }
        4 => {
            let ptr = held.pointer(input);
            let (size, device, stream) = (input.size(), input.device(), input.stream());
            let held_at = held.blocks.iter().position(|b| *b == (ptr, size, device));
            if let Some(i) = held_at {
                held.blocks.swap_remove(i);
            }
            // SAFETY: a block of the run freed with its size and device, or a pointer
            // memres never handed out: with no driver no stack is built, and memres_free
            // refuses it (a device it never allocated on) before using it. The stream is a
            // default-stream handle.
            unsafe { capi::memres_free(ptr, size, device, stream) };
            let message = last_error();
            assert!(message.len() <= LONGEST_MESSAGE, "memres_free: {message:?}");
        }
        5 => {
            let (ptr, device) = (held.pointer(input), input.device());
            let stream = std::ptr::without_provenance_mut(input.u64() as usize);
            // SAFETY: the pointer and the stream are only compared and kept (with no
            // driver no stack is built: the call is refused before either is used).
            let code = unsafe { capi::memres_record_stream(ptr, device, stream) };
            answered("memres_record_stream", code.into(), false);
        }
        6 => {
            let device = input.device();
            let mut stats = memres_stats_t {
                live_bytes: -7,
                ..memres_stats_t::default()
            };
            let out: *mut memres_stats_t = if input.one_in(8) {
                std::ptr::null_mut()
            } else {
                &mut stats
            };
            // SAFETY: null or one `memres_stats_t` to write.
            let code = unsafe { capi::memres_stats(device, out) };
            answered("memres_stats", code.into(), false);
            if code == MEMRES_OK {
                assert!(unbuilt(&stats), "{stats:?}");
            }
        }
        7 => {
            let device = input.device();
            let capacity = usize::from(input.byte() % 4);
            let null = input.one_in(4);
            let mut buffer = vec![memres_stats_t::default(); capacity];
            let out = if null {
                std::ptr::null_mut()
            } else {
                buffer.as_mut_ptr()
            };
            // SAFETY: `capacity` entries to write, or null (with room claimed: the call
            // refuses that before writing).
            let n = unsafe { capi::memres_tier_stats(device, out, capacity) };
            answered("memres_tier_stats", n, true);
            assert!(n <= 0, "{n} tiers of a stack never built");
        }
        8 => {
            let device = input.device();
            let capacity = usize::from(input.byte() % 4);
            let null = input.one_in(4);
            let mut buffer = vec![0u64; 2 * capacity];
            let out = if null {
                std::ptr::null_mut()
            } else {
                buffer.as_mut_ptr()
            };
            // SAFETY: `2 * capacity` values to write, or null (with no stack built, the
            // call writes nothing; with room claimed it refuses a built one's).
            let n = unsafe { capi::memres_segments(device, out, capacity) };
            answered("memres_segments", n, true);
            assert!(n <= 0, "{n} segments of a stack never built");
        }
        9 => answered(
            "memres_trim",
            capi::memres_trim(input.device()).into(),
            false,
        ),
        10 => {
            let device = input.device();
            let bytes = match input.byte() % 4 {
                0 => -1,
                1 => 0,
                2 => i64::MAX,
                _ => input.u64() as i64,
            };
            let code = capi::memres_set_limit(device, bytes);
            answered("memres_set_limit", code.into(), false);
        }
        11 => {
            let code = capi::memres_reset_peak(input.device());
            answered("memres_reset_peak", code.into(), false);
        }
        12 => {
            let tag = input.tag();
            let null = input.one_in(4);
            let name = if null { std::ptr::null() } else { tag.as_ptr() };
            // SAFETY: null or a NUL-terminated string.
            let code = unsafe { capi::memres_set_tag(name) };
            answered("memres_set_tag", code.into(), false);
        }
        13..=15 => {
            let (device, tag) = (input.device(), input.tag());
            let null = input.one_in(4);
            let name = if null { std::ptr::null() } else { tag.as_ptr() };
            let mode = match input.byte() % 4 {
                0 => capi::MEMRES_SLEEP_DISCARD,
                1 => capi::MEMRES_SLEEP_OFFLOAD,
                _ => input.u64() as c_int,
            };
            // SAFETY: null or a NUL-terminated string; nothing uses the run's memory
            // (it holds no block).
            let (what, answer) = unsafe {
                match input.byte() % 3 {
                    0 => ("memres_sleep", capi::memres_sleep(device, name, mode)),
                    1 => ("memres_wake", capi::memres_wake(device, name)),
                    _ => (
                        "memres_is_asleep",
                        capi::memres_is_asleep(device, name).into(),
                    ),
                }
            };
            answered(what, answer, true);
            if what == "memres_is_asleep" {
                assert!(answer <= 1, "memres_is_asleep: {answer}");
            }
        }
        16 | 17 => {
            let ptr = held.pointer(input);
            let (size, device) = (input.size(), input.device());
            let capacity = usize::from(input.byte());
            let (out_null, offset_null) = (input.one_in(4), input.one_in(2));
            let mut buffer = vec![0u8; capacity];
            let mut offset = usize::MAX;
            let out: *mut c_void = if out_null {
                std::ptr::null_mut()
            } else {
                buffer.as_mut_ptr().cast()
            };
            let at: *mut usize = if offset_null {
                std::ptr::null_mut()
            } else {
                &mut offset
            };
            // SAFETY: `out` is null or `capacity` bytes, `at` null or one `size_t`; the
            // pointer is only looked up (with no driver no stack is built: the call refuses
            // it before using it).
            let n = unsafe { capi::memres_ipc_export(ptr, size, device, out, capacity, at) };
            answered("memres_ipc_export", n, true);
            assert!(n <= 0, "exported {n} bytes of a foreign pointer");
            assert_eq!(
                offset,
                usize::MAX,
                "the offset of a refused export was written"
            );
        }
        18 | 19 => {
            let len = match input.byte() % 4 {
                0 => 64,
                1 => 66,
                _ => usize::from(input.byte()),
            };
            let handle = input.bytes(len).to_vec();
            let device = input.device();
            let nulls = input.byte() % 8;
            let mut base: *mut c_void = std::ptr::without_provenance_mut(1);
            let bytes: *const c_void = if nulls == 0 {
                std::ptr::null()
            } else {
                handle.as_ptr().cast()
            };
            let out: *mut *mut c_void = if nulls == 1 {
                std::ptr::null_mut()
            } else {
                &mut base
            };
            // SAFETY: `handle` is valid for its length (or null), `base` for one pointer
            // (or null).
            let code = unsafe { capi::memres_ipc_open(bytes, handle.len(), device, out) };
            answered("memres_ipc_open", code.into(), false);
            if code == MEMRES_OK {
                held.opened.push(base);
            } else {
                assert_eq!(base.addr(), 1, "a refused open wrote a base");
            }
        }
        20 => {
            // A range the run opened (none without a driver), or any other address.
            let base = match held.opened.last() {
                Some(&base) if input.one_in(2) => base,
                _ => held.pointer(input),
            };
            let code = capi::memres_ipc_close(base);
            answered("memres_ipc_close", code.into(), false);
            if let Some(i) = held.opened.iter().position(|&b| b == base) {
                assert_eq!(code, MEMRES_OK, "an open range {base:p} was not closed");
                held.opened.remove(i);
            }
        }
        21 => {
            let name = input.text();
            let (null, all) = (input.one_in(8), input.byte() % 2);
            let text = if null {
                std::ptr::null()
            } else {
                name.as_ptr()
            };
            // SAFETY: null or a NUL-terminated string.
            let id = unsafe { capi::memres_profile_push(text, c_int::from(all)) };
            answered("memres_profile_push", id, true);
            assert_eq!(id > 0, !null, "memres_profile_push: {id}");
            if id > 0 {
                held.scopes.push(id);
            }
        }
        22 => {
            // A scope the run opened, or any other id.
            let id = match held.scopes.last() {
                Some(&id) if input.one_in(2) => id,
                _ => input.u64() as i64,
            };
            let code = capi::memres_profile_pop(id);
            answered("memres_profile_pop", code.into(), false);
            match held.scopes.iter().position(|&s| s == id) {
                Some(i) => {
                    assert_eq!(code, MEMRES_OK, "the open scope {id} was not closed");
                    held.scopes.remove(i);
                }
                // Every scope of this thread is the run's.
                None => assert_ne!(code, MEMRES_OK, "closed a scope {id} never opened"),
            }
        }
        _ => match input.byte() % 3 {
            0 => capi::memres_profile_reset(),
            1 => {
                let _ = last_error();
            }
            _ => {
                let len = usize::from(input.byte());
                let null = input.one_in(8);
                let mut buffer = vec![0xffu8; len];
                let buf: *mut c_char = if null {
                    std::ptr::null_mut()
                } else {
                    buffer.as_mut_ptr().cast()
                };
                // SAFETY: null or `len` bytes to write.
                let n = unsafe { capi::memres_profile_report(buf, len) };
                answered("memres_profile_report", n as i64, true);
                if n >= 0 && !null && len > 0 {
                    // The report's first bytes, ended by a NUL within the buffer.
                    let written = (n as usize).min(len - 1);
                    assert_eq!(buffer[written], 0, "the report is NUL-terminated");
                    assert!(
                        std::str::from_utf8(&buffer[..written]).is_ok() || written < n as usize,
                        "a whole report is UTF-8"
                    );
                }
            }
        },
    }
}
