// Rule: a container cannot outlive the stream it will be freed on.
use memres::container::DeviceBuffer;
use memres::stream::Stream;
use memres::HostHeap;

fn main() -> Result<(), memres::Error> {
    let buf;
    {
        let stream = Stream::new()?;
        buf = DeviceBuffer::new(64, stream.as_ref(), HostHeap)?;
    }
    println!("{}", buf.size());
    Ok(())
}
