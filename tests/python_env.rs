//! Which Python environment the embedded interpreter uses, and what each bad set-up looks like:
//! no environment, an environment made by another Python X.Y, NumPy missing, another libpython
//! of the same X.Y loaded first. Each is a clear error naming the fix, never a panic.
//!
//! The interpreter starts once per process, so each scenario runs in a child process: this test
//! binary (`harness = false`) runs itself again with `PYOP_ENV_CHILD=<scenario>`.

use std::path::{Path, PathBuf};
use std::process::Command;

use pyop::candle::{Device, Tensor};
use pyop::{py_op, EnvSource, ErrorKind};

#[py_op(code = "def total(x):\n    return x.sum()", numpy, tout = f32)]
fn total(x: &Tensor) -> pyop::Result<Tensor>;

// Imports NumPy as it loads: with NumPy missing, that is the same problem, not a second one.
#[py_op(code = "import numpy as np\ndef mean(x):\n    return np.mean(x)", numpy, tout = f32)]
fn mean(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def twice(x):\n    return x * 2", tout = f32)]
fn twice(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import sys\ndef to_stderr(x, i):\n    print('python', i, file=sys.stderr, end='')\n    print(' line', file=sys.stderr)\n    return x", tout = f32)]
fn to_stderr(x: &Tensor, i: i64) -> pyop::Result<Tensor>;

#[py_op(code = "def to_numpy(x):\n    return x.numpy()", tout = f32)]
fn to_numpy(x: &Tensor) -> pyop::Result<Tensor>;

/// A pin this binary records as a crate built with `PYOP_PYTHON_ENV` set records it (as every
/// `#[py_op]` declaration does), to a venv that no longer exists: moved or deleted.
const GONE_PIN: &str = "/nonexistent/pyop-pinned-app/.venv";

pyop::__private::inventory::submit! {
    pyop::__private::BuildEnv {
        manifest_dir: "/nonexistent/pyop-pinned-app",
        pyop_python_env: Some(GONE_PIN),
        virtual_env: None,
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `python` of the repository's venv, as hints name it.
fn venv_python() -> PathBuf {
    repo().join(".venv").join("bin").join("python")
}

/// What a child checks, by scenario.
fn child(scenario: &str) {
    let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
    let env = pyop::python_env().unwrap();
    match scenario {
        "virtual_env" | "override" | "dot_venv" | "recorded_at_build" => {
            let want = match scenario {
                "virtual_env" => EnvSource::VirtualEnv,
                "override" => EnvSource::PyopPythonEnv,
                "dot_venv" => EnvSource::DotVenv,
                _ => EnvSource::Build,
            };
            assert_eq!(env.source, want, "{env:?}");
            assert_eq!(
                env.root.as_deref(),
                Some(repo().join(".venv").as_path()),
                "{env:?}"
            );
            // The gone pin is passed over, and named, unless PYOP_PYTHON_ENV overrides it.
            let pin = (scenario != "override").then(|| PathBuf::from(GONE_PIN));
            assert_eq!(env.missing_pin, pin, "{env:?}");
            assert_eq!(
                total(&x).unwrap().to_scalar::<f32>().unwrap(),
                6.0,
                "NumPy from the venv"
            );
            // The test binaries have an rpath: the interpreter is the one built against.
            assert!(env.problems.is_empty(), "{:?}", env.problems);
            assert_eq!(env.running.version, env.built.version, "{env:?}");
            pyop::validate().unwrap();
        }
        "no_env" => {
            assert_eq!(env.source, EnvSource::None, "{env:?}");
            assert_eq!(env.root, None);
            assert!(env.problems.is_empty(), "{:?}", env.problems);
            let err = total(&x).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::PackageUnavailable, "{err}");
            let text = err.to_string();
            // The hint names the embedded interpreter itself, never a bare `python3` from PATH.
            let exe = env
                .running
                .executable
                .clone()
                .expect("the installation's python");
            assert!(exe.is_absolute(), "{exe:?}");
            // PYOP_PYTHON_ENV=none asked for the interpreter's own packages: install there.
            assert!(
                text.contains(&format!(
                    "`{} -m pip install numpy` (PYOP_PYTHON_ENV=none",
                    exe.display()
                )),
                "{text}"
            );
            assert!(
                !text.contains("`python3 -m pip") && !text.contains("-m venv"),
                "{text}"
            );
        }
        "no_numpy" => {
            let err = total(&x).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::PackageUnavailable, "{err}");
            let text = err.to_string();
            assert!(
                text.starts_with("op `total`: numpy mode needs NumPy"),
                "{text}"
            );
            assert!(
                text.contains(&format!(
                    "`{} -m pip install numpy`",
                    venv_python().display()
                )),
                "the environment's own pip: {text}"
            );
            assert!(text.contains("numpy is broken here"), "says why: {text}");
            // Tensor mode works without NumPy; only `numpy()` needs it, and says so.
            assert_eq!(twice(&x).unwrap().to_vec1::<f32>().unwrap(), [2., 4., 6.]);
            let err = to_numpy(&x).unwrap_err();
            assert!(err.to_string().contains("needs NumPy"), "{err}");
            // validate(): one cause, one problem, listing the op it affects.
            let report = pyop::validation_report().unwrap();
            assert_eq!(report.problems.len(), 1, "{:#?}", report.problems);
            let p = &report.problems[0];
            assert!(p.message.starts_with("numpy mode needs NumPy"), "{p}");
            let ops: Vec<&str> = p.ops.iter().map(|o| o.name).collect();
            assert_eq!(ops, ["mean", "total"]);
            assert!(p.to_string().contains("affects 2 ops:"), "{p}");
        }
        "missing_pin" => {
            // Below the gone pin, the environment recorded at build time; NumPy broken there:
            // the error says first that the pin does not exist.
            assert_eq!(env.missing_pin.as_deref(), Some(Path::new(GONE_PIN)));
            assert_eq!(env.source, EnvSource::Build, "{env:?}");
            assert!(env.problems.is_empty(), "{:?}", env.problems);
            let err = total(&x).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::PackageUnavailable, "{err}");
            let text = err.to_string();
            let want = format!(
                "numpy is broken here); pyop uses the environment {} (the environment recorded at \
                 build time), since the environment pinned at build time (PYOP_PYTHON_ENV), \
                 {GONE_PIN}, does not exist (moved or deleted?): install it with",
                repo().join(".venv").display()
            );
            assert!(text.contains(&want), "{want:?} not in {text}");
        }
        "other_version_env" => {
            // A venv made by another Python X.Y: said so, with the command that recreates it.
            assert_eq!(env.source, EnvSource::PyopPythonEnv, "{env:?}");
            assert_eq!(env.site_packages, None, "{env:?}");
            let root = env.root.clone().unwrap();
            assert_eq!(env.problems.len(), 1, "{:?}", env.problems);
            let problem = &env.problems[0];
            let exe = env.running.executable.clone().unwrap();
            for want in [
                format!("the environment {} (PYOP_PYTHON_ENV)", root.display()),
                "was made by Python 3.6.15".to_owned(),
                format!("this program embeds Python {}", env.running.version),
                format!("`{} -m venv --clear {}`", exe.display(), root.display()),
            ] {
                assert!(problem.contains(&want), "{want:?} not in {problem}");
            }
            // The NumPy it cannot import is that problem's consequence, not a second problem.
            let report = pyop::validation_report().unwrap();
            assert_eq!(report.problems.len(), 1, "{:#?}", report.problems);
            let text = report.problems[0].to_string();
            assert!(text.starts_with(problem.as_str()), "{text}");
            assert!(
                text.ends_with(
                    "affects 2 ops:\n      python_env::mean (tests/python_env.rs:19)\n      \
                     python_env::total (tests/python_env.rs:15)"
                ),
                "{text}"
            );
            assert!(text.contains("NumPy cannot be imported"), "{text}");
            assert_eq!(report.problems[0].ops.len(), 2, "{text}");
            // And the error of a call says it too.
            let err = total(&x).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::PackageUnavailable);
            assert!(err.to_string().contains(problem.as_str()), "{err}");
        }
        "other_libpython" => {
            // LD_LIBRARY_PATH put another build of the same X.Y first.
            assert_eq!(env.problems.len(), 1, "{env:?}");
            let problem = &env.problems[0];
            let built_dir = env.built.library.clone().unwrap();
            let loaded = env.running.library.clone().unwrap();
            assert_ne!(loaded.parent(), Some(built_dir.as_path()));
            for want in [
                format!(
                    "built against Python {} ({})",
                    env.built.version,
                    built_dir.display()
                ),
                format!(
                    "running Python {} ({})",
                    env.running.version,
                    loaded.display()
                ),
                "LD_LIBRARY_PATH".to_owned(),
            ] {
                assert!(problem.contains(&want), "{want:?} not in {problem}");
            }
            let err = pyop::validate().unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Validation);
            assert!(err.to_string().contains(problem.as_str()), "{err}");
        }
        "stderr_order" => {
            // Python's stderr is line-buffered like Rust's: with stderr a pipe, each line lands
            // where it was written (the parent checks the order).
            for i in 0..3 {
                eprintln!("rust {i}");
                to_stderr(&x, i).unwrap();
            }
            eprintln!("rust end");
        }
        other => panic!("unknown scenario {other}"),
    }
    println!("ok {scenario}");
}

/// Runs one scenario; returns its stderr on success.
fn run(scenario: &str, cwd: &Path, env: &[(&str, &str)]) -> Result<String, String> {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.current_dir(cwd)
        .env("PYOP_ENV_CHILD", scenario)
        .env_remove("VIRTUAL_ENV")
        .env_remove("PYOP_PYTHON_ENV")
        .env_remove("PYTHONPATH")
        .env_remove("LD_LIBRARY_PATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() && stdout.contains(&format!("ok {scenario}")) {
        Ok(stderr)
    } else {
        Err(format!("{stdout}{stderr}"))
    }
}

/// A folder holding another build's `libpythonX.Y.so.1.0` of the version this binary was built
/// against (Debian's, beside pyenv's), if the machine has one.
fn other_libpython() -> Option<PathBuf> {
    let probe = Command::new(std::env::current_exe().unwrap())
        .env("PYOP_ENV_CHILD", "report")
        .output()
        .ok()?;
    let text = String::from_utf8(probe.stdout).ok()?;
    let mut lines = text.lines();
    let (version, built_dir) = (lines.next()?.to_owned(), PathBuf::from(lines.next()?));
    let name = format!("libpython{version}.so.1.0");
    [
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/lib",
    ]
    .iter()
    .map(PathBuf::from)
    .filter(|d| d.join(&name).is_file())
    .find(|d| d.canonicalize().ok() != built_dir.canonicalize().ok())
}

fn main() {
    match std::env::var("PYOP_ENV_CHILD").as_deref() {
        Ok("report") => {
            let env = pyop::python_env().unwrap();
            let v = &env.running.version;
            println!("{}", &v[..v.rfind('.').unwrap()]);
            println!("{}", env.built.library.unwrap_or_default().display());
            return;
        }
        Ok(scenario) => {
            child(scenario);
            return;
        }
        Err(_) => {}
    }
    let venv = repo().join(".venv");
    assert!(
        venv.join("pyvenv.cfg").exists(),
        "{} is missing: run scripts/dev.sh test",
        venv.display()
    );
    let venv = venv.to_str().unwrap();
    let outside = std::env::temp_dir().join(format!("pyop-env-{}", std::process::id()));
    let fake_numpy = outside.join("fake").join("numpy");
    std::fs::create_dir_all(&fake_numpy).unwrap();
    std::fs::write(
        fake_numpy.join("__init__.py"),
        "raise ImportError('numpy is broken here')\n",
    )
    .unwrap();
    let fake = outside.join("fake");
    let fake = fake.to_str().unwrap();
    // A venv as Python 3.6 makes one: a `pyvenv.cfg` and its own site-packages.
    let old_venv = outside.join("old-venv");
    std::fs::create_dir_all(old_venv.join("lib/python3.6/site-packages")).unwrap();
    std::fs::write(
        old_venv.join("pyvenv.cfg"),
        "home = /root/.pyenv/versions/3.6.15/bin\ninclude-system-site-packages = false\nversion = 3.6.15\n",
    )
    .unwrap();
    let old_venv = old_venv.to_str().unwrap();
    let other_lib = other_libpython();
    let other_lib_dir = other_lib.as_ref().map(|d| d.to_string_lossy().into_owned());

    type Scenario<'a> = (&'a str, PathBuf, Vec<(&'a str, &'a str)>);
    let mut scenarios: Vec<Scenario> = vec![
        ("virtual_env", outside.clone(), vec![("VIRTUAL_ENV", venv)]),
        (
            "override",
            outside.clone(),
            vec![
                ("PYOP_PYTHON_ENV", venv),
                ("VIRTUAL_ENV", "/nonexistent/venv"),
            ],
        ),
        ("dot_venv", repo().join("tests").join("py"), vec![]),
        // Started from elsewhere with nothing set: the environment recorded at build time.
        ("recorded_at_build", outside.clone(), vec![]),
        (
            "no_env",
            outside.clone(),
            vec![("PYOP_PYTHON_ENV", "none"), ("PYTHONPATH", fake)],
        ),
        (
            "no_numpy",
            outside.clone(),
            vec![("VIRTUAL_ENV", venv), ("PYTHONPATH", fake)],
        ),
        ("missing_pin", outside.clone(), vec![("PYTHONPATH", fake)]),
        (
            "other_version_env",
            outside.clone(),
            vec![("PYOP_PYTHON_ENV", old_venv), ("PYTHONPATH", fake)],
        ),
    ];
    scenarios.push(("stderr_order", outside.clone(), vec![("VIRTUAL_ENV", venv)]));
    match &other_lib_dir {
        Some(dir) => scenarios.push((
            "other_libpython",
            outside.clone(),
            vec![("VIRTUAL_ENV", venv), ("LD_LIBRARY_PATH", dir.as_str())],
        )),
        None => println!(
            "test other_libpython ... skipped: this machine has no second build of the Python \
             this binary was built against (none beside it in the standard library folders)"
        ),
    }
    let (mut passed, mut failed) = (0, 0);
    for (name, cwd, env) in &scenarios {
        match run(name, cwd, env) {
            Ok(stderr) if *name == "stderr_order" => {
                let lines: Vec<&str> = stderr.lines().collect();
                let want = [
                    "rust 0",
                    "python 0 line",
                    "rust 1",
                    "python 1 line",
                    "rust 2",
                    "python 2 line",
                    "rust end",
                ];
                if lines == want {
                    println!("test {name} ... ok");
                    passed += 1;
                } else {
                    println!("test {name} ... FAILED: stderr out of order\n{stderr}");
                    failed += 1;
                }
            }
            Ok(stderr) => {
                // A set-up problem is printed once at start-up, never silently ignored.
                let printed = stderr.lines().filter(|l| l.starts_with("pyop: ")).count();
                let expected =
                    usize::from(matches!(*name, "other_version_env" | "other_libpython"));
                if printed == expected {
                    println!("test {name} ... ok");
                    passed += 1;
                } else {
                    println!("test {name} ... FAILED: {printed} start-up warnings, expected {expected}\n{stderr}");
                    failed += 1;
                }
            }
            Err(output) => {
                println!("test {name} ... FAILED\n{output}");
                failed += 1;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&outside);
    println!("\n{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}
