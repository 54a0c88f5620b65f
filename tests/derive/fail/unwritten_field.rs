use widen::VirtualWidth;

// The default d_model = 64 is not divisible by heads = 3. That error names
// `d_model`, which is not written here, so it points at the first `#[widen]`.
#[derive(VirtualWidth)]
#[widen(heads = 3)]
#[widen(layers = 1)]
struct Model;

fn main() {}
