use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_model = 250, heads = 5)]
#[widen(residual = ghc(m = 4, r = 4))]
struct Vwn;

fn main() {}
