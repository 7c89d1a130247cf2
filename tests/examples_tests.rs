//! Builds the examples (the same profile and target folder as this test), runs them and checks
//! what they print.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// `cargo build --examples`, once per run of this test binary: what runs is what the tree holds
/// now, never a binary an older build left in the target folder.
fn built() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // target/<profile>/deps/<this test> → target/<profile>/examples
        let exe = std::env::current_exe().unwrap();
        let profile = exe.parent().unwrap().parent().unwrap();
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.args(["build", "--quiet", "-p", "pyop", "--examples"])
            .env("CARGO_TARGET_DIR", profile.parent().unwrap());
        if profile.ends_with("release") {
            cmd.arg("--release");
        }
        let out = cmd.output().expect("cargo runs");
        assert!(
            out.status.success(),
            "cargo build --examples failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        profile.join("examples")
    })
}

fn example(name: &str) -> String {
    example_with(name, &[])
}

fn example_with(name: &str, env: &[(&str, &str)]) -> String {
    let path = built().join(name);
    let out = Command::new(&path)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn log_huber_prints_the_seed_values() {
    let out = example("log_huber");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["y = 1", "dy/dx = 2"], "{out}");
    assert_eq!(
        lines[2..],
        ["y = 7.243721", "dy/dx = 2.6666667", "dy/dm = 3.243721"],
        "{out}"
    );
}

#[test]
fn train_lowers_the_loss() {
    let out = example("train");
    let losses: Vec<f64> = out
        .lines()
        .filter_map(|l| {
            l.strip_prefix("step ")?
                .split(" loss ")
                .nth(1)?
                .parse()
                .ok()
        })
        .collect();
    assert!(losses.len() >= 5, "{out}");
    // Fixed initial weights make the run deterministic.
    assert_eq!(losses[0], 0.7595, "{out}");
    assert!(
        losses.last().unwrap() < &(losses[0] * 0.5),
        "the loss falls: {losses:?}"
    );
    assert!(out.contains("learned w = 2.9"), "{out}");
}

#[test]
fn numpy_ops_prints_in_order() {
    let out = example("numpy_ops");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "x = [1.0, 2.0, 4.0, 9.0]");
    assert_eq!(
        lines[3],
        "divmod([7, -7, 9], [2, 2, 4]) = ([3, -4, 2], [1, 1, 1])"
    );
    // Python's print lands between Rust's, in order, though stdout is a pipe here.
    assert_eq!(
        lines[5], "log_stats: tag=x sum=16.0 (printed by Python)",
        "{out}"
    );
    assert!(
        lines[6].starts_with("rows3(arange(4)) fails: InvalidArgument: op `rows3`"),
        "{out}"
    );
}

#[test]
fn debugging_shows_print_and_traceback() {
    let out = example("debugging");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "scaled: got shape (2, 2) and dtype f32", "{out}");
    assert_eq!(lines[1], "result = [[2.0, 4.0], [6.0, 8.0]]");
    assert_eq!(lines[2], "error kind: InvalidArgument");
    assert!(
        lines[3].starts_with("op `reshaped`: ValueError: Shape mismatch"),
        "{out}"
    );
    // Inline code's lines are the example file's own.
    let source = include_str!("../examples/debugging.rs");
    let line = |text: &str| source.lines().position(|l| l == text).unwrap() + 1;
    let call = line("    return helper(x)");
    let reshape = line("    return x.reshape(7)");
    assert!(
        out.contains(&format!(
            "File \"examples/debugging.rs\", line {call}, in reshaped\n    return helper(x)"
        )),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "File \"examples/debugging.rs\", line {reshape}, in helper\n    return x.reshape(7)"
        )),
        "{out}"
    );
}

#[test]
fn manifest_prints_every_op_as_json() {
    let out = example("manifest");
    let ops: serde_json::Value = serde_json::from_str(&out).unwrap();
    let paths: Vec<&str> = ops
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["rust_path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        [
            "manifest::clip",
            "manifest::zscore",
            "manifest::stats::zscore"
        ]
    );
    assert_eq!(ops[2]["source"]["origin"], "examples/ops/stats.py");
    assert_eq!(ops[0]["grad"]["kind"], "python");
}

#[test]
fn gpu_example_runs_on_whatever_device_there_is() {
    let out = example("gpu");
    assert!(
        out.contains("y = 7.243721, dy/dx = 2.6666667 (on the op's device: true)"),
        "{out}"
    );
    assert!(
        out.contains(
            "numpy-mode zscore on the device: [-1.3416407, -0.4472136, 0.4472136, 1.3416407]"
        ),
        "{out}"
    );
}

#[test]
fn threads_example_counts_every_call() {
    // Short: 8 threads × 160 calls (every 16th `checked` call fails).
    let out = example_with("threads", &[("PYOP_EXAMPLE_CALLS", "160")]);
    let row = |name: &str| -> Vec<String> {
        out.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {out}"))
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(row("norm")[1..3], ["1280", "0"], "{out}");
    assert_eq!(row("checked")[1..3], ["1280", "80"], "{out}");
}

#[test]
fn batching_example_answers_every_request_as_the_unbatched_op() {
    // Short: 8 threads × 40 calls; the example itself compares every answer.
    let out = example_with("batching", &[("PYOP_EXAMPLE_CALLS", "40")]);
    assert!(
        out.starts_with("8 threads x 40 calls, one row each\nunbatched: 320 body calls in "),
        "{out}"
    );
    let batched = out
        .lines()
        .find_map(|l| l.strip_prefix("batched:   "))
        .unwrap_or_else(|| panic!("no batched line: {out}"));
    let body_calls: u64 = batched.split(' ').next().unwrap().parse().unwrap();
    assert!(body_calls < 320, "no call was batched: {out}");
    assert!(
        out.ends_with("every result equals the unbatched op's\n"),
        "{out}"
    );
}

#[test]
fn async_server_answers_every_connection() {
    let out = example_with("async_server", &[("PYOP_EXAMPLE_CONNECTIONS", "40")]);
    assert!(
        out.starts_with("served 80 requests from 40 connections at once: every answer right\n"),
        "{out}"
    );
    assert!(out.contains("\nheartbeat: "), "{out}");
}

#[test]
fn workers_example_runs_the_op_in_both_places() {
    let out = example_with("workers", &[("PYOP_EXAMPLE_CALLS", "10")]);
    assert!(
        out.starts_with("4 threads x 10 calls, 256 rows each\n"),
        "{out}"
    );
    assert!(out.contains("in-process "), "{out}");
    assert!(out.contains("2 workers "), "{out}");
    // Every call (and the warm-up) ran in the pool, none was lost.
    assert!(out.contains("pool: size 2, started 2 "), "{out}");
    assert!(out.contains("calls 41, lost 0, timed out 0"), "{out}");
    assert!(out.contains("op tokenize_w: calls 41, errors 0"), "{out}");
}

/// Without Ray in the environment, the Ray example says how to install it (and exits 2).
#[test]
fn ray_example_without_ray_says_how_to_install_it() {
    // An environment whose `bin/python` is a Python without Ray: the venv's own, told (by a
    // `ray` package first on its path) that Ray cannot be imported.
    let dir = std::env::temp_dir().join(format!("pyop-no-ray-{}", std::process::id()));
    let fake = dir.join("path/ray");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::write(
        fake.join("__init__.py"),
        "raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n",
    )
    .unwrap();
    let out = Command::new(built().join("ray"))
        .env("PYOP_RAY_ADDRESS", "")
        .env("PYTHONPATH", dir.join("path"))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with("Ray is not installed in "), "{err}");
    assert!(err.contains(" -m pip install 'ray>=2.40,<3'"), "{err}");
}

#[test]
fn ray_example_runs_the_op_on_actors_of_two_nodes() {
    // The example starts a two-node cluster of this machine for itself and stops it.
    let out = example_with(
        "ray",
        &[("PYOP_EXAMPLE_CALLS", "5"), ("PYOP_RAY_ADDRESS", "")],
    );
    assert!(
        out.starts_with("a 2-node Ray cluster of this machine at "),
        "{out}"
    );
    assert!(
        out.contains("4 threads x 5 calls, 256 rows each\n"),
        "{out}"
    );
    assert!(out.contains("Ray, 4 actors "), "{out}");
    let nodes: std::collections::HashSet<&str> = out
        .lines()
        .filter_map(|l| {
            l.strip_prefix("actor ")?
                .split(" on node ")
                .nth(1)?
                .split(' ')
                .next()
        })
        .collect();
    assert_eq!(nodes.len(), 2, "{out}");
    // The warm-up and every threaded call ran on the actors, none was lost.
    assert!(out.contains("pool: size 4, started 4 "), "{out}");
    assert!(out.contains("calls 21, lost 0, timed out 0"), "{out}");
}
