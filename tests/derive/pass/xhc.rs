//! An expanded-hyper-connections model (docs/math.md §6) with every list and enum knob.
use widen::ir::spec::{AugSublayers, Flash, ResidualSpec, Router};
use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_model = 128, layers = 4, heads = 4, kv_heads = 2)]
#[widen(residual = xhc(n = 16, k = 4, fixed = 2, conv_kernels = [4, 8, 12], flash = block,
                       router = softmax, temporal_aug = mlp_and_attention, gram_schmidt = false))]
struct Expanded;

pub fn main() {
    let spec = Expanded::spec();
    assert_eq!(spec.name, "expanded");
    assert_eq!(spec.kv_heads(), 2);
    let ResidualSpec::Xhc(x) = &spec.residual else { panic!("expected xHC, got {:?}", spec.residual) };
    assert_eq!((x.n, x.k, x.fixed), (16, 4, 2));
    assert_eq!(x.conv_kernels, vec![4, 8, 12]);
    assert_eq!(
        (x.flash, x.router, x.temporal_aug),
        (Flash::Block, Router::Softmax, AugSublayers::MlpAndAttention)
    );
    assert_eq!(x.gram_schmidt, Some(false));
    assert_eq!(spec.validate(), Ok(()));
}
