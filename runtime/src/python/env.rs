//! Which interpreter is running and which Python environment it is given, and whether both are
//! the ones the program was built for.
//!
//! An embedded interpreter honours neither `VIRTUAL_ENV` nor a `.venv`; pyop finds the
//! environment itself and adds its `site-packages` to `sys.path`. It also compares the running
//! interpreter with the one pyo3 linked at build time (`runtime/build.rs` records it): the loader
//! may find another `libpythonX.Y.so` first, and an environment made by another Python X.Y has no
//! packages for this one. Each such problem is reported by `validate()`, printed once when the
//! interpreter starts, and added to the errors it causes (NumPy or a package that cannot be
//! imported), each with the command that fixes it.

use std::fmt;
use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use super::describe;
use crate::error::{Error, ErrorKind, Result, NO_OP};

/// Why pyop chose the Python environment it uses; see [`PythonEnv`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EnvSource {
    /// `PYOP_PYTHON_ENV` at run time.
    PyopPythonEnv,
    /// `VIRTUAL_ENV` at run time (an activated venv).
    VirtualEnv,
    /// The nearest `.venv` (with a `pyvenv.cfg`) in the current directory or one of its parents.
    DotVenv,
    /// Recorded when the program was built: `PYOP_PYTHON_ENV` at build time (a pin, which ranks
    /// above `VIRTUAL_ENV` and the nearest `.venv` at run time), or else `VIRTUAL_ENV` at build
    /// time or the `.venv` of the crate that declares the ops (or of one of its parent folders),
    /// which rank below them.
    Build,
    /// No environment: only the interpreter's own `site-packages` (also `PYOP_PYTHON_ENV=none`).
    None,
}

impl fmt::Display for EnvSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvSource::PyopPythonEnv => "PYOP_PYTHON_ENV",
            EnvSource::VirtualEnv => "VIRTUAL_ENV",
            EnvSource::DotVenv => "the nearest .venv",
            EnvSource::Build => "the environment recorded at build time",
            EnvSource::None => "none",
        })
    }
}

/// A Python installation: the one the program was built against, or the one running.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Interpreter {
    /// `X.Y.Z` (only `X.Y` for a build whose interpreter could not be asked).
    pub version: String,
    /// `sys.base_prefix`: where the installation lives.
    pub prefix: Option<PathBuf>,
    /// Built: the folder of the libpython linked; running: the libpython file loaded (`None`
    /// when it is linked statically).
    pub library: Option<PathBuf>,
    /// The installation's own `python` executable, where it can be found.
    pub executable: Option<PathBuf>,
}

impl Interpreter {
    /// The installation's `python`, as a command to show in a hint (`pythonX.Y` if unknown).
    fn command(&self) -> String {
        match &self.executable {
            Some(p) => p.display().to_string(),
            None => format!("python{}", major_minor(&self.version)),
        }
    }
}

/// Which Python environment the interpreter was given and why, and what is wrong with the set-up.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct PythonEnv {
    /// The environment's root folder, or `None` when only the interpreter's own packages are used.
    pub root: Option<PathBuf>,
    /// The `site-packages` folder added to `sys.path`.
    pub site_packages: Option<PathBuf>,
    /// Why this environment.
    pub source: EnvSource,
    /// `sys.version` of the running interpreter.
    pub version: String,
    /// The interpreter running.
    pub running: Interpreter,
    /// The interpreter the program was built against (`PYO3_PYTHON` at build time).
    pub built: Interpreter,
    /// What is wrong with the set-up, each with its fix: another interpreter than the one built
    /// against, an environment made by another Python version, … Empty when all is well.
    pub problems: Vec<String>,
    /// The environment pinned at build time (`PYOP_PYTHON_ENV` then) when that folder no longer
    /// exists (moved or deleted) and nothing overrides it at run time: pyop then uses what it
    /// finds below the pin, and its messages name the pin first.
    pub missing_pin: Option<PathBuf>,
}

impl PythonEnv {
    /// The command that installs `package` where this program's interpreter finds it.
    pub fn pip_install(&self, package: &str) -> String {
        match (&self.root, &self.site_packages) {
            (Some(root), Some(_)) => {
                format!("`{} -m pip install {package}`", venv_python(root).display())
            }
            (Some(root), None) => format!(
                "`{} -m venv --clear {}` then `{} -m pip install {package}`",
                self.running_executable(),
                root.display(),
                venv_python(root).display()
            ),
            // `PYOP_PYTHON_ENV=none`: the interpreter's own packages, by request.
            (None, _) if std::env::var_os("PYOP_PYTHON_ENV").is_some_and(|v| v == "none") => {
                format!(
                    "`{} -m pip install {package}` (PYOP_PYTHON_ENV=none: the interpreter's own \
                     site-packages)",
                    self.running_executable()
                )
            }
            // The pinned venv is gone: make it again where the program looks first.
            (None, _) if self.missing_pin.is_some() => {
                let pin = self.missing_pin.as_deref().expect("some");
                format!(
                    "`{} -m venv {}` then `{} -m pip install {package}` (the pinned environment, \
                     made again)",
                    self.running_executable(),
                    pin.display(),
                    venv_python(pin).display()
                )
            }
            (None, _) => format!(
                "`{exe} -m venv .venv` then `{} -m pip install {package}` in the program's folder \
                 (or install it into the interpreter's own site-packages: `{exe} -m pip install \
                 {package}`)",
                venv_python(Path::new(".venv")).display(),
                exe = self.running_executable()
            ),
        }
    }

    /// The running installation's `python`, as a command to show in a hint.
    pub(crate) fn running_executable(&self) -> String {
        self.running.command()
    }

    /// Where the environment was found, for messages.
    pub(crate) fn describe(&self) -> String {
        let gone = |pin: &Path| {
            format!(
                "the environment pinned at build time (PYOP_PYTHON_ENV), {}, does not exist \
                 (moved or deleted?)",
                pin.display()
            )
        };
        match (&self.root, &self.missing_pin) {
            (Some(root), None) => format!("the environment {} ({})", root.display(), self.source),
            (Some(root), Some(pin)) => format!(
                "the environment {} ({}), since {}",
                root.display(),
                self.source,
                gone(pin)
            ),
            (None, None) => "no environment (only the interpreter's own site-packages)".to_owned(),
            (None, Some(pin)) => format!(
                "no environment: {}, so only the interpreter's own site-packages",
                gone(pin)
            ),
        }
    }

    /// The problems, as one sentence to add to an error they may explain.
    pub(crate) fn problems_note(&self) -> String {
        self.problems
            .iter()
            .map(|p| format!("; note: {p}"))
            .collect()
    }
}

/// What a `#[py_op]` declaration records of its build: `PYOP_PYTHON_ENV` and `VIRTUAL_ENV` at
/// build time, and the declaring crate's folder (whose nearest `.venv` is used). A binary started
/// from any directory then still finds the environment it was developed with.
#[doc(hidden)]
pub struct BuildEnv {
    pub manifest_dir: &'static str,
    pub pyop_python_env: Option<&'static str>,
    pub virtual_env: Option<&'static str>,
}

inventory::collect!(BuildEnv);

static ENV: PyOnceLock<PythonEnv> = PyOnceLock::new();

/// Checks what would make starting the interpreter end the process, before anything starts it:
/// CPython calls `Py_FatalError` (exit 1) when it cannot find its standard library, e.g. under a
/// wrong `PYTHONHOME`. Run once; an interpreter already running passes.
pub(crate) fn preflight() -> Result<()> {
    static CHECKED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let problem = CHECKED.get_or_init(|| {
        // SAFETY: Py_IsInitialized may be called at any time, before initialisation too.
        if unsafe { pyo3::ffi::Py_IsInitialized() } != 0 {
            return None;
        }
        let home = std::env::var_os("PYTHONHOME").filter(|h| !h.is_empty())?;
        let home = home.to_string_lossy();
        // `prefix[:exec_prefix]`, with the platform's path-list separator.
        let separator = if cfg!(windows) { ';' } else { ':' };
        let prefix = Path::new(home.split(separator).next().unwrap_or(&home));
        let version = major_minor(&built_interpreter().version).to_owned();
        let compact = version.replace('.', "");
        // Where CPython looks, for every layout it ships: `lib` or `lib64` (platlibdir), the
        // free-threaded `pythonX.Yt`, Windows' `Lib`, and a zipped standard library.
        let mut stdlib = Vec::new();
        for lib in ["lib", "lib64"] {
            for dir in [format!("python{version}"), format!("python{version}t")] {
                stdlib.push(prefix.join(lib).join(dir));
            }
        }
        stdlib.push(prefix.join("Lib"));
        let zipped = ["lib", "lib64"].iter().any(|lib| {
            prefix
                .join(lib)
                .join(format!("python{compact}.zip"))
                .is_file()
        }) || prefix.join(format!("python{compact}.zip")).is_file();
        let found = zipped
            || stdlib
                .iter()
                .any(|lib| lib.join("encodings").join("__init__.py").is_file());
        (!found).then(|| {
            format!(
                "PYTHONHOME is {home}, which has no standard library of Python {version} (no \
                 {}/encodings), so the interpreter cannot start: unset PYTHONHOME, or point it at \
                 the prefix of a Python {version} installation",
                stdlib[0].display()
            )
        })
    });
    match problem {
        None => Ok(()),
        Some(msg) => Err(Error::op_failure(
            NO_OP,
            ErrorKind::PythonUnavailable,
            msg.clone(),
        )),
    }
}

/// Sets the interpreter up once per process: line-buffered output, the environment found,
/// added to `sys.path` and checked.
pub(crate) fn init(py: Python<'_>) -> Result<&'static PythonEnv> {
    ENV.get_or_try_init(py, || {
        set_up_interpreter(py).map_err(|e| {
            Error::op_failure(
                NO_OP,
                ErrorKind::PythonUnavailable,
                format!("cannot set up the embedded Python: {}", describe(py, &e)),
            )
        })
    })
}

/// The environment, once the interpreter is set up.
pub(crate) fn current(py: Python<'_>) -> Option<&'static PythonEnv> {
    ENV.get(py)
}

/// Line-buffers Python's stdout and stderr, then finds and checks the environment.
fn set_up_interpreter(py: Python<'_>) -> PyResult<PythonEnv> {
    let sys = py.import("sys")?;
    // Rust's stdout is line-buffered; Python's is block-buffered when not a terminal. Line
    // buffering on both keeps their output in order, line by line, when both print.
    for stream in ["stdout", "stderr"] {
        if let Ok(s) = sys.getattr(stream) {
            if s.hasattr("reconfigure").unwrap_or(false) {
                let kwargs = pyo3::types::PyDict::new(py);
                kwargs.set_item("line_buffering", true)?;
                let _ = s.call_method("reconfigure", (), Some(&kwargs));
            }
        }
    }
    set_up(py)
}

/// Finds the environment, adds its `site-packages` to `sys.path` and checks the set-up.
fn set_up(py: Python<'_>) -> PyResult<PythonEnv> {
    let sys = py.import("sys")?;
    let version: String = sys.getattr("version")?.extract()?;
    let (major, minor, micro): (u32, u32, u32) = sys
        .getattr("version_info")?
        .extract::<(u32, u32, u32, String, u32)>()
        .map(|v| (v.0, v.1, v.2))?;
    let prefix: PathBuf = sys.getattr("base_prefix")?.extract::<String>()?.into();
    let running = Interpreter {
        version: format!("{major}.{minor}.{micro}"),
        executable: installation_python(&prefix, major, minor),
        prefix: Some(prefix),
        library: loaded_libpython(),
    };
    let built = built_interpreter();
    let mut problems = Vec::new();
    problems.extend(interpreter_problem(&built, &running));

    let (root, source) = find_environment();
    let missing_pin = missing_pin();
    let mut site_packages = None;
    if let Some(root) = &root {
        site_packages = site_packages_of(root, major, minor);
        problems.extend(environment_problem(
            root,
            source,
            &running,
            site_packages.is_some(),
        ));
        if let Some(sp) = &site_packages {
            py.import("site")?
                .call_method1("addsitedir", (sp.as_path(),))?;
        }
    }
    for p in &problems {
        eprintln!("pyop: {p}");
    }
    Ok(PythonEnv {
        root,
        site_packages,
        source,
        version,
        running,
        built,
        problems,
        missing_pin,
    })
}

/// `PYOP_PYTHON_ENV`, else a `PYOP_PYTHON_ENV` pinned at build time (`[env]` in
/// `.cargo/config.toml`: the venv wherever the binary runs from), else `VIRTUAL_ENV`, else the
/// nearest `.venv` of the current directory, else the rest of what was recorded at build time.
fn find_environment() -> (Option<PathBuf>, EnvSource) {
    let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(v) = var("PYOP_PYTHON_ENV") {
        if v == "none" {
            return (None, EnvSource::None);
        }
        return (Some(PathBuf::from(v)), EnvSource::PyopPythonEnv);
    }
    if let Some(d) = pinned_environment() {
        return (Some(d), EnvSource::Build);
    }
    if let Some(v) = var("VIRTUAL_ENV") {
        return (Some(PathBuf::from(v)), EnvSource::VirtualEnv);
    }
    if let Some(d) = std::env::current_dir().ok().and_then(|d| nearest_venv(&d)) {
        return (Some(d), EnvSource::DotVenv);
    }
    match recorded_environment() {
        Some(d) => (Some(d), EnvSource::Build),
        None => (None, EnvSource::None),
    }
}

/// The first existing folder a declaration recorded from `PYOP_PYTHON_ENV` at build time: a pin,
/// which ranks above an activated venv and the current directory's `.venv` at run time.
fn pinned_environment() -> Option<PathBuf> {
    let mut recorded: Vec<&BuildEnv> = inventory::iter::<BuildEnv>.into_iter().collect();
    recorded.sort_by_key(|b| b.manifest_dir);
    recorded
        .iter()
        .filter_map(|b| b.pyop_python_env)
        .filter(|p| !p.is_empty() && *p != "none")
        .map(PathBuf::from)
        .find(|p| p.is_dir())
}

/// The first folder a declaration recorded from `PYOP_PYTHON_ENV` at build time, when none of
/// those folders exists and `PYOP_PYTHON_ENV` is not set at run time: a pin that was moved or
/// deleted, which messages name (`find_environment` passed over it to what ranks below).
fn missing_pin() -> Option<PathBuf> {
    if std::env::var_os("PYOP_PYTHON_ENV").is_some_and(|v| !v.is_empty()) {
        return None;
    }
    if pinned_environment().is_some() {
        return None;
    }
    let mut recorded: Vec<&BuildEnv> = inventory::iter::<BuildEnv>.into_iter().collect();
    recorded.sort_by_key(|b| b.manifest_dir);
    recorded
        .iter()
        .filter_map(|b| b.pyop_python_env)
        .find(|p| !p.is_empty() && *p != "none")
        .map(PathBuf::from)
}

/// The first existing environment the declarations recorded: an explicit `PYOP_PYTHON_ENV`,
/// then an activated venv, then the `.venv` nearest a declaring crate.
fn recorded_environment() -> Option<PathBuf> {
    let mut recorded: Vec<&BuildEnv> = inventory::iter::<BuildEnv>.into_iter().collect();
    recorded.sort_by_key(|b| b.manifest_dir);
    let explicit = recorded
        .iter()
        .flat_map(|b| [b.pyop_python_env, b.virtual_env])
        .flatten()
        .filter(|p| !p.is_empty() && *p != "none")
        .map(PathBuf::from)
        .find(|p| p.is_dir());
    explicit.or_else(|| {
        recorded
            .iter()
            .find_map(|b| nearest_venv(Path::new(b.manifest_dir)))
    })
}

fn nearest_venv(dir: &Path) -> Option<PathBuf> {
    dir.ancestors()
        .map(|d| d.join(".venv"))
        .find(|d| d.join("pyvenv.cfg").is_file())
}

fn site_packages_of(root: &Path, major: u32, minor: u32) -> Option<PathBuf> {
    [
        root.join("lib")
            .join(format!("python{major}.{minor}"))
            .join("site-packages"),
        root.join("Lib").join("site-packages"),
    ]
    .into_iter()
    .find(|p| p.is_dir())
}

/// The `python` of an environment.
fn venv_python(root: &Path) -> PathBuf {
    if cfg!(windows) {
        root.join("Scripts").join("python.exe")
    } else {
        root.join("bin").join("python")
    }
}

/// The installation's own `pythonX.Y` under `prefix`, if it is there.
fn installation_python(prefix: &Path, major: u32, minor: u32) -> Option<PathBuf> {
    [
        prefix.join("bin").join(format!("python{major}.{minor}")),
        prefix.join("bin").join(format!("python{major}")),
        prefix.join("python.exe"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

fn major_minor(version: &str) -> &str {
    let mut dots = version.match_indices('.');
    match (dots.next(), dots.next()) {
        (Some(_), Some((second, _))) => &version[..second],
        _ => version,
    }
}

/// The interpreter `runtime/build.rs` recorded.
fn built_interpreter() -> Interpreter {
    let non_empty = |s: &'static str| (!s.is_empty()).then(|| PathBuf::from(s));
    let full = env!("PYOP_BUILT_PYTHON_VERSION");
    Interpreter {
        version: if full.is_empty() {
            env!("PYOP_BUILT_PYTHON").to_owned()
        } else {
            full.to_owned()
        },
        prefix: non_empty(env!("PYOP_BUILT_PYTHON_PREFIX")),
        library: non_empty(env!("PYOP_BUILT_PYTHON_LIBDIR")),
        executable: non_empty(env!("PYOP_BUILT_PYTHON_EXE")),
    }
}

/// The libpython file this process loaded, found from one of its symbols.
#[cfg(unix)]
fn loaded_libpython() -> Option<PathBuf> {
    use std::ffi::CStr;
    // SAFETY: dlsym and dladdr only read the loader's tables; `info` is plain data that dladdr
    // fills, and `dli_fname` points at a NUL-terminated string owned by the loader that stays
    // valid while the library is loaded (libpython is never unloaded).
    unsafe {
        let symbol = libc::dlsym(libc::RTLD_DEFAULT, c"Py_GetVersion".as_ptr());
        if symbol.is_null() {
            return None;
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(symbol, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let path = PathBuf::from(CStr::from_ptr(info.dli_fname).to_str().ok()?);
        let is_libpython = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libpython"));
        is_libpython.then(|| path.canonicalize().unwrap_or(path))
    }
}

#[cfg(not(unix))]
fn loaded_libpython() -> Option<PathBuf> {
    None
}

fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Says so when the running interpreter is not the one the program was built against.
fn interpreter_problem(built: &Interpreter, running: &Interpreter) -> Option<String> {
    let full = built.version.matches('.').count() == 2;
    let version_differs = if full {
        built.version != running.version
    } else {
        major_minor(&running.version) != built.version
    };
    let library_differs = match (&built.library, &running.library) {
        (Some(dir), Some(file)) => file.parent().is_none_or(|p| !same_path(p, dir)),
        _ => false,
    };
    let prefix_differs = match (&built.prefix, &running.prefix) {
        (Some(b), Some(r)) => !same_path(b, r),
        _ => false,
    };
    if !(version_differs || library_differs || prefix_differs) {
        return None;
    }
    // The same version, relocated on purpose: carried to a machine where the one built against
    // is not installed (a kit, a container image), or started with PYTHONHOME naming the copy
    // that runs. Nothing else could have been meant.
    let built_absent = built
        .library
        .as_ref()
        .or(built.prefix.as_ref())
        .is_some_and(|p| !p.exists());
    let home_named = std::env::var_os("PYTHONHOME")
        .filter(|h| !h.is_empty())
        .zip(running.prefix.as_ref())
        .is_some_and(|(home, prefix)| same_path(Path::new(&home), prefix));
    if !version_differs && (built_absent || home_named) {
        return None;
    }
    let built_at = built
        .library
        .as_ref()
        .or(built.prefix.as_ref())
        .map(|p| format!(" ({})", p.display()))
        .unwrap_or_default();
    let running_at = running
        .library
        .as_ref()
        .or(running.prefix.as_ref())
        .map(|p| format!(" ({})", p.display()))
        .unwrap_or_default();
    let mut msg = format!(
        "this program was built against Python {}{built_at} but is running Python {}{running_at}",
        built.version, running.version
    );
    if library_differs {
        let dir = built
            .library
            .as_ref()
            .map(|d| d.display().to_string())
            .unwrap_or_default();
        // LD_LIBRARY_PATH is searched before the rpath: blame it only if it holds the folder
        // the other libpython came from.
        let loaded_dir = running.library.as_ref().and_then(|l| l.parent());
        let ld_path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        let from_ld_path = ld_path
            .split(':')
            .filter(|d| !d.is_empty())
            .any(|d| loaded_dir.is_some_and(|l| same_path(Path::new(d), l)));
        match from_ld_path {
            true => msg.push_str(&format!(
                ": LD_LIBRARY_PATH ({ld_path}) put another libpython first; unset it, or put \
                 {dir} first"
            )),
            false => msg.push_str(&format!(
                ": the loader found another libpython of the same name first; give the binary an \
                 rpath to {dir} (a build.rs calling `pyop_build::link_libpython()`, see the \
                 README), or start it with LD_LIBRARY_PATH={dir}"
            )),
        }
    } else {
        msg.push_str(
            ": rebuild with PYO3_PYTHON pointing at the interpreter it runs with, or run it \
             where the one it was built against is installed",
        );
    }
    Some(msg)
}

/// Says so when the environment cannot serve this interpreter: made by another Python X.Y (read
/// from its `pyvenv.cfg`), or without `site-packages` for it.
fn environment_problem(
    root: &Path,
    source: EnvSource,
    running: &Interpreter,
    has_site_packages: bool,
) -> Option<String> {
    if !root.is_dir() {
        return Some(format!(
            "{source} names {}, which is not a folder; point it at a venv made by Python {}",
            root.display(),
            running.version
        ));
    }
    let exe = running.command();
    // The venv may be another project's: recreating it is one fix, choosing another the other.
    let elsewhere = match source {
        EnvSource::VirtualEnv => "leave it (`deactivate`, or unset VIRTUAL_ENV) or point \
                                  PYOP_PYTHON_ENV at a venv made by it"
            .to_owned(),
        _ => format!("point PYOP_PYTHON_ENV at a venv made by it (`{exe} -m venv <folder>`)"),
    };
    let recreate = format!(
        "recreate it with the embedded interpreter, `{exe} -m venv --clear {}`, then reinstall \
         its packages, e.g. `{} -m pip install numpy`; or, if it belongs to another project, \
         {elsewhere}",
        root.display(),
        venv_python(root).display()
    );
    if let Some(made_by) = venv_version(root) {
        if major_minor(&made_by) != major_minor(&running.version) {
            return Some(format!(
                "the environment {} ({source}) was made by Python {made_by}, but this program \
                 embeds Python {}: {recreate}",
                root.display(),
                running.version
            ));
        }
    }
    if !has_site_packages {
        return Some(format!(
            "the environment {} ({source}) has no site-packages for Python {}: {recreate}",
            root.display(),
            major_minor(&running.version)
        ));
    }
    None
}

/// The Python version a venv was made by, from its `pyvenv.cfg`.
fn venv_version(root: &Path) -> Option<String> {
    let cfg = std::fs::read_to_string(root.join("pyvenv.cfg")).ok()?;
    let mut version = None;
    for line in cfg.lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        match key.trim() {
            // `version_info` (3.12+) is `3.12.1.final.0`; `version` (up to 3.11) is `3.11.7`.
            "version_info" => {
                let v: Vec<&str> = value.trim().splitn(4, '.').take(3).collect();
                return Some(v.join("."));
            }
            "version" => version = Some(value.trim().to_owned()),
            _ => {}
        }
    }
    version
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interp(version: &str, lib: Option<&str>) -> Interpreter {
        Interpreter {
            version: version.into(),
            prefix: None,
            library: lib.map(PathBuf::from),
            executable: None,
        }
    }

    /// A pinned venv that has gone is named first, with the command that makes it again (the
    /// new-user trial: "pyop uses no environment" and a `.venv` in "the program's folder").
    #[test]
    fn a_missing_pin_is_named_with_its_fix() {
        let mut env = PythonEnv {
            root: None,
            site_packages: None,
            source: EnvSource::None,
            version: "3.12.3".into(),
            running: Interpreter {
                executable: Some("/usr/bin/python3.12".into()),
                ..interp("3.12.3", None)
            },
            built: interp("3.12.3", None),
            problems: Vec::new(),
            missing_pin: Some("/app/.venv".into()),
        };
        assert_eq!(
            env.describe(),
            "no environment: the environment pinned at build time (PYOP_PYTHON_ENV), /app/.venv, \
             does not exist (moved or deleted?), so only the interpreter's own site-packages"
        );
        assert_eq!(
            env.pip_install("numpy"),
            "`/usr/bin/python3.12 -m venv /app/.venv` then `/app/.venv/bin/python -m pip install \
             numpy` (the pinned environment, made again)"
        );
        // Another environment found below the pin: used, and the pin still named.
        env.root = Some("/home/me/.venv".into());
        env.site_packages = Some("/home/me/.venv/lib/python3.12/site-packages".into());
        env.source = EnvSource::DotVenv;
        assert_eq!(
            env.describe(),
            "the environment /home/me/.venv (the nearest .venv), since the environment pinned at \
             build time (PYOP_PYTHON_ENV), /app/.venv, does not exist (moved or deleted?)"
        );
        assert_eq!(
            env.pip_install("numpy"),
            "`/home/me/.venv/bin/python -m pip install numpy`"
        );
        env.missing_pin = None;
        assert_eq!(
            env.describe(),
            "the environment /home/me/.venv (the nearest .venv)"
        );
    }

    #[test]
    fn major_minor_of_versions() {
        assert_eq!(major_minor("3.11.7"), "3.11");
        assert_eq!(major_minor("3.12"), "3.12");
        assert_eq!(major_minor("3"), "3");
    }

    #[test]
    fn interpreter_identity() {
        let built = interp("3.11.7", Some("/opt/py/lib"));
        assert_eq!(
            interpreter_problem(
                &built,
                &interp("3.11.7", Some("/opt/py/lib/libpython3.11.so.1.0"))
            ),
            None
        );
        let p = interpreter_problem(
            &built,
            &interp("3.11.2", Some("/usr/lib/libpython3.11.so.1.0")),
        )
        .unwrap();
        assert!(
            p.contains("built against Python 3.11.7 (/opt/py/lib)"),
            "{p}"
        );
        assert!(
            p.contains("running Python 3.11.2 (/usr/lib/libpython3.11.so.1.0)"),
            "{p}"
        );
        // A relocated copy of the same version, where the one built against is absent: fine.
        let gone = interp("3.11.7", Some("/nonexistent/pyop-build/lib"));
        assert_eq!(
            interpreter_problem(
                &gone,
                &interp("3.11.7", Some("/kit/lib/libpython3.11.so.1.0"))
            ),
            None
        );
        assert!(interpreter_problem(
            &gone,
            &interp("3.11.2", Some("/kit/lib/libpython3.11.so.1.0"))
        )
        .is_some());
        // Only X.Y recorded (cross-compiled): the patch level is not compared.
        assert_eq!(
            interpreter_problem(&interp("3.11", None), &interp("3.11.2", None)),
            None
        );
        assert!(interpreter_problem(&interp("3.12", None), &interp("3.11.2", None)).is_some());
    }

    #[test]
    fn venv_versions_from_pyvenv_cfg() {
        let dir = std::env::temp_dir().join(format!("pyop-venv-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("pyvenv.cfg"),
            "home = /x/bin\nversion_info = 3.12.1.final.0\n",
        )
        .unwrap();
        assert_eq!(venv_version(&dir).as_deref(), Some("3.12.1"));
        std::fs::write(dir.join("pyvenv.cfg"), "home = /x/bin\nversion = 3.11.7\n").unwrap();
        assert_eq!(venv_version(&dir).as_deref(), Some("3.11.7"));
        let p =
            environment_problem(&dir, EnvSource::DotVenv, &interp("3.12.1", None), false).unwrap();
        assert!(p.contains("was made by Python 3.11.7"), "{p}");
        assert!(p.contains("python3.12 -m venv --clear"), "{p}");
        assert!(
            p.ends_with(
                "or, if it belongs to another project, point PYOP_PYTHON_ENV at a venv made by \
                 it (`python3.12 -m venv <folder>`)"
            ),
            "{p}"
        );
        // An activated venv can also be left.
        let p = environment_problem(&dir, EnvSource::VirtualEnv, &interp("3.12.1", None), false)
            .unwrap();
        assert!(
            p.ends_with(
                "or, if it belongs to another project, leave it (`deactivate`, or unset \
                 VIRTUAL_ENV) or point PYOP_PYTHON_ENV at a venv made by it"
            ),
            "{p}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
