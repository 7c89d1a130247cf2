//! The README's "Use pyop in your crate", done as a new user would: a crate made only from the
//! README's blocks (`<!-- user-crate: NAME -->` marks each), outside this workspace, set up with
//! the README's commands, built, run with `cargo run`, then its binary started from another
//! directory with no `VIRTUAL_ENV`, `PYOP_PYTHON_ENV` or `LD_LIBRARY_PATH`. A tensor-mode and a
//! numpy-mode op must give the README's values, on the Python the crate was built against.
//!
//! It runs twice: with the default `python3`, and with a second Python 3 of another X.Y built as
//! a shared library (pinned with `PYO3_PYTHON`, as the README says), where the machine has one.
//! Both build in the workspace's target folder with the profile the guide recommends (the
//! workspace's own: line tables only, no debug info for dependencies), so the dependencies the
//! workspace built are reused. What depends on the Python (the pyo3 family, NumPy's bindings and
//! pyop) each run builds apart, under a hash of its own ([`apart`]): a build for another
//! interpreter, or for the same one found another way (no `VIRTUAL_ENV`), would otherwise
//! replace the workspace's, and the workspace's next `cargo` would build them again, as would
//! this test's next run. So this test can run beside the workspace's other tests (CI does).
//! Step 4's `pip install numpy`
//! installs the wheel `scripts/dev.sh` keeps in `target/wheels` where it fits the Python (no
//! network inside `cargo test`), else from PyPI.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The lines the README says `cargo run` prints.
fn readme_output(readme: &str) -> Vec<String> {
    let at = readme
        .find("`cargo run` prints:")
        .expect("the README shows the output");
    readme[at..]
        .lines()
        .skip_while(|l| *l != "```text")
        .skip(1)
        .take_while(|l| *l != "```")
        .map(str::to_owned)
        .collect()
}

/// `X.Y.Z` of a Python, if it is built as a shared library.
fn shared_python(exe: &Path) -> Option<String> {
    let out = Command::new(exe)
        .args([
            "-c",
            "import sys, sysconfig; print('%d.%d.%d' % sys.version_info[:3], \
             sysconfig.get_config_var('Py_ENABLE_SHARED'))",
        ])
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let (version, shared) = text.trim().split_once(' ')?;
    (shared == "1").then(|| version.to_owned())
}

fn major_minor(version: &str) -> &str {
    &version[..version.rfind('.').unwrap_or(version.len())]
}

/// A second shared-library Python 3 of another X.Y than `default`: pyenv's, or one on `PATH`.
fn second_python(default: &str) -> Option<(PathBuf, String)> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    for minor in [12, 13, 10, 9] {
        let home = std::env::var_os("PYENV_ROOT")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".pyenv")));
        if let Some(versions) = home.map(|h| h.join("versions")) {
            if let Ok(dir) = std::fs::read_dir(&versions) {
                let mut found: Vec<PathBuf> = dir
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with(&format!("3.{minor}.")))
                    })
                    .map(|p| p.join("bin").join("python3"))
                    .collect();
                found.sort();
                candidates.extend(found.into_iter().rev());
            }
        }
        candidates.push(PathBuf::from(format!("python3.{minor}")));
    }
    candidates.into_iter().find_map(|exe| {
        let version = shared_python(&exe)?;
        (major_minor(&version) != major_minor(default)).then_some((exe, version))
    })
}

/// A command with the environment a new user's shell has: nothing of this repository's set-up
/// (dev.sh's `VIRTUAL_ENV` and `PYO3_PYTHON`), nothing of the `cargo test` running this.
fn clean(mut cmd: Command) -> Command {
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        let cargo_set = key.starts_with("CARGO_") && key != "CARGO_HOME";
        let python_set = matches!(
            &*key,
            "VIRTUAL_ENV" | "PYO3_PYTHON" | "PYTHONPATH" | "PYTHONHOME" | "LD_LIBRARY_PATH"
        ) || key.starts_with("PYOP_");
        if cargo_set || python_set {
            cmd.env_remove(&*key);
        }
    }
    cmd
}

fn run(what: &str, mut cmd: Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Makes, builds and runs the README's crate with the Python `exe` (`None`: the default
/// `python3`, with no `PYO3_PYTHON`). Returns a line for the summary.
fn user_crate(tag: &str, exe: Option<&Path>, version: &str, work: &Path) {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let blocks = common::user_crate_blocks(&readme);
    let app = work.join(format!("my-app-{tag}"));
    std::fs::create_dir_all(app.join("src")).unwrap();
    let repo_path = repo().display().to_string();
    let manifest = blocks["Cargo.toml"].replace("\"../pyop", &format!("\"{repo_path}"));
    assert_ne!(manifest, blocks["Cargo.toml"], "the README's path to pyop");
    std::fs::write(app.join("Cargo.toml"), manifest).unwrap();
    std::fs::write(app.join("build.rs"), &blocks["build.rs"]).unwrap();
    std::fs::write(app.join("src/main.rs"), &blocks["src/main.rs"]).unwrap();
    // The same dependency versions as this repository's build (a head start, not a change:
    // cargo resolves whatever the lock file does not cover).
    std::fs::copy(repo().join("Cargo.lock"), app.join("Cargo.lock")).unwrap();

    // Step 4, as written (one script: its first line sets a variable the next one reads), with
    // `PYO3_PYTHON` set in the shell for a pinned interpreter, which step 4 honours.
    let wheels = local_wheels(version);
    let setup = blocks["setup"].as_str();
    let mut cmd = clean(Command::new("sh"));
    cmd.args(["-e", "-c", setup]).current_dir(&app);
    if let Some(exe) = exe {
        cmd.env("PYO3_PYTHON", exe);
    }
    if let Some(dir) = &wheels {
        cmd.env("PIP_NO_INDEX", "1").env("PIP_FIND_LINKS", dir);
    }
    run(&format!("[{tag}] step 4:\n{setup}"), cmd);

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target = workspace_target();
    let cargo_cmd = |args: &[&str]| {
        let mut cmd = clean(Command::new(&cargo));
        cmd.args(args)
            .args(PROFILE)
            .args(apart(tag))
            .current_dir(&app)
            .env("CARGO_TARGET_DIR", &target);
        // CI builds without incremental caches; the same setting keeps pyop's own artifacts.
        if let Some(v) = std::env::var_os("CARGO_INCREMENTAL") {
            cmd.env("CARGO_INCREMENTAL", v);
        }
        if let Some(exe) = exe {
            cmd.env("PYO3_PYTHON", exe);
        }
        cmd
    };
    run(
        &format!("[{tag}] cargo build"),
        cargo_cmd(&["build", "--quiet"]),
    );

    let expected = readme_output(&readme);
    let check = |how: &str, out: &Output| {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = stdout.lines().collect();
        let venv = app.join(".venv").canonicalize().unwrap();
        assert_eq!(
            lines.first().copied(),
            Some(format!("Python {version}, environment {}", venv.display()).as_str()),
            "[{tag}] {how}: the Python built against, and the crate's venv\n{stdout}{stderr}"
        );
        assert!(
            expected[0].starts_with("Python ") && expected[0].contains(", environment /"),
            "the README's first line: {expected:?}"
        );
        assert_eq!(lines[1..], expected[1..], "[{tag}] {how}\n{stdout}{stderr}");
        assert!(
            !stderr.contains("pyop: "),
            "[{tag}] {how}: no set-up warning\n{stderr}"
        );
    };
    // `cargo run` in the crate, as the README says.
    let out = run(
        &format!("[{tag}] cargo run"),
        cargo_cmd(&["run", "--quiet"]),
    );
    check("cargo run", &out);

    // The binary on its own, from another directory, with nothing set.
    let elsewhere = work.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let mut cmd = clean(Command::new(target.join("debug").join("my-app")));
    cmd.current_dir(&elsewhere);
    let out = run(
        &format!("[{tag}] the binary from {}", elsewhere.display()),
        cmd,
    );
    check("from another directory", &out);
    assert_eq!(
        std::fs::read_to_string(app.join("typings/pyop.pyi")).unwrap(),
        pyop_build::PYTHON_STUB,
        "[{tag}] the README's build.rs writes the stub"
    );
    if tag == "default" {
        body_checked_at_build_time(&app, &blocks["src/main.rs"], &cargo_cmd);
        pinned_environment(
            &app,
            &blocks[".cargo/config.toml"],
            &cargo_cmd,
            &target,
            work,
        );
    }
    println!("test user_crate_{tag} (Python {version}) ... ok");
}

/// The profile the guide recommends to users, which is this workspace's own: with it the
/// crate's dependencies are the workspace's artifacts, not a second build.
const PROFILE: [&str; 4] = [
    "--config",
    "profile.dev.debug=\"line-tables-only\"",
    "--config",
    "profile.dev.package.\"*\".debug=false",
];

/// The settings that give each run's Python-dependent crates a hash of their own: the codegen
/// units of `pyo3-build-config`, which finds the interpreter and which the rest of the pyo3
/// family, NumPy's bindings and pyop depend on, and of `pyop-macros`, whose build script reads
/// the interpreter itself (a profile setting is part of a crate's hash, and so of every crate
/// above it; candle and the other dependencies keep the workspace's). One value per run (255 for
/// the default Python, 254 for the second), none the workspace's (256, cargo's default).
fn apart(tag: &str) -> Vec<String> {
    let units = if tag == "default" { 255 } else { 254 };
    ["pyo3-build-config", "pyop-macros"]
        .into_iter()
        .flat_map(|package| {
            [
                "--config".to_owned(),
                format!("profile.dev.package.{package}.codegen-units={units}"),
            ]
        })
        .collect()
}

/// The target folder this test was built in (`target/debug/deps/user_crate-…`).
fn workspace_target() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.ancestors()
        .nth(3)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// `target/wheels` (filled by `scripts/dev.sh`) when it holds a NumPy wheel for Python
/// `version`: step 4 installs from it instead of PyPI.
fn local_wheels(version: &str) -> Option<PathBuf> {
    let dir = workspace_target().join("wheels");
    let tag = format!("-cp{}-", major_minor(version).replace('.', ""));
    let found = std::fs::read_dir(&dir).ok()?.any(|e| {
        e.ok().is_some_and(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("numpy-") && name.contains(&tag) && name.ends_with(".whl")
        })
    });
    if !found {
        println!(
            "note: no NumPy wheel for Python {version} in {}: step 4 installs from PyPI",
            dir.display()
        );
    }
    found.then_some(dir)
}

/// A body in a `file` is checked when the crate builds, and editing it rebuilds and re-checks:
/// a syntax error fails `cargo build` naming the file, line and source line; the fix builds.
fn body_checked_at_build_time(app: &Path, main_rs: &str, cargo: &dyn Fn(&[&str]) -> Command) {
    std::fs::create_dir_all(app.join("ops")).unwrap();
    let body = app.join("ops/double.py");
    std::fs::write(&body, "def double(x):\n    return x * 2\n").unwrap();
    let with_file_op = format!(
        "{main_rs}\n#[allow(dead_code)]\n#[py_op(file = \"ops/double.py\", tout = f32)]\n\
         fn double(x: &Tensor) -> pyop::Result<Tensor>;\n"
    );
    std::fs::write(app.join("src/main.rs"), with_file_op).unwrap();
    run(
        "[default] cargo build with a file body",
        cargo(&["build", "--quiet"]),
    );
    std::fs::write(&body, "def double(x):\n    return x *\n").unwrap();
    let out = cargo(&["build", "--quiet"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a syntax error in ops/double.py must fail the build"
    );
    assert!(
        stderr.contains("Python syntax error in ops/double.py, line 2: invalid syntax")
            && stderr.contains("return x *")
            && stderr.contains("#[py_op(file = \"ops/double.py\""),
        "the error names the file, line and source line, on the `file` path:\n{stderr}"
    );
    std::fs::write(&body, "def double(x):\n    return x * 2\n").unwrap();
    run(
        "[default] cargo build after the fix",
        cargo(&["build", "--quiet"]),
    );
    std::fs::write(app.join("src/main.rs"), main_rs).unwrap();
    package_file_added(app, cargo);
}

/// A `.py` file added to a `package` folder is embedded by the next `cargo build` (the README's
/// `build.rs` prints no `rerun-if-changed`, so cargo reruns it, and rebuilds the crate, when any
/// file of the package changes).
fn package_file_added(app: &Path, cargo: &dyn Fn(&[&str]) -> Command) {
    let pkg = app.join("py/mylib");
    std::fs::create_dir_all(&pkg).unwrap();
    std::fs::write(
        pkg.join("__init__.py"),
        "def body(x):\n    from . import extra\n    return extra.f(x)\n",
    )
    .unwrap();
    std::fs::create_dir_all(app.join("src/bin")).unwrap();
    std::fs::write(
        app.join("src/bin/pkg.rs"),
        "use pyop::{py_op, Tensor};\n\
         #[py_op(package = \"py/mylib\", name = \"body\", tout = f32)]\n\
         fn body(x: &Tensor) -> pyop::Result<Tensor>;\n\
         fn main() {\n    \
         let x = Tensor::new(&[1f32, 2.], &pyop::candle::Device::Cpu).unwrap();\n    \
         match body(&x) {\n        \
         Ok(y) => println!(\"{:?}\", y.to_vec1::<f32>().unwrap()),\n        \
         Err(e) => println!(\"error: {e}\"),\n    }\n}\n",
    )
    .unwrap();
    let run_pkg = || {
        let out = run(
            "[default] cargo run --bin pkg",
            cargo(&["run", "--quiet", "--bin", "pkg"]),
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let before = run_pkg();
    assert!(before.contains("cannot import name 'extra'"), "{before}");
    std::fs::write(pkg.join("extra.py"), "def f(x):\n    return x * 3\n").unwrap();
    let after = run_pkg();
    assert_eq!(
        after.trim(),
        "[3.0, 6.0]",
        "the added file is embedded: {after}"
    );
    std::fs::remove_dir_all(app.join("src/bin")).unwrap();
}

/// The README's `.cargo/config.toml` pins the crate's venv: the binary uses it even when started
/// in a folder that has a `.venv` of its own, and with another venv activated.
fn pinned_environment(
    app: &Path,
    config: &str,
    cargo: &dyn Fn(&[&str]) -> Command,
    target: &Path,
    work: &Path,
) {
    // The README's block without its example interpreter: the default one built this crate.
    let config: String = config
        .lines()
        .filter(|l| !l.starts_with("PYO3_PYTHON"))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(config.contains("PYOP_PYTHON_ENV"), "{config}");
    std::fs::create_dir_all(app.join(".cargo")).unwrap();
    std::fs::write(app.join(".cargo/config.toml"), config).unwrap();
    run(
        "[default] cargo build with the pin",
        cargo(&["build", "--quiet"]),
    );
    let other = work.join("another-project");
    std::fs::create_dir_all(other.join(".venv")).unwrap();
    std::fs::copy(app.join(".venv/pyvenv.cfg"), other.join(".venv/pyvenv.cfg")).unwrap();
    let mut cmd = clean(Command::new(target.join("debug").join("my-app")));
    cmd.current_dir(&other)
        .env("VIRTUAL_ENV", other.join(".venv"));
    let out = run("[default] the pinned binary elsewhere", cmd);
    let first = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .to_owned();
    let venv = app.join(".venv").canonicalize().unwrap();
    assert!(
        first.ends_with(&format!("environment {}", venv.display())),
        "the pinned venv, not the folder's or the activated one: {first}"
    );
    std::fs::remove_dir_all(app.join(".cargo")).unwrap();
}

fn main() {
    let before = artifacts();
    let work = std::env::temp_dir().join(format!("pyop-user-crate-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    // The repository's path must not be an ancestor: the crate is outside the workspace.
    assert!(!work.starts_with(repo()));

    let default = shared_python(Path::new("python3"))
        .expect("the default python3 is built as a shared library (scripts/dev.sh checks it)");
    match second_python(&default) {
        Some((exe, version)) => {
            let tag = format!("py{}", major_minor(&version));
            user_crate(&tag, Some(&exe), &version, &work);
        }
        None => println!(
            "test user_crate_second_python ... skipped: no Python 3.9+ of another version than \
             {default} built as a shared library (pyenv's, or python3.X on PATH) on this machine"
        ),
    }
    user_crate("default", None, &default, &work);
    let _ = std::fs::remove_dir_all(&work);
    untouched(before);
}

/// The workspace's artifacts (every file its test build made or found fresh, as `scripts/dev.sh`
/// lists them from cargo's messages in the file `PYOP_TEST_WORKSPACE_ARTIFACTS`), each with when
/// it was last written. `None` where that list is not given (this test run alone).
fn artifacts() -> Option<Vec<(PathBuf, std::time::SystemTime)>> {
    let list = std::env::var_os("PYOP_TEST_WORKSPACE_ARTIFACTS")?;
    let text = std::fs::read_to_string(&list)
        .unwrap_or_else(|e| panic!("{}: {e}", Path::new(&list).display()));
    let files: Vec<_> = text
        .lines()
        .filter_map(|l| {
            let when = std::fs::metadata(l).ok()?.modified().ok()?;
            Some((PathBuf::from(l), when))
        })
        .collect();
    assert!(files.len() > 10, "the workspace's artifacts, from {list:?}");
    Some(files)
}

/// No artifact of the workspace's was written again or removed by the user crate's builds:
/// they make their own (`apart`), so the tests running beside this one, and the workspace's
/// next `cargo`, find the workspace's as they left them.
fn untouched(before: Option<Vec<(PathBuf, std::time::SystemTime)>>) {
    let Some(before) = before else {
        println!(
            "note: PYOP_TEST_WORKSPACE_ARTIFACTS not set (scripts/dev.sh sets it): whether the \
             workspace's artifacts were left alone is not checked"
        );
        return;
    };
    let changed: Vec<_> = before
        .iter()
        .filter(|(path, when)| {
            std::fs::metadata(path).and_then(|m| m.modified()).ok() != Some(*when)
        })
        .map(|(path, _)| path.display().to_string())
        .collect();
    assert!(
        changed.is_empty(),
        "the user crate's builds wrote over the workspace's artifacts: {changed:#?}"
    );
}
