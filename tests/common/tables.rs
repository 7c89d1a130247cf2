//! The numpy-mode tables (the output rule table, the bad-output table, the exception-kind
//! table), run by `in_process/numpy_tests.rs` in the program and by `worker_protocol_tests.rs` through worker
//! processes: the same cases, the same errors.

use pyop::candle::{DType, Tensor};
use pyop::{Arg, ErrorKind, OutSpec, PyOp};

use super::cpu;

/// Makes a numpy-mode op named `rule` whose body is `code` (defining `f`, NumPy as `np`).
pub type Make<'a> = &'a dyn Fn(&str, &[OutSpec]) -> PyOp;

/// Every dtype NumPy and candle share, by NumPy name.
pub const NUMPY_DTYPES: [(&str, DType); 8] = [
    ("uint8", DType::U8),
    ("uint32", DType::U32),
    ("int16", DType::I16),
    ("int32", DType::I32),
    ("int64", DType::I64),
    ("float16", DType::F16),
    ("float32", DType::F32),
    ("float64", DType::F64),
];

fn f32s() -> Vec<OutSpec> {
    vec![OutSpec::new(DType::F32)]
}

pub fn outputs_follow_one_rule_table(op: Make<'_>) {
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let ok = |code: &str, tout: Vec<OutSpec>| -> Vec<Tensor> {
        op(code, &tout)
            .call(&[Arg::from(&x)])
            .unwrap_or_else(|e| panic!("{code}: {e}"))
    };
    // One output: a value, or a 1-tuple holding it.
    assert_eq!(
        ok("def f(x): return x * 2", f32s())[0]
            .to_vec1::<f32>()
            .unwrap(),
        [2., 4.]
    );
    assert_eq!(
        ok("def f(x): return (x * 2,)", f32s())[0]
            .to_vec1::<f32>()
            .unwrap(),
        [2., 4.]
    );
    // M outputs: a tuple or a list of exactly M values.
    let two = vec![OutSpec::new(DType::F32), OutSpec::new(DType::I64)];
    let r = ok("def f(x): return [x, 3]", two.clone());
    assert_eq!(r[1].to_scalar::<i64>().unwrap(), 3);
    let r = ok("def f(x): return (x, [1, 2])", two);
    assert_eq!(r[1].to_vec1::<i64>().unwrap(), [1, 2]);
    // No outputs: None.
    assert!(ok("def f(x): return None", vec![]).is_empty());
    // Python numbers and nested lists, converted exactly.
    assert_eq!(
        ok("def f(x): return [[1.5, 2], [3, 4]]", f32s())[0]
            .to_vec2::<f32>()
            .unwrap(),
        [[1.5, 2.], [3., 4.]]
    );
    assert_eq!(
        ok("def f(x): return 2.0", vec![OutSpec::new(DType::I64)])[0]
            .to_scalar::<i64>()
            .unwrap(),
        2
    );
    assert_eq!(
        ok("def f(x): return True", vec![OutSpec::new(DType::U8)])[0]
            .to_scalar::<u8>()
            .unwrap(),
        1
    );
    assert_eq!(
        ok("def f(x): return 255", vec![OutSpec::new(DType::U8)])[0]
            .to_scalar::<u8>()
            .unwrap(),
        255
    );
    // NumPy scalars of the declared dtype; bool arrays for u8.
    assert_eq!(
        ok("def f(x): return np.float32(1.5)", f32s())[0]
            .to_scalar::<f32>()
            .unwrap(),
        1.5
    );
    assert_eq!(
        ok("def f(x): return x > 1", vec![OutSpec::new(DType::U8)])[0]
            .to_vec1::<u8>()
            .unwrap(),
        [0, 1]
    );
    // Fortran-ordered and strided arrays come back with correct values.
    let f = ok(
        "def f(x): return np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3))",
        f32s(),
    );
    assert_eq!(f[0].to_vec2::<f32>().unwrap(), [[0., 1., 2.], [3., 4., 5.]]);
    let s = ok(
        "def f(x): return np.arange(10, dtype=np.float32)[::3]",
        f32s(),
    );
    assert_eq!(s[0].to_vec1::<f32>().unwrap(), [0., 3., 6., 9.]);
    // An unaligned array (NumPy allows them) is copied byte-wise, correctly.
    let u = ok("def f(x): return np.frombuffer(b'\\0' + np.arange(4, dtype=np.float32).tobytes(), np.float32, offset=1)", f32s());
    assert_eq!(u[0].to_vec1::<f32>().unwrap(), [0., 1., 2., 3.]);
    // Shapes with `_` match any size.
    let shaped = vec![OutSpec::shaped(DType::F32, [None, Some(2)])];
    assert_eq!(
        ok("def f(x): return np.zeros((5, 2), np.float32)", shaped)[0].dims(),
        [5, 2]
    );
    // Every dtype NumPy holds.
    for (np_name, dtype) in NUMPY_DTYPES {
        let r = ok(
            &format!("def f(x): return np.arange(3, dtype=np.{np_name})"),
            vec![OutSpec::new(dtype)],
        );
        assert_eq!(r[0].dtype(), dtype);
        assert_eq!(
            r[0].to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap(),
            [0., 1., 2.]
        );
    }
}

pub fn wrong_outputs_are_errors_naming_op_and_index(op: Make<'_>) {
    let x = Tensor::new(&[1f32, 2.], &cpu()).unwrap();
    let i64s = vec![OutSpec::new(DType::I64)];
    let u8s = vec![OutSpec::new(DType::U8)];
    let two = vec![OutSpec::new(DType::F32), OutSpec::new(DType::F32)];
    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<OutSpec>, Option<usize>, &str)> = vec![
        ("def f(x): return (x, x)", f32s(), None, "expected 1 output, got a tuple of 2 values"),
        ("def f(x): return ()", f32s(), None, "expected 1 output, got a tuple of 0 values"),
        ("def f(x): return (x, x, x)", two.clone(), None, "expected 2 outputs, got 3"),
        ("def f(x): return x", two.clone(), None, "expected a tuple of 2 outputs"),
        ("def f(x): return [x]", two.clone(), None, "expected 2 outputs, got 1"),
        ("def f(x): return (x, None)", two, Some(1), "output 1: expected f32"),
        ("def f(x): return x", vec![], None, "`tout = ()` expects the body to return None"),
        ("def f(x): return None", f32s(), Some(0), "got None"),
        ("def f(x): return {'a': 1}", f32s(), Some(0), "got a value of type `dict`"),
        ("def f(x): return 'text'", f32s(), Some(0), "got a value of type `str`"),
        ("def f(x): return x.astype(np.float64)", f32s(), Some(0), "expected dtype f32, got a NumPy array of dtype float64"),
        ("def f(x): return np.array([1, 'a'], dtype=object)", f32s(), Some(0), "object arrays are not tensors"),
        ("def f(x): return np.zeros(2, dtype=[('a', 'f4')])", f32s(), Some(0), "structured arrays are not tensors"),
        ("def f(x): return np.float64(1.0)", f32s(), Some(0), "expected dtype f32, got a NumPy array of dtype float64"),
        ("def f(x): return 0.5", i64s.clone(), Some(0), "the float 0.5 does not fit dtype i64 exactly"),
        ("def f(x): return 256", u8s.clone(), Some(0), "the int 256 does not fit dtype u8 exactly"),
        ("def f(x): return -1", u8s, Some(0), "the int -1 does not fit dtype u8 exactly"),
        ("def f(x): return -1e19", i64s.clone(), Some(0), "the float -1e19 does not fit dtype i64 exactly"),
        ("def f(x): return 2**70", i64s.clone(), Some(0), "does not fit any tensor dtype"),
        ("def f(x): return [[1, 2], [3]]", i64s.clone(), Some(0), "ragged nested list"),
        ("def f(x): return [1, 'a']", i64s, Some(0), "expected numbers, got a value of type `str`"),
        ("def f(x): return np.zeros((2, 2), np.float32)", vec![OutSpec::shaped(DType::F32, [Some(2), Some(3)])], Some(0), "expected shape f32[2, 3], got shape [2, 2]"),
        ("def f(x): return np.zeros(3, np.float32)", vec![OutSpec::shaped(DType::F32, [])], Some(0), "expected shape f32[], got shape [3]"),
    ];
    for (code, tout, index, message) in cases {
        let err = op(code, &tout).call(&[Arg::from(&x)]).expect_err(code);
        assert_eq!(err.kind(), ErrorKind::OutputMismatch, "{code}: {err}");
        assert_eq!(err.op(), Some("rule"), "{code}");
        assert_eq!(err.index(), index, "{code}: {err}");
        assert!(err.to_string().contains(message), "{code}: {err}");
        assert!(err.to_string().starts_with("op `rule`: "), "{code}: {err}");
    }
}

pub fn python_exceptions_keep_kind_message_and_traceback(op: Make<'_>) {
    let x = Tensor::new(&[1f32], &cpu()).unwrap();
    for (raise, kind, exception) in [
        (
            "raise ValueError('bad value')",
            ErrorKind::InvalidArgument,
            "ValueError",
        ),
        (
            "raise TypeError('bad type')",
            ErrorKind::InvalidArgument,
            "TypeError",
        ),
        (
            "raise StopIteration('done')",
            ErrorKind::OutOfRange,
            "StopIteration",
        ),
        (
            "raise MemoryError('full')",
            ErrorKind::ResourceExhausted,
            "MemoryError",
        ),
        (
            "raise NotImplementedError('later')",
            ErrorKind::Unimplemented,
            "NotImplementedError",
        ),
        ("raise KeyError('k')", ErrorKind::Unknown, "KeyError"),
        (
            "raise RuntimeError('boom')",
            ErrorKind::Unknown,
            "RuntimeError",
        ),
        (
            "raise KeyboardInterrupt()",
            ErrorKind::Cancelled,
            "KeyboardInterrupt",
        ),
        ("raise SystemExit(3)", ErrorKind::Cancelled, "SystemExit"),
    ] {
        let body = op(
            &format!("def inner():\n    {raise}\ndef f(x):\n    inner()"),
            &f32s(),
        );
        let err = body.call(&[Arg::from(&x)]).unwrap_err();
        assert_eq!(err.kind(), kind, "{raise}: {err}");
        assert_eq!(err.op(), Some("rule"));
        let pyop::Error::Python {
            exception: e,
            traceback,
            ..
        } = &err
        else {
            panic!("{err:?}")
        };
        assert_eq!(e, exception);
        assert_eq!(err.exception(), Some(exception));
        assert!(
            traceback.contains("Traceback (most recent call last)"),
            "{traceback}"
        );
        assert!(traceback.contains("in inner"), "{traceback}");
        assert!(traceback.contains("line 3, in inner"), "{traceback}");
    }
}
