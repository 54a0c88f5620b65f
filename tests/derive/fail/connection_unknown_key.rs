use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_model = 64, heads = 4)]
#[widen(residual = connection(streams = 4, segmnets = 1, carry(init = identity, contraint = softmax)))]
struct Design;

fn main() {}
