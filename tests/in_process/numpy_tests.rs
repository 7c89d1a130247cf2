//! Numpy mode: declarations of every kind, zero-copy inputs, the output rule table, errors.

use pyop::candle::{DType, Device, Tensor};
use pyop::{py_op, Arg, ErrorKind, OutSpec, PyOp};

use crate::common;
use common::tables::{self, NUMPY_DTYPES};
use common::{cpu, data_ptr};

// --- the five declaration forms ---

/// Doc comments carry over.
#[py_op(file = "tests/py/stats.py", numpy, tout = f32)]
pub fn zscore(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/stats.py", numpy, tout = i64[])]
fn call_count(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def scale(x, k):\n    return x * k", numpy, tout = f64)]
fn scale(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

#[py_op(module = "numpy", name = "divmod", numpy, tout = (i64, i64))]
fn divmod(a: &Tensor, b: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

#[py_op(code = "def rows3(x):\n    return x.reshape(-1, 3)", numpy, tout = f32[_, 3])]
fn rows3(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/stats.py", numpy, tout = ())]
fn log_stats(x: &Tensor, tag: &str) -> pyop::Result<()>;

#[py_op(file = "tests/py/stats.py", numpy, tout = f64)]
fn last_logged(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn file_source_is_embedded_and_runs() {
    let x = Tensor::new(&[1f32, 2., 3., 4.], &cpu()).unwrap();
    let z = zscore(&x).unwrap().to_vec1::<f32>().unwrap();
    let want = [-1.3416408f32, -0.4472136, 0.4472136, 1.3416408];
    for (a, b) in z.iter().zip(want) {
        assert!((a - b).abs() < 1e-6, "{z:?}");
    }
}

#[test]
fn ops_of_one_source_share_its_module() {
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let before = call_count(&x).unwrap().to_scalar::<i64>().unwrap();
    zscore(&x).unwrap();
    zscore(&x).unwrap();
    let after = call_count(&x).unwrap().to_scalar::<i64>().unwrap();
    assert!(after >= before + 2, "{before} -> {after}");
}

/// One text for two declarations (`code = CONST`): a counter module.
const COUNTER: &str = "import numpy as np\nN = 0\n\
    def const_bump(x):\n    global N\n    N += 1\n    return np.int64(N)\n\
    def const_read(x):\n    return np.int64(N)\n";

#[py_op(code = COUNTER, numpy, tout = i64[])]
fn const_bump(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = COUNTER, numpy, tout = i64[])]
fn const_read(x: &Tensor) -> pyop::Result<Tensor>;

/// Each `code` declaration gets a module of its own, even when two share one constant (as
/// executor.md says; the new-user trial read "one code string" as sharing): state to share goes
/// in a `file` or `package`.
#[test]
fn each_code_declaration_gets_its_own_module() {
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let bumped: Vec<i64> = (0..3)
        .map(|_| const_bump(&x).unwrap().to_scalar::<i64>().unwrap())
        .collect();
    assert_eq!(bumped, [1, 2, 3]);
    assert_eq!(const_read(&x).unwrap().to_scalar::<i64>().unwrap(), 0);
}

#[test]
fn plain_attributes_reach_python() {
    let x = Tensor::new(&[1f64, 2.], &cpu()).unwrap();
    assert_eq!(
        scale(&x, 2.5).unwrap().to_vec1::<f64>().unwrap(),
        [2.5, 5.0]
    );
}

#[test]
fn module_function_with_two_outputs() {
    let a = Tensor::new(&[7i64, -7, 9], &cpu()).unwrap();
    let b = Tensor::new(&[2i64, 2, 4], &cpu()).unwrap();
    let (q, r) = divmod(&a, &b).unwrap();
    assert_eq!(q.to_vec1::<i64>().unwrap(), [3, -4, 2]);
    assert_eq!(r.to_vec1::<i64>().unwrap(), [1, 1, 1]);
}

#[py_op(code = "def as_is(x):\n    return x", name = "as_is", numpy, tout = f32[_, 3])]
fn as_is_rows3(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def halve(x, y):\n    return x[: len(x) // 2]", name = "halve", numpy, tout = f32[y])]
fn halve_like_y(x: &Tensor, y: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn declared_shape_is_checked() {
    let x = Tensor::arange(0f32, 6., &cpu()).unwrap();
    assert_eq!(rows3(&x).unwrap().dims(), [2, 3]);
    assert_eq!(
        rows3(&Tensor::arange(0f32, 9., &cpu()).unwrap())
            .unwrap()
            .dims(),
        [3, 3]
    );
    // The body's own error (NumPy cannot reshape 4 elements into rows of 3) ...
    let err = rows3(&Tensor::arange(0f32, 4., &cpu()).unwrap()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
    // ... and pyop's check of a value of the wrong shape.
    let err = as_is_rows3(&Tensor::arange(0f32, 4., &cpu()).unwrap()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutputMismatch);
    assert_eq!(
        err.to_string(),
        "op `as_is_rows3`: output 0: expected shape f32[_, 3], got shape [4]"
    );
    // `f32[y]`: the shape of the argument `y`.
    let y = Tensor::zeros(3, DType::F32, &cpu()).unwrap();
    assert_eq!(halve_like_y(&x, &y).unwrap().dims(), [3]);
    let err = halve_like_y(&x, &Tensor::zeros(2, DType::F32, &cpu()).unwrap()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "op `halve_like_y`: output 0: expected shape [2] (the shape of argument 1), got shape [3]"
    );
}

#[py_op(code = "def first(x, y):\n    return x", name = "first", numpy, tout = f32[y])]
fn first_like_y(x: &Tensor, y: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def first(x, y):\n    return x", name = "first", tout = f32[y])]
fn first_like_y_tensor_mode(x: &Tensor, y: &Tensor) -> pyop::Result<Tensor>;

/// `f32[y]` is checked on an input handed back unchanged too (a view, a `pyop.Tensor`: taken as
/// it is by the output check, then checked like any output).
#[test]
fn an_input_handed_back_is_checked_against_a_shape_like_another_argument() {
    let x = Tensor::arange(0f32, 3., &cpu()).unwrap();
    let y = Tensor::zeros(2, DType::F32, &cpu()).unwrap();
    for f in [first_like_y, first_like_y_tensor_mode] {
        assert_eq!(f(&x, &x).unwrap().to_vec1::<f32>().unwrap(), [0., 1., 2.]);
        let err = f(&x, &y).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutputMismatch, "{err}");
        assert!(
            err.to_string()
                .contains("output 0: expected shape [2] (the shape of argument 1), got shape [3]"),
            "{err}"
        );
    }
}

#[test]
fn unit_output_for_side_effects() {
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    log_stats(&x, "first").unwrap();
    let v = last_logged(&x).unwrap().to_vec1::<f64>().unwrap();
    assert!(v[0] >= 1.0);
    assert_eq!(v[1], 6.0);
}

// --- inputs ---

#[py_op(code = r#"
import numpy as np
def probe(x):
    return np.array([x.ctypes.data, int(x.flags.writeable), int(x.base is not None)], dtype=np.int64)
"#, numpy, tout = i64[3])]
fn probe(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn inputs_are_read_only_zero_copy_views() {
    let x = Tensor::arange(0f32, 1000., &cpu()).unwrap();
    let v = probe(&x).unwrap().to_vec1::<i64>().unwrap();
    assert_eq!(
        v[0] as usize,
        data_ptr(&x),
        "the view must point at candle's storage"
    );
    assert_eq!(v[1], 0, "input views are read-only");
    assert_eq!(v[2], 1, "the view's base keeps the storage alive");
    let narrowed = x.narrow(0, 10, 5).unwrap();
    let v = probe(&narrowed).unwrap().to_vec1::<i64>().unwrap();
    assert_eq!(
        v[0] as usize,
        data_ptr(&narrowed),
        "narrowed tensors are views too"
    );
    // Strided inputs are views as well, not copies: a broadcast (stride 0) and a narrow along
    // dim 1 (rows with gaps).
    let broadcast = Tensor::new(&[1f32, 2.], &cpu())
        .unwrap()
        .broadcast_as((3, 2))
        .unwrap();
    let gaps = Tensor::arange(0f32, 12., &cpu())
        .unwrap()
        .reshape((3, 4))
        .unwrap()
        .narrow(1, 1, 2)
        .unwrap();
    for (what, t) in [("a broadcast tensor", broadcast), ("a dim-1 narrow", gaps)] {
        let v = probe(&t).unwrap().to_vec1::<i64>().unwrap();
        assert_eq!(
            v[0] as usize,
            data_ptr(&t),
            "{what} reaches NumPy as a view"
        );
    }
}

#[py_op(code = r#"
import numpy as np
def back(x, how):
    ways = [lambda: x, lambda: x[...], lambda: x.view(), lambda: x[::-1], lambda: x.T,
            lambda: x.reshape(-1), lambda: x[:1], lambda: x.view(np.int32),
            lambda: x.view(x.dtype.newbyteorder()), lambda: np.asarray(x, order="F")]
    return ways[how]()
"#, numpy, tout = f32)]
fn back(x: &Tensor, how: i64) -> pyop::Result<Tensor>;

/// A body that hands an input's view back unchanged returns that very input (no copy, the same
/// storage); every other view of it — reversed, transposed, reshaped, cut, reinterpreted, of
/// another byte order — is read as what it is, or refused when it is not the declared dtype.
#[test]
fn a_returned_input_view_is_the_input_and_any_other_view_what_it_is() {
    let grid = Tensor::arange(0f32, 6., &cpu())
        .unwrap()
        .reshape((2, 3))
        .unwrap();
    let inputs = [
        ("a 2x3 grid", grid.clone()),
        // Transposed, the same data, shape and base, other strides.
        (
            "a 3x3 grid",
            Tensor::arange(0f32, 9., &cpu())
                .unwrap()
                .reshape((3, 3))
                .unwrap(),
        ),
        ("one element", Tensor::new(&[7f32], &cpu()).unwrap()),
        ("a 0-d scalar", Tensor::new(5f32, &cpu()).unwrap()),
        ("a dim-1 narrow", grid.narrow(1, 1, 2).unwrap()),
        ("a transposed grid", grid.t().unwrap()),
    ];
    for (what, x) in &inputs {
        let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let dims = x.dims().to_vec();
        let n = x.elem_count();
        for how in [0, 1, 2] {
            let y = back(x, how).unwrap();
            assert_eq!(y.dims(), dims, "{what}, {how}");
            assert_eq!(values(&y), values(x), "{what}, {how}");
            assert_eq!(data_ptr(&y), data_ptr(x), "{what}, {how}: the input itself");
        }
        if x.rank() > 0 {
            // Reversed along the first dimension.
            let y = back(x, 3).unwrap();
            let want: Vec<Tensor> = (0..dims[0]).rev().map(|i| x.get(i).unwrap()).collect();
            let want = Tensor::stack(&want, 0).unwrap();
            assert_eq!(values(&y), values(&want), "{what}, reversed");
            let y = back(x, 6).unwrap();
            assert_eq!(
                values(&y),
                values(&x.narrow(0, 0, 1).unwrap()),
                "{what}, cut"
            );
        }
        let y = back(x, 4).unwrap();
        let want = if x.rank() >= 2 {
            x.t().unwrap()
        } else {
            x.clone()
        };
        assert_eq!(
            (y.dims(), values(&y)),
            (want.dims(), values(&want)),
            "{what}, .T"
        );
        let y = back(x, 5).unwrap();
        assert_eq!(
            (y.dims(), values(&y)),
            (&[n][..], values(x)),
            "{what}, reshape"
        );
        let e = back(x, 7).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutputMismatch, "{what}, int32: {e}");
        assert!(e.to_string().contains("int32"), "{what}: {e}");
        // Byte-swapped: not a dtype pyop reads, refused rather than read as native floats.
        let e = back(x, 8).unwrap_err();
        assert_eq!(
            e.kind(),
            ErrorKind::OutputMismatch,
            "{what}, byte order: {e}"
        );
        let y = back(x, 9).unwrap();
        assert_eq!(
            (y.dims(), values(&y)),
            (&dims[..], values(x)),
            "{what}, F order"
        );
    }
}

#[py_op(code = "def ident(x):\n    return x", name = "ident", numpy, tout = f32)]
fn ident_f32(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import numpy as np\ndef copy(x):\n    return np.array(x)", name = "copy", numpy, tout = f32)]
fn copy_f32(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn non_contiguous_inputs_arrive_with_correct_values() {
    let x = Tensor::arange(0f32, 12., &cpu())
        .unwrap()
        .reshape((3, 4))
        .unwrap();
    let t = x.t().unwrap();
    assert!(!t.is_contiguous());
    assert_eq!(
        copy_f32(&t).unwrap().to_vec2::<f32>().unwrap(),
        t.to_vec2::<f32>().unwrap()
    );
    let n = x.narrow(1, 1, 2).unwrap();
    assert_eq!(
        copy_f32(&n).unwrap().to_vec2::<f32>().unwrap(),
        n.to_vec2::<f32>().unwrap()
    );
    let b = Tensor::new(&[1f32, 2.], &cpu())
        .unwrap()
        .broadcast_as((3, 2))
        .unwrap();
    assert_eq!(
        copy_f32(&b).unwrap().to_vec2::<f32>().unwrap(),
        b.to_vec2::<f32>().unwrap()
    );
}

#[test]
fn an_input_returned_unchanged_shares_its_storage() {
    let x = Tensor::arange(0f32, 64., &cpu()).unwrap();
    let y = ident_f32(&x).unwrap();
    assert_eq!(data_ptr(&y), data_ptr(&x));
    assert_eq!(y.to_vec1::<f32>().unwrap(), x.to_vec1::<f32>().unwrap());
    let t = x.reshape((8, 8)).unwrap().t().unwrap();
    let y = ident_f32(&t).unwrap();
    assert_eq!(y.to_vec2::<f32>().unwrap(), t.to_vec2::<f32>().unwrap());
    assert_eq!(
        data_ptr(&y),
        data_ptr(&t),
        "a transposed input's view comes back without a copy"
    );
    assert_eq!(y.stride(), t.stride());
}

#[py_op(code = r#"
def all_kinds(ts, xs, ns, flag, maybe, name, count):
    assert isinstance(ts, list) and len(ts) == 2
    assert xs == [0.5, 1.5] and ns == [1, -2] and flag is True and maybe is None
    assert name == "café" and count == -3
    return ts[0] + ts[1] + sum(xs) + sum(ns) + count
"#, numpy, tout = f64)]
#[allow(clippy::too_many_arguments)]
fn all_kinds(
    ts: &[Tensor],
    xs: &[f64],
    ns: &[i64],
    flag: bool,
    maybe: Option<f64>,
    name: &str,
    count: i64,
) -> pyop::Result<Tensor>;

#[py_op(code = "def maybe(x, y):\n    return x if y is None else x + y", name = "maybe", numpy, tout = f64)]
fn maybe_add(x: &Tensor, y: Option<&Tensor>) -> pyop::Result<Tensor>;

#[py_op(code = "def on(x, k):\n    return x if k is None else x * k", name = "on", numpy, tout = f64)]
fn on_device(x: &Tensor, k: Option<f64>, device: &Device) -> pyop::Result<Tensor>;

#[test]
fn every_parameter_kind() {
    let a = Tensor::new(&[1f64, 2.], &cpu()).unwrap();
    let b = Tensor::new(&[10f64, 20.], &cpu()).unwrap();
    let r = all_kinds(
        &[a.clone(), b],
        &[0.5, 1.5],
        &[1, -2],
        true,
        None,
        "café",
        -3,
    )
    .unwrap();
    assert_eq!(r.to_vec1::<f64>().unwrap(), [9.0, 20.0]);
    assert_eq!(
        on_device(&a, Some(3.0), &cpu())
            .unwrap()
            .to_vec1::<f64>()
            .unwrap(),
        [3.0, 6.0]
    );
    assert_eq!(
        on_device(&a, None, &cpu())
            .unwrap()
            .to_vec1::<f64>()
            .unwrap(),
        [1.0, 2.0]
    );
    assert_eq!(
        maybe_add(&a, Some(&a)).unwrap().to_vec1::<f64>().unwrap(),
        [2.0, 4.0]
    );
    assert_eq!(
        maybe_add(&a, None).unwrap().to_vec1::<f64>().unwrap(),
        [1.0, 2.0]
    );
}

// --- outputs: the rule table, by one table-driven test ---

/// A run-time numpy op whose body is `code` (defining `f`) and whose outputs are `tout`.
fn op(code: &str, tout: &[OutSpec]) -> PyOp {
    common::numpy_op("rule", code, tout).unwrap()
}

fn f32s() -> Vec<OutSpec> {
    vec![OutSpec::new(DType::F32)]
}

#[test]
fn outputs_follow_one_rule_table() {
    tables::outputs_follow_one_rule_table(&|code, tout| op(code, tout));
}

#[test]
fn wrong_outputs_are_errors_naming_op_and_index() {
    tables::wrong_outputs_are_errors_naming_op_and_index(&|code, tout| op(code, tout));
}

#[test]
fn returned_arrays_do_not_alias_python_memory() {
    let keep = op(
        "buf = np.zeros(3, np.float32)\ndef f(x):\n    buf[:] += 1\n    return buf",
        &f32s(),
    );
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    let first = keep.call(&[Arg::from(&x)]).unwrap().remove(0);
    let second = keep.call(&[Arg::from(&x)]).unwrap().remove(0);
    assert_eq!(
        first.to_vec1::<f32>().unwrap(),
        [1., 1., 1.],
        "Python's later mutation must not show"
    );
    assert_eq!(second.to_vec1::<f32>().unwrap(), [2., 2., 2.]);
}

// --- Python exceptions ---

#[test]
fn python_exceptions_keep_kind_message_and_traceback() {
    tables::python_exceptions_keep_kind_message_and_traceback(&|code, tout| op(code, tout));
}

#[py_op(file = "tests/py/stats.py", numpy, tout = f32)]
fn fails(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn traceback_names_the_embedded_file_and_shows_its_lines() {
    let x = Tensor::new(&[-2f32], &cpu()).unwrap();
    let err = fails(&x).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    let text = err.to_string();
    assert!(
        text.starts_with("op `fails`: ValueError: x must be positive, got -2.0"),
        "{text}"
    );
    assert!(
        text.contains("tests/py/stats.py\", line 24, in helper_that_fails"),
        "{text}"
    );
    assert!(
        text.contains("raise ValueError(\"x must be positive"),
        "source lines shown: {text}"
    );
}

// --- state, run-time ops ---

#[py_op(code = "import itertools\ncounter = itertools.count()\ndef tick(x):\n    return next(counter)", numpy, tout = i64)]
fn tick(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn ops_are_never_cached() {
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    let a = tick(&x).unwrap().to_scalar::<i64>().unwrap();
    let b = tick(&x).unwrap().to_scalar::<i64>().unwrap();
    assert_eq!(b, a + 1);
}

#[test]
fn runtime_ops_get_their_own_namespace() {
    let code = "n = 0\ndef f(x):\n    global n\n    n += 1\n    return n";
    let a = op(code, &[OutSpec::new(DType::I64)]);
    let b = op(code, &[OutSpec::new(DType::I64)]);
    let x = Tensor::new(&[0f32], &cpu()).unwrap();
    a.call(&[Arg::from(&x)]).unwrap();
    a.call(&[Arg::from(&x)]).unwrap();
    let nb = b
        .call(&[Arg::from(&x)])
        .unwrap()
        .remove(0)
        .to_scalar::<i64>()
        .unwrap();
    assert_eq!(nb, 1, "b does not see a's state");
}

#[test]
fn runtime_op_from_a_python_callable() {
    use pyop::interop::pyo3::prelude::*;
    let f = Python::attach(|py| -> PyResult<Py<PyAny>> {
        let m = PyModule::from_code(
            py,
            c"def half(x):\n    return x / 2\n",
            c"half.py",
            c"half_mod",
        )?;
        Ok(m.getattr("half")?.unbind())
    })
    .unwrap();
    let op = PyOp::builder("half")
        .callable(f)
        .numpy()
        .tout([OutSpec::new(DType::F64)])
        .build()
        .unwrap();
    let x = Tensor::new(&[3f64], &cpu()).unwrap();
    assert_eq!(
        op.call(&[Arg::from(&x)]).unwrap()[0]
            .to_vec1::<f64>()
            .unwrap(),
        [1.5]
    );
}

#[test]
fn bad_sources_are_errors() {
    let cases: Vec<(pyop::Result<PyOp>, ErrorKind, &str)> = vec![
        (
            PyOp::builder("nofn")
                .code("def g(x): return x")
                .tout([])
                .build(),
            ErrorKind::MissingFunction,
            "has no function `nofn`",
        ),
        (
            PyOp::builder("notcallable")
                .code("notcallable = 3")
                .tout([])
                .build(),
            ErrorKind::MissingFunction,
            "is not callable",
        ),
        (
            PyOp::builder("syntax")
                .code("def syntax(x):\n    return (x\n")
                .tout([])
                .build(),
            ErrorKind::Source,
            "line 2",
        ),
        (
            PyOp::builder("imp")
                .module("no_such_module_pyop")
                .tout([])
                .build(),
            ErrorKind::Source,
            "cannot load the module `no_such_module_pyop`",
        ),
        (
            PyOp::builder("raises")
                .code("raise RuntimeError('at import')")
                .tout([])
                .build(),
            ErrorKind::Source,
            "at import",
        ),
        (
            PyOp::builder("notout").code("def notout(x): pass").build(),
            ErrorKind::InvalidArgument,
            "no `tout`",
        ),
        (
            PyOp::builder("bf")
                .code("def bf(x): pass")
                .numpy()
                .tout([OutSpec::new(DType::BF16)])
                .build(),
            ErrorKind::InvalidArgument,
            "NumPy cannot hold",
        ),
    ];
    for (result, kind, message) in cases {
        let err = result.unwrap_err();
        assert_eq!(err.kind(), kind, "{err}");
        assert!(err.to_string().contains(message), "{err}");
    }
}

#[test]
fn numpy_mode_rejects_dtypes_numpy_cannot_hold() {
    let x = Tensor::new(&[1f32], &cpu())
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let err = ident_f32(&x).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(
        err.to_string()
            .contains("input 0 is bf16, which NumPy cannot hold"),
        "{err}"
    );
    // The input is named by its place among the call's tensors, lists included.
    let op = common::numpy_op(
        "third",
        "def f(a, bs):\n    return a",
        &[OutSpec::new(DType::F32)],
    )
    .unwrap();
    let a = Tensor::new(&[1f32], &cpu()).unwrap();
    let err = op
        .call(&[Arg::from(&a), Arg::from(&[a.clone(), x.clone()][..])])
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("input 2 is bf16, which NumPy cannot hold"),
        "{err}"
    );
}

// --- errors and candle ---

#[test]
fn errors_convert_to_and_from_candle() {
    fn candle_result(x: &Tensor) -> pyop::candle::Result<Tensor> {
        Ok(rows3(x)?) // pyop::Error -> candle::Error through `?`
    }
    let bad = Tensor::arange(0f32, 4., &cpu()).unwrap();
    let candle_err = candle_result(&bad).unwrap_err();
    let back: pyop::Error = candle_err.into();
    assert_eq!(
        back.kind(),
        ErrorKind::InvalidArgument,
        "the kind survives the round trip"
    );
    assert_eq!(back.op(), Some("rows3"));
    fn pyop_result() -> pyop::Result<Tensor> {
        Ok(Tensor::new(&[1f32], &Device::Cpu)?.reshape((2, 2))?) // candle::Error -> pyop::Error
    }
    assert_eq!(pyop_result().unwrap_err().kind(), ErrorKind::Candle);
}

#[test]
fn ops_run_from_many_threads() {
    let handles: Vec<_> = (0..4)
        .map(|i| {
            std::thread::spawn(move || {
                for j in 0..50 {
                    let x = Tensor::new(&[i as f64, j as f64], &Device::Cpu).unwrap();
                    let y = scale(&x, 2.0).unwrap().to_vec1::<f64>().unwrap();
                    assert_eq!(y, [2.0 * i as f64, 2.0 * j as f64]);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

/// A crate that re-exports pyop points the generated code at its re-export with `crate = ...`.
mod reexport {
    pub use pyop as inner;
}

#[py_op(crate = "crate::numpy_tests::reexport::inner", code = "def through(x):\n    return x + 1", numpy, tout = f64)]
fn through(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn the_crate_option_points_at_a_reexport() {
    let x = Tensor::new(&[1f64], &cpu()).unwrap();
    assert_eq!(through(&x).unwrap().to_vec1::<f64>().unwrap(), [2.0]);
}

#[py_op(file = "tests/py/kept.py", name = "fill", numpy, tout = f32[x])]
fn fill_f(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/kept.py", name = "give_back", numpy, tout = f32)]
fn give_back_f(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/kept.py", name = "scribble", numpy, tout = ())]
fn scribble_f(x: &Tensor) -> pyop::Result<()>;

#[test]
fn python_never_keeps_writable_candle_memory() {
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let filled = fill_f(&x).unwrap();
    assert_eq!(filled.to_vec1::<f32>().unwrap(), [2., 3.]);
    let back = give_back_f(&x).unwrap();
    assert_eq!(back.to_vec1::<f32>().unwrap(), [2., 3.]);
    scribble_f(&x).unwrap(); // writes -7 into the `out` the body kept
    assert_eq!(
        filled.to_vec1::<f32>().unwrap(),
        [2., 3.],
        "`out` was kept, so the output was copied"
    );
    assert_eq!(
        back.to_vec1::<f32>().unwrap(),
        [2., 3.],
        "a kept `out` handed back is copied too"
    );
}

/// A returned array that is not C-contiguous (reversed, strided, Fortran-ordered, unaligned, or
/// several at once) is copied in one strided pass by NumPy into candle memory: exact values for
/// every dtype, at sizes on both sides of the 1 MiB line where copies leave the GIL, and the
/// tensor does not change when Python later writes to the array it came from.
#[test]
fn strided_arrays_are_copied_exactly_for_every_dtype() {
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for (np_name, dtype) in NUMPY_DTYPES {
        // 2-D: every other row, reversed, every third column.
        let out = op(
            &format!("def f(x): return (np.arange(60) % 100).astype(np.{np_name}).reshape(10, 6)[::-2, ::3]"),
            &[OutSpec::new(dtype)],
        )
        .call(&[Arg::from(&x)])
        .unwrap_or_else(|e| panic!("{np_name}: {e}"));
        let got = out[0]
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        let want: Vec<Vec<f64>> = (0..5)
            .map(|i| {
                let row = 9 - 2 * i;
                vec![(row * 6) as f64, (row * 6 + 3) as f64]
            })
            .collect();
        assert_eq!(got, want, "{np_name}");
    }
    // Large (4.8 MB, copied without the GIL), reversed; and Fortran-ordered 3-D.
    let n = 1_200_000usize;
    let big = op(
        &format!("def f(x): return np.arange({n}, dtype=np.float32)[::-1]"),
        &f32s(),
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    let v = big[0].to_vec1::<f32>().unwrap();
    assert_eq!(v.len(), n);
    assert!(v.iter().enumerate().all(|(i, &e)| e == (n - 1 - i) as f32));
    let fortran = op(
        "def f(x): return np.asfortranarray(np.arange(24, dtype=np.int64).reshape(2, 3, 4))",
        &[OutSpec::new(DType::I64)],
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(
        fortran[0].flatten_all().unwrap().to_vec1::<i64>().unwrap(),
        (0..24).collect::<Vec<i64>>()
    );
    // Unaligned and strided at once; and empty and strided.
    let odd = op(
        "def f(x): return np.frombuffer(b'\\0' + np.arange(8, dtype=np.float64).tobytes(), np.float64, offset=1)[::3]",
        &[OutSpec::new(DType::F64)],
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(odd[0].to_vec1::<f64>().unwrap(), [0., 3., 6.]);
    let empty = op(
        "def f(x): return np.zeros((4, 0), np.float32)[::-2]",
        &f32s(),
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(empty[0].dims(), [2, 0]);
    // The tensor is a copy: the body writing to the array it returned, on the next call, does
    // not reach the first call's output.
    let kept = op(
        "kept = None\ndef f(x):\n    global kept\n    if kept is None:\n        kept = np.arange(8, dtype=np.float32)\n        return kept[::2]\n    kept[:] = -1\n    return kept[::2]",
        &f32s(),
    );
    let first = kept.call(&[Arg::from(&x)]).unwrap();
    let second = kept.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(first[0].to_vec1::<f32>().unwrap(), [0., 2., 4., 6.]);
    assert_eq!(second[0].to_vec1::<f32>().unwrap(), [-1.; 4]);
}

/// The copy path without the copy: a fresh array the body returns (from 64 KiB on) becomes the
/// tensor itself — same address — because NumPy allocated it, during the body, from the
/// allocator candle frees into. Only when nothing else can reach it: a kept reference, a kept
/// view, the same array returned twice, a subclass, or a small array all take the copy, and a
/// later write through what the body kept does not reach the tensor.
#[test]
fn fresh_arrays_become_tensors_without_a_copy_only_when_nothing_else_reaches_them() {
    let _memory = common::memory_lock();
    // No body scans `gc.get_objects()` meanwhile (that list would hold the arrays' operands).
    let _gc = common::gc_scan_lock();
    let n = 100_000usize; // 400 KB of f32
    let x = Tensor::arange(0f32, n as f32, &cpu()).unwrap();
    let plus1: Vec<f32> = (0..n).map(|i| i as f32 + 1.0).collect();
    let addr = OutSpec::new(DType::I64);
    let run = |code: &str, tout: &[OutSpec]| -> Vec<Tensor> {
        op(code, tout)
            .call(&[Arg::from(&x)])
            .unwrap_or_else(|e| panic!("{code}: {e}"))
    };
    let reported = |t: &Tensor| t.to_scalar::<i64>().unwrap() as usize;
    const ADDR: &str = "np.int64(y.__array_interface__['data'][0])";
    let f32_addr = [OutSpec::new(DType::F32), addr.clone()];

    // Adopted: the natural body, f32 and f64, and a buffer NumPy reallocated (`resize`).
    let out = run(
        &format!("def f(x):\n    y = x + np.float32(1)\n    return y, {ADDR}"),
        &f32_addr,
    );
    assert_eq!(data_ptr(&out[0]), reported(&out[1]), "x + 1 is adopted");
    assert_eq!(out[0].to_vec1::<f32>().unwrap(), plus1);
    let out = run(
        &format!("def f(x):\n    y = x.astype(np.float64) * 2\n    return y, {ADDR}"),
        &[OutSpec::new(DType::F64), addr.clone()],
    );
    assert_eq!(data_ptr(&out[0]), reported(&out[1]), "f64 is adopted");
    assert_eq!(
        out[0].to_vec1::<f64>().unwrap(),
        (0..n).map(|i| i as f64 * 2.0).collect::<Vec<_>>()
    );
    let out = run(
        &format!("def f(x):\n    y = np.empty(3 * x.size, np.float32)\n    y.resize(x.size, refcheck=False)\n    np.add(x, np.float32(1), out=y)\n    return y, {ADDR}"),
        &f32_addr,
    );
    assert_eq!(
        data_ptr(&out[0]),
        reported(&out[1]),
        "a resized array is adopted"
    );
    assert_eq!(out[0].to_vec1::<f32>().unwrap(), plus1);

    // Copied: something else can reach the array.
    for (why, code) in [
        ("a kept reference", format!("kept = []\ndef f(x):\n    y = x + np.float32(1)\n    kept.append(y)\n    return y, {ADDR}")),
        ("a kept view", format!("kept = []\ndef f(x):\n    y = x + np.float32(1)\n    kept.append(y[1:])\n    return y, {ADDR}")),
        ("a subclass", format!("class Sub(np.ndarray):\n    pass\ndef f(x):\n    y = np.ndarray.__new__(Sub, x.shape, np.float32)\n    np.add(x, np.float32(1), out=y)\n    return y, {ADDR}")),
        ("a weak reference", format!("import weakref\nkept = []\ndef f(x):\n    y = x + np.float32(1)\n    kept.append(weakref.ref(y))\n    return y, {ADDR}")),
        ("a memoryview", format!("kept = []\ndef f(x):\n    y = x + np.float32(1)\n    kept.append(memoryview(y))\n    return y, {ADDR}")),
    ] {
        let out = run(&code, &f32_addr);
        assert_ne!(data_ptr(&out[0]), reported(&out[1]), "{why}: copied");
        assert_eq!(out[0].to_vec1::<f32>().unwrap(), plus1, "{why}");
    }
    let twice = run(
        &format!("def f(x):\n    y = x + np.float32(1)\n    return y, y, {ADDR}"),
        &[
            OutSpec::new(DType::F32),
            OutSpec::new(DType::F32),
            addr.clone(),
        ],
    );
    assert_ne!(data_ptr(&twice[0]), reported(&twice[2]));
    assert_ne!(data_ptr(&twice[1]), reported(&twice[2]));
    assert_ne!(data_ptr(&twice[0]), data_ptr(&twice[1]));
    let small = PyOp::builder("small")
        .code(format!(
            "import numpy as np\ndef f(x):\n    y = x[:100] + np.float32(1)\n    return y, {ADDR}"
        ))
        .function("f")
        .numpy()
        .tout(f32_addr.iter().cloned())
        .build()
        .unwrap()
        .call(&[Arg::from(&x)])
        .unwrap();
    assert_ne!(
        data_ptr(&small[0]),
        reported(&small[1]),
        "below 64 KiB: copied"
    );

    // What the body kept cannot reach the tensor: its next call writes -1 into the array it kept.
    let keeper = op(
        "kept = None\ndef f(x):\n    global kept\n    if kept is not None:\n        kept[:] = -1\n    kept = x + np.float32(1)\n    return kept",
        &f32s(),
    );
    let first = keeper.call(&[Arg::from(&x)]).unwrap();
    keeper.call(&[Arg::from(&x)]).unwrap();
    assert_eq!(first[0].to_vec1::<f32>().unwrap(), plus1);

    // Adopted buffers are freed by candle like any other: 300 calls of 4 MB each leave resident
    // memory where it was (a leak would add 1.2 GB).
    let big = Tensor::zeros(1 << 20, DType::F32, &cpu()).unwrap();
    let plus = op("def f(x):\n    return x + np.float32(1)", &f32s());
    let warm: Vec<_> = (0..5)
        .map(|_| plus.call(&[Arg::from(&big)]).unwrap())
        .collect();
    drop(warm);
    let before = common::rss_bytes();
    for _ in 0..300 {
        let y = plus.call(&[Arg::from(&big)]).unwrap();
        assert_eq!(y[0].dims(), [1 << 20]);
    }
    let grown = common::rss_bytes().saturating_sub(before);
    assert!(grown < 200 << 20, "resident memory grew by {grown} bytes");
}

/// `usize`, `u32`, `i32`, `f32` and `&[usize]` reach Python as `int`/`float`/list of `int`
/// without loss (usize::MAX is beyond i64; f32 widens exactly), optional ones as `None`.
#[allow(clippy::too_many_arguments)] // one of each kind
#[py_op(
    code = "import numpy as np\ndef rust_numbers(x, a, b, c, d, dims, e, fs):\n    return np.array([a == 2**64 - 1, type(a) is int, b == 2**32 - 1, c == -2**31, d == float(np.float32(0.1)), type(d) is float, dims == [2, 3], e is None, fs == [float(np.float32(0.1)), 2.5]], np.uint8)",
    numpy,
    tout = u8
)]
fn rust_numbers(
    x: &Tensor,
    a: usize,
    b: u32,
    c: i32,
    d: f32,
    dims: &[usize],
    e: Option<u32>,
    fs: &[f32],
) -> pyop::Result<Tensor>;

#[test]
fn candle_number_types_pass_to_python_without_loss() {
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    let flags = rust_numbers(
        &x,
        usize::MAX,
        u32::MAX,
        i32::MIN,
        0.1f32,
        &[2, 3],
        None,
        &[0.1, 2.5],
    )
    .unwrap();
    assert_eq!(flags.to_vec1::<u8>().unwrap(), [1; 9]);
}

// --- the `out` protocol, in every form ---

#[py_op(file = "tests/py/outs.py", numpy, tout = i64)]
fn out_addresses(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/outs.py", numpy, tout = f32[x])]
fn returns_out(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/outs.py", numpy, tout = f32[x])]
fn returns_none(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/outs.py", numpy, tout = f32[4, 3])]
fn declared_shape(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/outs.py", numpy, tout = (f32[x], i64[x]))]
fn two_outputs(x: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

#[py_op(file = "tests/py/outs.py", numpy, tout = f32[x])]
fn returns_other(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/outs.py", numpy, tout = f32[x])]
fn keeps_a_view(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/outs.py", numpy, tout = ())]
fn scribble_on_kept(x: &Tensor) -> pyop::Result<()>;

/// The buffers the last `outs.py` body was given, as the body saw them. Bodies of one file share
/// one module, and the tests here call them one at a time (a lock), so "last" is this test's.
fn given(x: &Tensor) -> Vec<usize> {
    out_addresses(x)
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|a| a as usize)
        .collect()
}

static OUTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Each form of `out` hands back the very memory the body wrote: one output returned as `out`
/// or as `None`, a fully declared shape, two outputs (a tuple `out`); any other return is an
/// error naming the rule.
#[test]
fn out_buffers_become_the_outputs_without_a_copy() {
    let _one_at_a_time = OUTS.lock().unwrap();
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    let y = returns_out(&x).unwrap();
    assert_eq!(given(&x), [data_ptr(&y)], "returned `out`");
    assert_eq!(y.to_vec1::<f32>().unwrap(), [2., 3., 4.]);
    let y = returns_none(&x).unwrap();
    assert_eq!(given(&x), [data_ptr(&y)], "returned None");
    assert_eq!(y.to_vec1::<f32>().unwrap(), [2., 4., 6.]);
    let y = declared_shape(&x).unwrap();
    assert_eq!(given(&x), [data_ptr(&y)], "f32[4, 3]");
    assert_eq!(y.dims(), [4, 3]);
    assert_eq!(
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        (0..12).map(|i| i as f32).collect::<Vec<_>>()
    );
    let (a, b) = two_outputs(&x).unwrap();
    assert_eq!(given(&x), [data_ptr(&a), data_ptr(&b)], "a tuple `out`");
    assert_eq!(a.to_vec1::<f32>().unwrap(), [2., 3., 4.]);
    assert_eq!(b.to_vec1::<i64>().unwrap(), [0, 1, 2]);
    let err = returns_other(&x).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::OutputMismatch);
    assert!(
        err.to_string().contains(
            "op `returns_other`: a body given `out` writes its outputs into it and returns None \
             (or `out`), got a NumPy array of dtype float32 and shape [3]"
        ),
        "{err}"
    );
}

/// A body that keeps a view of `out` past the call gets its output copied: the tensor is not
/// the buffer the body kept, and a later write through the kept view does not reach it.
#[test]
fn a_kept_view_of_out_makes_the_output_a_copy() {
    let _one_at_a_time = OUTS.lock().unwrap();
    let x = Tensor::new(&[1f32, 2., 3.], &cpu()).unwrap();
    let y = keeps_a_view(&x).unwrap();
    assert_ne!(given(&x), [data_ptr(&y)]);
    scribble_on_kept(&x).unwrap();
    assert_eq!(y.to_vec1::<f32>().unwrap(), [1., 2., 3.]);
}

/// The `VmFlags` of the mapping of this process that holds `addr` (`/proc/self/smaps`).
fn vm_flags_at(addr: usize) -> Option<String> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ') {
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = a <= addr && addr < b;
                    continue;
                }
            }
        }
        if inside {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                return Some(flags.trim().to_owned());
            }
        }
    }
    None
}

/// An `out` buffer of 4 MiB or more is advised to use transparent huge pages (`MADV_HUGEPAGE`,
/// which `/proc/self/smaps` shows as `hg`), as NumPy does for its own large arrays: a fresh
/// 64 MiB buffer then faults 32 times on first write instead of 16,384.
#[test]
fn large_out_buffers_are_advised_to_use_huge_pages() {
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
    if !thp.is_ok_and(|s| s.contains("[madvise]") || s.contains("[always]")) {
        eprintln!("skipped: this kernel offers no transparent huge pages to advise");
        return;
    }
    let x = Tensor::zeros(4 << 20, DType::F32, &cpu()).unwrap(); // 16 MiB
    let y = returns_none(&x).unwrap();
    // The first whole page of the buffer (its start need not be page-aligned).
    let page = data_ptr(&y).div_ceil(4096) * 4096;
    let flags = vm_flags_at(page).expect("the buffer is mapped");
    assert!(
        flags.split_whitespace().any(|f| f == "hg"),
        "VmFlags of the out buffer: {flags}"
    );
    let end = data_ptr(&y) + (4 << 22) - 4096;
    let flags = vm_flags_at(end / 4096 * 4096).expect("the buffer is mapped");
    assert!(
        flags.split_whitespace().any(|f| f == "hg"),
        "VmFlags at the buffer's last whole page: {flags}"
    );
}

/// A fresh array of 64 KiB or more becomes the tensor without a copy only when it is
/// C-contiguous and of the declared dtype: a fresh Fortran-ordered one is copied in order, and
/// one of another dtype is refused as a smaller one is (mutation testing of
/// `bridge/numbers.rs`, `adopted`: its flag mask and dtype guard).
#[test]
fn only_c_contiguous_fresh_arrays_of_the_declared_dtype_are_adopted() {
    let x = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
    let fortran = op(
        "def f(x): return np.asfortranarray(np.arange(32768, dtype=np.float32).reshape(256, 128))",
        &f32s(),
    )
    .call(&[Arg::from(&x)])
    .unwrap();
    assert_eq!(fortran[0].dims(), [256, 128]);
    assert_eq!(
        fortran[0].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        (0..32768).map(|i| i as f32).collect::<Vec<_>>()
    );
    let other = |n: usize| {
        op(
            &format!("def f(x): return np.arange({n}, dtype=np.float64)"),
            &f32s(),
        )
        .call(&[Arg::from(&x)])
        .unwrap_err()
        .to_string()
    };
    let (small, large) = (other(4), other(32768));
    assert!(small.contains("dtype"), "{small}");
    assert_eq!(large.replace("32768", "4"), small);
}

/// A view's base object (`pyop.Tensor`) is kept per thread and refilled for later calls only when
/// nothing else holds it (`bridge::tensor::spare`): views a body kept, their roots' bases it kept,
/// and inputs it handed back keep their values through later calls of other shapes;
/// spares it found through `gc` stay empty while held; every result is exact.
#[test]
fn view_bases_are_reused_only_when_no_one_else_holds_them() {
    let _gc = common::gc_scan_lock();
    let op = PyOp::builder("keepview")
        .code(format!(
            "{}import numpy as np\n\
             def f(xs, how):\n\
             \x20   x = xs[0]\n\
             \x20   if how == 1:\n\
             \x20       kept.append((x, x.tolist()))\n\
             \x20   elif how == 2:\n\
             \x20       kept.append((x.base.base, x.tolist()))\n\
             \x20   elif how == 3:\n\
             \x20       kept.append((x[1:], x[1:].tolist()))\n\
             \x20   found = look_and_check(how == 4)\n\
             \x20   return x if how == 5 else x * 2, np.int64(found)\n",
            common::SPARE_CHECKS
        ))
        .function("f")
        .numpy()
        .tout([OutSpec::new(DType::F64), OutSpec::new(DType::I64)])
        .build()
        .unwrap();
    let mut found = 0;
    for i in 0..48usize {
        let n = 2 + i % 5;
        let x = Tensor::arange(i as f64, (i + n) as f64, &cpu()).unwrap();
        let how = (i % 6) as i64;
        // Calls of 3 inputs leave spares in the store that the calls of 1 which look find.
        let xs = if how == 4 {
            vec![x.clone()]
        } else {
            vec![x.clone(), x.clone(), x.clone()]
        };
        let out = op
            .call(&[Arg::from(&xs[..]), Arg::I64(how)])
            .unwrap_or_else(|e| panic!("call {i}: {e}"));
        let factor = if how == 5 { 1. } else { 2. };
        assert_eq!(
            out[0].to_vec1::<f64>().unwrap(),
            (&x * factor).unwrap().to_vec1::<f64>().unwrap(),
            "call {i}"
        );
        found = out[1].to_scalar::<i64>().unwrap();
    }
    assert!(found > 0, "no spare found");
}

/// Input views (the array, its root and base) are kept per thread and refilled for later calls
/// only when nothing can reach any part of them (`bridge::tensor::spare`), and a body cannot
/// tell: arrays (or roots) it kept keep their values, its weak references to them die when the
/// call ends, and every array it gets has the values, shape, strides and flags of a new array
/// over its input (those NumPy gives `x.view()` and the root), whatever an earlier call did to
/// its arrays: reshaped them in place (to another rank too), took a buffer of one, handed one back.
#[test]
fn input_views_are_reused_only_when_nothing_can_reach_them() {
    // No body scans `gc.get_objects()` meanwhile: that list would keep this test's views alive.
    let _gc = common::gc_scan_lock();
    let op = PyOp::builder("reuseview")
        .code(
            "import weakref\n\
             import numpy as np\n\
             kept, weak = [], []\n\
             def flags(a):\n\
             \x20   return [a.flags[k] for k in ('C', 'F', 'A', 'W', 'O')]\n\
             def f(xs, how):\n\
             \x20   for a, values in kept:\n\
             \x20       assert a.tolist() == values, (a.tolist(), values)\n\
             \x20   for r in weak:\n\
             \x20       assert r() is None\n\
             \x20   for x in xs:\n\
             \x20       assert flags(x) == flags(x.base) == flags(x.view()), (flags(x), flags(x.base))\n\
             \x20       assert not x.flags.writeable and not x.base.flags.writeable\n\
             \x20       assert (x.base.shape, x.base.strides) == (x.shape, x.strides)\n\
             \x20   x = xs[0]\n\
             \x20   y, strides = x * 2, np.array(x.strides, dtype=np.int64)\n\
             \x20   if how == 1:\n\
             \x20       kept.append((x, x.tolist()))\n\
             \x20   elif how == 2:\n\
             \x20       kept.append((x.base, x.tolist()))\n\
             \x20   elif how == 3:\n\
             \x20       weak.append(weakref.ref(x))\n\
             \x20   elif how == 4:\n\
             \x20       weak.append(weakref.ref(xs[-1].base))\n\
             \x20   elif how == 5:\n\
             \x20       memoryview(xs[-1]).release()\n\
             \x20   elif how == 6 and x.ndim == 2 and x.flags.c_contiguous:\n\
             \x20       for v in xs[1:]:\n\
             \x20           v.shape = v.shape[::-1]\n\
             \x20       x.shape = (-1,)\n\
             \x20   elif how == 7:\n\
             \x20       return x, strides\n\
             \x20   return y, strides\n",
        )
        .function("f")
        .numpy()
        .tout([OutSpec::new(DType::F64), OutSpec::new(DType::I64)])
        .build()
        .unwrap();
    for i in 0..96usize {
        // Ranks 0, 1 and 2 (C-ordered and transposed) in turn, of changing sizes.
        let n = 1 + i % 4;
        let x = Tensor::arange((i * 10) as f64, (i * 10 + 2 * n) as f64, &cpu()).unwrap();
        let x = match i % 4 {
            0 => x.sum_all().unwrap(),
            1 => x,
            2 => x.reshape((2, n)).unwrap(),
            _ => x.reshape((2, n)).unwrap().t().unwrap(),
        };
        let how = (i / 4 % 8) as i64;
        let xs = if i % 3 == 0 {
            vec![x.clone()]
        } else {
            vec![x.clone(), x.clone(), x.clone()]
        };
        let out = op
            .call(&[Arg::from(&xs[..]), Arg::I64(how)])
            .unwrap_or_else(|e| panic!("call {i} (how {how}): {e}"));
        let factor = if how == 7 { 1. } else { 2. };
        let want = (&x * factor).unwrap();
        assert_eq!(out[0].dims(), want.dims(), "call {i}");
        assert_eq!(
            out[0].flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            want.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
            "call {i}"
        );
        let strides: Vec<i64> = x.stride().iter().map(|&s| 8 * s as i64).collect();
        assert_eq!(out[1].to_vec1::<i64>().unwrap(), strides, "call {i}");
    }
}

/// A spare input view refilled with a layout gets NumPy's own flags for it, also where NumPy's
/// last answer on this thread was for the same shape with other strides, or the same strides
/// with another shape: the thread's memo of the flags (`ndarray::FlagsMemo`) is used only for the
/// very layout it was computed for. One input of one rank and dtype, so every call refills the
/// same spare view.
#[test]
fn a_refilled_views_flags_are_numpys_for_its_layout() {
    let op = PyOp::builder("viewflags")
        .code(
            "import numpy as np\n\
             def f(x):\n\
             \x20   v = x.view()\n\
             \x20   got = [x.flags.c_contiguous, x.flags.f_contiguous, x.flags.aligned]\n\
             \x20   assert got == [v.flags.c_contiguous, v.flags.f_contiguous, v.flags.aligned], got\n\
             \x20   return np.array(got, dtype=np.uint8)\n",
        )
        .function("f")
        .numpy()
        .tout([OutSpec::new(DType::U8)])
        .build()
        .unwrap();
    let square = Tensor::arange(0f64, 9., &cpu())
        .unwrap()
        .reshape((3, 3))
        .unwrap();
    let wide = Tensor::arange(0f64, 12., &cpu())
        .unwrap()
        .reshape((3, 4))
        .unwrap();
    // (3, 3) in C order, in Fortran order, and neither (strides 4 and 1 elements); (1, 3) and
    // (3, 1), contiguous both ways; (3, 3) in C order again.
    let layouts = [
        (square.clone(), [1, 0, 1]),
        (square.t().unwrap(), [0, 1, 1]),
        (wide.narrow(1, 0, 3).unwrap(), [0, 0, 1]),
        (wide.narrow(1, 1, 3).unwrap(), [0, 0, 1]),
        (square.narrow(0, 0, 1).unwrap(), [1, 1, 1]),
        (square.narrow(1, 0, 1).unwrap(), [0, 0, 1]),
        (
            square.narrow(1, 0, 1).unwrap().contiguous().unwrap(),
            [1, 1, 1],
        ),
        (square.clone(), [1, 0, 1]),
    ];
    for round in 0..3 {
        for (i, (x, want)) in layouts.iter().enumerate() {
            let got = op.call(&[Arg::from(x)]).unwrap();
            assert_eq!(
                got[0].to_vec1::<u8>().unwrap(),
                want,
                "round {round}, layout {i}: {:?} strides {:?}",
                x.dims(),
                x.stride()
            );
        }
    }
}

/// A registered gradient's views (inputs, outputs, grads) go back to the thread's spares after
/// it returns like a forward call's: gradient calls leave the thread's store as full as they
/// found it (they emptied it: the tuples still held the views when their objects were given
/// back). Counted in this thread's store, not through `gc` (which sees every thread's spares,
/// and other tests' threads take, give back and let go of theirs meanwhile).
#[test]
fn gradient_calls_give_their_views_back_to_the_spares() {
    let op = PyOp::builder("gradspares")
        .code(
            "def f(xs):\n\
             \x20   return xs[0] * 2\n\
             def f_grad(inputs, outputs, grads):\n\
             \x20   return ([grads[0] * 2] + [None] * (len(inputs[0]) - 1),)\n",
        )
        .function("f")
        .numpy()
        .tout([OutSpec::new(DType::F64)])
        .gradient("f_grad")
        .build()
        .unwrap();
    let x = Tensor::arange(0f64, 3., &cpu()).unwrap();
    let var = pyop::candle::Var::from_tensor(&x).unwrap();
    let many = vec![x.clone(); 6];
    // The views this thread keeps after a call.
    let spares = |xs: &[Tensor]| {
        let out = op.call(&[Arg::from(xs)]).unwrap();
        assert_eq!(out[0].to_vec1::<f64>().unwrap(), [0., 2., 4.]);
        pyop::__private::spares_on_this_thread().1
    };
    spares(&many);
    let before = spares(&many[..1]);
    assert!(before > 0, "no spare kept");
    for _ in 0..3 {
        let y = op
            .call(&[Arg::from(&[var.as_tensor().clone()][..])])
            .unwrap();
        let grads = y[0].sum_all().unwrap().backward().unwrap();
        assert_eq!(
            grads.get(&var).unwrap().to_vec1::<f64>().unwrap(),
            [2., 2., 2.]
        );
    }
    assert!(
        spares(&many[..1]) >= before,
        "gradient calls emptied the spares"
    );
}
