//! SAXPY (`y = a * x + y`) on memres memory through cudarc: the kernel is compiled at run
//! time with NVRTC, launched by cudarc on `DeviceVec`s allocated from a `Pool<Cuda>`, and
//! the result is checked on the host.
//!
//! Run it with `cargo run --example saxpy`. Where no CUDA driver (or no NVRTC) is present,
//! it says so and exits cleanly.

use std::process::ExitCode;

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use memres::container::DeviceVec;
use memres::{Cuda, Pool, PoolConfig, StreamRef};

const KERNEL: &str = r#"
extern "C" __global__ void saxpy(float a, const float* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        y[i] = a * x[i] + y[i];
    }
}
"#;

fn main() -> ExitCode {
    if !memres::driver::is_present() {
        println!("saxpy: no CUDA driver on this machine; this example needs an NVIDIA GPU.");
        return ExitCode::SUCCESS;
    }
    // SAFETY: only asks whether the NVRTC library can be loaded.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        println!("saxpy: NVRTC (libnvrtc) is not installed; it compiles the kernel at run time.");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("saxpy: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    const N: usize = 1 << 20;
    const A: f32 = 2.5;

    // cudarc drives the GPU; memres allocates. Both use device 0's primary context.
    let ctx = CudaContext::new(0)?;
    let stream = ctx.new_stream()?;
    let s = StreamRef::from(&*stream);

    let ptx = cudarc::nvrtc::compile_ptx(KERNEL)?;
    let saxpy = ctx.load_module(ptx)?.load_function("saxpy")?;

    // A pool over the driver: after the first round, allocation is sub-allocation.
    let pool = Pool::new(Cuda::new()?, PoolConfig::default())?;
    let host_x: Vec<f32> = (0..N).map(|i| i as f32).collect();
    let host_y: Vec<f32> = (0..N).map(|i| (N - i) as f32).collect();
    let x = DeviceVec::from_slice(&host_x, s, &pool)?;
    let mut y = DeviceVec::<f32, _>::new(N, s, &pool)?;
    // cudarc's own copy into memres memory, through a view on the vector's stream.
    stream.memcpy_htod(&host_y, &mut y.cudarc_mut(&stream)?)?;

    let n = N as u32;
    {
        let (xv, mut yv) = (x.cudarc(&stream)?, y.cudarc_mut(&stream)?);
        let mut launch = stream.launch_builder(&saxpy);
        launch.arg(&A).arg(&xv).arg(&mut yv).arg(&n);
        // SAFETY: the kernel's parameters are (float, const float*, float*, unsigned int),
        // as pushed; both vectors hold `n` floats on the launch's stream, which is theirs.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n)) }?;
    }

    let result = y.to_vec(s)?; // synchronises the stream
    let wrong = (0..N)
        .filter(|&i| result[i] != A * host_x[i] + host_y[i])
        .count();
    println!(
        "saxpy: y = {A} * x + y over {N} floats on {} from a Pool<Cuda> of {} MiB: {}",
        ctx.name()?,
        pool.pool_size() >> 20,
        if wrong == 0 { "all correct" } else { "WRONG" }
    );
    println!(
        "saxpy: y[0] = {}, y[{}] = {}",
        result[0],
        N - 1,
        result[N - 1]
    );
    if wrong != 0 {
        return Err(format!("{wrong} of {N} elements are wrong").into());
    }
    Ok(())
}
