// Rule: a `StreamRef` borrows the stream it names, so it cannot outlive it; the CUDA
// driver cannot be relied on to catch a destroyed stream handle, the compiler can.
use std::sync::Arc;

use cudarc::driver::CudaStream;
use memres::StreamRef;

fn name_of_a_stream_about_to_be_dropped(stream: Arc<CudaStream>) -> StreamRef<'static> {
    StreamRef::from(&*stream)
}

fn main() {
    let _ = name_of_a_stream_about_to_be_dropped;
}
