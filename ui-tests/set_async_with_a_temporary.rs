// Rule: `set_async` may read its source after it returns, so the source must live as long
// as the program; a temporary (or a local) does not compile.
use memres::container::DeviceVec;
use memres::{HostHeap, StreamRef};

fn scale() -> f32 {
    2.0
}

fn main() -> Result<(), memres::Error> {
    let s = StreamRef::HOST;
    let mut v = DeviceVec::<f32, _>::new(4, s, HostHeap)?;
    v.set_async(0, &scale(), s)?;
    Ok(())
}
