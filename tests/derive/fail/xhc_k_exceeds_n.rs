use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_model = 128, heads = 4, residual = xhc(n = 4, k = 5, fixed = 2))]
struct Expanded;

fn main() {}
