//! The device tensors made inside a body land on: the running op's, per thread.

use std::cell::RefCell;

use candle_core::Device;

thread_local! {
    /// The devices of the op calls running on this thread, innermost last.
    static DEVICES: RefCell<Vec<Device>> = const { RefCell::new(Vec::new()) };
}

/// While alive, `pyop.tensor`, `zeros`, … on this thread make tensors on `device`.
pub(crate) struct DeviceScope(());

impl DeviceScope {
    pub(crate) fn enter(device: &Device) -> Self {
        DEVICES.with(|d| d.borrow_mut().push(device.clone()));
        DeviceScope(())
    }
}

impl Drop for DeviceScope {
    fn drop(&mut self) {
        DEVICES.with(|d| d.borrow_mut().pop());
    }
}

pub(crate) fn current_device() -> Device {
    DEVICES
        .with(|d| d.borrow().last().cloned())
        .unwrap_or(Device::Cpu)
}
