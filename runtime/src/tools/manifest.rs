//! [`manifest_json`]: the registry as JSON (no serde for one dump).

use std::fmt::Write as _;

use crate::registry::decl::{GradDecl, SourceDecl};
use crate::registry::registered_ops;
use crate::spec::tout_named;

/// Every declared op as JSON: name, Rust path and location, mode, `tout`, gradient, batching
/// (`{"max":64,"wait_us":200,"inputs":["x"]}`, `inputs` null when every tensor argument is
/// stacked; `null` for an op that does not batch), where its source came from, and a hash of the
/// source's text (FNV-1a, 64 bits).
pub fn manifest_json() -> String {
    let mut out = String::from("[");
    for (i, op) in registered_ops().iter().enumerate() {
        let d = op.decl();
        if i > 0 {
            out.push(',');
        }
        let (kind, origin, text) = match d.source_decl() {
            // Inline code: where it is written.
            SourceDecl::Code { text, line, .. } => {
                ("code", format!("{}:{line}", d.file()), Some(*text))
            }
            SourceDecl::File { path, text, .. } => ("file", (*path).to_owned(), Some(*text)),
            SourceDecl::Package { path, module, .. } => {
                ("package", format!("{path}:{module}"), None)
            }
            SourceDecl::Module(m) => ("module", (*m).to_owned(), None),
        };
        let hash = match (d.source_decl(), text) {
            (SourceDecl::Package { files, .. }, _) => Some(fnv1a(
                files.iter().flat_map(|(n, t)| n.bytes().chain(t.bytes())),
            )),
            (_, Some(t)) => Some(fnv1a(t.bytes())),
            _ => None,
        };
        let grad = match d.gradient() {
            None => "null".to_owned(),
            Some(GradDecl::Python(g)) => {
                format!("{{\"kind\":\"python\",\"name\":{}}}", json_str(g))
            }
            Some(GradDecl::Rust(_, path)) => {
                format!("{{\"kind\":\"rust\",\"path\":{}}}", json_str(path))
            }
        };
        let batch = match d.batch() {
            None => "null".to_owned(),
            Some(b) => {
                let inputs = match &b.inputs {
                    None => "null".to_owned(),
                    Some(inputs) => {
                        let names: Vec<String> = inputs
                            .iter()
                            // By name (an index past them, which `#[py_op]` never writes, as is).
                            .map(|&i| {
                                d.params()
                                    .get(i)
                                    .map_or_else(|| i.to_string(), |p| json_str(p))
                            })
                            .collect();
                        format!("[{}]", names.join(","))
                    }
                };
                format!(
                    "{{\"max\":{},\"wait_us\":{},\"inputs\":{inputs}}}",
                    b.max,
                    b.wait.as_micros()
                )
            }
        };
        let _ = write!(
            out,
            "\n  {{\"name\":{},\"rust_path\":{},\"file\":{},\"line\":{},\"mode\":{},\"function\":{},\"tout\":{},\"grad\":{},\"batch\":{},\"source\":{{\"kind\":{},\"origin\":{},\"hash\":{}}}}}",
            json_str(d.name()),
            json_str(&d.rust_path()),
            json_str(d.file()),
            d.line(),
            json_str(d.mode().as_str()),
            json_str(d.function()),
            json_str(&tout_named(d.tout(), d.params())),
            grad,
            batch,
            json_str(kind),
            json_str(&origin),
            hash.map_or("null".to_owned(), |h| format!("\"{h:016x}\"")),
        );
    }
    out.push_str("\n]");
    out
}

fn fnv1a(bytes: impl Iterator<Item = u8>) -> u64 {
    bytes.fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
