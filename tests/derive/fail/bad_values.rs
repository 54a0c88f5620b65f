use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(layers = 2.5, heads = "four", tie_embeddings = yes)]
#[widen(residual = ghc(m = 4, n = 16, r = 4), ffn = gelu)]
struct Model {
    #[widen(d_model)]
    width: usize,
}

fn main() {}
