//! System memory the GPU reaches directly: [`System`] and [`SamHeadroom`].

use std::alloc::Layout;
use std::ptr::NonNull;

use super::driver_leaf::free_after;
use super::host_heap::HostHeap;
use crate::device::{Context, DeviceId, bind, process_is_exiting};
use crate::error::Error;
use crate::platform::{Active, Attribute, Feature, Location, Platform};
use crate::property::HostDevice;
use crate::resource::{Resource, SyncResource};
use crate::stream::StreamRef;

/// The check both resources make: the device can access pageable host memory (HMM or
/// ATS), else [`Error::Unsupported`].
fn pageable_access(device: DeviceId) -> Result<Context, Error> {
    let ctx = Context::primary(device)?;
    if device.attribute(Attribute::PageableMemoryAccess)? == 0 {
        return Err(Error::unsupported(format!(
            "{device} cannot access pageable host memory \
             (CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS is 0: no HMM or ATS); \
             use Managed or PinnedHost instead"
        )));
    }
    Ok(ctx)
}

/// Ordinary host memory (the Rust global allocator) used directly by the GPU, on systems
/// where the device can access pageable memory through HMM or ATS (RMM's
/// `system_memory_resource`).
///
/// - Host- and device-accessible; any power-of-two alignment (at least 256 is used).
/// - [`System::new`] checks `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` and returns
///   [`Error::Unsupported`] where it is 0.
/// - Streams: memory is usable at once; the stream-ordered `deallocate` synchronises its
///   stream before freeing, since kernels on it may still use the memory.
/// - Stateless: all `System`s are equal.
#[derive(Debug, Clone, Copy)]
pub struct System {
    ctx: Context,
}

impl System {
    /// System memory for the current device, if it can access pageable memory.
    pub fn new() -> Result<System, Error> {
        System::on(DeviceId::current()?)
    }

    /// System memory for `device`, if it can access pageable memory.
    pub fn on(device: DeviceId) -> Result<System, Error> {
        Ok(System {
            ctx: pageable_access(device)?,
        })
    }

    /// The device the resource was checked for.
    pub fn device(&self) -> DeviceId {
        self.ctx.device()
    }

    /// The layout widened to 256-byte alignment (a no-op for most); a size so close to
    /// `isize::MAX` that the widening overflows cannot be served: out of memory.
    fn layout(layout: Layout) -> Result<Layout, Error> {
        layout
            .align_to(crate::resource::DEFAULT_ALIGNMENT)
            .map_err(|_| Error::out_of_memory(layout.size()))
    }
}

impl PartialEq for System {
    /// Always: host memory from one `System` may be freed by any other.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

// SAFETY: blocks come from the global allocator (`HostHeap`) with the caller's size and
// at least its alignment; the device reaches them through HMM/ATS, which the constructor
// checked; any `System` may free them.
unsafe impl SyncResource for System {
    type Properties = HostDevice;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        HostHeap.allocate_sync(Self::layout(layout)?)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // A layout that could not be widened was never served, so it is never freed.
        let Ok(widened) = Self::layout(layout) else {
            return;
        };
        // SAFETY: the block came from `allocate_sync`, i.e. `HostHeap` with this layout
        // widened the same way; nothing uses it any more (the caller's promise).
        unsafe { HostHeap.deallocate_sync(ptr, widened) }
    }
}

// SAFETY: as for `SyncResource`; the stream-ordered free waits for the stream first.
unsafe impl Resource for System {
    fn allocate(&self, _stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        // Host memory from the heap: no driver call, so nothing a capture forbids.
        self.allocate_sync(layout)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() == 0 || process_is_exiting() {
            // SAFETY: nothing waits on a zero-byte block; at exit the heap is still ours.
            return unsafe { self.deallocate_sync(ptr, layout) };
        }
        let (this, address) = (*self, ptr.as_ptr().expose_provenance());
        free_after(stream, self.ctx, "System", move || {
            let ptr = std::ptr::with_exposed_provenance_mut::<u8>(address);
            let ptr = NonNull::new(ptr).expect("a freed block is not null");
            // SAFETY: the work ordered before this free on `stream` is done (`free_after`
            // waited), so nothing uses the memory; it came from this resource with
            // `layout`.
            unsafe { this.deallocate_sync(ptr, layout) }
        });
    }
}

/// [`System`] memory that leaves `headroom` bytes of GPU memory free (RMM's
/// `sam_headroom_memory_resource`).
///
/// On a system where the GPU reaches host memory (HMM/ATS), pages of system memory can
/// migrate to the GPU when it touches them. This resource advises each new allocation
/// where to live: the part that fits in the device's free memory less `headroom`
/// prefers the device, and the rest prefers the host, so the GPU always keeps `headroom`
/// bytes for other allocations (CUDA's own, a cuBLAS workspace). The advice is checked
/// against free memory at allocation time; later allocations elsewhere are not re-advised.
///
/// Otherwise as [`System`]; two `SamHeadroom`s are equal (either may free the other's
/// memory).
#[derive(Debug, Clone, Copy)]
pub struct SamHeadroom {
    system: System,
    headroom: usize,
}

impl SamHeadroom {
    /// Keeps `headroom` bytes of the current device's memory free.
    pub fn new(headroom: usize) -> Result<SamHeadroom, Error> {
        SamHeadroom::on(DeviceId::current()?, headroom)
    }

    /// Keeps `headroom` bytes of `device`'s memory free.
    pub fn on(device: DeviceId, headroom: usize) -> Result<SamHeadroom, Error> {
        crate::driver::require(Feature::LocatedAdvice, "SamHeadroom (cuMemAdvise_v2)")?;
        Ok(SamHeadroom {
            system: System::on(device)?,
            headroom,
        })
    }

    /// The headroom in bytes.
    pub fn headroom(&self) -> usize {
        self.headroom
    }

    /// How many of `size` bytes may live on the device now, rounded down to 256 bytes.
    fn device_portion(&self, size: usize) -> Result<usize, Error> {
        let _current = bind(self.system.ctx)?;
        // The device's context is current.
        let (free, _total) = Active::memory_info()?;
        let allowed = free.saturating_sub(self.headroom).min(size);
        Ok(allowed & !(crate::resource::DEFAULT_ALIGNMENT - 1))
    }

    /// Sets the preferred location of `[start, start + len)`.
    fn advise(&self, start: usize, len: usize, on_device: bool) -> Result<(), Error> {
        let location = if on_device {
            Location::Device(self.system.device().ordinal())
        } else {
            Location::Host
        };
        let _current = bind(self.system.ctx)?;
        // SAFETY: the range lies inside a live allocation of this resource; advice only
        // changes where pages prefer to live, never their contents.
        unsafe { Active::advise_preferred(start, len, location) }
    }

    fn place(&self, ptr: NonNull<u8>, size: usize) -> Result<(), Error> {
        let on_device = self.device_portion(size)?;
        let start = ptr.as_ptr() as usize;
        if on_device > 0 {
            self.advise(start, on_device, true)?;
        }
        if on_device < size {
            self.advise(start + on_device, size - on_device, false)?;
        }
        Ok(())
    }
}

impl PartialEq for SamHeadroom {
    /// Always: the memory is system memory, which any of them may free.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

// SAFETY: as `System`, whose blocks these are; the advice changes only page placement.
unsafe impl SyncResource for SamHeadroom {
    type Properties = HostDevice;

    fn allocate_sync(&self, layout: Layout) -> Result<NonNull<u8>, Error> {
        let ptr = self.system.allocate_sync(layout)?;
        if layout.size() > 0
            && let Err(e) = self.place(ptr, layout.size())
        {
            // SAFETY: allocated just above with `layout`, never handed out.
            unsafe { self.system.deallocate_sync(ptr, layout) };
            return Err(e);
        }
        Ok(ptr)
    }

    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the block came from `self.system` with `layout` (the caller's promise).
        unsafe { self.system.deallocate_sync(ptr, layout) }
    }
}

// SAFETY: as for `SyncResource`; the free goes through `System`'s stream-ordered free.
unsafe impl Resource for SamHeadroom {
    fn allocate(&self, _stream: StreamRef<'_>, layout: Layout) -> Result<NonNull<u8>, Error> {
        self.allocate_sync(layout)
    }

    unsafe fn deallocate(&self, stream: StreamRef<'_>, ptr: NonNull<u8>, layout: Layout) {
        // SAFETY: the caller keeps `deallocate`'s contract; the block is `System`'s.
        unsafe { self.system.deallocate(stream, ptr, layout) }
    }
}
