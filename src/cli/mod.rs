//! The command-line surface (docs/design.md §4): one file per subcommand.

pub mod cache_table;
pub mod common;
pub mod compare;
pub mod convert;
pub mod inspect;
pub mod out;
pub mod perplexity;
pub mod plot;
pub mod sample;
pub mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tinygpt-cpu",
    version,
    about = "Pure-CPU LLM decoding with a bounded, quantised KV cache (StreamingLLM + KIVI)",
    after_help = r#"Example (the bundled model, 1,000 tokens through a 256-row int4 cache):
  tinygpt-cpu sample --prompt "Once upon a time" --tokens 1000 \
      --streaming-llm-sink 4 --streaming-llm-window 252 --kv-quantize int4"#
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Generate text from a prompt.
    #[command(after_help = r#"Example:
  tinygpt-cpu sample model.gguf --chat --prompt "Write one sentence about the sea." \
      --temperature 0 --streaming-llm-sink 4 --streaming-llm-window 252 --kv-quantize int4"#)]
    Sample(sample::SampleArgs),
    /// Teacher-forced perplexity of a text through the cached decode path.
    #[command(after_help = r#"Example:
  tinygpt-cpu perplexity --text fixtures/heldout.txt --max-tokens 1024 \
      --compare-modes "sink=4,window=252;sink=4,window=252,kv=int8;sink=4,window=252,kv=int4""#)]
    Perplexity(perplexity::PerplexityArgs),
    /// Greedy agreement of KV precisions with the fp32 cache.
    #[command(after_help = r#"Example:
  tinygpt-cpu compare --prompts docs/eval/tiny_prompts.txt --modes int8,int4,int4+r32"#)]
    Compare(compare::CompareArgs),
    /// Bytes a filled KV cache holds, per precision.
    #[command(after_help = r#"Example:
  tinygpt-cpu cache-table model.gguf --lengths 1024,4096 --modes fp32,int8,int4,int4+r128"#)]
    CacheTable(cache_table::CacheTableArgs),
    /// Write a Hugging Face model directory as one .tinygpt file.
    #[command(after_help = r#"Example:
  tinygpt-cpu convert fixtures/tiny tiny.tinygpt"#)]
    Convert(convert::ConvertArgs),
    /// Print a model's config, parameter count, dtypes and file size.
    #[command(after_help = r#"Example:
  tinygpt-cpu inspect model.gguf"#)]
    Inspect(inspect::InspectArgs),
    /// OpenAI-compatible HTTP server with continuous batching.
    #[command(after_help = r#"Example:
  tinygpt-cpu serve model.gguf --streaming-llm-sink 4 --streaming-llm-window 252 --kv-quantize int4
  curl -s localhost:8080/v1/completions -H 'Content-Type: application/json' \
      -d '{"prompt": "Once upon a time", "max_tokens": 32}'"#)]
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
