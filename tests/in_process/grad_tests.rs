//! Registered gradients and any-arity ops in candle's autograd, checked with `pyop::gradcheck`.

use pyop::candle::{DType, Tensor, Var};
use pyop::{gradcheck, py_op, Arg, ErrorKind, GradCheck, GradientCall, OutSpec, PyOp};

use crate::common;
use common::{cpu, data_ptr};

fn f64s(v: &[f64]) -> Tensor {
    Tensor::new(v, &cpu()).unwrap()
}

#[py_op(file = "tests/py/special.py", numpy, tout = f64, grad = "erfcx_grad")]
fn erfcx(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn one_in_one_out_python_gradient() {
    let x = f64s(&[-1.5, -0.2, 0.0, 0.7, 2.5]);
    let report = gradcheck(|xs| Ok(vec![erfcx(&xs[0])?]), &[x], GradCheck::default()).unwrap();
    assert!(report.max_abs_error[0] < 1e-7, "{report:?}");
    // erfcx(0) = 1 exactly; d/dx at 0 = -2/sqrt(pi).
    let v = Var::new(&[0.0f64], &cpu()).unwrap();
    let y = erfcx(v.as_tensor()).unwrap();
    assert_eq!(y.to_vec1::<f64>().unwrap(), [1.0]);
    let g = y
        .backward()
        .unwrap()
        .get(&v)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert!((g[0] + 2.0 / std::f64::consts::PI.sqrt()).abs() < 1e-15);
}

/// One tracked matrix: its gradient comes back as a matrix, element for element the gradient of
/// the same values as a vector (mutation testing of `op/autograd/node.rs`: without the one-input
/// case of `pack_input_grads` the gradient came back flat and candle refused to add it).
#[test]
fn one_matrix_input_gets_a_matrix_gradient() {
    let values = [-1.5, -0.2, 0.0, 0.7, 2.5, 1.0];
    let grad_of = |x: &Tensor| {
        let v = Var::from_tensor(x).unwrap();
        let g = erfcx(&v).unwrap().sum_all().unwrap().backward().unwrap();
        g.get(&v).unwrap().clone()
    };
    let flat = grad_of(&f64s(&values));
    let matrix = grad_of(&f64s(&values).reshape((2, 3)).unwrap());
    assert_eq!(matrix.dims(), [2, 3]);
    assert_eq!(
        matrix.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        flat.to_vec1::<f64>().unwrap()
    );
}

#[py_op(file = "tests/py/special.py", numpy, tout = (f64, f32, i64), grad = "four_in_three_out_grad")]
fn four_in_three_out(
    a: &Tensor,
    b: &Tensor,
    n: &Tensor,
    d: &Tensor,
) -> pyop::Result<(Tensor, Tensor, Tensor)>;

fn mixed_inputs() -> Vec<Tensor> {
    vec![
        f64s(&[0.5, -1.0, 2.0]),
        Tensor::new(&[1.5f32, 0.25, -2.0], &cpu()).unwrap(),
        Tensor::new(&[1i64, 2, 3], &cpu()).unwrap(),
        f64s(&[0.1, 0.2, -0.3]),
    ]
}

#[test]
fn four_in_three_out_with_mixed_dtypes() {
    let f = |xs: &[Tensor]| -> pyop::Result<Vec<Tensor>> {
        let (y0, y1, y2) = four_in_three_out(&xs[0], &xs[1], &xs[2], &xs[3])?;
        assert_eq!(
            (y0.dtype(), y1.dtype(), y2.dtype()),
            (DType::F64, DType::F32, DType::I64)
        );
        assert!(!y2.track_op(), "integer outputs are not tracked");
        Ok(vec![y0, y1, y2])
    };
    // The f32 input limits the precision of the differences.
    let tol = GradCheck::default().eps(1e-3).atol(2e-3).rtol(1e-3);
    gradcheck(f, &mixed_inputs(), tol).unwrap();
    // Gradients come back in each input's own dtype; the integer input gets none.
    let vars: Vec<Var> = mixed_inputs()
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let (y0, y1, _) = four_in_three_out(&vars[0], &vars[1], &vars[2], &vars[3]).unwrap();
    let grads = (y0.sum_all().unwrap() + y1.to_dtype(DType::F64).unwrap().sum_all().unwrap())
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(grads.get(&vars[0]).unwrap().dtype(), DType::F64);
    assert_eq!(grads.get(&vars[1]).unwrap().dtype(), DType::F32);
    assert!(grads.get(&vars[2]).is_none());
    assert_eq!(
        grads.get(&vars[1]).unwrap().to_vec1::<f32>().unwrap(),
        [3.5, 2.0, 5.0]
    );
}

#[test]
fn a_loss_using_only_some_outputs() {
    let only_second = |xs: &[Tensor]| -> pyop::Result<Vec<Tensor>> {
        Ok(vec![four_in_three_out(&xs[0], &xs[1], &xs[2], &xs[3])?.1])
    };
    let tol = GradCheck::default().eps(1e-3).atol(2e-3).rtol(1e-3);
    gradcheck(only_second, &mixed_inputs(), tol).unwrap();
    let only_first = |xs: &[Tensor]| -> pyop::Result<Vec<Tensor>> {
        Ok(vec![four_in_three_out(&xs[0], &xs[1], &xs[2], &xs[3])?.0])
    };
    gradcheck(only_first, &mixed_inputs(), tol).unwrap();
}

#[py_op(code = "def mul(x, y):\n    return x * y\ndef mul_grad(inputs, outputs, grads):\n    (x, y), (g,) = inputs, grads\n    return g * y, g * x", numpy, tout = f64, grad = "mul_grad")]
fn mul(x: &Tensor, y: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn the_same_input_passed_twice() {
    let x = f64s(&[1.5, -2.0, 0.25]);
    gradcheck(
        |xs| Ok(vec![mul(&xs[0], &xs[0])?]),
        &[x],
        GradCheck::default(),
    )
    .unwrap();
    let v = Var::new(&[3.0f64], &cpu()).unwrap();
    let g = mul(&v, &v).unwrap().backward().unwrap();
    assert_eq!(g.get(&v).unwrap().to_vec1::<f64>().unwrap(), [6.0]);
}

#[py_op(file = "tests/py/special.py", numpy, tout = f64, grad = "weighted_grad")]
fn weighted(xs: &[Tensor], w: f64) -> pyop::Result<Tensor>;

#[test]
fn list_arguments_take_a_tuple_of_gradients() {
    let inputs = vec![f64s(&[1.0, 2.0]), f64s(&[3.0, -1.0]), f64s(&[0.5, 0.5])];
    let report = gradcheck(
        |xs| Ok(vec![weighted(xs, 2.5)?]),
        &inputs,
        GradCheck::default(),
    )
    .unwrap();
    assert_eq!(report.max_abs_error.len(), 3);
}

/// d(a·b·c·d)/d… written in candle.
fn product_grad(call: &GradientCall<'_>) -> pyop::Result<Vec<Option<Tensor>>> {
    let ts: Vec<&Tensor> = call
        .args
        .iter()
        .filter_map(|a| match a {
            Arg::Tensor(t) => Some(*t),
            _ => None,
        })
        .collect();
    assert_eq!(call.outputs.len(), 3);
    let g = &call.grads;
    let mut out = Vec::new();
    for i in 0..4 {
        let mut others: Option<Tensor> = None;
        for (j, t) in ts.iter().enumerate() {
            if j != i {
                others = Some(match others {
                    None => (*t).clone(),
                    Some(o) => (o * *t)?,
                });
            }
        }
        let others = others.unwrap();
        // outputs: p, 2p, p + a  → dL/dx_i = (g0 + 2 g1 + g2) ∂p/∂x_i + [i == 0] g2
        let mut gi = ((&g[0] + (&g[1] * 2.0)?)? + &g[2])?.mul(&others)?;
        if i == 0 {
            gi = (gi + &g[2])?;
        }
        out.push(Some(gi));
    }
    Ok(out)
}

#[py_op(code = "def product(a, b, c, d):\n    p = a * b * c * d\n    return p, 2 * p, p + a", numpy, tout = (f32, f32, f32), grad = product_grad)]
fn product(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    d: &Tensor,
) -> pyop::Result<(Tensor, Tensor, Tensor)>;

#[test]
fn a_rust_gradient() {
    let inputs: Vec<Tensor> = [[1.5f64, -0.5], [2.0, 0.25], [-1.0, 3.0], [0.5, 0.75]]
        .iter()
        .map(|v| {
            Tensor::new(v, &cpu())
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
        })
        .collect();
    let f = |xs: &[Tensor]| -> pyop::Result<Vec<Tensor>> {
        let (p, q, r) = product(&xs[0], &xs[1], &xs[2], &xs[3])?;
        Ok(vec![p, q, r])
    };
    gradcheck(
        f,
        &inputs,
        GradCheck::default().eps(1e-2).atol(1e-2).rtol(1e-2),
    )
    .unwrap();
}

fn panicking_grad(_: &GradientCall<'_>) -> pyop::Result<Vec<Option<Tensor>>> {
    panic!("gradient exploded on purpose")
}

#[py_op(code = "def p(x):\n    return x", numpy, name = "p", tout = f64, grad = panicking_grad)]
fn panics_in_backward(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn a_panicking_rust_gradient_is_an_error() {
    let v = Var::new(&[1.0f64], &cpu()).unwrap();
    let err = panics_in_backward(&v).unwrap().backward().unwrap_err();
    let err = pyop::Error::from(err);
    assert_eq!(err.kind(), ErrorKind::Panic);
    assert!(
        err.to_string().contains("gradient exploded on purpose"),
        "{err}"
    );
    // The executor keeps working.
    let g = panics_in_backward(&v).unwrap();
    assert_eq!(g.to_vec1::<f64>().unwrap(), [1.0]);
}

#[py_op(code = r#"
import pyop
def hard_clip(x):
    return x.clamp(-1, 1)
def straight_through(inputs, outputs, grads):
    return grads[0]
"#, tout = f64, grad = "straight_through")]
fn hard_clip(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn a_tensor_mode_gradient_overrides_autograd() {
    let v = Var::new(&[-3.0f64, 0.5, 2.0], &cpu()).unwrap();
    let y = hard_clip(&v).unwrap();
    assert_eq!(y.to_vec1::<f64>().unwrap(), [-1.0, 0.5, 1.0]);
    let g = y.sum_all().unwrap().backward().unwrap();
    // autograd would give [0, 1, 0]; the registered straight-through gradient gives ones.
    assert_eq!(
        g.get(&v).unwrap().to_vec1::<f64>().unwrap(),
        [1.0, 1.0, 1.0]
    );
}

#[py_op(code = "def no_grad(x):\n    return x * 2", numpy, tout = f64)]
fn no_grad(x: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn a_numpy_op_without_gradient_fails_in_backward() {
    let v = Var::new(&[1.0f64, 2.0], &cpu()).unwrap();
    let y = no_grad(&v).unwrap(); // forward is fine
    assert_eq!(y.to_vec1::<f64>().unwrap(), [2.0, 4.0]);
    let err = pyop::Error::from(y.sum_all().unwrap().backward().unwrap_err());
    assert_eq!(err.kind(), ErrorKind::NoGradient);
    assert_eq!(err.op(), Some("no_grad"));
    assert!(
        err.to_string()
            .contains("declare one with `grad = \"python_function\"`"),
        "{err}"
    );
}

#[test]
fn nothing_extra_without_tracked_inputs() {
    #[py_op(code = "def same(x):\n    return x\ndef same_grad(i, o, g):\n    return g[0]", numpy, tout = f64, grad = "same_grad")]
    fn same(x: &Tensor) -> pyop::Result<Tensor>;
    let x = f64s(&[1.0, 2.0, 3.0]);
    let y = same(&x).unwrap();
    assert!(!y.track_op(), "no graph node");
    assert_eq!(data_ptr(&y), data_ptr(&x), "no copy");
    let v = Var::from_tensor(&x).unwrap();
    let y = same(&v).unwrap();
    assert!(y.track_op(), "a tracked input gets a node");
}

#[py_op(file = "tests/py/special.py", numpy, tout = f64, grad = "wrong_shape_grad")]
fn wrong_shape(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(file = "tests/py/special.py", numpy, tout = f64, grad = "wrong_count_grad")]
fn wrong_count(x: &Tensor, y: &Tensor) -> pyop::Result<Tensor>;

#[test]
fn gradient_results_are_checked() {
    let v = Var::new(&[1.0f64, 2.0], &cpu()).unwrap();
    let err = pyop::Error::from(
        wrong_shape(&v)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap_err(),
    );
    assert_eq!(err.kind(), ErrorKind::GradientMismatch);
    assert_eq!(err.op(), Some("wrong_shape"));
    assert!(
        err.to_string()
            .contains("gradient 0: expected shape f64[2], got shape [3]"),
        "{err}"
    );
    let err = pyop::Error::from(
        wrong_count(&v, &v)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap_err(),
    );
    assert_eq!(err.kind(), ErrorKind::GradientMismatch);
    assert!(
        err.to_string()
            .contains("expected 2 gradients (one per tensor argument), got 1"),
        "{err}"
    );
}

#[test]
fn gradcheck_catches_a_wrong_gradient() {
    let op = PyOp::builder("bad")
        .code("def bad(x):\n    return x * x\ndef bad_grad(i, o, g):\n    return g[0] * i[0]")
        .numpy()
        .tout([OutSpec::new(DType::F64)])
        .gradient("bad_grad")
        .build()
        .unwrap();
    let err = gradcheck(
        |xs| op.call(&[Arg::from(&xs[0])]),
        &[f64s(&[1.0, 2.0])],
        GradCheck::default(),
    )
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::GradientMismatch);
    assert_eq!(err.op(), Some("bad"));
    // In gradient units: d(x²)/dx at 1 is 2; the wrong gradient gives 1.
    let text = err.to_string();
    assert!(
        text.contains(
            "d(output 0[0])/d(input 0[0]): analytic gradient 1 but finite differences give "
        ),
        "{text}"
    );
    let numeric: f64 = text
        .split("finite differences give ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!((numeric - 2.0).abs() < 1e-6, "{text}");
    assert!(
        text.contains("step eps = 0.000001; |difference| ")
            && text.contains("> atol = 0.00001 + rtol = 0.001 × |finite difference|; the gradient of op `bad` ran for it)"),
        "{text}"
    );
}

/// The tolerances are those of the narrowest dtype involved, an output's too: a right gradient
/// through an f32 output of f64 inputs passes (it was a mismatch at f64's tolerances); and a step
/// that rounds away in the input's dtype is said to, not blamed on the gradient.
#[test]
fn gradcheck_compares_at_the_precision_it_has() {
    let x = f64s(&[0.3, 1.1]);
    gradcheck(
        |xs| Ok(vec![xs[0].to_dtype(DType::F32)?.sin()?]),
        &[x],
        GradCheck::default(),
    )
    .unwrap();
    let x = f64s(&[300.0, 1000.0]).to_dtype(DType::F16).unwrap();
    let err = gradcheck(|xs| Ok(vec![(&xs[0] * 2.0)?]), &[x], GradCheck::default()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidArgument);
    assert!(
        err.to_string()
            .contains("input 0[0] = 300: the step eps = 0.01 rounds away in f16"),
        "{err}"
    );
}

/// Each Jacobian entry is checked on its own: a gradient that is right for the first output and
/// wrong for the second is caught at the second, in that output's units.
#[test]
fn gradcheck_names_the_output_and_element() {
    let op = PyOp::builder("two")
        .code(
            "def two(x):\n    return x * 2, x * x\n\
             def two_grad(i, o, g):\n    return g[0] * 2 + g[1] * 3 * i[0]",
        )
        .numpy()
        .tout([OutSpec::new(DType::F64), OutSpec::new(DType::F64)])
        .gradient("two_grad")
        .build()
        .unwrap();
    let err = gradcheck(
        |xs| op.call(&[Arg::from(&xs[0])]),
        &[f64s(&[1.0, 2.0])],
        GradCheck::default(),
    )
    .unwrap_err();
    let text = err.to_string();
    // Output 0 is right (2 everywhere); output 1 at x = 1: analytic 3 but d(x²)/dx = 2.
    assert!(
        text.contains("d(output 1[0])/d(input 0[0]): analytic gradient 3 but"),
        "{text}"
    );
}
fn mismatched_grad(_: &GradientCall<'_>) -> pyop::Result<Vec<Option<Tensor>>> {
    let a = Tensor::zeros(2, DType::F64, &cpu())?;
    let b = Tensor::zeros(3, DType::F64, &cpu())?;
    Ok(vec![Some((a + b)?)])
}

#[py_op(code = "def q(x):\n    return x", numpy, name = "q", tout = f64, grad = mismatched_grad)]
fn candle_error_in_backward(x: &Tensor) -> pyop::Result<Tensor>;

/// A candle error on an op's call path (here its Rust gradient) is of kind `Candle` and names
/// the op.
#[test]
fn candle_errors_name_the_op() {
    let v = Var::new(&[1.0f64, 2.], &cpu()).unwrap();
    let err = candle_error_in_backward(&v)
        .unwrap()
        .backward()
        .unwrap_err();
    let err = pyop::Error::from(err);
    assert_eq!(err.kind(), ErrorKind::Candle, "{err}");
    let text = err.to_string();
    assert!(
        text.starts_with("op `candle_error_in_backward`: "),
        "{text}"
    );
    assert!(text.contains("shape mismatch"), "{text}");
}

/// d(x·Σxs + Σys²)/d… written in candle from the gradient call's arguments: the tensor and
/// both lists as the call gives them.
fn mixed_grad(call: &GradientCall<'_>) -> pyop::Result<Vec<Option<Tensor>>> {
    let (x, xs, ys) = match call.args {
        [Arg::Tensor(x), Arg::Tensors(xs), Arg::Tensors(ys)] => (*x, *xs, *ys),
        other => panic!("arguments {other:?}"),
    };
    let g = &call.grads[0];
    let sum_xs = xs[1..].iter().try_fold(xs[0].clone(), |a, t| a + t)?;
    let mut out = vec![Some(g.mul(&sum_xs)?)];
    for _ in xs {
        out.push(Some(g.mul(x)?));
    }
    for y in ys {
        out.push(Some((g.mul(y)? * 2.0)?));
    }
    Ok(out)
}

#[py_op(code = "def mixed(x, xs, ys):\n    return x * sum(xs) + sum(y * y for y in ys)\n", numpy, tout = f64, grad = mixed_grad)]
fn mixed(x: &Tensor, xs: &[Tensor], ys: &[Tensor]) -> pyop::Result<Tensor>;

/// A tensor, then two lists: a Rust gradient gets each list as its own slice, made of the right
/// inputs (mutation testing of `op/autograd/backward.rs`, `tensor_lists`: an offset that skipped
/// the tensor, or the first list, went unnoticed).
#[test]
fn a_tensor_and_two_lists_reach_the_gradient_as_themselves() {
    let inputs = vec![
        f64s(&[1.5, -2.0]),
        f64s(&[3.0, -1.0]),
        f64s(&[0.5, 0.25]),
        f64s(&[-0.75, 2.0]),
        f64s(&[1.25, -3.5]),
    ];
    let report = gradcheck(
        |t| Ok(vec![mixed(&t[0], &t[1..3], &t[3..5])?]),
        &inputs,
        GradCheck::default(),
    )
    .unwrap();
    assert_eq!(report.max_abs_error.len(), 5);
}

/// A Rust gradient of the wrong shape and one of the wrong dtype (each right in the other).
fn misshapen_grad(call: &GradientCall<'_>) -> pyop::Result<Vec<Option<Tensor>>> {
    let x = match call.args {
        [Arg::Tensor(x)] => *x,
        other => panic!("arguments {other:?}"),
    };
    let wrong = if x.dims() == [2] {
        Tensor::zeros(3, x.dtype(), x.device())?
    } else {
        x.to_dtype(DType::F32)?
    };
    Ok(vec![Some(wrong)])
}

#[py_op(code = "def m(x):\n    return x", numpy, name = "m", tout = f64, grad = misshapen_grad)]
fn misshapen(x: &Tensor) -> pyop::Result<Tensor>;

/// A Rust gradient is checked as a Python one is: its shape and its dtype, each on its own
/// (mutation testing of `op/autograd/backward.rs`, `check_rust`: `||` → `&&` let either pass).
#[test]
fn rust_gradients_are_checked_for_shape_and_dtype() {
    for (x, want) in [
        (f64s(&[1.0, 2.0]), "gradient 0: expected f64[2], got f64[3]"),
        (
            f64s(&[1.0, 2.0, 3.0]),
            "gradient 0: expected f64[3], got f32[3]",
        ),
    ] {
        let v = Var::from_tensor(&x).unwrap();
        let err = pyop::Error::from(
            misshapen(&v)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap_err(),
        );
        assert_eq!(err.kind(), ErrorKind::GradientMismatch);
        assert!(err.to_string().contains(want), "{err}");
    }
}

/// A numpy-mode op with a registered gradient whose tracked input is a broadcast too large to
/// copy (2^40 elements of one), returned as it is: both are views, but autograd packs the
/// tracked inputs and float outputs into one buffer, and that copy is refused before it is made,
/// as a `MemoryError` naming the size (mutation testing of `alloc.rs`: `Refusal`'s Display
/// emptied went unnoticed; no test reached this check).
#[test]
fn inputs_and_outputs_too_large_to_pack_for_the_gradient_are_refused_with_their_size() {
    let huge = PyOp::builder("huge_same")
        .code("def huge_same(x):\n    return x\ndef huge_same_grad(x, y, dy):\n    return dy")
        .numpy()
        .gradient("huge_same_grad")
        .tout([OutSpec::new(DType::F32)])
        .build()
        .unwrap();
    let x = Var::new(&[1f32], &cpu()).unwrap();
    let wide = x.as_tensor().broadcast_as(1usize << 40).unwrap();
    let err = huge.call(&[Arg::from(&wide)]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ResourceExhausted, "{err}");
    assert!(
        err.to_string().contains(
            "MemoryError: the tracked inputs and float outputs, packed for the gradient: \
             Unable to allocate 8192.00 GiB"
        ),
        "{err}"
    );
}
