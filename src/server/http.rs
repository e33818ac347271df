//! The HTTP surface: OpenAI-shaped `/v1/completions` and `/v1/chat/completions`
//! (server-sent events when `stream: true`), `/v1/models`, `/health`, `/metrics`.
//!
//! Request bodies are read as JSON values and checked field by field, so every 400 names
//! the offending field (`param` in OpenAI's error object). Unknown fields are ignored, as
//! OpenAI-compatible servers do. Extension fields: `top_k`, `ignore_eos`, and the cache
//! settings `streaming_llm_sink`, `streaming_llm_window`, `streaming_llm_positions`,
//! `kv_quantize`, `kv_quantize_k`, `kv_quantize_v`, `kv_group_size`, `kv_residual`,
//! `kv_key_rope`, `kv_rotation` (the `sample` flags' names with underscores; they override the server's
//! defaults for this request).
//!
//! Before a body is read, [`check_access`] applies the server's access rules: the Host
//! header must name an allowed host (the loopback names when bound to loopback, against
//! DNS rebinding), an Origin header must be an allowed origin (a web page elsewhere cannot
//! drive the server), `/v1/*` needs `Authorization: Bearer KEY` when keys are set (401,
//! compared in constant time), and POST bodies must be `application/json` (415; a browser
//! cannot send that cross-origin without a preflight, which is not answered). The body is
//! then read under `--body-timeout` (408) and `--max-body-bytes` (413).
//!
//! OpenAI fields this server does not implement (`logprobs`, `echo`, `tools`,
//! `response_format` other than text, `logit_bias`, penalties, `suffix`, ...) are a 400
//! naming the field when set to anything but their no-op value, never silently ignored.

use super::scheduler::{Event, FinishReason, Job};
use super::{Refusal, Shared};
use crate::generate::{GenerateOptions, Surface};
use crate::kv_cache::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
use crate::sampler::SamplerConfig;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::StreamExt;

/// Seconds a 429 asks the client to wait.
const RETRY_AFTER_SECS: u64 = 1;
/// Most stop strings per request (OpenAI allows 4).
const MAX_STOP: usize = 16;

type AppState = Arc<Shared>;

/// The endpoints.
pub fn router(shared: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(shared)
}

/// An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
    retry_after: Option<u64>,
}

impl ApiError {
    fn bad(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            param: Some(param.to_string()),
            retry_after: None,
        }
    }
    fn unsupported(param: &str, what: &str) -> Self {
        ApiError::bad(
            param,
            format!("{what} is not supported by this server; leave it out"),
        )
    }
    fn status(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::BAD_REQUEST
            | StatusCode::REQUEST_TIMEOUT
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::UNSUPPORTED_MEDIA_TYPE => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            _ => "server_error",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        let mut r = (self.status, Json(body)).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

type ApiResult<T> = Result<T, ApiError>;

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
    let text = s.metrics.render(&s.budget);
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

// ---------------------------------------------------------------------------------------
// Access rules and the body

/// The host part of a Host header or an Origin's authority, lower case, without port
/// (`[::1]:8080` → `[::1]`).
fn host_part(authority: &str) -> String {
    let a = authority.trim().to_ascii_lowercase();
    if a.starts_with('[') {
        return match a.find(']') {
            Some(i) => a[..=i].to_string(),
            None => a,
        };
    }
    match a.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h.to_string(),
        _ => a,
    }
}

fn host_allowed(s: &Shared, host: &str) -> bool {
    let hosts = &s.cfg.access.allowed_hosts;
    hosts.is_empty() || hosts.iter().any(|h| h == "*" || *h == host_part(host))
}

/// The server's access rules (see the module docs); `key` = the endpoint needs the API
/// key, `json` = it takes a JSON body.
fn check_access(s: &Shared, headers: &HeaderMap, key: bool, json: bool) -> ApiResult<()> {
    let access = &s.cfg.access;
    if let Some(h) = headers.get(header::HOST) {
        let h = h.to_str().unwrap_or("");
        if !host_allowed(s, h) {
            return Err(ApiError::status(
                StatusCode::FORBIDDEN,
                format!("Host '{h}' is not allowed here (see serve --allowed-hosts)"),
            ));
        }
    }
    if let Some(o) = headers.get(header::ORIGIN) {
        let o = o.to_str().unwrap_or("");
        let by_list = access
            .allowed_origins
            .iter()
            .any(|a| a == "*" || a.eq_ignore_ascii_case(o.trim_end_matches('/')));
        // A page served from an allowed host (e.g. http://localhost:3000) may call.
        let by_host = o
            .split_once("://")
            .is_some_and(|(_, auth)| !access.allowed_hosts.is_empty() && host_allowed(s, auth));
        if !(by_list || by_host) {
            return Err(ApiError::status(
                StatusCode::FORBIDDEN,
                format!("Origin '{o}' is not allowed here (see serve --allowed-origins)"),
            ));
        }
    }
    if key && !access.api_keys.is_empty() {
        use subtle::ConstantTimeEq;
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| {
            // Every key is compared (no early exit on the first match).
            access.api_keys.iter().fold(0u8, |acc, k| {
                acc | g.as_bytes().ct_eq(k.as_bytes()).unwrap_u8()
            }) == 1
        });
        if !ok {
            let mut e = ApiError::status(
                StatusCode::UNAUTHORIZED,
                if given.is_some() {
                    "Incorrect API key provided"
                } else {
                    "Missing API key: send 'Authorization: Bearer KEY'"
                },
            );
            e.param = None;
            return Err(e);
        }
    }
    if json {
        let ct = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let mime = ct.split(';').next().unwrap_or("").trim();
        if !mime.eq_ignore_ascii_case("application/json") {
            return Err(ApiError::status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "Content-Type must be application/json, got '{}'",
                    if ct.is_empty() { "(none)" } else { ct }
                ),
            ));
        }
    }
    Ok(())
}

/// Reads the whole body within `--body-timeout` and `--max-body-bytes`.
async fn read_body(s: &Shared, headers: &HeaderMap, body: Body) -> ApiResult<Bytes> {
    let limits = &s.cfg.limits;
    let too_large = || {
        ApiError::status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request body is larger than this server's --max-body-bytes ({})",
                limits.max_body_bytes
            ),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_body_bytes as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(
        limits.body_timeout,
        axum::body::to_bytes(body, limits.max_body_bytes),
    )
    .await
    {
        Err(_) => Err(ApiError::status(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within --body-timeout ({} s)",
                limits.body_timeout.as_secs_f64()
            ),
        )),
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => {
            let length_limit = std::error::Error::source(&e)
                .is_some_and(|src| src.is::<http_body_util::LengthLimitError>());
            if length_limit {
                Err(too_large())
            } else {
                Err(ApiError::bad("body", format!("could not read it: {e}")))
            }
        }
    }
}

/// Refuses, before any work, fields this server would otherwise ignore.
fn refuse_unsupported(o: &Map<String, Value>) -> ApiResult<()> {
    let set = |name: &str| field(o, name);
    let truthy = |v: &Value| match v {
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(m) => !m.is_empty(),
        Value::Null => false,
    };
    for (name, what) in [
        ("logprobs", "logprobs"),
        ("top_logprobs", "top_logprobs"),
        ("echo", "echo"),
        ("suffix", "suffix (insertion)"),
        ("logit_bias", "logit_bias"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("tools", "tool calling"),
        ("tool_choice", "tool calling"),
        ("functions", "function calling"),
        ("function_call", "function calling"),
        ("parallel_tool_calls", "tool calling"),
        ("audio", "audio output"),
        ("prediction", "predicted outputs"),
    ] {
        if set(name).is_some_and(truthy) {
            return Err(ApiError::unsupported(name, what));
        }
    }
    if let Some(rf) = set("response_format") {
        if rf.get("type").and_then(Value::as_str) != Some("text") {
            return Err(ApiError::unsupported(
                "response_format",
                "a response_format other than {\"type\": \"text\"}",
            ));
        }
    }
    if let Some(m) = set("modalities") {
        if m != &json!(["text"]) {
            return Err(ApiError::unsupported(
                "modalities",
                "an output other than [\"text\"]",
            ));
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Field readers: each error names the field.

fn parse_body(body: &Bytes) -> ApiResult<Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad("body", "must be a JSON object")),
        Err(e) => Err(ApiError::bad("body", format!("invalid JSON: {e}"))),
    }
}

/// The field's value, `None` when absent or `null`.
fn field<'a>(o: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

fn get_uint(o: &Map<String, Value>, name: &str, max: u64) -> ApiResult<Option<u64>> {
    match field(o, name) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n <= max => Ok(Some(n)),
            Some(n) => Err(ApiError::bad(
                name,
                format!("{n} is above this server's limit of {max}"),
            )),
            None => Err(ApiError::bad(
                name,
                format!("must be a non-negative integer, got {v}"),
            )),
        },
    }
}

fn get_f32(o: &Map<String, Value>, name: &str) -> ApiResult<Option<f32>> {
    match field(o, name) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x as f32)),
            _ => Err(ApiError::bad(name, format!("must be a number, got {v}"))),
        },
    }
}

fn get_bool(o: &Map<String, Value>, name: &str) -> ApiResult<Option<bool>> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::bad(
            name,
            format!("must be true or false, got {v}"),
        )),
    }
}

fn get_str<'a>(o: &'a Map<String, Value>, name: &str) -> ApiResult<Option<&'a str>> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(ApiError::bad(name, format!("must be a string, got {v}"))),
    }
}

/// The settings shared by both generation endpoints.
struct GenParams {
    stream: bool,
    max_tokens: Option<usize>,
    sampler: SamplerConfig,
    ignore_eos: bool,
    stop: Vec<String>,
    kv: KvConfig,
}

fn gen_params(s: &Shared, o: &Map<String, Value>) -> ApiResult<GenParams> {
    refuse_unsupported(o)?;
    if let Some(m) = get_str(o, "model")? {
        if m != s.cfg.model_name {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                message: format!(
                    "model: '{m}' is not served here (this server serves '{}')",
                    s.cfg.model_name
                ),
                param: Some("model".into()),
                retry_after: None,
            });
        }
    }
    if let Some(n) = get_uint(o, "n", u64::MAX)? {
        if n != 1 {
            return Err(ApiError::bad("n", "only n = 1 is supported"));
        }
    }
    if let Some(b) = get_uint(o, "best_of", u64::MAX)? {
        if b != 1 {
            return Err(ApiError::bad("best_of", "only best_of = 1 is supported"));
        }
    }
    let cap = s.cfg.limits.max_request_tokens as u64;
    let max_tokens = match get_uint(o, "max_tokens", cap)? {
        Some(n) => Some(n),
        None => get_uint(o, "max_completion_tokens", cap)?,
    };
    if max_tokens == Some(0) {
        return Err(ApiError::bad("max_tokens", "must be at least 1"));
    }
    let temperature = get_f32(o, "temperature")?.unwrap_or(1.0);
    if !(0.0..=100.0).contains(&temperature) {
        return Err(ApiError::bad(
            "temperature",
            format!("must be in [0, 100], got {temperature}"),
        ));
    }
    let top_p = get_f32(o, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = get_uint(o, "top_k", s.model_cfg.vocab_size as u64)?.unwrap_or(0) as usize;
    let seed = match field(o, "seed") {
        None => None,
        // OpenAI documents the seed as an integer; negative ones are taken as two's complement.
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|i| i as u64))
                .ok_or_else(|| ApiError::bad("seed", format!("must be an integer, got {v}")))?,
        ),
    };
    let seed = seed.unwrap_or_else(|| {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        t ^ NEXT.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
    });
    let stop = match field(o, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => {
            if a.len() > MAX_STOP {
                return Err(ApiError::bad(
                    "stop",
                    format!("at most {MAX_STOP} stop strings"),
                ));
            }
            a.iter()
                .map(|v| {
                    v.as_str().map(String::from).ok_or_else(|| {
                        ApiError::bad("stop", "must be a string or a list of strings")
                    })
                })
                .collect::<ApiResult<_>>()?
        }
        Some(_) => {
            return Err(ApiError::bad(
                "stop",
                "must be a string or a list of strings",
            ))
        }
    };
    if stop.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(ApiError::bad(
            "stop",
            "each stop string must be 1 to 256 bytes",
        ));
    }
    let kv = request_kv(s, o)?;
    Ok(GenParams {
        stream: get_bool(o, "stream")?.unwrap_or(false),
        max_tokens: max_tokens.map(|n| n as usize),
        sampler: SamplerConfig {
            temperature,
            top_k,
            top_p,
            seed,
        },
        ignore_eos: get_bool(o, "ignore_eos")?.unwrap_or(false),
        stop,
        kv,
    })
}

/// The request's cache settings: the server's defaults with the request's overrides.
fn request_kv(s: &Shared, o: &Map<String, Value>) -> ApiResult<KvConfig> {
    const MAX_ROWS: u64 = crate::kv_cache::MAX_CACHE_ROWS as u64;
    let mut kv = s.cfg.kv.clone();
    let precision = |field: &str| -> ApiResult<Option<Precision>> {
        get_str(o, field)?
            .map(|p| {
                Precision::parse(p).ok_or_else(|| {
                    let names: Vec<&str> = Precision::ALL.iter().map(|p| p.name()).collect();
                    ApiError::bad(field, format!("'{p}' is not one of {}", names.join(", ")))
                })
            })
            .transpose()
    };
    if let Some(p) = precision("kv_quantize")? {
        kv.precision = p;
    }
    if let Some(p) = precision("kv_quantize_k")? {
        kv.k_precision = Some(p);
    }
    if let Some(p) = precision("kv_quantize_v")? {
        kv.v_precision = Some(p);
    }
    if let Some(r) = get_uint(o, "kv_residual", MAX_ROWS)? {
        kv.residual = r as usize;
    }
    if let Some(k) = get_str(o, "kv_key_rope")? {
        kv.key_rope = KeyRope::parse(k).ok_or_else(|| {
            ApiError::bad("kv_key_rope", format!("'{k}' is not one of pre, post"))
        })?;
    }
    if let Some(r) = get_str(o, "kv_rotation")? {
        kv.rotation = KvRotation::parse(r).ok_or_else(|| {
            ApiError::bad(
                "kv_rotation",
                format!("'{r}' is not one of auto, none, hadamard"),
            )
        })?;
    }
    if let Some(g) = get_uint(o, "kv_group_size", crate::kv_cache::MAX_GROUP_SIZE as u64)? {
        if g == 0 {
            return Err(ApiError::bad("kv_group_size", "must be at least 1"));
        }
        kv.group_size = g as usize;
    }
    if let Some(p) = get_str(o, "streaming_llm_positions")? {
        kv.positions = match p {
            "original" => PositionsMode::Original,
            "cache" => PositionsMode::Cache,
            _ => {
                return Err(ApiError::bad(
                    "streaming_llm_positions",
                    format!("'{p}' is not one of original, cache"),
                ))
            }
        };
    }
    let sink = get_uint(o, "streaming_llm_sink", MAX_ROWS)?;
    let window = get_uint(o, "streaming_llm_window", MAX_ROWS)?;
    match (sink, window) {
        (_, Some(0)) => return Err(ApiError::bad("streaming_llm_window", "must be at least 1")),
        (Some(sk), None) => {
            if kv.window.is_none() && sk > 0 {
                return Err(ApiError::bad(
                    "streaming_llm_sink",
                    "needs streaming_llm_window (sinks only matter when the window evicts rows)",
                ));
            }
            kv.sink = sk as usize;
        }
        (sk, Some(w)) => {
            kv.window = Some(w as usize);
            if let Some(sk) = sk {
                kv.sink = sk as usize;
            }
        }
        (None, None) => {}
    }
    crate::kv_cache::validate(&kv, &s.model_cfg).map_err(|e| {
        let param = match &e {
            crate::Error::Flag { flag, .. } => flag.trim_start_matches("--").replace('-', "_"),
            _ => "kv_quantize".into(),
        };
        ApiError::bad(&param, e.to_string())
    })?;
    Ok(kv)
}

/// Checks a prompt's size before it is tokenised (see
/// [`GenerateOptions::check_prompt_bytes`]): `bytes` of text for a request with `p`.
fn check_prompt_bytes(s: &Shared, p: &GenParams, bytes: usize, param: &str) -> ApiResult<()> {
    let opts = options(s, p, 1)?;
    let limit = opts
        .prompt_token_limit()
        .unwrap_or(s.cfg.limits.max_prompt_tokens);
    opts.check_prompt_bytes(bytes, &s.tokenizer, Some(limit), Surface::Http)
        .map_err(|e| from_flag_error(e, param))
}

/// `sample`'s options for this request: the one place both check a run's settings.
fn options(s: &Shared, p: &GenParams, max_tokens: usize) -> ApiResult<GenerateOptions> {
    GenerateOptions::new(
        max_tokens,
        p.sampler.clone(),
        p.ignore_eos,
        &p.kv,
        s.model_cfg.max_position_embeddings,
        s.cfg.allow_past_context,
    )
    .map_err(|e| from_flag_error(e, "temperature"))
}

/// A library refusal as a 400: a flag error names its field; others get `fallback`.
fn from_flag_error(e: crate::Error, fallback: &str) -> ApiError {
    match e {
        crate::Error::Flag { flag, msg } => {
            let field = flag.trim_start_matches("--").replace('-', "_");
            ApiError::bad(&field, msg)
        }
        other => ApiError::bad(fallback, other.to_string()),
    }
}

/// The completion's token limit, the checks `sample` makes, and admission (at once, or
/// after waiting in the queue); returns the job's channels.
async fn admit(
    s: &Shared,
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
    let opts = options(s, &p, max_tokens)?;
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
        .map_err(|e| from_flag_error(e, "max_tokens"))?;
    let need = s.worst_case_bytes(&p.kv, n + max_tokens);
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
    let draining = || {
        ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        )
    };
    if s.is_draining() {
        return Err(draining());
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
                Refusal::Draining => return draining(),
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
            prompt_ids,
            kv: p.kv,
            sampler: p.sampler,
            max_tokens,
            ignore_eos: p.ignore_eos,
            stop: p.stop,
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
        Err(ApiError::status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        ))
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

/// Waits for the whole completion: (text, finish reason, prompt tokens, completion tokens).
async fn collect(
    mut rx: UnboundedReceiver<Event>,
) -> ApiResult<(String, FinishReason, usize, usize)> {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Text(t) => text.push_str(&t),
            Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => return Ok((text, reason, prompt_tokens, completion_tokens)),
            Event::Error(e) => return Err(ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, e)),
        }
    }
    Err(ApiError::status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the scheduler dropped the request",
    ))
}

fn usage(p: usize, c: usize) -> Value {
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
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
    let o = parse_body(&body)?;
    let p = gen_params(&s, &o)?;
    let encode = |t: &str| {
        check_prompt_bytes(&s, &p, t.len(), "prompt")?;
        s.tokenizer
            .encode(t)
            .map_err(|e| ApiError::bad("prompt", e.to_string()))
    };
    let prompt_ids = match field(&o, "prompt") {
        Some(Value::String(t)) => encode(t)?,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            encode(a[0].as_str().unwrap_or_default())?
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            let vocab = s.model_cfg.vocab_size as u64;
            a.iter()
                .map(|v| match v.as_u64() {
                    Some(t) if t < vocab => Ok(t as u32),
                    _ => Err(ApiError::bad(
                        "prompt",
                        format!("token id {v} is outside the vocabulary ({vocab})"),
                    )),
                })
                .collect::<ApiResult<Vec<u32>>>()?
        }
        Some(_) => {
            return Err(ApiError::bad(
                "prompt",
                "must be a string, a list of one string, or a list of token ids",
            ))
        }
        None => return Err(ApiError::bad("prompt", "is required")),
    };
    // OpenAI's default for /v1/completions.
    let (job, rx, stream) = admit(&s, p, prompt_ids, 16).await?;
    submit(&s, job)?;
    let (id, created, model) = (next_id("cmpl"), now_secs(), s.cfg.model_name.clone());
    let obj = move |text: &str, finish: Option<&str>| {
        json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        })
    };
    if stream {
        return Ok(sse_response(rx, Vec::new(), move |ev| match ev {
            Event::Text(t) => Some(obj(t, None)),
            Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let mut v = obj("", Some(reason.name()));
                v["usage"] = usage(*prompt_tokens, *completion_tokens);
                Some(v)
            }
            Event::Error(_) => None,
        }));
    }
    let (text, reason, pt, ct) = collect(rx).await?;
    let mut v = obj(&text, Some(reason.name()));
    v["usage"] = usage(pt, ct);
    Ok(Json(v).into_response())
}

// ---------------------------------------------------------------------------------------
// POST /v1/chat/completions

fn chat_messages(o: &Map<String, Value>) -> ApiResult<Vec<BTreeMap<String, minijinja::Value>>> {
    let Some(Value::Array(msgs)) = field(o, "messages") else {
        return Err(ApiError::bad("messages", "is required and must be a list"));
    };
    if msgs.is_empty() {
        return Err(ApiError::bad("messages", "must not be empty"));
    }
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::bad("messages", "each message needs a string 'role'"))?;
            let role = match role {
                "system" | "user" | "assistant" => role,
                // OpenAI's newer name for system instructions.
                "developer" => "system",
                "tool" | "function" => {
                    return Err(ApiError::bad(
                        &format!("messages[{i}].role"),
                        format!(
                        "'{role}' messages need tool calling, which this server does not support"
                    ),
                    ))
                }
                _ => {
                    return Err(ApiError::bad(
                        &format!("messages[{i}].role"),
                        format!("'{role}' is not one of system, developer, user, assistant"),
                    ))
                }
            };
            if m.get("tool_calls").is_some_and(|v| !v.is_null()) {
                return Err(ApiError::unsupported(
                    &format!("messages[{i}].tool_calls"),
                    "tool calling",
                ));
            }
            let content = match m.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                // Content parts: the text ones, concatenated.
                Some(Value::Array(parts)) => parts
                    .iter()
                    .map(
                        |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                            (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                            _ => Err(ApiError::bad(
                                "messages",
                                "only text content parts are supported",
                            )),
                        },
                    )
                    .collect::<ApiResult<Vec<&str>>>()?
                    .concat(),
                Some(_) => {
                    return Err(ApiError::bad(
                        "messages",
                        "'content' must be a string or a list of parts",
                    ))
                }
            };
            let mut msg = BTreeMap::new();
            msg.insert("role".to_string(), minijinja::Value::from(role));
            msg.insert("content".to_string(), minijinja::Value::from(content));
            Ok(msg)
        })
        .collect()
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
    let o = parse_body(&body)?;
    let p = gen_params(&s, &o)?;
    let messages = chat_messages(&o)?;
    let template = s.chat_template.as_deref().ok_or_else(|| {
        ApiError::bad(
            "messages",
            "this model has no chat template; use /v1/completions",
        )
    })?;
    let tok = &s.tokenizer;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    let (bos, eos) = (name(tok.bos_id), name(tok.eos_ids.first().copied()));
    // As `sample --chat`: render, then encode without adding special tokens (the template
    // spells them out).
    let text = crate::chat::render_messages(template, &messages, true, &bos, &eos)
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    check_prompt_bytes(&s, &p, text.len(), "messages")?;
    let prompt_ids = tok
        .encode_with(&text, false)
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    // No max_tokens: up to the context length (whatever the cache mode, to bound the run).
    let default_max = s
        .model_cfg
        .max_position_embeddings
        .saturating_sub(prompt_ids.len())
        .max(1);
    let (job, rx, stream) = admit(&s, p, prompt_ids, default_max).await?;
    submit(&s, job)?;
    let (id, created, model) = (next_id("chatcmpl"), now_secs(), s.cfg.model_name.clone());
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
            Event::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let mut v = chunk(json!({}), Some(reason.name()));
                v["usage"] = usage(*prompt_tokens, *completion_tokens);
                Some(v)
            }
            Event::Error(_) => None,
        }));
    }
    let (text, reason, pt, ct) = collect(rx).await?;
    Ok(Json(json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": reason.name(),
        }],
        "usage": usage(pt, ct),
    }))
    .into_response())
}
