//! One module per subcommand.

pub mod bench;
pub mod build;
pub mod check;
pub mod compile;
pub mod parity;
pub mod sample;
pub mod train;
