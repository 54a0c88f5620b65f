use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_model = 64, heads = 4)]
#[widen(residual = connection(
    read(init = logit(0.25), constraint = sigmod(scale = 1.0, offset = 0.0)),
    carry(constraint = sinkhorn_knopp),
    write(constraint = sigmoid(scale = 2.0)),
))]
struct Design;

fn main() {}
