//! Which Python environment the embedded interpreter uses, and what happens without NumPy.
//!
//! The interpreter starts once per process, so each scenario runs in a child process: this test
//! binary (`harness = false`) runs itself again with `PYOP_ENV_CHILD=<scenario>`.

use std::path::{Path, PathBuf};
use std::process::Command;

use pyop::candle::{Device, Tensor};
use pyop::{py_op, ErrorKind};

#[py_op(code = "def total(x):\n    return x.sum()", numpy, tout = f32)]
fn total(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def twice(x):\n    return x * 2", tout = f32)]
fn twice(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def to_numpy(x):\n    return x.numpy()", tout = f32)]
fn to_numpy(x: &Tensor) -> pyop::Result<Tensor>;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// What a child checks, by scenario.
fn child(scenario: &str) {
    let x = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
    let env = pyop::python_env().unwrap();
    match scenario {
        "virtual_env" | "override" | "dot_venv" => {
            let want = match scenario {
                "virtual_env" => "VIRTUAL_ENV",
                "override" => "PYOP_PYTHON_ENV",
                _ => ".venv",
            };
            assert_eq!(env.source, want, "{env:?}");
            assert_eq!(
                env.root.as_deref(),
                Some(repo().join(".venv").as_path()),
                "{env:?}"
            );
            assert_eq!(
                total(&x).unwrap().to_scalar::<f32>().unwrap(),
                6.0,
                "NumPy from the venv"
            );
        }
        "no_env" => {
            assert_eq!(env.source, "none", "{env:?}");
            assert_eq!(env.root, None);
        }
        "no_numpy" => {
            let err = total(&x).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::PackageUnavailable, "{err}");
            let text = err.to_string();
            assert!(text.contains("numpy mode needs NumPy"), "{text}");
            assert!(
                text.contains("python3 -m pip install numpy"),
                "says what to do: {text}"
            );
            assert!(text.contains("numpy is broken here"), "says why: {text}");
            // Tensor mode works without NumPy; only `numpy()` needs it, and says so.
            assert_eq!(twice(&x).unwrap().to_vec1::<f32>().unwrap(), [2., 4., 6.]);
            let err = to_numpy(&x).unwrap_err();
            assert!(err.to_string().contains("needs NumPy"), "{err}");
        }
        other => panic!("unknown scenario {other}"),
    }
    println!("ok {scenario}");
}

fn run(scenario: &str, cwd: &Path, env: &[(&str, &str)]) -> Result<(), String> {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.current_dir(cwd)
        .env("PYOP_ENV_CHILD", scenario)
        .env_remove("VIRTUAL_ENV")
        .env_remove("PYOP_PYTHON_ENV")
        .env_remove("PYTHONPATH");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if out.status.success() && stdout.contains(&format!("ok {scenario}")) {
        Ok(())
    } else {
        Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
    }
}

fn main() {
    if let Ok(scenario) = std::env::var("PYOP_ENV_CHILD") {
        child(&scenario);
        return;
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
    type Scenario<'a> = (&'a str, PathBuf, Vec<(&'a str, &'a str)>);
    let scenarios: Vec<Scenario> = vec![
        ("virtual_env", outside.clone(), vec![("VIRTUAL_ENV", venv)]),
        (
            "override",
            outside.clone(),
            vec![
                ("PYOP_PYTHON_ENV", venv),
                ("VIRTUAL_ENV", "/nonexistent/venv"),
            ],
        ),
        ("dot_venv", repo().join("tests").join("ui"), vec![]),
        ("no_env", outside.clone(), vec![]),
        (
            "no_numpy",
            outside.clone(),
            vec![
                ("VIRTUAL_ENV", venv),
                ("PYTHONPATH", fake.to_str().unwrap()),
            ],
        ),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, cwd, env) in &scenarios {
        match run(name, cwd, env) {
            Ok(()) => {
                println!("test {name} ... ok");
                passed += 1;
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
