//! The command-line surface (docs/design.md §4): one file per subcommand.

pub mod cache_table;
pub mod common;
pub mod compare;
pub mod convert;
pub mod inspect;
pub mod out;
pub mod perplexity;
pub mod sample;
pub mod serve;

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
    /// Teacher-forced perplexity of a text through the cached decode path.
    Perplexity(perplexity::PerplexityArgs),
    /// Greedy agreement of KV precisions with the fp32 cache.
    Compare(compare::CompareArgs),
    /// Bytes a filled KV cache holds, per precision.
    CacheTable(cache_table::CacheTableArgs),
    /// Write a Hugging Face model directory as one .tinygpt file.
    Convert(convert::ConvertArgs),
    /// Print a model's config, parameter count, dtypes and file size.
    Inspect(inspect::InspectArgs),
    /// OpenAI-compatible HTTP server with continuous batching.
    Serve(serve::ServeArgs),
}

/// Runs the parsed command. Output goes through [`out`]: a closed or full stdout is an
/// [`Error::Write`](crate::Error::Write), never a panic.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Sample(a) => sample::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Compare(a) => compare::run(a),
        Command::CacheTable(a) => cache_table::run(a),
        Command::Convert(a) => convert::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Serve(a) => serve::run(a),
    }
}
