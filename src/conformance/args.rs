//! Arguments for calling an owned tool: the user's (`--tool-args`), else a
//! value derived from the tool's JSON Schema. Generating strings for a
//! `pattern` is out of reach, so the schema's own `examples` / `default` win
//! over synthesis; whatever comes out is then validated with the engine's
//! own argument check before it is used.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use crate::agent::tools::validate_call;
use crate::hooks::registry::compile_schema;
use crate::message::{ToolCall, ToolSpec};

/// What the checker makes of a tool's declared schema.
pub enum Schema {
    /// No schema: any JSON object.
    Any,
    Valid(Arc<jsonschema::Validator>, Value),
    Invalid(String),
}

pub fn schema_of(spec: &ToolSpec) -> Schema {
    let text = spec.parameters_json_schema.trim();
    if text.is_empty() {
        return Schema::Any;
    }
    let validator = match compile_schema(text) {
        Ok(v) => v,
        Err(e) => return Schema::Invalid(e),
    };
    let value: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    // Tool arguments are always a JSON object (hookwire rejects anything
    // else before validating), so a schema for another type can never pass.
    if let Some(t) = value.get("type") {
        let allows_object = match t {
            Value::String(s) => s == "object",
            Value::Array(a) => a.iter().any(|x| x == "object"),
            _ => true,
        };
        if !allows_object {
            return Schema::Invalid(format!(
                "its type is {t}, but tool arguments are always a JSON object"
            ));
        }
    }
    Schema::Valid(Arc::new(validator), value)
}

/// Arguments derived from a schema: `examples[0]`, `default`, `const`, the
/// first `enum` value, or a value of the declared type (required properties
/// only, honouring `format`, lengths and bounds).
pub fn derive(schema: &Value) -> Value {
    match value_for(schema, 0) {
        v @ Value::Object(_) => v,
        _ => Value::Object(Map::new()),
    }
}

fn value_for(schema: &Value, depth: usize) -> Value {
    let Value::Object(s) = schema else {
        return json!("example");
    };
    if depth > 8 {
        return Value::Null;
    }
    if let Some(Value::Array(examples)) = s.get("examples") {
        if let Some(first) = examples.first() {
            return first.clone();
        }
    }
    for key in ["default", "const"] {
        if let Some(v) = s.get(key) {
            return v.clone();
        }
    }
    if let Some(Value::Array(values)) = s.get("enum") {
        if let Some(first) = values.first() {
            return first.clone();
        }
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(options)) = s.get(key) {
            if let Some(first) = options.first() {
                return value_for(first, depth + 1);
            }
        }
    }
    let ty = match s.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(Value::Array(types)) => types
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null"),
        _ if s.contains_key("properties") => "object",
        _ => "object",
    };
    match ty {
        "object" => {
            let props = s.get("properties").and_then(Value::as_object);
            let mut out = Map::new();
            if let Some(Value::Array(required)) = s.get("required") {
                for name in required.iter().filter_map(Value::as_str) {
                    let sub = props.and_then(|p| p.get(name)).unwrap_or(&Value::Null);
                    out.insert(name.to_string(), value_for(sub, depth + 1));
                }
            }
            Value::Object(out)
        }
        "string" => Value::String(string_for(s)),
        "integer" => json!(number_for(s).round() as i64),
        "number" => json!(number_for(s)),
        "boolean" => json!(true),
        "array" => {
            let max = s
                .get("maxItems")
                .and_then(Value::as_u64)
                .unwrap_or(u64::MAX);
            let min = s.get("minItems").and_then(Value::as_u64).unwrap_or(1);
            let n = min.max(1).min(max);
            let item = s.get("items").cloned().unwrap_or(Value::Null);
            Value::Array((0..n).map(|_| value_for(&item, depth + 1)).collect())
        }
        _ => Value::Null,
    }
}

fn string_for(s: &Map<String, Value>) -> String {
    let mut out = match s.get("format").and_then(Value::as_str) {
        Some("email") => "ada@example.com",
        Some("date") => "2024-05-01",
        Some("date-time") => "2024-05-01T12:00:00Z",
        Some("time") => "12:00:00Z",
        Some("uri" | "url" | "iri") => "https://example.com/",
        Some("uuid") => "123e4567-e89b-12d3-a456-426614174000",
        Some("ipv4") => "192.0.2.1",
        Some("ipv6") => "2001:db8::1",
        Some("hostname") => "example.com",
        _ => "hookwire conformance check",
    }
    .to_string();
    let min = s.get("minLength").and_then(Value::as_u64).unwrap_or(0) as usize;
    let max = s
        .get("maxLength")
        .and_then(Value::as_u64)
        .map(|m| m as usize);
    while out.chars().count() < min {
        out.push('x');
    }
    if let Some(max) = max {
        out = out.chars().take(max).collect();
    }
    out
}

fn number_for(s: &Map<String, Value>) -> f64 {
    let mut n = 1.0;
    if let Some(min) = s.get("minimum").and_then(Value::as_f64) {
        n = f64::max(n, min);
    }
    if let Some(min) = s.get("exclusiveMinimum").and_then(Value::as_f64) {
        if n <= min {
            n = min + 1.0;
        }
    }
    if let Some(max) = s.get("maximum").and_then(Value::as_f64) {
        n = f64::min(n, max);
    }
    if let Some(max) = s.get("exclusiveMaximum").and_then(Value::as_f64) {
        if n >= max {
            n = max - 1.0;
        }
    }
    n
}

/// Checks `args` for `spec` exactly as hookwire checks a model's call: a JSON
/// object valid against the schema. `Err` says what is wrong.
pub fn validate(spec: &ToolSpec, schema: &Schema, args: &str) -> Result<(), String> {
    let call = ToolCall {
        id: "check".into(),
        name: spec.name.clone(),
        arguments_json: args.to_string(),
    };
    let validator = match schema {
        Schema::Valid(v, _) => Some(v.clone()),
        _ => None,
    };
    match validate_call(&call, std::slice::from_ref(spec), |_| validator.clone()) {
        None => Ok(()),
        Some((_, error)) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(schema: Value) -> ToolSpec {
        ToolSpec {
            name: "t".into(),
            description: "d".into(),
            parameters_json_schema: schema.to_string(),
        }
    }

    fn derived_valid(schema: Value) -> Value {
        let s = spec(schema.clone());
        let parsed = schema_of(&s);
        let args = derive(&schema);
        validate(&s, &parsed, &args.to_string()).unwrap_or_else(|e| panic!("{args}: {e}"));
        args
    }

    #[test]
    fn required_properties_get_values_of_their_type() {
        let args = derived_valid(json!({
            "type": "object",
            "properties": {
                "text": {"type": "string", "minLength": 40},
                "n": {"type": "integer", "minimum": 3, "maximum": 9},
                "x": {"type": "number", "exclusiveMinimum": 5},
                "on": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}},
                "mail": {"type": "string", "format": "email"},
                "optional": {"type": "string"}
            },
            "required": ["text", "n", "x", "on", "tags", "mail"],
            "additionalProperties": false
        }));
        assert_eq!(args["n"], 3);
        assert_eq!(args["tags"], json!(["hoo"]));
        assert_eq!(args["mail"], "ada@example.com");
        assert!(args.get("optional").is_none());
    }

    #[test]
    fn examples_default_and_enum_win_over_synthesis() {
        let args = derived_valid(json!({
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^C-[0-9]{4}$", "examples": ["C-1001"]},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "mode": {"type": "string", "default": "fast"}
            },
            "required": ["id", "unit", "mode"]
        }));
        assert_eq!(args, json!({"id": "C-1001", "unit": "C", "mode": "fast"}));
        let whole = derive(&json!({"type": "object", "examples": [{"a": 1}]}));
        assert_eq!(whole, json!({"a": 1}));
    }

    #[test]
    fn pattern_without_examples_is_caught_by_validation() {
        let schema = json!({
            "type": "object",
            "properties": {"id": {"type": "string", "pattern": "^C-[0-9]{4}$"}},
            "required": ["id"]
        });
        let s = spec(schema.clone());
        let err = validate(&s, &schema_of(&s), &derive(&schema).to_string()).unwrap_err();
        assert!(err.contains("does not match"), "{err}");
    }

    #[test]
    fn schema_problems_are_named() {
        let bad = ToolSpec {
            parameters_json_schema: "{not json".into(),
            ..spec(json!({}))
        };
        assert!(matches!(schema_of(&bad), Schema::Invalid(e) if e.contains("not valid JSON")));
        let bad = spec(json!({"type": "object", "properties": {"a": {"type": "strin"}}}));
        assert!(
            matches!(schema_of(&bad), Schema::Invalid(e) if e.contains("not a valid JSON Schema"))
        );
        let bad = spec(json!({"type": "string"}));
        assert!(
            matches!(schema_of(&bad), Schema::Invalid(e) if e.contains("always a JSON object"))
        );
        let empty = ToolSpec::default();
        assert!(matches!(schema_of(&empty), Schema::Any));
        assert_eq!(validate(&empty, &Schema::Any, "{}"), Ok(()));
        assert!(validate(&empty, &Schema::Any, "[1]").is_err());
    }
}
