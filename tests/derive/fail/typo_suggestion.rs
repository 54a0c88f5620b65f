use widen::VirtualWidth;

#[derive(VirtualWidth)]
#[widen(d_modle = 256, heads = 4)]
#[widen(residual = xhc(flash = blok), mtp(dpeth = 1))]
struct Model;

fn main() {}
