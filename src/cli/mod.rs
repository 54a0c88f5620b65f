//! One module per subcommand.

pub mod bench;
pub mod check;
pub mod compile;
pub mod sample;
pub mod train;
