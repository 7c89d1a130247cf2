//! Pools whose workers are Ray actors: what such a pool is asked for (plain data). The driver,
//! which needs the interpreter, is `bridge::ray`; the pool's counters are the pool's own.

/// A pool whose workers are actors on a [Ray](https://docs.ray.io) cluster, for bodies that need
/// more cores than one machine has: [`WorkerPool::ray`](crate::WorkerPool::ray).
///
/// The program's interpreter is the Ray driver (`ray.init`, the first time a call needs the
/// pool); each actor is a Python process on some node of the cluster that loads the op's source
/// the program sends it (no `.py` file is needed on the nodes) and runs one call at a time. The
/// nodes need the program's Python X.Y, NumPy and Ray versions, and whatever the bodies import.
///
/// ```no_run
/// use pyop::{RayPool, WorkerPool};
///
/// // 8 actors on the cluster whose head `ray start --head` started at 10.0.0.5.
/// let pool = WorkerPool::ray(RayPool::new(8).address("10.0.0.5:6379"));
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct RayPool {
    /// The cluster: its head's `host:port` (what `ray start --head` prints), `"auto"` (the
    /// cluster this machine is part of), or `"ray://host:10001"` (Ray Client). `None`: Ray's
    /// own choice (`RAY_ADDRESS`, else the cluster Ray last started on this machine, else a
    /// one-machine cluster started for the program).
    pub address: Option<String>,
    /// How many actors the pool runs at most (each runs one call at a time).
    pub actors: usize,
    /// The CPUs each actor reserves on its node (Ray's `num_cpus`).
    pub num_cpus: f64,
    /// Custom resources each actor reserves (Ray's `resources`, e.g. `("preprocess", 1.0)` for
    /// nodes started with `--resources='{"preprocess": 4}'`).
    pub resources: Vec<(String, f64)>,
    /// The Ray namespace the driver joins (the first Ray pool used sets it for the program).
    pub namespace: String,
}

impl RayPool {
    /// At most `actors` actors (at least one), each reserving one CPU, on Ray's default cluster.
    pub fn new(actors: usize) -> RayPool {
        RayPool {
            address: None,
            actors: actors.max(1),
            num_cpus: 1.0,
            resources: Vec::new(),
            namespace: "pyop".to_owned(),
        }
    }

    /// The cluster to join (see [`address`](RayPool::address)).
    pub fn address(mut self, address: impl Into<String>) -> RayPool {
        self.address = Some(address.into());
        self
    }

    /// The CPUs each actor reserves (fractions allowed).
    pub fn num_cpus(mut self, cpus: f64) -> RayPool {
        self.num_cpus = cpus;
        self
    }

    /// A custom resource each actor reserves.
    pub fn resource(mut self, name: impl Into<String>, amount: f64) -> RayPool {
        self.resources.push((name.into(), amount));
        self
    }

    /// The named pool `name` of `size` as the environment says: a Ray pool when `PYOP_RAY_POOLS`
    /// lists it (comma-separated names, or `*` for every named pool), on the cluster at
    /// `PYOP_RAY_ADDRESS` (Ray's own choice when unset), with `size` actors.
    pub(crate) fn from_env(name: &str, size: usize) -> Option<RayPool> {
        let pools = std::env::var("PYOP_RAY_POOLS").ok()?;
        if !listed(&pools, name) {
            return None;
        }
        let pool = RayPool::new(size);
        Some(match std::env::var("PYOP_RAY_ADDRESS") {
            Ok(a) if !a.trim().is_empty() => pool.address(a.trim()),
            _ => pool,
        })
    }
}

/// Whether `PYOP_RAY_POOLS`' value `pools` names the pool `name`.
fn listed(pools: &str, name: &str) -> bool {
    pools
        .split(',')
        .map(str::trim)
        .any(|p| p == "*" || p == name)
}

/// Where an actor of a Ray pool runs (for [`WorkerPool::ray_actors`](crate::WorkerPool::ray_actors)).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RayActor {
    /// The pool's number for it (as a worker's, in errors and traces).
    pub id: u64,
    /// Its process on its node.
    pub pid: u32,
    /// Its node's Ray id.
    pub node: String,
    /// Its node's address.
    pub ip: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_are_listed_by_name_or_all() {
        assert!(listed("text, images", "images"));
        assert!(listed("*", "anything"));
        assert!(!listed("text", "tex"));
        assert!(!listed("", "text"));
    }
}
