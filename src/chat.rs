//! Chat templates: the Jinja template a model ships (`tokenizer.chat_template` in a GGUF,
//! `chat_template` in `tokenizer_config.json`) rendered with MiniJinja.
//!
//! The environment mirrors transformers' `apply_chat_template`: `trim_blocks` and
//! `lstrip_blocks` on, the `loopcontrols` extension (`{% break %}`), a `raise_exception(msg)`
//! function, `strftime_now(fmt)` (UTC date only), and Python string/dict methods
//! (`.strip()`, `.startswith()`, `.items()`, ...) through `minijinja_contrib::pycompat`.
//! The context is `messages` (one user message), `add_generation_prompt = true`, `bos_token`
//! and `eos_token`.

use crate::error::{Error, Result};
use minijinja::value::Value;
use minijinja::{Environment, ErrorKind};
use std::collections::BTreeMap;

/// MiniJinja instructions a template may execute (real chat templates need a few thousand).
const TEMPLATE_FUEL: u64 = 50_000_000;

/// Renders `template` for a single user turn, ready for the assistant's reply
/// (`add_generation_prompt = true`). `bos` and `eos` are the token strings the template may
/// refer to as `bos_token` / `eos_token`. Template errors (syntax, `raise_exception`) are
/// returned as [`Error::Generate`] with MiniJinja's message.
pub fn render_chat(template: &str, user_message: &str, bos: &str, eos: &str) -> Result<String> {
    let mut msg = BTreeMap::new();
    msg.insert("role".to_string(), Value::from("user"));
    msg.insert("content".to_string(), Value::from(user_message));
    render_messages(template, &[msg], true, bos, eos)
}

/// Renders `template` for any list of messages (each a map with at least `role` and
/// `content`).
pub fn render_messages(
    template: &str,
    messages: &[BTreeMap<String, Value>],
    add_generation_prompt: bool,
    bos: &str,
    eos: &str,
) -> Result<String> {
    let err = |e: minijinja::Error| {
        let mut msg = format!("chat template: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            msg.push_str(&format!(": {s}"));
            source = s.source();
        }
        Error::Generate(msg)
    };
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(err)?;
    env.set_syntax(syntax);
    // A template comes from the model file: bound its work so a hostile one cannot hang us.
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_function("strftime_now", |fmt: String| -> String {
        strftime_utc(&fmt)
    });
    let messages: Vec<Value> = messages.iter().map(|m| Value::from(m.clone())).collect();
    let ctx = minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos,
        eos_token => eos,
    };
    env.render_str(template, ctx).map_err(err)
}

/// The `bos_token` and `eos_token` strings a template may refer to: the tokenizer's BOS
/// token and its first end-of-sequence token, each empty when it has none.
pub fn special_tokens(tok: &crate::tokenizer::Tokenizer) -> (String, String) {
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    (name(tok.bos_id), name(tok.eos_ids.first().copied()))
}

/// A minimal `strftime` over today's UTC date: `%Y %m %d %B %b %A` and `%%`; other
/// directives are left as they are. Templates use it to print the current date.
fn strftime_utc(fmt: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[days.rem_euclid(7) as usize]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template() {
        let out = render_chat(SMOLLM2, "Hi there", "<|im_start|>", "<|im_end|>").unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_trim_blocks_and_bos() {
        let t = "{{ bos_token }}{% for m in messages %}\n  [{{ m['content'].strip() | upper }}]\n{% endfor %}{% if add_generation_prompt %}>{% endif %}";
        // Python's jinja2 (trim_blocks, lstrip_blocks) renders exactly this.
        assert_eq!(
            render_chat(t, "  hello ", "<s>", "</s>").unwrap(),
            "<s>  [HELLO]\n>"
        );
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_errors() {
        let e = render_chat(
            "{{ raise_exception('only user/assistant roles') }}",
            "x",
            "",
            "",
        )
        .unwrap_err();
        assert!(e.to_string().contains("only user/assistant roles"), "{e}");
        assert!(render_chat("{% for %}", "x", "", "").is_err());
        let e = render_chat(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "x",
            "",
            "",
        );
        assert!(e.is_err(), "out of fuel");
    }

    #[test]
    fn strftime_has_a_year() {
        let s = strftime_utc("%d %B %Y %%");
        assert!(s.ends_with(" %") && s.len() > 10, "{s}");
    }
}
