//! Tests that run on every available device: the CPU always, CUDA with `--features cuda` (as
//! `scripts/gpu-check.sh` does on a GPU machine).

use pyop::candle::{Device, Tensor, Var};
use pyop::py_op;

type Result<T = ()> = pyop::Result<T>;

/// `test_device!(f)` makes `f::cpu` and, with the `cuda` feature, `f::cuda` from `fn f(&Device)`.
macro_rules! test_device {
    ($f:ident) => {
        mod $f {
            #[test]
            fn cpu() -> super::Result {
                super::$f(&pyop::candle::Device::Cpu)
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() -> super::Result {
                super::$f(&pyop::candle::Device::new_cuda(0)?)
            }
        }
    };
}

fn on(device: &Device, v: &[f32]) -> Result<Tensor> {
    Ok(Tensor::new(v, device)?)
}

fn assert_on(t: &Tensor, device: &Device) {
    assert!(
        t.device().same_device(device),
        "{:?} is not on {:?}",
        t.device().location(),
        device.location()
    );
}

#[py_op(code = r#"
import pyop
def mixed(x):
    made = pyop.tensor([1.0, 2.0, 3.0]) + pyop.zeros(3) + pyop.ones_like(x)
    return x * 2 + made + 0.5, x.sum()
"#, tout = (f32, f32))]
fn mixed(x: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

fn tensor_mode_runs_on_the_tensors_device(device: &Device) -> Result {
    let x = on(device, &[1., 2., 3.])?;
    let (y, s) = mixed(&x)?;
    assert_on(&y, device);
    assert_on(&s, device);
    assert_eq!(y.to_vec1::<f32>()?, [4.5, 7.5, 10.5]);
    assert_eq!(s.to_scalar::<f32>()?, 6.0);
    Ok(())
}
test_device!(tensor_mode_runs_on_the_tensors_device);

#[py_op(code = "def loss(x, w):\n    h = (x @ w).tanh()\n    return (h * h).sum()", tout = f32)]
fn loss(x: &Tensor, w: &Tensor) -> pyop::Result<Tensor>;

fn gradients_flow_on_the_device(device: &Device) -> Result {
    let x = Tensor::new(&[[0.5f32, -1.0], [2.0, 0.25]], device)?;
    let w = Var::from_tensor(&Tensor::new(&[[0.1f32], [0.3]], device)?)?;
    let y = loss(&x, &w)?;
    let g = y.backward()?.get(&w).expect("w is used").clone();
    assert_on(&g, device);
    // Against candle computing the same thing directly.
    let h = x.matmul(&w)?.tanh()?;
    let want = (&h * &h)?
        .sum_all()?
        .backward()?
        .get(&w)
        .expect("used")
        .to_vec2::<f32>()?;
    assert_eq!(g.to_vec2::<f32>()?, want);
    Ok(())
}
test_device!(gradients_flow_on_the_device);

#[py_op(code = "def twice(x):\n    return x * 2", numpy, tout = f32)]
fn twice(x: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "import numpy as np\ndef plus1(x, out=None):\n    return np.add(x, np.float32(1), out=out)", numpy, tout = f32[x])]
fn plus1(x: &Tensor) -> pyop::Result<Tensor>;

fn numpy_mode_copies_through_the_host(device: &Device) -> Result {
    let x = on(device, &[1., 2., 3.])?;
    let y = twice(&x)?;
    assert_on(&y, device);
    assert_eq!(y.to_vec1::<f32>()?, [2., 4., 6.]);
    let z = plus1(&x)?;
    assert_on(&z, device);
    assert_eq!(z.to_vec1::<f32>()?, [2., 3., 4.]);
    Ok(())
}
test_device!(numpy_mode_copies_through_the_host);

#[py_op(code = "def cube(x):\n    return x ** 3\ndef cube_grad(i, o, g):\n    return g[0] * 3 * i[0] ** 2", numpy, tout = f32, grad = "cube_grad")]
fn cube(x: &Tensor) -> pyop::Result<Tensor>;

fn registered_gradients_on_the_device(device: &Device) -> Result {
    let x = Var::from_tensor(&on(device, &[1., -2.])?)?;
    let y = cube(&x)?;
    assert_on(&y, device);
    let g = y.sum_all()?.backward()?.get(&x).expect("used").clone();
    assert_on(&g, device);
    assert_eq!(g.to_vec1::<f32>()?, [3., 12.]);
    Ok(())
}
test_device!(registered_gradients_on_the_device);

#[py_op(code = "import pyop\ndef filled(n):\n    return pyop.full((n,), 7.0)", tout = f32)]
fn filled(n: i64, device: &Device) -> pyop::Result<Tensor>;

fn a_device_parameter_places_outputs(device: &Device) -> Result {
    let t = filled(3, device)?;
    assert_on(&t, device);
    assert_eq!(t.to_vec1::<f32>()?, [7., 7., 7.]);
    Ok(())
}
test_device!(a_device_parameter_places_outputs);

#[py_op(code = "def echo(x):\n    return x", tout = f32)]
fn echo(x: &Tensor, device: &Device) -> pyop::Result<Tensor>;

#[py_op(code = "def echo(x):\n    return x", name = "echo", numpy, tout = f32)]
fn echo_numpy(x: &Tensor) -> pyop::Result<Tensor>;

/// An input handed back unchanged goes to the op's device: numpy mode's host view of a device
/// tensor, and a CPU input of an op whose `&Device` is another (taken as it is by the output
/// check, then moved by its one device check).
fn an_input_handed_back_goes_to_the_ops_device(device: &Device) -> Result {
    let y = echo_numpy(&on(device, &[1., 2.])?)?;
    assert_on(&y, device);
    assert_eq!(y.to_vec1::<f32>()?, [1., 2.]);
    let z = echo(&on(&Device::Cpu, &[1., 2.])?, device)?;
    assert_on(&z, device);
    assert_eq!(z.to_vec1::<f32>()?, [1., 2.]);
    Ok(())
}
test_device!(an_input_handed_back_goes_to_the_ops_device);

#[cfg(feature = "cuda")]
#[test]
fn inputs_on_two_devices_are_an_error() -> Result {
    let a = on(&Device::Cpu, &[1.])?;
    let b = on(&Device::new_cuda(0)?, &[1.])?;
    #[py_op(code = "def add(a, b):\n    return a + b", tout = f32)]
    fn add(a: &Tensor, b: &Tensor) -> pyop::Result<Tensor>;
    let err = add(&a, &b).unwrap_err();
    assert_eq!(err.kind(), pyop::ErrorKind::DeviceMismatch);
    assert!(
        err.to_string().contains("inputs are on different devices"),
        "{err}"
    );
    Ok(())
}
