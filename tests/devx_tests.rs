//! Developer experience: the registry and its manifest, start-up validation, packages, and the
//! embedded copy being used when hot reload is off.

use pyop::candle::{DType, Device, Tensor};
use pyop::{py_op, Arg, ErrorKind, OutSpec, PyOp};

fn x() -> Tensor {
    Tensor::new(&[1f64, 2.], &Device::Cpu).unwrap()
}

// --- ops of this test binary: two of the same name in different modules, and broken ones ---

mod first {
    use pyop::{py_op, Tensor};
    #[py_op(code = "def same_name(x):\n    return x + 1", tout = f64)]
    pub fn same_name(x: &Tensor) -> pyop::Result<Tensor>;
}

mod second {
    use pyop::{py_op, Tensor};
    #[py_op(code = "def same_name(x):\n    return x + 2", numpy, tout = f64)]
    pub fn same_name(x: &Tensor) -> pyop::Result<Tensor>;
}

#[py_op(package = "tests/py/mylib", name = "lib_fn", tout = f64)]
fn lib_fn(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(package = "tests/py/mylib", module = "mylib.sub.deep", tout = f64)]
fn deep_fn(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(package = "tests/py/mylib", tout = i64)]
fn where_from(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(module = "numpy", name = "divmod", numpy, tout = (i64, i64))]
fn divmod(a: &Tensor, b: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

/// A builtin without a signature: validation says it skipped the check.
#[py_op(module = "math", name = "hypot", tout = f64)]
fn hypot(a: f64, b: f64) -> pyop::Result<Tensor>;

/// Broken bodies, for `validate()`. Inline code this broken is a compile error (the build-time
/// check); a body in a `const` is text the macro does not see, so these reach `validate()` as a
/// `module` source or a build without the check (`PYOP_BUILD_CHECKS=0`, cross-compiling) would.
mod broken {
    use pyop::{py_op, Tensor};

    const OTHER: &str = "def other(x):\n    return x";
    #[py_op(code = OTHER, tout = f64)]
    pub fn missing_function(x: &Tensor) -> pyop::Result<Tensor>;

    const WRONG_ARITY: &str = "def wrong_arity(x, y, z):\n    return x";
    #[py_op(code = WRONG_ARITY, tout = f64)]
    pub fn wrong_arity(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

    const NO_GRAD_FN: &str = "def no_grad_fn(x):\n    return x";
    #[py_op(code = NO_GRAD_FN, tout = f64, grad = "no_such_grad")]
    pub fn no_grad_fn(x: &Tensor) -> pyop::Result<Tensor>;

    const SYNTAX: &str = "def syntax(x):\n    return (x\n";
    #[py_op(code = SYNTAX, tout = f64)]
    pub fn syntax(x: &Tensor) -> pyop::Result<Tensor>;

    const BAD_GRAD_SIG: &str = "def g(x):\n    return x\ndef bad_grad_sig(x):\n    return x";
    #[py_op(code = BAD_GRAD_SIG, tout = f64, grad = "g")]
    pub fn bad_grad_sig(x: &Tensor) -> pyop::Result<Tensor>;

    // Two problems of one op: its body's arity and its gradient's.
    const TWO_PROBLEMS: &str = "def body(x, y):\n    return x\ndef g(a):\n    return a";
    #[py_op(code = TWO_PROBLEMS, name = "body", tout = f64, grad = "g")]
    pub fn two_problems(x: &Tensor) -> pyop::Result<Tensor>;

    // A syntax error: reported with the source line and a caret.
    const RAW_SYNTAX: &str = r#"
def raw_syntax(x):
    return x +* 2
"#;
    #[py_op(code = RAW_SYNTAX, tout = f64)]
    pub fn raw_syntax(x: &Tensor) -> pyop::Result<Tensor>;

    // Two ops sharing a worker pool but declaring it with different sizes.
    #[py_op(code = "def pool_small(x):\n    return x", numpy, workers = 1, pool = "mismatched", tout = f64)]
    pub fn pool_small(x: &Tensor) -> pyop::Result<Tensor>;

    #[py_op(code = "def pool_large(x):\n    return x", numpy, workers = 2, pool = "mismatched", tout = f64)]
    pub fn pool_large(x: &Tensor) -> pyop::Result<Tensor>;
}

// An exception in inline code: the traceback names this file and its line.
#[py_op(code = r#"
def helper(x):
    raise ValueError("bad value")

def inline_fail(x):
    return helper(x)
"#, tout = f64)]
fn inline_fail(x: &Tensor) -> pyop::Result<Tensor>;

/// The line of this file that holds `needle` (1-based).
fn line_of(needle: &str) -> usize {
    include_str!("devx_tests.rs")
        .lines()
        .position(|l| l.trim_end() == needle)
        .unwrap_or_else(|| panic!("{needle:?} is not a line of this file"))
        + 1
}

#[test]
fn inline_code_counts_lines_as_the_rust_file_does() {
    let err = inline_fail(&x()).unwrap_err();
    let tb = err.traceback().unwrap();
    let raise = line_of(r#"    raise ValueError("bad value")"#);
    let call = line_of("    return helper(x)");
    assert!(
        tb.contains(&format!(
            "File \"tests/devx_tests.rs\", line {call}, in inline_fail\n    return helper(x)"
        )),
        "{tb}"
    );
    assert!(
        tb.contains(&format!(
            "File \"tests/devx_tests.rs\", line {raise}, in helper\n    raise ValueError(\"bad value\")"
        )),
        "{tb}"
    );
    // pyop's own frames are not in it.
    assert!(!tb.contains("<pyop>") && !tb.contains("importlib"), "{tb}");
}

#[test]
fn every_declared_op_is_registered_by_rust_path() {
    let paths: Vec<String> = pyop::registered_ops()
        .iter()
        .map(|op| op.decl().rust_path())
        .collect();
    for want in [
        "devx_tests::first::same_name",
        "devx_tests::second::same_name",
        "devx_tests::lib_fn",
        "devx_tests::broken::syntax",
    ] {
        assert!(paths.iter().any(|p| p == want), "{want} not in {paths:?}");
    }
    // Same name, different crates or modules: both there, found by path; the bare name is ambiguous.
    assert!(pyop::registered_op("devx_tests::second::same_name").is_some());
    assert!(pyop::registered_op("same_name").is_none());
    // The typed handle of each is that registry entry, without a string.
    assert!(std::ptr::eq(
        pyop::op!(first::same_name),
        pyop::registered_op("devx_tests::first::same_name").unwrap()
    ));
    assert_eq!(
        pyop::op!(second::same_name).decl().rust_path(),
        "devx_tests::second::same_name"
    );
    assert_eq!(
        first::same_name(&x()).unwrap().to_vec1::<f64>().unwrap(),
        [2., 3.]
    );
    assert_eq!(
        second::same_name(&x()).unwrap().to_vec1::<f64>().unwrap(),
        [3., 4.]
    );
    let stats = pyop::op_stats("devx_tests::first::same_name").unwrap();
    assert!(stats.calls >= 1);
}

#[py_op(code = "def shaped_like(x, y):\n    return x, y * 1.0", tout = (like(x), f64[y]))]
fn shaped_like(x: &Tensor, y: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

#[py_op(code = "def row_sums(x, w):\n    return (x * w).sum(axis=1)", numpy,
        batch(max = 64, wait_us = 200, inputs = [x]), tout = f64[_])]
fn row_sums(x: &Tensor, w: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def doubled(x):\n    return x * 2", numpy, batch(max = 4), tout = like(x))]
fn doubled(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn the_manifest_is_json_with_everything_declared() {
    let json: serde_json::Value = serde_json::from_str(&pyop::manifest_json()).unwrap();
    let ops = json.as_array().unwrap();
    let find = |path: &str| {
        ops.iter()
            .find(|o| o["rust_path"] == path)
            .unwrap_or_else(|| panic!("{path}"))
    };
    let op = find("devx_tests::second::same_name");
    assert_eq!(op["name"], "same_name");
    assert_eq!(op["mode"], "numpy");
    assert_eq!(op["tout"], "f64");
    assert_eq!(op["file"], "tests/devx_tests.rs");
    assert_eq!(op["source"]["kind"], "code");
    // Inline code comes from where it is written.
    let origin = op["source"]["origin"].as_str().unwrap();
    let line = origin.strip_prefix("tests/devx_tests.rs:").unwrap();
    assert!(line.parse::<u32>().unwrap() > 1, "{origin}");
    assert_eq!(op["source"]["hash"].as_str().unwrap().len(), 16);
    assert_ne!(
        op["source"]["hash"],
        find("devx_tests::first::same_name")["source"]["hash"]
    );
    // `tout` as declared, parameters by name.
    assert_eq!(find("devx_tests::shaped_like")["tout"], "(like(x), f64[y])");
    let op = find("devx_tests::divmod");
    assert_eq!(op["tout"], "(i64, i64)");
    assert_eq!(op["source"]["kind"], "module");
    assert_eq!(op["source"]["origin"], "numpy");
    assert!(op["source"]["hash"].is_null());
    assert_eq!(
        find("devx_tests::broken::no_grad_fn")["grad"]["name"],
        "no_such_grad"
    );
    assert_eq!(find("devx_tests::lib_fn")["source"]["kind"], "package");
    // Batching: its settings, the stacked parameters by name (`null`: every tensor one); `null`
    // for an op that does not batch.
    assert_eq!(
        find("devx_tests::row_sums")["batch"],
        serde_json::json!({"max": 64, "wait_us": 200, "inputs": ["x"]})
    );
    assert_eq!(
        find("devx_tests::doubled")["batch"],
        serde_json::json!({"max": 4, "wait_us": 0, "inputs": null})
    );
    assert!(op["batch"].is_null());
    assert!(ops.iter().all(|o| o.get("batch").is_some()));
}

#[test]
fn validation_reports_every_problem_with_its_declaration() {
    let report = pyop::validation_report().unwrap();
    assert!(report.checked >= 10, "{report:?}");
    let problems_of = |name: &str| -> Vec<&pyop::Problem> {
        report
            .problems
            .iter()
            .filter(|p| p.ops.iter().any(|o| o.name == name))
            .collect()
    };
    let expect = |name: &str, message: &str| {
        let ps = problems_of(name);
        assert_eq!(ps.len(), 1, "{name}: {ps:?}");
        let p = ps[0];
        assert_eq!(p.ops.len(), 1, "{p:?}");
        assert_eq!(p.ops[0].rust_path, format!("devx_tests::broken::{name}"));
        assert_eq!(p.ops[0].file, "tests/devx_tests.rs");
        assert!(p.ops[0].line > 0);
        assert!(p.message.contains(message), "{name}: {}", p.message);
    };
    expect(
        "missing_function",
        "has no function `missing_function`; it defines `other`: if that is the body, declare \
         `name = \"other\"`",
    );
    let decl = line_of("    pub fn raw_syntax(x: &Tensor) -> pyop::Result<Tensor>;") - 1;
    expect(
        "raw_syntax",
        &format!(
            "SyntaxError: cannot load the code <inline code at tests/devx_tests.rs:{decl}>: \
             invalid syntax\n  File \"<inline code at tests/devx_tests.rs:{decl}>\", line 3\n    return x +* 2\n"
        ),
    );
    expect(
        "wrong_arity",
        "the function `wrong_arity` does not accept the declared arguments (x, k): TypeError",
    );
    expect("no_grad_fn", "has no gradient `no_such_grad`");
    expect("syntax", "SyntaxError");
    expect(
        "bad_grad_sig",
        "the gradient `g` does not accept (inputs, outputs, grads)",
    );
    let syntax = problems_of("raw_syntax")[0].message.clone();
    let caret = syntax.lines().last().unwrap();
    assert_eq!(caret.trim(), "^", "{syntax}");
    assert_eq!(
        caret.find('^'),
        syntax.lines().nth(2).unwrap().find('*'),
        "{syntax}"
    );
    // Ops that share a pool with different sizes: one problem naming both.
    let pool = problems_of("pool_small");
    assert_eq!(pool.len(), 1, "{pool:?}");
    assert_eq!(pool[0].ops.len(), 2, "{pool:?}");
    assert!(pool[0].ops.iter().any(|o| o.name == "pool_large"));
    assert!(
        pool[0].message.contains(
            "the ops sharing the worker pool `mismatched` declare different sizes (1, 2)"
        ),
        "{}",
        pool[0].message
    );
    // An op with two problems has both, each naming it once (the second was dropped, and the op
    // listed twice under the first).
    let two: Vec<&pyop::Problem> = report
        .problems
        .iter()
        .filter(|p| {
            p.ops
                .iter()
                .any(|o| o.rust_path == "devx_tests::broken::two_problems")
        })
        .collect();
    assert_eq!(two.len(), 2, "{two:#?}");
    assert!(two.iter().all(|p| p.ops.len() == 1), "{two:#?}");
    assert!(two[0]
        .message
        .contains("the function `body` does not accept the declared arguments (x)"));
    assert!(two[1]
        .message
        .contains("the gradient `g` does not accept (inputs, outputs, grads)"));
    // One op named twice is checked once.
    let twice = pyop::Validate::ops([
        pyop::op!(broken::two_problems),
        pyop::op!(broken::two_problems),
    ])
    .report()
    .unwrap();
    assert_eq!((twice.checked, twice.problems.len()), (1, 2), "{twice:#?}");
    assert_eq!(
        format!("{:?}", pyop::op!(broken::two_problems)),
        "StaticOp(devx_tests::broken::two_problems)"
    );
    // Only the broken ones: the rest, and the Python version, check out.
    assert_eq!(report.problems.len(), 9, "{:#?}", report.problems);
    assert!(
        report
            .skipped
            .iter()
            .any(|s| s.contains("devx_tests::hypot") && s.contains("no signature")),
        "{:?}",
        report.skipped
    );
    // validate() turns them into one error listing all of them.
    let err = pyop::validate().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Validation);
    let text = err.to_string();
    assert!(text.starts_with("validate() found 9 problem(s)"), "{text}");
    assert!(
        !text.contains("op `validate`"),
        "no pseudo-op names: {text}"
    );
    assert_eq!(err.op(), None);
    for p in &report.problems {
        assert!(
            text.contains(&p.to_string().replace('\n', "\n    ")),
            "{text}"
        );
    }
}

#[test]
fn a_module_function_without_tensors() {
    assert_eq!(hypot(3.0, 4.0).unwrap().to_scalar::<f64>().unwrap(), 5.0);
    assert!(hypot(3.0, 4.0).unwrap().device().is_cpu());
}

#[test]
fn packages_import_their_own_modules_from_memory() {
    assert_eq!(lib_fn(&x()).unwrap().to_vec1::<f64>().unwrap(), [3., 5.]);
    assert_eq!(deep_fn(&x()).unwrap().to_vec1::<f64>().unwrap(), [4., 8.]);
    assert_eq!(where_from(&x()).unwrap().to_vec1::<i64>().unwrap(), [1, 1]);
}

#[test]
fn without_hot_reload_the_embedded_copy_is_used() {
    assert!(std::env::var_os("PYOP_HOT_RELOAD").is_none());
    let dir = std::env::temp_dir().join(format!("pyop-devx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("body.py");
    std::fs::write(&path, "def body(x):\n    return x + 1\n").unwrap();
    let op = PyOp::builder("body")
        .file(&path)
        .unwrap()
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    std::fs::write(&path, "def body(x):\n    return x + 100\n").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert_eq!(
        op.call(&[Arg::from(&x())]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap(),
        [2., 3.]
    );
    std::fs::remove_dir_all(&dir).unwrap(); // never read again
    assert_eq!(
        op.call(&[Arg::from(&x())]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap(),
        [2., 3.]
    );
}

#[test]
fn missing_packages_say_what_to_do() {
    let op = PyOp::builder("needs_pkg")
        .code("import pyop_surely_missing_pkg\ndef needs_pkg(x):\n    return x")
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap_err();
    assert_eq!(op.kind(), ErrorKind::Source);
    let text = op.to_string();
    assert!(
        text.contains("No module named 'pyop_surely_missing_pkg'"),
        "{text}"
    );
    assert!(
        text.contains(
            "pip install pyop_surely_missing_pkg` (the package may have another name on PyPI)"
        ),
        "{text}"
    );
    // A module whose distribution has another name is installed by that name, and said plainly.
    // (`None` in `sys.modules` makes the import fail whether or not scikit-learn is installed.)
    let err = PyOp::builder("needs_sklearn")
        .code(
            "import sys\nsys.modules['sklearn'] = None\nimport sklearn.isotonic\n\
             def needs_sklearn(x):\n    return x",
        )
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("pip install scikit-learn`"), "{text}");
    assert!(!text.contains("pip install sklearn"), "{text}");
    assert!(!text.contains("another name"), "{text}");
    // An import inside the body fails its call with the kind NumPy missing has.
    let op = PyOp::builder("imports_late")
        .code("def imports_late(x):\n    import pyop_surely_missing_pkg\n    return x")
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    let err = op.call(&[Arg::from(&x())]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::PackageUnavailable, "{err}");
    assert!(
        err.to_string()
            .contains("pip install pyop_surely_missing_pkg"),
        "{err}"
    );
}

// Declarations may return candle's or anyhow's `Result` (any `Result<_, E: From<pyop::Error>>`).
#[py_op(code = "def candle_style(x):\n    return x * 3", tout = f64)]
fn candle_style(x: &Tensor) -> pyop::candle::Result<Tensor>;

#[py_op(code = "def anyhow_style(x):\n    raise ValueError('no good')", tout = f64)]
fn anyhow_style(x: &Tensor) -> anyhow::Result<Tensor>;

#[test]
fn declarations_return_candle_or_anyhow_results() {
    let y = candle_style(&x()).unwrap();
    assert_eq!(y.to_vec1::<f64>().unwrap(), [3., 6.]);
    let from_candle: pyop::candle::Result<Tensor> = (|| candle_style(&candle_style(&x())?))();
    assert_eq!(from_candle.unwrap().to_vec1::<f64>().unwrap(), [9., 18.]);
    // The kind survives both: back from candle's error, and downcast from anyhow's.
    let err = anyhow_style(&x()).unwrap_err();
    let pyop_err = err
        .downcast_ref::<pyop::Error>()
        .expect("a pyop::Error inside");
    assert_eq!(pyop_err.kind(), ErrorKind::InvalidArgument);
    assert!(err.to_string().contains("ValueError: no good"), "{err}");
    // As candle's error: the same text (no context line of its own), and the kind back.
    let pyop_err = anyhow_style(&x())
        .unwrap_err()
        .downcast::<pyop::Error>()
        .unwrap();
    let text = pyop_err.to_string();
    let as_candle = pyop::candle::Error::from(pyop_err);
    assert_eq!(as_candle.to_string(), text);
    assert_eq!(
        pyop::Error::from(as_candle).kind(),
        ErrorKind::InvalidArgument
    );
}

/// The files a `package` embeds (walked by the macro) and those the runtime reads for
/// `OpBuilder::package` and hot reload (walked by the runtime) are the same: one skip rule.
#[test]
fn one_package_walk_rule_at_compile_and_run_time() {
    let files = |source: &pyop::Source| -> Vec<String> {
        match source {
            pyop::Source::Package { files, .. } => {
                files.iter().map(|(path, _)| path.to_string()).collect()
            }
            other => panic!("{other:?}"),
        }
    };
    let embedded = files(
        &pyop::registered_op("devx_tests::lib_fn")
            .unwrap()
            .decl()
            .source(),
    );
    let op = PyOp::builder("lib_fn")
        .package("tests/py/mylib", "mylib")
        .unwrap()
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    let read = files(op.source().unwrap());
    assert_eq!(embedded, read);
    assert!(embedded.iter().any(|f| f == "sub/deep.py"), "{embedded:?}");
    assert!(
        !embedded.iter().any(|f| f.contains("checkpoint")),
        "dot-folders are skipped: {embedded:?}"
    );
}

/// A syntax error in a package's helper module (which the build-time check does not compile)
/// is a `Source` error at load whose traceback starts at the package's own import of it: not in
/// `importlib`, which pyop calls to load the package.
#[test]
fn a_helper_modules_syntax_error_shows_no_import_machinery() {
    let dir = std::env::temp_dir().join(format!("pyop-devx-helper-{}", std::process::id()));
    let pkg = dir.join("broken_helper");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(pkg.join("__init__.py"), "from .helpers import twice\n").unwrap();
    std::fs::write(pkg.join("helpers.py"), "def twice(x):\n    return (x * 2\n").unwrap();
    let err = PyOp::builder("twice")
        .package(&pkg, "broken_helper")
        .unwrap()
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap_err();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(err.kind(), ErrorKind::Source);
    let tb = err.traceback().unwrap();
    assert!(!tb.contains("importlib"), "{tb}");
    assert!(
        tb.starts_with("Traceback (most recent call last):\n  File \"")
            && tb.contains("__init__.py\", line 1, in <module>\n    from .helpers import twice"),
        "{tb}"
    );
    assert!(tb.contains("helpers.py\", line 2"), "{tb}");
}

/// Test bodies that check with Python `assert` rely on asserts running: PYTHONOPTIMIZE would
/// strip them silently (scripts/dev.sh unsets it; this fails if it is set anyway).
#[test]
fn python_asserts_run_in_the_test_suite() {
    let op = PyOp::builder("asserts")
        .code("def asserts(x):\n    assert False, 'asserts run'\n    return x")
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    let err = op.call(&[Arg::from(&x())]).unwrap_err();
    assert!(
        err.to_string().contains("AssertionError: asserts run"),
        "Python asserts are stripped (PYTHONOPTIMIZE?): {err}"
    );
}
