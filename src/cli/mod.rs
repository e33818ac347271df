//! The command-line surface (DESIGN.md §4): one file per subcommand.

pub mod common;
pub mod convert;
pub mod inspect;
pub mod sample;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tinygpt-cpu",
    version,
    about = "Pure-CPU LLM decoding with a bounded, quantised KV cache (StreamingLLM + KIVI)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate text from a prompt.
    Sample(sample::SampleArgs),
    /// Write a Hugging Face model directory as one .tinygpt file.
    Convert(convert::ConvertArgs),
    /// Print a model's config, parameter count, dtypes and file size.
    Inspect(inspect::InspectArgs),
}

/// Runs the parsed command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Sample(a) => sample::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Inspect(a) => inspect::run(a),
    }
}
