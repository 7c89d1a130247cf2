//! Hot reload (`PYOP_HOT_RELOAD=1`, here `pyop::set_hot_reload(true)`): edits to a body's file or package show up without a
//! rebuild; a broken edit keeps the last good body and reports why.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor};
use pyop::{Arg, OutSpec, PyOp};

fn hot() {
    // The same switch as PYOP_HOT_RELOAD=1, without changing the environment of a process whose
    // other threads may be reading it.
    pyop::set_hot_reload(true);
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pyop-reload-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn call(op: &PyOp) -> Vec<f64> {
    let x = Tensor::new(&[1f64, 2.], &Device::Cpu).unwrap();
    op.call(&[Arg::from(&x)])
        .unwrap()
        .remove(0)
        .to_vec1::<f64>()
        .unwrap()
}

/// Writes `text` and waits past the check interval, so the next call looks at the file.
fn edit(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::thread::sleep(pyop_check_interval() + Duration::from_millis(100));
}

fn pyop_check_interval() -> Duration {
    Duration::from_millis(250)
}

#[test]
fn an_edited_file_is_reloaded() {
    hot();
    let dir = temp("file");
    let path = dir.join("body.py");
    std::fs::write(&path, "def body(x):\n    return x + 1\n").unwrap();
    let op = PyOp::builder("body")
        .file(&path)
        .unwrap()
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    assert_eq!(call(&op), [2., 3.]);

    edit(&path, "def body(x):\n    return x * 10\n");
    assert_eq!(call(&op), [10., 20.], "the edit shows up without a rebuild");

    // Checked at most every 250 ms, not on every call.
    let checked = Instant::now();
    std::fs::write(&path, "def body(x):\n    return x * 1000\n").unwrap();
    let v = call(&op);
    if checked.elapsed() < Duration::from_millis(200) {
        assert_eq!(v, [10., 20.], "looked at the file again too soon");
    }

    // A reload that fails keeps the last good body and says why.
    edit(&path, "def body(x):\n    return (x\n");
    let v = call(&op);
    assert!(v == [10., 20.] || v == [1000., 2000.], "{v:?}");
    let err = op.last_reload_error().expect("the broken edit is reported");
    assert!(err.contains("SyntaxError"), "{err}");

    edit(&path, "def body(x):\n    return x - 1\n");
    assert_eq!(call(&op), [0., 1.]);
    assert_eq!(op.last_reload_error(), None);

    // Broken again, then restored to exactly the text in use: the error is cleared too.
    edit(&path, "def body(x):\n    return (x\n");
    assert_eq!(call(&op), [0., 1.]);
    assert!(op.last_reload_error().is_some());
    edit(&path, "def body(x):\n    return x - 1\n");
    assert_eq!(call(&op), [0., 1.]);
    assert_eq!(
        op.last_reload_error(),
        None,
        "the restored file is good again"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_edited_package_is_reloaded() {
    hot();
    let dir = temp("pkg");
    let pkg = dir.join("hotlib");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(
        pkg.join("__init__.py"),
        "from . import helpers\n\ndef f(x):\n    return helpers.k * x\n",
    )
    .unwrap();
    std::fs::write(pkg.join("helpers.py"), "k = 2\n").unwrap();
    let op = PyOp::builder("hotlib")
        .package(&pkg, "hotlib")
        .unwrap()
        .function("f")
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    assert_eq!(call(&op), [2., 4.]);
    edit(&pkg.join("helpers.py"), "k = 3\n");
    assert_eq!(call(&op), [3., 6.], "a sibling module's edit shows up");
    std::fs::remove_dir_all(&dir).unwrap();
}
