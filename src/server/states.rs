//! Saved conversation states (`--state-dir DIR`; docs/design.md §4, the file format §5):
//!
//! * `POST /v1/states/save {"id": "<completion id>", "name": "<file name>"}` writes the
//!   cache the completion `id` left in the prompt cache, with the ids whose rows it holds
//!   (its prompt and the generated tokens fed back), to `DIR/<name>`
//!   ([`crate::state::save`]: versioned, checksummed, the model's identity and the cache
//!   configuration recorded; written to a temporary file and renamed, never partial).
//! * `POST /v1/states/restore {"name": "<file name>", cache fields...}` loads `DIR/<name>`
//!   into the prompt cache ([`crate::state::load`]'s checks: another model, another cache
//!   configuration, another format version, a truncated or corrupted file are a 400 whose
//!   message names what differs), so the next request whose prompt starts with its ids
//!   (and is longer) resumes from it. The cache fields (`streaming_llm_window`,
//!   `kv_quantize`, ...; the server's flags by default) are those of the requests that
//!   will resume it, as for a completion: the state must have been made with them.
//!
//! A name is a plain file name (letters, digits, `.`, `_`, `-`; not starting with `.`; at
//! most 128 bytes): a path is refused (400 naming `name`). Without `--state-dir` both
//! endpoints answer 404 saying so. A restored entry resumes at its end only (a state holds
//! no hold, §3.2); it counts against `--prompt-cache-bytes` like any entry.

use super::api::{get_str, parse_body, ApiError, ApiResult};
use super::prompt_cache::Finished;
use super::Shared;
use crate::state;
use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{json, Value};
use std::path::PathBuf;

/// Longest state name in bytes.
const MAX_NAME: usize = 128;

/// The state directory, or the 404 that says there is none.
fn state_dir(s: &Shared) -> ApiResult<(&PathBuf, &state::ModelIdentity)> {
    match (&s.cfg.state_dir, &s.cfg.model_identity) {
        (Some(dir), Some(id)) => Ok((dir, id)),
        _ => Err(ApiError::status(
            StatusCode::NOT_FOUND,
            "saved states are off: start the server with --state-dir DIR",
        )),
    }
}

/// The body's `name`, a plain file name (see the module docs).
fn state_name(o: &serde_json::Map<String, Value>) -> ApiResult<String> {
    let name = get_str(o, "name")?.ok_or_else(|| ApiError::bad("name", "is required"))?;
    let plain = name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if name.is_empty() || name.len() > MAX_NAME || name.starts_with('.') || !plain {
        return Err(ApiError::bad(
            "name",
            format!(
                "'{}' is not a plain file name (letters, digits, '.', '_', '-'; not starting \
                 with '.'; at most {MAX_NAME} bytes)",
                name.chars().take(MAX_NAME).collect::<String>()
            ),
        ));
    }
    Ok(name.to_string())
}

/// A refused state as a 400 naming `name`'s file; other errors (writing it) as a 500
/// unless `all_bad`.
fn refused(name: &str, e: crate::Error, all_bad: bool) -> ApiError {
    match e {
        crate::Error::State { msg, .. } => ApiError::bad("name", format!("{name}: {msg}")),
        e if all_bad => ApiError::bad("name", format!("{name}: {e}")),
        e => ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, format!("{name}: {e}")),
    }
}

/// `POST /v1/states/save` (runs on the blocking pool).
pub(super) fn save(s: &Shared, body: &Bytes) -> ApiResult<Value> {
    let (dir, identity) = state_dir(s)?;
    let o = parse_body(body)?;
    let id = get_str(&o, "id")?.ok_or_else(|| ApiError::bad("id", "is required"))?;
    let name = state_name(&o)?;
    let (kv, ids, cache) = s.prompt_cache().state_of(id).ok_or_else(|| {
        ApiError::status(
            StatusCode::NOT_FOUND,
            format!(
                "id: no kept cache for completion '{id}' (it ran with cache_prompt false or \
                 ended with an error, or the prompt cache dropped it)"
            ),
        )
    })?;
    let path = dir.join(&name);
    state::save(&path, identity, &kv, &ids, &cache).map_err(|e| refused(&name, e, false))?;
    let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    Ok(json!({"object": "state", "name": name, "id": id, "tokens": ids.len(), "bytes": bytes}))
}

/// `POST /v1/states/restore` (runs on the blocking pool).
pub(super) fn restore(s: &Shared, body: &Bytes) -> ApiResult<Value> {
    let (dir, identity) = state_dir(s)?;
    let o = parse_body(body)?;
    let name = state_name(&o)?;
    let kv = super::params::request_kv(s, &o)?;
    let limit = s.cfg.prompt_cache_bytes;
    if limit == 0 {
        return Err(ApiError::bad(
            "name",
            "the prompt cache is off (--prompt-cache-bytes 0): a restored state would not be kept",
        ));
    }
    let path = dir.join(&name);
    let meta = std::fs::metadata(&path).map_err(|_| {
        ApiError::status(
            StatusCode::NOT_FOUND,
            format!("name: no saved state '{name}' in --state-dir"),
        )
    })?;
    // A state's file holds about its cache's bytes; one much larger could never be kept.
    if meta.len() > 2 * limit as u64 + (1 << 20) {
        return Err(ApiError::bad(
            "name",
            format!(
                "{name}: {} bytes, more than --prompt-cache-bytes ({limit}) could keep",
                meta.len()
            ),
        ));
    }
    let loaded =
        state::load(&path, identity, &kv, &s.model_cfg).map_err(|e| refused(&name, e, true))?;
    let tokens = loaded.ids.len();
    let worst_case = s.worst_case_bytes(&kv, tokens);
    let mut pc = s.prompt_cache();
    let kept = pc.insert(Finished {
        kv,
        ids: loaded.ids,
        cache: loaded.cache,
        worst_case,
        completion: String::new(),
    });
    s.metrics.set_prompt_cache(&pc);
    drop(pc);
    if !kept.kept {
        return Err(ApiError::bad(
            "name",
            format!(
                "{name}: its cache counts {worst_case} bytes, more than --prompt-cache-bytes ({limit})"
            ),
        ));
    }
    Ok(json!({"object": "state", "name": name, "tokens": tokens}))
}
