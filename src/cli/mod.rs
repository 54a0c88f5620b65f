//! One module per subcommand.

pub mod bench;
pub mod check;
pub mod sample;
pub mod train;
