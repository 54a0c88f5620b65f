use widen::VirtualWidth;

// Three validation errors in different places, reported together. `k` is left at
// its default (4), so that error points at the whole `xhc(..)` value.
#[derive(VirtualWidth)]
#[widen(heads = 4, kv_heads = 3)]
#[widen(residual = xhc(n = 2), train(seq_len = 1))]
struct Model;

// The impl is still emitted, so code using the type type-checks.
fn main() {
    let _ = Model::spec();
}
