use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_model = 128, widht = 3)]
#[widen(residual = hc(n = 4, streams = 2))]
struct Model;

fn main() {}
