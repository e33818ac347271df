//! Who may call the server and what a request must look like before its body is read:
//! Host, Origin, the API key, the Content-Type, and the body's time and size limits.

use super::api::{ApiError, ApiResult};
use super::Shared;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};

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

/// The server's access rules (see [`super::http`]); `key` = the endpoint needs the API
/// key, `json` = it takes a JSON body.
pub(super) fn check_access(
    s: &Shared,
    headers: &HeaderMap,
    key: bool,
    json: bool,
) -> ApiResult<()> {
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
            .and_then(bearer_token);
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

/// The token of an `Authorization: Bearer TOKEN` value; the scheme's case does not matter
/// (RFC 9110 §11.1), nor the whitespace around the token.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once([' ', '\t'])?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Reads the whole body within `--body-timeout` and `--max-body-bytes`; a body still
/// arriving when the drain's grace ends is abandoned with 503 (so that a stalled client
/// does not hold the process past the grace).
pub(super) async fn read_body(s: &Shared, headers: &HeaderMap, body: Body) -> ApiResult<Bytes> {
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
    let read = tokio::time::timeout(
        limits.body_timeout,
        axum::body::to_bytes(body, limits.max_body_bytes),
    );
    let read = tokio::select! {
        r = read => r,
        _ = s.closing.wait() => {
            return Err(ApiError::status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
            ))
        }
    };
    match read {
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
