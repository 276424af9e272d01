//! Lending a [`DeviceVec`] to cudarc: its copies, memsets and kernel launches.
//!
//! cudarc's [`DeviceSlice`] names the stream a slice belongs to as an
//! `&Arc<CudaStream>`, which a memres vector (on a [`StreamRef`]) does not have. So the
//! vector lends itself together with the cudarc stream that *is* its stream:
//! [`DeviceVec::cudarc`] and [`DeviceVec::cudarc_mut`] check that, and return views that
//! implement [`DeviceSlice`], [`DevicePtr`] / [`DevicePtrMut`] and cudarc's
//! [`PushKernelArg`], so `stream.memcpy_htod(&host, &mut v.cudarc_mut(&stream)?)` and
//! `builder.arg(&x.cudarc(&stream)?)` work. Memory is never wrapped in a `CudaSlice`
//! (whose drop would free it).
//!
//! Work cudarc enqueues on the vector's own stream is ordered before the vector's free.
//! Where cudarc asks a view for its pointer on another stream (a copy issued from another
//! stream), the view first waits for the vector's stream on the host and has the other
//! stream synchronised when cudarc is done with the pointer, so the free cannot overtake
//! it. Two uses escape the view and are the caller's to order:
//! - kernel launches (cudarc's `launch` is `unsafe` for this): launch on the view's
//!   stream, which is the vector's;
//! - a copy *from* a view to memory of another device (`memcpy_dtod` across contexts runs
//!   on the destination's stream after asking the source for its pointer on the source's
//!   own stream): synchronise the destination stream before the source vector is dropped
//!   or changed.
//!
//! [`StreamRef`]: crate::StreamRef

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use super::vec::DeviceVec;
use crate::error::Error;
use crate::property::DeviceAccessible;
use crate::resource::Has;
use crate::resource::Resource;

/// A [`DeviceVec`] lent to cudarc for reading, on its own stream.
#[derive(Debug)]
pub struct CudarcView<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    elements: PhantomData<&'a [T]>,
}

/// A [`DeviceVec`] lent to cudarc for writing, on its own stream.
#[derive(Debug)]
pub struct CudarcViewMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    stream: &'a Arc<CudaStream>,
    elements: PhantomData<&'a mut [T]>,
}

impl<'s, T: Pod, R: Resource + Has<DeviceAccessible>> DeviceVec<'s, T, R> {
    /// The vector as a cudarc slice for reading; `stream` must be the vector's stream.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] where `stream` is not the vector's stream (move the
    /// vector with [`set_stream`](Self::set_stream) first) or belongs to another device.
    pub fn cudarc<'a>(&'a self, stream: &'a Arc<CudaStream>) -> Result<CudarcView<'a, T>, Error> {
        self.check_cudarc_stream(stream)?;
        Ok(CudarcView {
            ptr: self.as_ptr() as CUdeviceptr,
            len: self.len(),
            stream,
            elements: PhantomData,
        })
    }

    /// The vector as a cudarc slice for writing; `stream` must be the vector's stream.
    ///
    /// # Errors
    /// As [`cudarc`](Self::cudarc).
    pub fn cudarc_mut<'a>(
        &'a mut self,
        stream: &'a Arc<CudaStream>,
    ) -> Result<CudarcViewMut<'a, T>, Error> {
        self.check_cudarc_stream(stream)?;
        Ok(CudarcViewMut {
            ptr: self.as_mut_ptr() as CUdeviceptr,
            len: self.len(),
            stream,
            elements: PhantomData,
        })
    }

    fn check_cudarc_stream(&self, stream: &CudaStream) -> Result<(), Error> {
        let ours = self.stream();
        // SAFETY: the handle is only compared, never given to the driver.
        let theirs = unsafe { crate::StreamRef::from_raw(stream.cu_stream().cast()) };
        let same_stream = ours == theirs || (ours.is_default() && theirs.is_default());
        if !same_stream {
            return Err(Error::invalid_argument(format!(
                "cudarc stream {theirs:?} is not the vector's stream {ours:?}; \
                 move the vector there with `set_stream` first"
            )));
        }
        let device = stream.context().ordinal();
        if self.device().map(|d| d.ordinal() as usize) != Some(device) {
            return Err(Error::invalid_argument(format!(
                "cudarc stream of cuda:{device} used with a vector on {:?}",
                self.device()
            )));
        }
        Ok(())
    }
}

/// Orders cudarc's use of a view on `stream` against the view's own stream `own`: nothing
/// where they are the same; otherwise waits for `own` now and has `stream` synchronised
/// when cudarc drops the guard (after scheduling its work).
fn order_on<'a>(own: &CudaStream, stream: &'a CudaStream) -> SyncOnDrop<'a> {
    if own.cu_stream() == stream.cu_stream() {
        SyncOnDrop::Sync(None)
    } else {
        stream.context().record_err(own.synchronize());
        SyncOnDrop::sync_stream(stream)
    }
}

macro_rules! cudarc_view {
    ($view:ident, $($ref:tt)+) => {
        impl<T> DeviceSlice<T> for $view<'_, T> {
            fn len(&self) -> usize {
                self.len
            }

            fn stream(&self) -> &Arc<CudaStream> {
                self.stream
            }
        }

        impl<T> DevicePtr<T> for $view<'_, T> {
            fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
                (self.ptr, order_on(self.stream, stream))
            }
        }

        // SAFETY: pushes a reference to the view's device address (a `u64` that lives as
        // long as the borrow of the view, `'b: 'a`), as cudarc does for its own slices.
        unsafe impl<'a, 'b: 'a, 'c: 'b, T> PushKernelArg<$($ref)+ $view<'c, T>> for LaunchArgs<'a> {
            #[inline(always)]
            fn arg(&mut self, arg: $($ref)+ $view<'c, T>) -> &mut Self {
                let arg: &'b $view<'c, T> = arg;
                self.arg(&arg.ptr)
            }
        }
    };
}

cudarc_view!(CudarcView, &'b);
cudarc_view!(CudarcViewMut, &'b mut);

impl<T> DevicePtrMut<T> for CudarcViewMut<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, order_on(self.stream, stream))
    }
}
