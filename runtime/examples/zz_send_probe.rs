fn is_send<T: Send>() {}
fn main() { is_send::<runtime::device::cuda::CudaExecutor>(); is_send::<runtime::device::executor::CpuExecutor>(); is_send::<runtime::executor::ReferenceExecutor>(); }
