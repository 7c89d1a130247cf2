//! Which ops' gradients a backward pass ran, for `gradcheck`'s messages: a thread-local list,
//! kept only while [`gradients_run`] runs (candle's backward runs on the caller's thread).

thread_local! {
    /// The ops whose gradient ran on this thread since [`gradients_run`] began, while it runs.
    static GRADIENTS_RUN: std::cell::RefCell<Option<Vec<String>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` (a backward pass) and names the ops whose gradient it ran, each once, in order.
pub(crate) fn gradients_run<R>(f: impl FnOnce() -> R) -> (R, Vec<String>) {
    /// Puts back what an enclosing recording had, also when `f` panics.
    struct Restore(Option<Vec<String>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            let _ = GRADIENTS_RUN.try_with(|g| *g.borrow_mut() = outer);
        }
    }
    // On a thread whose thread-locals are gone (a backward pass run by a thread-local
    // destructor) nothing is recorded: never a panic, which would abort the process there.
    let restore = Restore(
        GRADIENTS_RUN
            .try_with(|g| g.borrow_mut().replace(Vec::new()))
            .ok()
            .flatten(),
    );
    let r = f();
    let ran = GRADIENTS_RUN
        .try_with(|g| g.borrow_mut().take())
        .ok()
        .flatten();
    drop(restore);
    (r, ran.unwrap_or_default())
}

pub(super) fn note_gradient_run(op: &str) {
    let _ = GRADIENTS_RUN.try_with(|g| {
        if let Some(ran) = g.borrow_mut().as_mut() {
            if !ran.iter().any(|r| r == op) {
                ran.push(op.to_owned());
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::{gradients_run, note_gradient_run};

    #[test]
    fn each_op_once_in_order_and_nested_recordings_keep_the_outer() {
        let ((), outer) = gradients_run(|| {
            note_gradient_run("a");
            let ((), inner) = gradients_run(|| {
                note_gradient_run("c");
            });
            assert_eq!(inner, ["c"]);
            note_gradient_run("b");
            note_gradient_run("a");
        });
        assert_eq!(outer, ["a", "b"]);
        // Nothing is recorded outside a recording.
        note_gradient_run("d");
        let ((), none) = gradients_run(|| {});
        assert!(none.is_empty());
    }
}
