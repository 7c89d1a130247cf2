// pyop's `Error` may gain fields: its variants can be matched (with `..`) but not built outside
// pyop.
use pyop::{Error, ErrorKind};

fn main() {
    let e = Error::Op {
        op: None,
        kind: ErrorKind::Source,
        message: String::new(),
    };
    if let Error::Op { kind, .. } = &e {
        let _ = kind;
    }
    if let Error::Mismatch { op, kind, index, what } = &e {
        let _ = (op, kind, index, what);
    }
}
