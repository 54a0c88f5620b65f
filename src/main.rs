//! The `widen` command line.

mod cli;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "widen", version, about = "Compile and train transformers with expanded residual streams")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a spec and print its cost report.
    Check(cli::check::Args),
    /// Print the reference of every spec field (docs/spec.md).
    Spec(cli::spec::Args),
    /// Compile a spec and write graph dumps, kernels and the plan.
    Compile(cli::compile::Args),
    /// Train a model from a spec.
    Train(cli::train::Args),
    /// Generate text from a checkpoint.
    Sample(cli::sample::Args),
    /// A checkpoint's validation loss; optionally dump one batch's logits, loss and gradients.
    Eval(cli::eval::Args),
    /// Measure training throughput against the plain-residual baseline.
    Bench(cli::bench::Args),
    /// Compile a spec into a standalone executable that trains the model.
    Build(cli::standalone::Args),
    /// Compare a compiled device against the reference executor.
    Parity(cli::parity::Args),
    /// Train a family of models over spec fields and compare them (results, fits, plots).
    Sweep(cli::sweep::Args),
    /// Rewrite a sweep folder's results and plots and print its table.
    Report(cli::report::Args),
    /// Draw one run's loss curves as SVG.
    Plot(cli::plot::Args),
    /// muP coordinate check: activation size per layer across widths over a few steps.
    CoordCheck(cli::coord_check::Args),
    /// Token datasets: `widen data prepare` tokenizes text into llm.c shards (docs/data.md).
    Data(cli::data::Args),
}

fn main() -> ExitCode {
    // Before anything is written: a file-size limit then fails the write
    // that crosses it with an error naming the file, instead of killing the
    // process with SIGXFSZ and no message.
    if let Err(err) = runtime::process::report_file_size_limit_as_error() {
        eprintln!("warning: cannot handle SIGXFSZ ({err}); a file-size limit would end widen silently");
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(args) => cli::check::run(args),
        Command::Spec(args) => cli::spec::run(args),
        Command::Compile(args) => cli::compile::run(args),
        Command::Train(args) => cli::train::run(args),
        Command::Sample(args) => cli::sample::run(args),
        Command::Eval(args) => cli::eval::run(args),
        Command::Bench(args) => cli::bench::run(args),
        Command::Build(args) => cli::standalone::run(args),
        Command::Parity(args) => cli::parity::run(args),
        Command::Sweep(args) => cli::sweep::run(args),
        Command::Report(args) => cli::report::run(args),
        Command::Plot(args) => cli::plot::run(args),
        Command::CoordCheck(args) => cli::coord_check::run(args),
        Command::Data(args) => cli::data::run(args),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
