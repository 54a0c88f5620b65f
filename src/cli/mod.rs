//! One module per subcommand.

pub mod check;
pub mod sample;
pub mod train;
