//! Writes the benchmarks' flagship-huge model (12 layers, hidden 256, 8 heads, head dim
//! 32, intermediate 768, vocab 2048, random f32 weights, fixed seed) as a `.tinygpt`, for
//! measuring the CLI on it (e.g. peak RSS of `sample`, benches/README.md):
//!
//! ```sh
//! cargo run --release --example write_flagship -- /tmp/flagship
//! /usr/bin/time -v target/release/tinygpt-cpu sample /tmp/flagship/flagship-huge.tinygpt ...
//! ```

#[path = "../benches/common/mod.rs"]
mod common;

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: write_flagship DIR");
        std::process::exit(2);
    };
    let dir = std::path::PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("error: cannot create {}: {e}", dir.display());
        std::process::exit(1);
    }
    println!("{}", common::write_flagship(&dir).display());
}
