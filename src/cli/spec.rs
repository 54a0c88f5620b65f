//! `widen spec --reference`: print the spec reference (every field the parser
//! accepts, with its type, default and meaning) as Markdown. `docs/spec.md` is this
//! output; a test keeps the two equal.

use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Print the reference of every spec field as Markdown.
    #[arg(long)]
    pub reference: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.reference, "give --reference to print the spec reference (docs/spec.md)");
    print!("{}", ir::spec::reference::markdown());
    Ok(ExitCode::SUCCESS)
}
