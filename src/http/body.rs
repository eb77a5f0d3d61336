//! Request bodies every JSON route reads the same way: `application/json` or 415, at most
//! the body limit or 413, JSON or 400, an object or 422, no member given twice and no text
//! Postgres cannot store (422), and no field it does not know.
//!
//! The body is read into a `serde_json::Value` by a visitor of our own rather than
//! serde_json's, so that the two checks serde_json cannot make — a key repeated in one
//! object (serde_json keeps the last one, which would make `{"scopes": ["audit"], "scopes":
//! ["finance"]}` a finance token) and a NUL in any key or string, nested or not — happen in
//! the one pass that parses the body.
//!
//! A route names its body as a type read with [`StrictJson`]: a `Deserialize` struct with
//! `deny_unknown_fields` that is also the body's schema in the OpenAPI document. Fields
//! whose wrong type must be answered with the field's own code (`invalid_org_id`, not a
//! generic one) are read as they were sent, with [`present`], and checked by the route.

use std::cell::RefCell;
use std::fmt;

use axum::body::Body;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::storable;

/// The content codings the body was sent under, in lower case, `identity` left out; 415
/// `unsupported_content_encoding` when `Content-Encoding` is not text.
pub fn content_codings(headers: &HeaderMap) -> Result<Vec<String>, ApiError> {
    let mut codings = Vec::new();
    for value in headers.get_all(header::CONTENT_ENCODING) {
        let value = value
            .to_str()
            .map_err(|_| unsupported_coding("Content-Encoding is not text".into()))?;
        codings.extend(
            value
                .split(',')
                .map(|coding| coding.trim().to_ascii_lowercase())
                .filter(|coding| !coding.is_empty() && coding != "identity"),
        );
    }
    Ok(codings)
}

/// 415 `unsupported_content_encoding`.
pub fn unsupported_coding(message: String) -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ErrorCode::UnsupportedContentEncoding,
        message,
    )
}

/// Refuses a body sent under any content coding: only provider reports take one (gzip);
/// any other route read a gzipped body as its text and answered that it was not UTF-8.
pub fn identity_only(headers: &HeaderMap) -> Result<(), ApiError> {
    let codings = content_codings(headers)?;
    if codings.is_empty() {
        return Ok(());
    }
    Err(unsupported_coding(format!(
        "Content-Encoding {:?}: this route takes its body as sent (identity)",
        codings.join(", ")
    )))
}

/// The body as a JSON object.
pub async fn json_object(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Map<String, Value>, ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.split(';').next().map(str::trim) == Some("application/json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::UnsupportedMediaType,
            "Content-Type must be application/json",
        ));
    }
    identity_only(headers)?;
    let bytes = read_body(body, state.body_max_bytes).await?;
    match parse_strict(&bytes)? {
        Value::Object(fields) => Ok(fields),
        _ => Err(ApiError::invalid(
            ErrorCode::InvalidBody,
            "the body must be a JSON object",
        )),
    }
}

/// A request body of type `T`, read as [`json_object`] reads it; a field `T` does not
/// have is refused by [`RequestBody::unknown_fields`].
#[derive(Debug)]
pub struct StrictJson<T>(pub T);

/// A type a JSON request body is read into.
pub trait RequestBody: DeserializeOwned {
    /// The body in the message about a field it does not have: "a token".
    const WHAT: &'static str;

    /// The refusal of a body with the fields `unknown` (never empty, in the body's order):
    /// 422 `unknown_field` naming the first.
    fn unknown_fields(unknown: &[&str]) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownField,
            format!("{}: is not a field of {}", unknown[0], Self::WHAT),
        )
    }
}

impl<T: RequestBody> FromRequest<AppState> for StrictJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        let (parts, body) = request.into_parts();
        let fields = json_object(state, &parts.headers, body).await?;
        typed(fields).map(StrictJson)
    }
}

/// The object as a `T`. The unknown fields are found before serde reads it, so that their
/// refusal is the body type's own and names every one of them.
fn typed<T: RequestBody>(fields: Map<String, Value>) -> Result<T, ApiError> {
    let known = field_names::<T>();
    let unknown: Vec<&str> = fields
        .keys()
        .map(String::as_str)
        .filter(|name| !known.contains(name))
        .collect();
    if !unknown.is_empty() {
        return Err(T::unknown_fields(&unknown));
    }
    serde_json::from_value(Value::Object(fields)).map_err(|error| {
        ApiError::invalid(
            ErrorCode::InvalidBody,
            format!("the body is not {}: {error}", T::WHAT),
        )
    })
}

/// A field as it was sent, `null` included: `Some` whenever the field is present. With
/// `#[serde(default, deserialize_with = "present")]` on an `Option<Value>` field, absent
/// and `null` stay apart, as routes that refuse a `null` need them to.
pub fn present<'de, D: de::Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

/// The field names of a struct with a derived `Deserialize`: the list it hands to
/// `deserialize_struct`, caught by a deserializer that reads nothing else.
pub(super) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut &'static [&'static str]);

    impl<'de> de::Deserializer<'de> for Names<'_> {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("only the field names are read"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }

    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut fields));
    fields
}

/// What the strict reader refused, and where: the path is collected as the error unwinds,
/// innermost segment first, so that the happy path builds no paths at all.
#[derive(Debug)]
struct Problem {
    code: ErrorCode,
    /// Innermost first: `["name", "data", "[0]", "events"]` is `events[0].data.name`.
    path: Vec<String>,
    /// What is wrong, after the path.
    what: &'static str,
}

impl Problem {
    fn field(&self) -> String {
        let mut field = String::new();
        for segment in self.path.iter().rev() {
            if !field.is_empty() && !segment.starts_with('[') {
                field.push('.');
            }
            field.push_str(segment);
        }
        if field.is_empty() {
            field.push_str("body");
        }
        field
    }
}

/// Parses JSON text into a value, refusing a key given twice in one object
/// (`duplicate_field`) and a NUL in any key or string (`unstorable_text`), with the
/// field's path in the message. Not JSON at all is 400 `malformed_json`.
pub fn parse_strict(bytes: &[u8]) -> Result<Value, ApiError> {
    let problem = RefCell::new(None);
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let parsed = Strict { problem: &problem }
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value));
    match (parsed, problem.into_inner()) {
        (Ok(value), _) => Ok(value),
        (Err(_), Some(problem)) => {
            let field = problem.field();
            let message = match problem.code {
                storable::UNSTORABLE_TEXT => storable::unstorable_message(&field),
                _ => format!("{field}: {}", problem.what),
            };
            Err(
                ApiError::invalid(problem.code, message.clone()).with_details(vec![json!({
                    "field": field,
                    "code": problem.code,
                    "message": message,
                })]),
            )
        }
        (Err(error), None) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::MalformedJson,
            format!("body is not JSON: {error}"),
        )),
    }
}

/// A JSON value, read as `serde_json::Value` reads it but refusing what [`parse_strict`]
/// refuses. The refusal is recorded in `problem`; the serde error only unwinds the parse.
#[derive(Clone, Copy)]
struct Strict<'a> {
    problem: &'a RefCell<Option<Problem>>,
}

impl Strict<'_> {
    fn refuse<E: de::Error>(self, code: ErrorCode, segment: &str, what: &'static str) -> E {
        *self.problem.borrow_mut() = Some(Problem {
            code,
            path: vec![segment.to_owned()],
            what,
        });
        E::custom(what)
    }

    /// A nested value failed: add its place to the path, if it was a refusal of ours.
    fn within<E>(self, error: E, segment: impl FnOnce() -> String) -> E {
        if let Some(problem) = self.problem.borrow_mut().as_mut() {
            problem.path.push(segment());
        }
        error
    }

    fn text<E: de::Error>(self, value: String) -> Result<Value, E> {
        if storable::is_storable(&value) {
            Ok(Value::String(value))
        } else {
            // The field is named by the enclosing key, added as the error unwinds.
            *self.problem.borrow_mut() = Some(Problem {
                code: storable::UNSTORABLE_TEXT,
                path: Vec::new(),
                what: "contains a NUL character",
            });
            Err(E::custom("a NUL character"))
        }
    }
}

impl<'de> DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::from(value))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        // As serde_json's own `Value` does: a JSON number is never NaN or infinite.
        Ok(serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Value, E> {
        self.text(value.to_owned())
    }

    fn visit_string<E: de::Error>(self, value: String) -> Result<Value, E> {
        self.text(value)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut items: A) -> Result<Value, A::Error> {
        let mut values = Vec::with_capacity(items.size_hint().unwrap_or(0));
        while let Some(value) = items
            .next_element_seed(self)
            .map_err(|error| self.within(error, || format!("[{}]", values.len())))?
        {
            values.push(value);
        }
        Ok(Value::Array(values))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut members: A) -> Result<Value, A::Error> {
        let mut fields = Map::new();
        while let Some(key) = members.next_key::<String>()? {
            if !storable::is_storable(&key) {
                // The key itself cannot be shown as it is; name it with the NUL escaped.
                return Err(self.refuse(
                    storable::UNSTORABLE_TEXT,
                    &key.replace('\0', "\\u0000"),
                    "contains a NUL character",
                ));
            }
            if fields.contains_key(&key) {
                return Err(self.refuse(
                    ErrorCode::DuplicateField,
                    &key,
                    "is given twice; send each field once",
                ));
            }
            let value = members
                .next_value_seed(self)
                .map_err(|error| self.within(error, || key.clone()))?;
            fields.insert(key, value);
        }
        Ok(Value::Object(fields))
    }
}

/// A body past the limit is still read and discarded up to this many bytes, so that the
/// client, still sending, receives the 413 instead of a reset connection (what nginx calls
/// lingering close). Past it, the connection is cut.
const OVERSIZED_DRAIN_MAX_BYTES: usize = 64 * 1024 * 1024;
/// And for at most this long.
const OVERSIZED_DRAIN_MAX_MS: u64 = 2_000;

/// Reads the whole body, refusing it when it passes `limit` bytes.
pub(crate) async fn read_body(body: Body, limit: usize) -> Result<bytes::Bytes, ApiError> {
    use http_body_util::BodyExt;

    let mut body = body;
    let mut collected = bytes::BytesMut::new();
    let mut oversized = false;
    let mut seen = 0usize;
    let deadline =
        tokio::time::Instant::now() + std::time::Duration::from_millis(OVERSIZED_DRAIN_MAX_MS);
    loop {
        let frame = if oversized {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Ok(frame) => frame,
                Err(_) => break,
            }
        } else {
            body.frame().await
        };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|error| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                ErrorCode::UnreadableBody,
                format!("cannot read the body: {error}"),
            )
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen = seen.saturating_add(data.len());
        if seen > limit {
            oversized = true;
            collected.clear();
            if seen > OVERSIZED_DRAIN_MAX_BYTES {
                break;
            }
        } else {
            collected.extend_from_slice(&data);
        }
    }
    if oversized {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::BodyTooLarge,
            format!("the body must be at most {limit} bytes"),
        ));
    }
    Ok(collected.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(text: &str) -> (StatusCode, &'static str, String) {
        let error = parse_strict(text.as_bytes()).unwrap_err();
        (error.status, error.code.as_str(), error.message)
    }

    #[test]
    fn a_body_reads_as_serde_json_reads_it() {
        let text =
            r#"{"a": [1, -2, 3.5, true, null, "é\n"], "b": {"c": {}}, "d": 18446744073709551615}"#;
        assert_eq!(
            parse_strict(text.as_bytes()).unwrap(),
            serde_json::from_str::<Value>(text).unwrap()
        );
    }

    #[test]
    fn a_key_given_twice_is_refused_at_any_depth_with_its_path() {
        let (status, code, message) = refusal(r#"{"scopes": ["audit"], "scopes": ["finance"]}"#);
        assert_eq!(
            (status, code),
            (StatusCode::UNPROCESSABLE_ENTITY, "duplicate_field")
        );
        assert!(message.starts_with("scopes: "), "{message}");
        let (_, code, message) = refusal(r#"{"events": [{}, {"data": {"a": 1, "a": 1}}]}"#);
        assert_eq!(code, "duplicate_field");
        assert!(message.starts_with("events[1].data.a: "), "{message}");
    }

    #[test]
    fn a_nul_in_any_string_or_key_is_refused_with_its_path() {
        let cases = [
            (r#"{"reason": "a\u0000b"}"#, "reason"),
            (r#"{"a": {"b": ["x", "\u0000"]}}"#, "a.b[1]"),
            (r#"{"a": {"k\u0000": 1}}"#, "a.k\\u0000"),
            (r#"["\u0000"]"#, "[0]"),
            (r#""\u0000""#, "body"),
        ];
        for (text, field) in cases {
            let (status, code, message) = refusal(text);
            assert_eq!(
                (status, code),
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    storable::UNSTORABLE_TEXT.as_str()
                ),
                "{text}"
            );
            assert!(
                message.starts_with(&format!("{field}: ")),
                "{text}: {message}"
            );
        }
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        #[serde(default, deserialize_with = "present")]
        given: Option<Value>,
        #[serde(default)]
        count: u64,
    }

    impl RequestBody for Sample {
        const WHAT: &'static str = "a sample";
    }

    fn object(value: Value) -> Map<String, Value> {
        value.as_object().expect("an object").clone()
    }

    #[test]
    fn a_body_type_knows_its_field_names() {
        assert_eq!(field_names::<Sample>(), ["given", "count"]);
    }

    #[test]
    fn a_field_the_body_type_does_not_have_is_refused_by_name() {
        let error = typed::<Sample>(object(json!({"given": 1, "b": 2, "a": 3}))).unwrap_err();
        assert_eq!(
            (error.status, error.code.as_str(), error.message.as_str()),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_field",
                "a: is not a field of a sample"
            )
        );
    }

    #[test]
    fn a_present_field_keeps_null_apart_from_absence() {
        let absent: Sample = typed(object(json!({}))).unwrap();
        assert_eq!(absent.given, None);
        let null: Sample = typed(object(json!({"given": null}))).unwrap();
        assert_eq!(null.given, Some(Value::Null));
        assert_eq!(null.count, 0);
    }

    #[test]
    fn a_field_of_the_wrong_type_for_serde_is_an_invalid_body() {
        let error = typed::<Sample>(object(json!({"count": "many"}))).unwrap_err();
        assert_eq!(
            (error.status, error.code.as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid_body")
        );
    }

    #[test]
    fn text_that_is_not_json_is_malformed() {
        for text in ["{\"a\": ", "{} {}", "", "{\"a\": \"\0\"}"] {
            let (status, code, _) = refusal(text);
            assert_eq!(
                (status, code),
                (StatusCode::BAD_REQUEST, "malformed_json"),
                "{text:?}"
            );
        }
    }
}
