//! The OpenAI error shape and the request-body readers: every refusal is an [`ApiError`]
//! whose `param` names the offending field.

use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

/// An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) param: Option<String>,
    pub(super) retry_after: Option<u64>,
}

impl ApiError {
    pub(super) fn bad(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            param: Some(param.to_string()),
            retry_after: None,
        }
    }
    pub(super) fn unsupported(param: &str, what: &str) -> Self {
        ApiError::bad(
            param,
            format!("{what} is not supported by this server; leave it out"),
        )
    }
    pub(super) fn status(status: StatusCode, message: impl Into<String>) -> Self {
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
            | StatusCode::UNSUPPORTED_MEDIA_TYPE
            | StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => "invalid_request_error",
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

pub(super) type ApiResult<T> = Result<T, ApiError>;

/// Refuses, before any work, fields this server would otherwise ignore.
pub(super) fn refuse_unsupported(o: &Map<String, Value>) -> ApiResult<()> {
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

// Field readers: each error names the field.

pub(super) fn parse_body(body: &Bytes) -> ApiResult<Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad("body", "must be a JSON object")),
        Err(e) => Err(ApiError::bad("body", format!("invalid JSON: {e}"))),
    }
}

/// The field's value, `None` when absent or `null`.
pub(super) fn field<'a>(o: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    o.get(name).filter(|v| !v.is_null())
}

pub(super) fn get_uint(o: &Map<String, Value>, name: &str, max: u64) -> ApiResult<Option<u64>> {
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

pub(super) fn get_f32(o: &Map<String, Value>, name: &str) -> ApiResult<Option<f32>> {
    match field(o, name) {
        None => Ok(None),
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() => Ok(Some(x as f32)),
            _ => Err(ApiError::bad(name, format!("must be a number, got {v}"))),
        },
    }
}

pub(super) fn get_bool(o: &Map<String, Value>, name: &str) -> ApiResult<Option<bool>> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::bad(
            name,
            format!("must be true or false, got {v}"),
        )),
    }
}

pub(super) fn get_str<'a>(o: &'a Map<String, Value>, name: &str) -> ApiResult<Option<&'a str>> {
    match field(o, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(ApiError::bad(name, format!("must be a string, got {v}"))),
    }
}

/// A library refusal as a 400: a flag error names its field; others get `fallback`.
pub(super) fn from_flag_error(e: crate::Error, fallback: &str) -> ApiError {
    match e {
        crate::Error::Flag { flag, msg } => {
            let field = flag.trim_start_matches("--").replace('-', "_");
            ApiError::bad(&field, msg)
        }
        other => ApiError::bad(fallback, other.to_string()),
    }
}
