//! The device tensors made inside a body land on: the running op's, per thread.

use std::cell::RefCell;

use candle_core::Device;

thread_local! {
    /// The devices of the op calls running on this thread, innermost last.
    static DEVICES: RefCell<Vec<Device>> = const { RefCell::new(Vec::new()) };
}

/// While alive, `pyop.tensor`, `zeros`, … on this thread make tensors on `device`.
///
/// An op called from a thread-local destructor that runs after this thread's `DEVICES` is gone
/// has no scope: tensors a body makes land on the CPU (an op on the CPU, the usual case, sees no
/// difference; one on a GPU gets the CPU tensors its body made, which candle's device checks
/// refuse). Never a panic: a panic in a thread-local destructor aborts the process.
pub(crate) struct DeviceScope(bool);

impl DeviceScope {
    pub(crate) fn enter(device: &Device) -> Self {
        DeviceScope(
            DEVICES
                .try_with(|d| d.borrow_mut().push(device.clone()))
                .is_ok(),
        )
    }
}

impl Drop for DeviceScope {
    fn drop(&mut self) {
        if self.0 {
            let _ = DEVICES.try_with(|d| d.borrow_mut().pop());
        }
    }
}

/// Whether this thread is running a body (of any op): a call from here comes from Python.
pub(crate) fn in_body() -> bool {
    DEVICES
        .try_with(|d| !d.borrow().is_empty())
        .unwrap_or(false)
}

pub(crate) fn current_device() -> Device {
    DEVICES
        .try_with(|d| d.borrow().last().cloned())
        .ok()
        .flatten()
        .unwrap_or(Device::Cpu)
}
