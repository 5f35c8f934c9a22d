//! `--json`: messages in the canonical protobuf JSON mapping, the one
//! grpcurl and `buf curl` print (lowerCamelCase field names, enum value
//! names, a oneof's set field under its own name, 64-bit integers as
//! strings, default values left out), so a script can treat hookwire's
//! output and theirs alike. It is produced from the descriptor set compiled
//! into the binary, not from the generated Rust types.

use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};

use crate::pb;

/// Why a message could not be printed as JSON.
#[derive(Debug, thiserror::Error)]
pub enum JsonError {
    #[error("the embedded descriptor set is unusable: {0}")]
    Descriptors(String),
    #[error("`{0}` is not in the embedded descriptor set")]
    UnknownMessage(String),
    #[error("cannot re-read a `{name}` message: {error}")]
    Decode { name: String, error: String },
    #[error("cannot write JSON: {0}")]
    Write(#[from] serde_json::Error),
}

/// Prints messages of one type as canonical JSON.
pub struct ProtoJson {
    descriptor: MessageDescriptor,
    options: SerializeOptions,
}

impl ProtoJson {
    /// For the message type with the fully qualified `name`, e.g.
    /// `hookwire.v1.RunEvent`.
    pub fn new(name: &str) -> Result<ProtoJson, JsonError> {
        let pool = DescriptorPool::decode(pb::FILE_DESCRIPTOR_SET)
            .map_err(|e| JsonError::Descriptors(e.to_string()))?;
        let descriptor = pool
            .get_message_by_name(name)
            .ok_or_else(|| JsonError::UnknownMessage(name.to_string()))?;
        Ok(ProtoJson {
            descriptor,
            // The defaults are the canonical mapping.
            options: SerializeOptions::new(),
        })
    }

    /// One message as a single line of JSON.
    pub fn line<M: prost::Message>(&self, message: &M) -> Result<String, JsonError> {
        let bytes = message.encode_to_vec();
        let dynamic =
            DynamicMessage::decode(self.descriptor.clone(), bytes.as_slice()).map_err(|e| {
                JsonError::Decode {
                    name: self.descriptor.full_name().to_string(),
                    error: e.to_string(),
                }
            })?;
        let mut out = serde_json::Serializer::new(Vec::new());
        dynamic.serialize_with_options(&mut out, &self.options)?;
        // serde_json writes UTF-8 only.
        Ok(String::from_utf8_lossy(&out.into_inner()).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    #[test]
    fn run_events_use_the_canonical_mapping() {
        let j = ProtoJson::new("hookwire.v1.RunEvent").unwrap();
        let ev = pb::RunEvent {
            run_id: "r1".into(),
            seq: 3,
            event: Some(pb::run_event::Event::Finished(pb::RunFinished {
                result: Some(pb::RunResult {
                    run_id: "r1".into(),
                    outcome: pb::RunOutcome::Completed as i32,
                    usage: Some(pb::Usage {
                        input_tokens: 7,
                        output_tokens: 0,
                        estimated: true,
                    }),
                    ..Default::default()
                }),
            })),
        };
        let v: Value = serde_json::from_str(&j.line(&ev).unwrap()).unwrap();
        assert_eq!(
            v,
            json!({
                "runId": "r1",
                "seq": "3",
                "finished": {"result": {
                    "runId": "r1",
                    "outcome": "RUN_OUTCOME_COMPLETED",
                    "usage": {"inputTokens": "7", "estimated": true},
                }},
            })
        );
    }

    #[test]
    fn an_unknown_message_name_is_an_error() {
        assert!(matches!(
            ProtoJson::new("hookwire.v1.Nope"),
            Err(JsonError::UnknownMessage(_))
        ));
    }
}
