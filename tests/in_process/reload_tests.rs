//! Hot reload (`PYOP_HOT_RELOAD=1`, here `pyop::set_hot_reload(true)`): edits to a body's file or package show up without a
//! rebuild; a broken edit keeps the last good body and reports why. Every test runs in a child
//! process: the switch is the whole process's, and other test modules share this binary.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pyop::candle::{DType, Device, Tensor};
use pyop::{Arg, OutSpec, PyOp};

use crate::common;

fn hot() {
    // The same switch as PYOP_HOT_RELOAD=1, without changing the environment of a process whose
    // other threads may be reading it.
    pyop::set_hot_reload(true);
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
    let (passed, text) =
        common::child_test(module_path!(), "an_edited_file_is_reloaded_child", &[]);
    assert!(passed, "{text}");
}

/// Run by `an_edited_file_is_reloaded` in a process of its own: hot reload, once on, stays on for
/// every op the process builds after it, and the other test modules share this binary.
#[test]
#[ignore = "a child process of an_edited_file_is_reloaded"]
fn an_edited_file_is_reloaded_child() {
    hot();
    let tmp = common::TempDir::new("reload-file");
    let dir = tmp.path();
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

    // Checked at most every 250 ms, not on every call: an edit made right after a call that
    // checked is not seen by a call that ends less than 250 ms after the checking call began.
    // Each attempt is judged only when the machine was fast enough to make both calls in
    // 200 ms; at least one of 20 attempts must be (a slow machine retries, it never skips).
    let mut judged = 0;
    for _ in 0..20 {
        std::thread::sleep(pyop_check_interval() + Duration::from_millis(50));
        let checked = Instant::now();
        assert_eq!(call(&op), [10., 20.]); // this call looks at the file
        std::fs::write(&path, "def body(x):\n    return x * 1000\n").unwrap();
        let v = call(&op);
        let in_time = checked.elapsed() < Duration::from_millis(200);
        std::fs::write(&path, "def body(x):\n    return x * 10\n").unwrap();
        if in_time {
            assert_eq!(v, [10., 20.], "looked at the file again too soon");
            judged += 1;
            break;
        }
    }
    assert_eq!(judged, 1, "no attempt made two calls within 200 ms");
    std::thread::sleep(pyop_check_interval() + Duration::from_millis(50));
    assert_eq!(call(&op), [10., 20.]);

    // A reload that fails keeps the last good body and says why.
    edit(&path, "def body(x):\n    return (x\n");
    assert_eq!(call(&op), [10., 20.]);
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
}

#[test]
fn an_edited_package_is_reloaded() {
    let (passed, text) =
        common::child_test(module_path!(), "an_edited_package_is_reloaded_child", &[]);
    assert!(passed, "{text}");
}

/// Run by `an_edited_package_is_reloaded` in a process of its own: hot reload, once on, stays on for
/// every op the process builds after it, and the other test modules share this binary.
#[test]
#[ignore = "a child process of an_edited_package_is_reloaded"]
fn an_edited_package_is_reloaded_child() {
    hot();
    let tmp = common::TempDir::new("reload-pkg");
    let dir = tmp.path();
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
}

// --- `#[py_op]` ops under PYOP_HOT_RELOAD, in a child process (the variable is read once) ---

#[pyop::py_op(file = "tests/py/reload/body.py", numpy, tout = f64, grad = "reloaded_grad")]
fn reloaded(x: &Tensor) -> pyop::Result<Tensor>;

#[pyop::py_op(file = "tests/py/reload/body.py", numpy, tout = f64)]
fn sibling(x: &Tensor) -> pyop::Result<Tensor>;

#[pyop::py_op(package = "tests/py/reloadpkg", name = "pkg_body", numpy, tout = f64)]
fn pkg_body(x: &Tensor) -> pyop::Result<Tensor>;

const BODY_PY: &str = include_str!("../py/reload/body.py");

/// The child's copy of a fixture: the declared ops read their sources from a copy of the
/// fixtures the parent made (`RELOAD_ROOT`), so the tracked files are never edited, even by a
/// run that is killed halfway.
fn fixture(rel: &str) -> PathBuf {
    Path::new(&std::env::var("RELOAD_ROOT").expect("set by the parent test")).join(rel)
}

/// Values of a declared op and of its gradient at x = [1, 2].
fn value_and_grad(op: fn(&Tensor) -> pyop::Result<Tensor>) -> (Vec<f64>, Vec<f64>) {
    let x = pyop::candle::Var::new(&[1f64, 2.], &Device::Cpu).unwrap();
    let y = op(x.as_tensor()).unwrap();
    let g = y.sum_all().unwrap().backward().unwrap();
    let dx = g.get(&x).unwrap().to_vec1::<f64>().unwrap();
    (y.to_vec1::<f64>().unwrap(), dx)
}

fn plain(op: fn(&Tensor) -> pyop::Result<Tensor>) -> Vec<f64> {
    op(&Tensor::new(&[1f64, 2.], &Device::Cpu).unwrap())
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// Run by `declared_ops_reload_with_pyop_hot_reload` in a child process, with `PYOP_HOT_RELOAD`
/// set or not and `EXPECT_RELOAD` saying which: edits the body file (the body, its gradient and
/// another op of the same file) and adds a file to the package.
#[test]
#[ignore = "a child process of declared_ops_reload_with_pyop_hot_reload, which sets its environment"]
fn hot_reload_child() {
    let reload = std::env::var("EXPECT_RELOAD").expect("run by the parent test") == "1";
    pyop::__private::relocate_sources(env!("CARGO_MANIFEST_DIR"), fixture(""));
    assert_eq!(value_and_grad(reloaded), (vec![2., 4.], vec![2., 2.]));
    assert_eq!(plain(sibling), [2., 2.]);
    assert_eq!(plain(pkg_body), [-1., -1.]);

    std::fs::write(
        fixture("tests/py/reload/body.py"),
        BODY_PY.replace("K = 2", "K = 3"),
    )
    .unwrap();
    std::fs::write(fixture("tests/py/reloadpkg/extra.py"), "VALUE = 7\n").unwrap();
    std::thread::sleep(pyop_check_interval() + Duration::from_millis(150));
    if reload {
        assert_eq!(
            value_and_grad(reloaded),
            (vec![3., 6.], vec![3., 3.]),
            "body and gradient"
        );
        assert_eq!(
            plain(sibling),
            [3., 3.],
            "another op of the same file sees the new module"
        );
        assert_eq!(
            plain(pkg_body),
            [7., 7.],
            "a file added to the package is seen at once"
        );
    } else {
        assert_eq!(
            value_and_grad(reloaded),
            (vec![2., 4.], vec![2., 2.]),
            "the embedded copy"
        );
        assert_eq!(plain(sibling), [2., 2.]);
        assert_eq!(plain(pkg_body), [-1., -1.]);
    }
    println!("child: ok");
}

#[test]
fn declared_ops_reload_with_pyop_hot_reload() {
    let tmp = common::TempDir::new("reload-declared");
    let copy = |rel: &str| {
        let (from, to) = (
            Path::new(env!("CARGO_MANIFEST_DIR")).join(rel),
            tmp.path().join(rel),
        );
        std::fs::create_dir_all(&to).unwrap();
        for f in std::fs::read_dir(&from).unwrap() {
            let f = f.unwrap();
            if f.file_type().unwrap().is_file() {
                std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
            }
        }
    };
    for (var, expect) in [(Some("1"), "1"), (Some("0"), "0"), (None, "0")] {
        let _ = std::fs::remove_dir_all(tmp.path().join("tests"));
        copy("tests/py/reload");
        copy("tests/py/reloadpkg");
        let env = [
            ("EXPECT_RELOAD", Some(expect.as_ref())),
            ("RELOAD_ROOT", Some(tmp.path().as_os_str())),
            ("PYOP_HOT_RELOAD", var.map(AsRef::as_ref)),
        ];
        let (passed, text) = common::child_test(module_path!(), "hot_reload_child", &env);
        assert!(
            passed && text.contains("child: ok"),
            "PYOP_HOT_RELOAD={var:?}:\n{text}"
        );
    }
}

#[test]
fn an_edited_file_is_reloaded_in_workers() {
    let (passed, text) = common::child_test(
        module_path!(),
        "an_edited_file_is_reloaded_in_workers_child",
        &[],
    );
    assert!(passed, "{text}");
}

/// Run by `an_edited_file_is_reloaded_in_workers` in a process of its own: hot reload, once on, stays on for
/// every op the process builds after it, and the other test modules share this binary.
#[test]
#[ignore = "a child process of an_edited_file_is_reloaded_in_workers"]
fn an_edited_file_is_reloaded_in_workers_child() {
    hot();
    let tmp = common::TempDir::new("reload-workers");
    let path = tmp.path().join("wbody.py");
    std::fs::write(&path, "def wbody(x):\n    return x + 1\n").unwrap();
    let pool = pyop::WorkerPool::new(2);
    let op = PyOp::builder("wbody")
        .file(&path)
        .unwrap()
        .numpy()
        .pool(&pool)
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    // Both workers load the first text.
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| assert_eq!(call(&op), [2., 3.]));
        }
    });
    edit(&path, "def wbody(x):\n    return x * 10\n");
    // Every worker, whichever runs the call, runs the edited body.
    for _ in 0..6 {
        assert_eq!(call(&op), [10., 20.]);
    }
    // A broken edit keeps the last good body, in the workers too.
    edit(&path, "def wbody(x):\n    return (x\n");
    assert_eq!(call(&op), [10., 20.]);
    assert!(op.last_reload_error().is_some());
}
