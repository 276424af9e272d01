// Rule: a container that borrows its resource (`&Pool<..>`) cannot outlive it: RMM's
// containers dangle here, memres's do not compile.
use memres::container::DeviceVec;
use memres::{HostHeap, Pool, PoolConfig, StreamRef};

fn main() -> Result<(), memres::Error> {
    let v;
    {
        let pool = Pool::new(HostHeap, PoolConfig::default())?;
        v = DeviceVec::<f32, _>::new(10, StreamRef::HOST, &pool)?;
    }
    println!("{}", v.len());
    Ok(())
}
