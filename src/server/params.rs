//! The generation settings of a request (both endpoints), and its prompt as token ids.

use super::api::*;
use super::Shared;
use crate::generate::{GenerateOptions, Surface};
use crate::kv_cache::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
use crate::sampler::SamplerConfig;
use crate::speculate::SpecConfig;
use crate::tokenizer::Bounded;
use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Most stop strings per request (OpenAI allows 4).
const MAX_STOP: usize = 16;

/// The settings shared by both generation endpoints.
pub(super) struct GenParams {
    pub(super) stream: bool,
    pub(super) max_tokens: Option<usize>,
    pub(super) sampler: SamplerConfig,
    pub(super) ignore_eos: bool,
    pub(super) stop: Vec<String>,
    pub(super) kv: KvConfig,
    /// `cache_prompt` (llama-server's name; default true): use the prompt cache.
    pub(super) cache_prompt: bool,
    /// `speculate`: prompt-lookup drafts (`"ngram"`, `"ngram:K"`), off (`false`, `"off"`),
    /// or when absent the server's `--speculate`.
    pub(super) speculate: Option<SpecConfig>,
}

/// A `/v1/completions` body: its settings and its prompt as ids (`prompt`: a string, a
/// list of one string, or a list of token ids).
pub(super) fn completion_request(s: &Shared, body: &Bytes) -> ApiResult<(GenParams, Vec<u32>)> {
    let o = parse_body(body)?;
    let p = gen_params(s, &o)?;
    let ids = match field(&o, "prompt") {
        Some(Value::String(t)) => encode_prompt(s, &p, t, true, "prompt")?,
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            encode_prompt(s, &p, a[0].as_str().unwrap_or_default(), true, "prompt")?
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
    Ok((p, ids))
}

/// A `/v1/chat/completions` body: its settings and its `messages` rendered with the chat
/// template and tokenised, as `sample --chat` does (without adding special tokens: the
/// template spells them out).
pub(super) fn chat_request(s: &Shared, body: &Bytes) -> ApiResult<(GenParams, Vec<u32>)> {
    let o = parse_body(body)?;
    let p = gen_params(s, &o)?;
    let messages = chat_messages(&o)?;
    drop(o);
    let template = s.chat_template.as_deref().ok_or_else(|| {
        ApiError::bad(
            "messages",
            "this model has no chat template; use /v1/completions",
        )
    })?;
    let tok = &s.tokenizer;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    let (bos, eos) = (name(tok.bos_id), name(tok.eos_ids.first().copied()));
    let text = crate::chat::render_messages(template, &messages, true, &bos, &eos)
        .map_err(|e| ApiError::bad("messages", e.to_string()))?;
    drop(messages);
    let ids = encode_prompt(s, &p, &text, false, "messages")?;
    Ok((p, ids))
}

/// Tokenises a prompt text of a request with settings `p`, refused with a 400 naming
/// `param` as soon as it is known to be longer than its token limit (the context length
/// for a dense cache, else `--max-prompt-tokens`): first by its length in bytes
/// ([`GenerateOptions::check_prompt_bytes`]), then while it is tokenised
/// ([`crate::tokenizer::Tokenizer::encode_bounded`]), so that refusing costs work bounded
/// by the limit, not by the text.
fn encode_prompt(
    s: &Shared,
    p: &GenParams,
    text: &str,
    add_special_tokens: bool,
    param: &str,
) -> ApiResult<Vec<u32>> {
    let opts = options(s, p, 1)?;
    let dense = opts.prompt_token_limit();
    let limit = dense.unwrap_or(s.cfg.limits.max_prompt_tokens);
    opts.check_prompt_bytes(text.len(), &s.tokenizer, Some(limit), Surface::Http)
        .map_err(|e| from_flag_error(e, param))?;
    let found = s
        .tokenizer
        .encode_bounded(text, add_special_tokens, limit)
        .map_err(|e| ApiError::bad(param, e.to_string()))?;
    match found {
        Bounded::Ids(ids) => Ok(ids),
        Bounded::Over { at_least, exact } => {
            let n = if exact {
                format!("{at_least} tokens")
            } else {
                format!("at least {at_least} tokens")
            };
            Err(ApiError::bad(
                param,
                match dense {
                    Some(ctx) => format!(
                        "{n} exceeds the model's context length ({ctx}); bound the cache with \
                         streaming_llm_sink and streaming_llm_window, or start the server with \
                         --allow-past-context to run dense attention past it anyway"
                    ),
                    None => format!("{n} is more than this server's --max-prompt-tokens ({limit})"),
                },
            ))
        }
    }
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
        cache_prompt: get_bool(o, "cache_prompt")?.unwrap_or(true),
        speculate: speculate(s, o)?,
    })
}

/// The request's `speculate` (`sample --speculate`'s values, and `false` or `"off"` to
/// turn the server's default off), or the server's `--speculate` when absent or null.
fn speculate(s: &Shared, o: &Map<String, Value>) -> ApiResult<Option<SpecConfig>> {
    match field(o, "speculate") {
        None => Ok(s.cfg.speculate),
        Some(Value::Bool(false)) => Ok(None),
        Some(Value::String(v)) if v == "off" => Ok(None),
        Some(Value::String(v)) => SpecConfig::parse(v, "speculate")
            .map(Some)
            .map_err(|e| from_flag_error(e, "speculate")),
        Some(v) => Err(ApiError::bad(
            "speculate",
            format!("must be \"ngram\", \"ngram:K\", \"off\" or false, got {v}"),
        )),
    }
}

/// The request's cache settings: the server's defaults with the request's overrides.
pub(super) fn request_kv(s: &Shared, o: &Map<String, Value>) -> ApiResult<KvConfig> {
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

/// `sample`'s options for this request: the one place both check a run's settings.
pub(super) fn options(s: &Shared, p: &GenParams, max_tokens: usize) -> ApiResult<GenerateOptions> {
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
