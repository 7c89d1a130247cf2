use pyop::{py_op, Tensor};

// `dlpack` is numpy mode's option: tensor mode already passes DLPack producers.
#[py_op(code = "def f(x): return x", dlpack, tout = f32)]
fn f(x: &Tensor) -> pyop::Result<Tensor>;

// Worker processes cannot reach the op's device.
#[py_op(code = "def g(x): return x", numpy, dlpack, workers = 2, tout = f32)]
fn g(x: &Tensor) -> pyop::Result<Tensor>;

// DLPack carries bf16 (this one is fine) but not fp8.
#[py_op(code = "def h(x): return x, x", numpy, dlpack, tout = (bf16, f8e4m3))]
fn h(x: &Tensor) -> pyop::Result<(Tensor, Tensor)>;

// A flag takes no value.
#[py_op(code = "def k(x): return x", numpy, dlpack = true, tout = f32)]
fn k(x: &Tensor) -> pyop::Result<Tensor>;

fn main() {}
