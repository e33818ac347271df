//! The HTTP surface: OpenAI-shaped `/v1/completions` and `/v1/chat/completions`
//! (server-sent events when `stream: true`), `/v1/models`, `/health`, `/metrics`, and
//! `/v1/states/save` and `/v1/states/restore` ([`super::states`]).
//!
//! Request bodies are read as JSON values and checked field by field, so every 400 names
//! the offending field (`param` in OpenAI's error object). Unknown fields are ignored, as
//! OpenAI-compatible servers do. Extension fields: `top_k`, `ignore_eos`, and the cache
//! settings `streaming_llm_sink`, `streaming_llm_window`, `streaming_llm_positions`,
//! `kv_quantize`, `kv_quantize_k`, `kv_quantize_v`, `kv_group_size`, `kv_residual`,
//! `kv_key_rope`, `kv_rotation` (the `sample` flags' names with underscores; they override the server's
//! defaults for this request), and llama-server's `cache_prompt` (default true; false: this
//! request neither resumes from nor feeds the prompt cache). `usage` carries OpenAI's
//! `prompt_tokens_details.cached_tokens`: the prompt tokens resumed from the prompt cache.
//!
//! Before a body is read, `access::check_access` applies the server's access rules: the Host
//! header must name an allowed host (the loopback names when bound to loopback, against
//! DNS rebinding), an Origin header must be an allowed origin (a web page elsewhere cannot
//! drive the server), `/v1/*` needs `Authorization: Bearer KEY` when keys are set (401,
//! compared in constant time), and POST bodies must be `application/json` (415; a browser
//! cannot send that cross-origin without a preflight, which is not answered). The body is
//! then read under `--body-timeout` (408) and `--max-body-bytes` (413), and abandoned with
//! 503 if the drain's grace ends first.
//!
//! OpenAI fields this server does not implement (`logprobs`, `echo`, `tools`,
//! `response_format` other than text, `logit_bias`, penalties, `suffix`, ...) are a 400
//! naming the field when set to anything but their no-op value, never silently ignored.
//!
//! The rest of a request's work before admission (parsing the body, checking its fields,
//! rendering the chat template, tokenising the prompt with its token limit) runs in
//! `prepare`, on the blocking pool, so this runtime's one thread only moves bytes.

use super::access::{check_access, read_body};
use super::api::{ApiError, ApiResult};
use super::params::{self, GenParams};
use super::scheduler::{Event, FinishReason, Job};
use super::{Refusal, Shared};
use crate::generate::Surface;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

/// Seconds a 429 asks the client to wait.
const RETRY_AFTER_SECS: u64 = 1;
/// After a body at least this large is prepared, freed memory is given back to the
/// system ([`crate::memory::release_free_memory`]).
const TRIM_AFTER_BODY_BYTES: usize = 1 << 20;

type AppState = Arc<Shared>;

/// The endpoints.
pub fn router(shared: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/states/save", post(states_save))
        .route("/v1/states/restore", post(states_restore))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

async fn health(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = check_access(&s, &headers, false, false) {
        return e.into_response();
    }
    if s.is_draining() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining"})),
        )
            .into_response()
    } else {
        Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = check_access(&s, &headers, false, false) {
        return e.into_response();
    }
    let text = s.metrics.render(&s.budget, s.cfg.prompt_cache_bytes);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn models(State(s): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = check_access(&s, &headers, true, false) {
        return e.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tinygpt-cpu",
            "max_model_len": s.model_cfg.max_position_embeddings,
        }]
    }))
    .into_response()
}

/// Runs a request's CPU work (`work`: parsing its body, checking its fields, rendering the
/// chat template, tokenising) on the blocking pool, at most [`Shared::prep`] requests at a
/// time, so that the runtime that accepts connections, answers `/health` and carries the
/// streams never waits for it. After a large body, the memory it freed is given back, once
/// the result is on its way.
async fn prepare<T: Send + 'static>(
    s: &AppState,
    body: Bytes,
    work: fn(&Shared, &Bytes) -> ApiResult<T>,
) -> ApiResult<T> {
    let turn = s.prep.acquire().await.map_err(|_| shutting_down())?;
    let large = body.len() >= TRIM_AFTER_BODY_BYTES;
    let shared = Arc::clone(s);
    let result = tokio::task::spawn_blocking(move || work(&shared, &body))
        .await
        .map_err(|e| ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    drop(turn);
    if large {
        tokio::task::spawn_blocking(crate::memory::release_free_memory);
    }
    result
}

async fn states_save(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    states_call(s, headers, body, super::states::save).await
}

async fn states_restore(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    states_call(s, headers, body, super::states::restore).await
}

/// A `/v1/states/*` call ([`super::states`]): access rules, the body, then `work` on the
/// blocking pool.
async fn states_call(
    s: AppState,
    headers: HeaderMap,
    body: Body,
    work: fn(&Shared, &Bytes) -> ApiResult<Value>,
) -> Response {
    let run = async {
        check_access(&s, &headers, true, true)?;
        let body = read_body(&s, &headers, body).await?;
        prepare(&s, body, work).await
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

fn shutting_down() -> ApiError {
    ApiError::status(
        StatusCode::SERVICE_UNAVAILABLE,
        "the server is shutting down",
    )
}

/// The completion's token limit, the checks `sample` makes, and admission (at once, or
/// after waiting in the queue); returns the job's channels.
async fn admit(
    s: &Shared,
    id: &str,
    p: GenParams,
    prompt_ids: Vec<u32>,
    default_max: usize,
) -> ApiResult<(Job, UnboundedReceiver<Event>, bool)> {
    if prompt_ids.is_empty() {
        return Err(ApiError::bad(
            "prompt",
            "encodes to zero tokens and the tokenizer adds no BOS",
        ));
    }
    let bounded = p.kv.window.is_some();
    let n = prompt_ids.len();
    let max_tokens = p
        .max_tokens
        .unwrap_or(default_max.min(s.cfg.limits.max_request_tokens));
    let opts = params::options(s, &p, max_tokens)?;
    // Prompts of token ids (text prompts were checked while they were tokenised).
    if opts.prompt_token_limit().is_none() && n > s.cfg.limits.max_prompt_tokens {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "{n} tokens is more than this server's --max-prompt-tokens ({})",
                s.cfg.limits.max_prompt_tokens
            ),
        ));
    }
    opts.check_prompt_on(n, Surface::Http)
        .map_err(|e| super::api::from_flag_error(e, "max_tokens"))?;
    let need = s.admission_bytes(&p.kv, n + max_tokens, p.speculate);
    if need > s.budget.max_bytes {
        let param = if bounded {
            "streaming_llm_window"
        } else {
            "max_tokens"
        };
        return Err(ApiError::bad(
            param,
            format!(
                "this request's cache may reach {need} bytes, more than the server's whole --kv-budget ({})",
                s.budget.max_bytes
            ),
        ));
    }
    if s.is_draining() {
        return Err(shutting_down());
    }
    let limits = &s.cfg.limits;
    let reservation = s
        .budget
        .reserve_or_wait(need, limits.max_queue, limits.queue_timeout, &s.draining)
        .await
        .map_err(|r| {
            if r != Refusal::Draining {
                s.metrics.requests_rejected.fetch_add(1, Ordering::Relaxed);
            }
            let message = match r {
                Refusal::Sequences => format!(
                    "all {} sequence slots (--max-sequences) are busy; retry later",
                    s.budget.max_sequences
                ),
                Refusal::Bytes { need, free } => format!(
                    "the KV budget is full: this request may need {need} bytes, {free} are free; retry later"
                ),
                Refusal::QueueFull { waiting } => format!(
                    "the server is busy and {waiting} requests are already waiting (--max-queue); retry later"
                ),
                Refusal::QueueTimeout { waited } => format!(
                    "the server stayed busy for {:.1} s (--queue-timeout); retry later",
                    waited.as_secs_f64()
                ),
                Refusal::Draining => return shutting_down(),
            };
            ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message,
                param: None,
                retry_after: Some(RETRY_AFTER_SECS),
            }
        })?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    Ok((
        Job {
            id: id.to_string(),
            prompt_ids,
            kv: p.kv,
            sampler: p.sampler,
            max_tokens,
            ignore_eos: p.ignore_eos,
            stop: p.stop,
            cache_prompt: p.cache_prompt,
            speculate: p.speculate,
            reservation,
            events: tx,
            deadline: limits
                .request_timeout
                .map(|t| std::time::Instant::now() + t),
        },
        rx,
        p.stream,
    ))
}

fn submit(s: &Shared, job: Job) -> ApiResult<()> {
    if s.submit(job) {
        Ok(())
    } else {
        Err(shutting_down())
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn next_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(1);
    format!("{prefix}-{}", N.fetch_add(1, Ordering::Relaxed))
}

/// Waits for the whole completion: its text, finish reason and usage.
async fn collect(mut rx: UnboundedReceiver<Event>) -> ApiResult<(String, FinishReason, Value)> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            done @ Event::Done { reason, .. } => return Ok((text, reason, usage(&done))),
            Event::Error(e) => return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e)),
        }
    }
    Err(ApiError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the scheduler dropped the request",
    ))
}

/// OpenAI's `usage` of a `Done` event (`null` for any other).
fn usage(done: &Event) -> Value {
    match *done {
        Event::Done {
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens,
            ..
        } => json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}),
        _ => Value::Null,
    }
}

/// An SSE response: `chunk(event)` turns each scheduler event into zero or one JSON
/// chunk; `first` chunks go out before; `data: [DONE]` ends the stream.
fn sse_response(
    rx: UnboundedReceiver<Event>,
    first: Vec<Value>,
    chunk: impl Fn(&Event) -> Option<Value> + Send + 'static,
) -> Response {
    let data = |v: &Value| SseEvent::default().data(v.to_string());
    let head: Vec<Result<SseEvent, Infallible>> = first.iter().map(|v| Ok(data(v))).collect();
    let body = UnboundedReceiverStream::new(rx).filter_map(move |ev| {
        let v = match &ev {
            Event::Error(e) => Some(json!({"error": {"message": e, "type": "server_error"}})),
            other => chunk(other),
        };
        v.map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
    });
    let done = tokio_stream::once(Ok(SseEvent::default().data("[DONE]")));
    Sse::new(tokio_stream::iter(head).chain(body).chain(done)).into_response()
}

// ---------------------------------------------------------------------------------------
// POST /v1/completions

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match completions_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(s: AppState, headers: HeaderMap, body: Body) -> ApiResult<Response> {
    check_access(&s, &headers, true, true)?;
    let body = read_body(&s, &headers, body).await?;
    let (p, prompt_ids) = prepare(&s, body, params::completion_request).await?;
    let id = next_id("cmpl");
    // OpenAI's default for /v1/completions.
    let (job, rx, stream) = admit(&s, &id, p, prompt_ids, 16).await?;
    submit(&s, job)?;
    let (created, model) = (now_secs(), s.cfg.model_name.clone());
    let obj = move |text: &str, finish: Option<&str>| {
        json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        })
    };
    if stream {
        return Ok(sse_response(rx, Vec::new(), move |ev| match ev {
            Event::Text(t) => Some(obj(t, None)),
            done @ Event::Done { reason, .. } => {
                let mut v = obj("", Some(reason.name()));
                v["usage"] = usage(done);
                Some(v)
            }
            Event::Error(_) => None,
        }));
    }
    let (text, reason, usage) = collect(rx).await?;
    let mut v = obj(&text, Some(reason.name()));
    v["usage"] = usage;
    Ok(Json(v).into_response())
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    match chat_inner(s, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(s: AppState, headers: HeaderMap, body: Body) -> ApiResult<Response> {
    check_access(&s, &headers, true, true)?;
    let body = read_body(&s, &headers, body).await?;
    let (p, prompt_ids) = prepare(&s, body, params::chat_request).await?;
    // No max_tokens: up to the context length (whatever the cache mode, to bound the run).
    let default_max = s
        .model_cfg
        .max_position_embeddings
        .saturating_sub(prompt_ids.len())
        .max(1);
    let id = next_id("chatcmpl");
    let (job, rx, stream) = admit(&s, &id, p, prompt_ids, default_max).await?;
    submit(&s, job)?;
    let (created, model) = (now_secs(), s.cfg.model_name.clone());
    if stream {
        let chunk = move |delta: Value, finish: Option<&str>| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        };
        let first = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
        return Ok(sse_response(rx, first, move |ev| match ev {
            Event::Text(t) => Some(chunk(json!({"content": t}), None)),
            done @ Event::Done { reason, .. } => {
                let mut v = chunk(json!({}), Some(reason.name()));
                v["usage"] = usage(done);
                Some(v)
            }
            Event::Error(_) => None,
        }));
    }
    let (text, reason, usage) = collect(rx).await?;
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": reason.name(),
        }],
        "usage": usage,
    }))
    .into_response())
}
