//! The `tinygpt-cpu` binary: parse flags, run, print errors as one line.

use clap::Parser;
use tinygpt_cpu::cli::{run, Cli};

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        // One line, no backtrace: the error names the file/tensor/flag.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
