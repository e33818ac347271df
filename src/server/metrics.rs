//! Counters and gauges for `GET /metrics`, in the Prometheus text exposition format.
//! The scheduler writes them once per step; handlers read them.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Server metrics; all relaxed atomics (each value is independent).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Sequences past their prompt, generating.
    pub active: AtomicU64,
    /// Sequences admitted whose prompt is not fully prefilled yet.
    pub prefilling: AtomicU64,
    pub tokens_generated: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub requests_finished: AtomicU64,
    pub requests_cancelled: AtomicU64,
    /// Answered 429 (budget or sequence limit).
    pub requests_rejected: AtomicU64,
    /// Cut by `--request-timeout`.
    pub requests_timed_out: AtomicU64,
    pub steps: AtomicU64,
    /// f64 bits: generated tokens per second over the last ~2 s of steps.
    pub decode_tok_s: AtomicU64,
    /// Bytes the active sequences' caches hold now (counted from their buffers).
    pub kv_bytes_in_use: AtomicU64,
    /// Requests that looked in the prompt cache and resumed from an entry.
    pub prompt_cache_hits: AtomicU64,
    /// Requests that looked in the prompt cache and found no entry to resume from.
    pub prompt_cache_misses: AtomicU64,
    /// Prompt tokens resumed from the prompt cache instead of prefilled.
    pub prompt_cache_reused_tokens: AtomicU64,
    /// What the prompt cache's entries count against `--prompt-cache-bytes`.
    pub prompt_cache_bytes: AtomicU64,
    pub prompt_cache_entries: AtomicU64,
    /// Bytes the running sequences' holds keep beside their caches.
    pub prompt_cache_hold_bytes: AtomicU64,
    /// Draft tokens verified (speculative decoding, `speculate`).
    pub speculate_drafted: AtomicU64,
    /// Draft tokens accepted.
    pub speculate_accepted: AtomicU64,
    /// Verification passes (a decoding sequence's multi-token forward).
    pub speculate_passes: AtomicU64,
}

impl Metrics {
    pub fn set_decode_tok_s(&self, v: f64) {
        self.decode_tok_s.store(v.to_bits(), Ordering::Relaxed);
    }

    /// The prompt cache's gauges, from `pc`.
    pub fn set_prompt_cache(&self, pc: &super::prompt_cache::PromptCache) {
        self.prompt_cache_bytes
            .store(pc.bytes() as u64, Ordering::Relaxed);
        self.prompt_cache_entries
            .store(pc.len() as u64, Ordering::Relaxed);
    }

    /// The exposition text, with the admission state of `admission`.
    pub fn render(&self, admission: &super::Budget, prompt_cache_limit: usize) -> String {
        let limit = prompt_cache_limit;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let reserved = admission.used();
        let (max_sequences, budget) = (admission.max_sequences, admission.max_bytes);
        let (waiting, waited, wait_secs) = admission.queue_stats();
        let rows: [(&str, &str, &str, String); 17] = [
            (
                "tinygpt_active_sequences",
                "gauge",
                "Sequences generating tokens.",
                g(&self.active).to_string(),
            ),
            (
                "tinygpt_queued_sequences",
                "gauge",
                "Sequences admitted and waiting for or in prompt prefill.",
                g(&self.prefilling).to_string(),
            ),
            (
                "tinygpt_admitted_sequences",
                "gauge",
                "Sequences holding an admission (queued + active).",
                reserved.0.to_string(),
            ),
            (
                "tinygpt_max_sequences",
                "gauge",
                "--max-sequences.",
                max_sequences.to_string(),
            ),
            (
                "tinygpt_tokens_generated_total",
                "counter",
                "Tokens sampled.",
                g(&self.tokens_generated).to_string(),
            ),
            (
                "tinygpt_prompt_tokens_total",
                "counter",
                "Prompt tokens prefilled.",
                g(&self.prompt_tokens).to_string(),
            ),
            (
                "tinygpt_requests_finished_total",
                "counter",
                "Requests that ran to a stop condition.",
                g(&self.requests_finished).to_string(),
            ),
            (
                "tinygpt_requests_cancelled_total",
                "counter",
                "Requests whose client went away before the end.",
                g(&self.requests_cancelled).to_string(),
            ),
            (
                "tinygpt_requests_rejected_total",
                "counter",
                "Requests answered 429 (queue full or queue timeout; with --max-queue 0, sequence limit or KV budget full).",
                g(&self.requests_rejected).to_string(),
            ),
            (
                "tinygpt_requests_timed_out_total",
                "counter",
                "Requests cut by --request-timeout (finish reason length).",
                g(&self.requests_timed_out).to_string(),
            ),
            (
                "tinygpt_waiting_requests",
                "gauge",
                "Requests waiting in the admission queue.",
                waiting.to_string(),
            ),
            (
                "tinygpt_queue_wait_seconds_sum",
                "counter",
                "Seconds spent in the admission queue by requests that left it.",
                format!("{wait_secs:.6}"),
            ),
            (
                "tinygpt_queue_wait_seconds_count",
                "counter",
                "Requests that left the admission queue (admitted, timed out, refused or gone).",
                waited.to_string(),
            ),
            (
                "tinygpt_decode_tokens_per_second",
                "gauge",
                "Tokens generated per second, all sequences, over the last ~2 s.",
                format!("{:.3}", f64::from_bits(g(&self.decode_tok_s))),
            ),
            (
                "tinygpt_kv_bytes_in_use",
                "gauge",
                "Bytes the active sequences' KV caches hold now.",
                g(&self.kv_bytes_in_use).to_string(),
            ),
            (
                "tinygpt_kv_bytes_reserved",
                "gauge",
                "Worst-case KV bytes of the admitted sequences.",
                reserved.1.to_string(),
            ),
            (
                "tinygpt_kv_budget_bytes",
                "gauge",
                "--kv-budget.",
                budget.to_string(),
            ),
        ];
        let mut out = String::new();
        let rows = rows
            .into_iter()
            .chain(self.prompt_cache_rows(limit))
            .chain(self.speculate_rows());
        for (name, kind, help, value) in rows {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        out
    }

    /// Speculative decoding's rows of [`render`](Self::render).
    fn speculate_rows(&self) -> [(&'static str, &'static str, &'static str, String); 3] {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            (
                "tinygpt_speculate_drafted_total",
                "counter",
                "Draft tokens verified (speculative decoding).",
                g(&self.speculate_drafted).to_string(),
            ),
            (
                "tinygpt_speculate_accepted_total",
                "counter",
                "Draft tokens accepted (speculative decoding).",
                g(&self.speculate_accepted).to_string(),
            ),
            (
                "tinygpt_speculate_passes_total",
                "counter",
                "Verification passes: decode steps that ran a draft (speculative decoding).",
                g(&self.speculate_passes).to_string(),
            ),
        ]
    }

    /// The prompt cache's rows of [`render`](Self::render); `limit`: `--prompt-cache-bytes`.
    fn prompt_cache_rows(
        &self,
        limit: usize,
    ) -> [(&'static str, &'static str, &'static str, String); 7] {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            (
                "tinygpt_prompt_cache_hits_total",
                "counter",
                "Requests resumed from a kept cache (prompt cache).",
                g(&self.prompt_cache_hits).to_string(),
            ),
            (
                "tinygpt_prompt_cache_misses_total",
                "counter",
                "Requests that looked in the prompt cache and found nothing to resume from.",
                g(&self.prompt_cache_misses).to_string(),
            ),
            (
                "tinygpt_prompt_cache_reused_tokens_total",
                "counter",
                "Prompt tokens resumed from the prompt cache instead of prefilled.",
                g(&self.prompt_cache_reused_tokens).to_string(),
            ),
            (
                "tinygpt_prompt_cache_bytes",
                "gauge",
                "Bytes the prompt cache's entries count (worst-case cache bytes plus holds).",
                g(&self.prompt_cache_bytes).to_string(),
            ),
            (
                "tinygpt_prompt_cache_entries",
                "gauge",
                "Finished sequences' caches kept in the prompt cache.",
                g(&self.prompt_cache_entries).to_string(),
            ),
            (
                "tinygpt_prompt_cache_limit_bytes",
                "gauge",
                "--prompt-cache-bytes.",
                limit.to_string(),
            ),
            (
                "tinygpt_prompt_cache_hold_bytes",
                "gauge",
                "Bytes the running sequences hold for the prompt cache beside their caches.",
                g(&self.prompt_cache_hold_bytes).to_string(),
            ),
        ]
    }
}
