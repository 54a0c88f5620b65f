use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_model = 64, heads = 4)]
#[widen(residual = connection(
    streams = 4,
    create = split,
    carry(constraint = sinkhorn(iters = 0, eps = 1e-6)),
    write(init = logit(1.5)),
))]
struct Design;

fn main() {}
