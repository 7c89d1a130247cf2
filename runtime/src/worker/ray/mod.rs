//! Pools whose workers are Ray actors: what such a pool is asked for ([`RayPool`]), and how one
//! of its workers starts. Ray's whole part of pyop is in this folder: this file, the relay's
//! Python (`relay.py`, part of every worker's main loop) and the actor's (`actor.py`).
//!
//! The program's own interpreter never imports Ray. Each actor has a relay: a worker process of
//! the pool (forked from the zygote like any other) that joins the cluster as a Ray driver of
//! its own, starts the actor, and forwards the worker protocol's loads, calls, pings and unloads
//! to it, answering with the protocol's replies (its results copied into the shared memory the
//! program reads, as a worker's are). So Ray's threads, C++ statics, signal handlers, `sys.path`
//! and environment live only in processes pyop owns, and a Ray pool is a pool of workers like
//! any other: the same lease, time limits (the relay is killed, and Ray ends the actor with its
//! driver), counters and end with the program (the relay's guardian). ARCHITECTURE.md says why
//! this design and not an exit gate around a driver in the program.

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use super::exchange::RayActor;
use super::exchange::{Failure, Launch, StartError};
use super::process::Worker;
use super::protocol::{ActorPlace, ExcInfo, JoinStage, Reply, Request, Versions};

/// A pool whose workers are actors on a [Ray](https://docs.ray.io) cluster, for bodies that need
/// more cores than one machine has: [`WorkerPool::ray`](crate::WorkerPool::ray).
///
/// Each actor is a Python process on some node of the cluster that loads the op's source the
/// program sends it (no `.py` file is needed on the nodes) and runs one call at a time; its
/// relay, a process of pyop's on this machine, is its Ray driver, so the program itself never
/// imports Ray and nothing of Ray's (threads, signal handlers, `sys.path`) is in it. The nodes
/// need the program's Python X.Y, NumPy and Ray versions, and whatever the bodies import.
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
    /// cluster this machine is part of), or `"ray://host:10001"` (Ray Client). `None`:
    /// `RAY_ADDRESS`, else the cluster this machine is part of (`ray start --head` started
    /// one). pyop never starts a cluster itself: one started by a relay would end with it.
    pub address: Option<String>,
    /// How many actors the pool runs at most (each runs one call at a time).
    pub actors: usize,
    /// The CPUs each actor reserves on its node (Ray's `num_cpus`).
    pub num_cpus: f64,
    /// Custom resources each actor reserves (Ray's `resources`, e.g. `("preprocess", 1.0)` for
    /// nodes started with `--resources='{"preprocess": 4}'`).
    pub resources: Vec<(String, f64)>,
    /// The Ray namespace the actors are in.
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

/// The actor's code: what any process running bodies needs, then the actor class. The relay
/// sends it to Ray by value, so no node needs a file of pyop's.
const ACTOR_PY: &str = concat!(super::python::host_py!(), include_str!("python/actor.py"));
/// How long an actor may take to be placed, start and say where it runs.
const PLACE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a relay may take to import Ray and join the cluster, on top of placing its actor.
const JOIN_TIMEOUT: Duration = Duration::from_secs(90);
/// How long a failed join of a cluster is not tried again.
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// Starts worker `id` of the Ray pool `spec`: a relay, which joins the cluster and starts its
/// actor. Where the actor runs is the worker's `actor`.
pub(crate) fn start(id: u64, launch: &Launch, spec: &RayPool) -> Result<Worker, StartError> {
    recent_failure(spec)?;
    let env_address = std::env::var("RAY_ADDRESS").ok();
    if let Some(address) = spec.address.as_deref().or(env_address.as_deref()) {
        if address.trim() == "local" {
            return Err(StartError::Cluster(
                "the Ray address `local` would start a one-machine cluster in each actor's \
                 relay, ending with it: start one with `ray start --head` and use its address \
                 (or none, for the cluster this machine runs)"
                    .to_owned(),
            ));
        }
    }
    if let Some(address) = &spec.address {
        reachable(address)?;
    }
    // The relay computes nothing: one thread for its BLAS.
    let mut relay = Worker::start(id, launch, 1)?;
    let join = Request::Join {
        address: spec.address.as_deref(),
        namespace: &spec.namespace,
        num_cpus: spec.num_cpus,
        resources: &spec.resources,
        actor: ACTOR_PY,
        timeout: PLACE_TIMEOUT.as_secs_f64(),
    };
    let reply = relay.ask_once(&join, &[], JOIN_TIMEOUT + PLACE_TIMEOUT);
    let place = match reply {
        Ok(Reply::Joined { driver, actor }) => {
            let mut failed = FAILED.lock().unwrap_or_else(|e| e.into_inner());
            if failed.as_ref().is_some_and(|f| f.1 == spec.address) {
                *failed = None;
            }
            drop(failed);
            if let Some(why) = mismatch(&actor, &driver) {
                return Err(StartError::Cluster(why));
            }
            actor
        }
        Ok(Reply::JoinFailed { stage, exc }) => {
            let e = join_failed(launch, spec, id, stage, &exc);
            if stage == JoinStage::Connect {
                *FAILED.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((Instant::now(), spec.address.clone(), e.text().to_owned()));
            }
            return Err(e);
        }
        Ok(Reply::Raised { exc, .. }) => {
            return Err(StartError::Cluster(format!(
                "the relay of Ray actor {id} failed as it joined the cluster at {} ({}: {})\n{}",
                shown(&spec.address),
                exc.type_name,
                exc.message,
                exc.traceback.trim_end()
            )))
        }
        Ok(other) => {
            return Err(StartError::Cluster(format!(
                "the relay of Ray actor {id} answered its join with `{}`",
                other.kind()
            )))
        }
        Err(Failure::TimedOut { .. }) => {
            return Err(StartError::Cluster(format!(
                "the relay of Ray actor {id} did not join the cluster at {} and start its actor \
                 within {} s (it was killed)",
                shown(&spec.address),
                (JOIN_TIMEOUT + PLACE_TIMEOUT).as_secs()
            )))
        }
        Err(Failure::Lost { how, .. }) => {
            return Err(StartError::Cluster(format!(
                "the relay of Ray actor {id} {how} while joining the cluster (its own output, \
                 above, says why)"
            )))
        }
    };
    tracing::debug!(actor = id, pid = place.pid, node = %place.ip, "pyop Ray actor started");
    relay.actor = Some(RayActor {
        id,
        pid: place.pid,
        node: place.node,
        ip: place.ip,
    });
    Ok(relay)
}

/// A join of `spec`'s cluster that failed in the last `RETRY_AFTER`: calls meanwhile fail at
/// once, with its reason (Ray itself retries for tens of seconds before it gives up).
static FAILED: Mutex<Option<(Instant, Option<String>, String)>> = Mutex::new(None);

fn recent_failure(spec: &RayPool) -> Result<(), StartError> {
    let failed = FAILED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((at, address, why)) = &*failed {
        let ago = at.elapsed();
        if *address == spec.address && ago < RETRY_AFTER {
            return Err(StartError::Cluster(format!(
                "{why} (an attempt {} s ago; the next one {} s after it)",
                ago.as_secs(),
                RETRY_AFTER.as_secs()
            )));
        }
    }
    Ok(())
}

/// Why a relay could not join or start its actor, and the fix.
fn join_failed(
    launch: &Launch,
    spec: &RayPool,
    id: u64,
    stage: JoinStage,
    exc: &ExcInfo,
) -> StartError {
    let what = format!("{}: {}", exc.type_name, exc.message);
    let traceback = if exc.traceback.is_empty() {
        String::new()
    } else {
        format!("\n{}", exc.traceback.trim_end())
    };
    match stage {
        JoinStage::Import if exc.name.as_deref() == Some("ray") => StartError::NoRay(format!(
            "a Ray pool needs Ray in the program's Python environment ({}, {what}); install it \
             with {}, the same version as on the cluster's nodes",
            launch.describe, launch.pip_ray
        )),
        JoinStage::Import => StartError::Cluster(format!(
            "Ray cannot be imported in the program's Python environment ({what}){traceback}"
        )),
        JoinStage::Connect => {
            // Ray's own words when nothing runs where it looked.
            let none_running = exc
                .message
                .contains("Could not find any running Ray instance");
            let hint = if none_running {
                "; start one with `ray start --head`, or point PYOP_RAY_ADDRESS (or \
                 RayPool::address) at a running one"
            } else {
                ""
            };
            StartError::Cluster(format!(
                "cannot join the Ray cluster at {} ({what}){hint}{traceback}",
                shown(&spec.address)
            ))
        }
        JoinStage::Place => StartError::Cluster(format!(
            "actor {id} of a Ray pool was not placed and started within {} s: the cluster may \
             lack the CPUs or resources it asks for ({}); `ray status` shows what the nodes \
             have",
            PLACE_TIMEOUT.as_secs(),
            asked(spec)
        )),
        JoinStage::Submit => StartError::Cluster(format!(
            "actor {id} of a Ray pool could not be asked for ({what}): Ray refused what the \
             pool asks it for ({}){traceback}",
            asked(spec)
        )),
        JoinStage::Start => StartError::Cluster(format!(
            "actor {id} of a Ray pool failed as it started ({what}): its node's Python \
             environment may lack NumPy, or run another Python X.Y than the program (every node \
             needs the program's Python, NumPy and Ray){traceback}"
        )),
    }
}

/// What each actor of `spec` asks Ray for: `0.5 CPUs, 1 extra`.
fn asked(spec: &RayPool) -> String {
    let cpus = if spec.num_cpus == 1.0 { "CPU" } else { "CPUs" };
    let mut text = format!("{} {cpus}", spec.num_cpus);
    for (k, v) in &spec.resources {
        text.push_str(&format!(", {v} {k}"));
    }
    text
}

fn shown(address: &Option<String>) -> String {
    address
        .as_deref()
        .map_or_else(|| "Ray's default address".to_owned(), |a| format!("`{a}`"))
}

/// A `host:port` address that refuses a connection is said so at once (Ray itself retries for
/// tens of seconds before it gives up): the one case where nothing listens, so the one that
/// names `ray start --head`.
fn reachable(address: &str) -> Result<(), StartError> {
    use std::net::ToSocketAddrs;
    if address.contains("://") || address == "auto" || address == "local" {
        return Ok(());
    }
    let refused = |why: String| {
        StartError::Cluster(format!(
            "cannot reach the Ray cluster at `{address}` ({why}): start its head there with \
             `ray start --head --port=<port>`, or point PYOP_RAY_ADDRESS (or RayPool::address) \
             at a running one"
        ))
    };
    let addrs: Vec<_> = address
        .to_socket_addrs()
        .map_err(|e| refused(e.to_string()))?
        .collect();
    let mut last = String::from("no address");
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, Duration::from_secs(3)) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(refused(last))
}

/// Why the node `actor` runs on cannot serve the program (its versions differ from the
/// relay's, which are the program's environment's), if so.
fn mismatch(actor: &ActorPlace, ours: &Versions) -> Option<String> {
    let theirs = &actor.versions;
    (theirs != ours).then(|| {
        format!(
            "the Ray node {} ({}) runs Python {}, NumPy {} and Ray {}, the program Python {}, \
             NumPy {} and Ray {}: every node needs the program's versions (install them in the \
             environment `ray start` runs from)",
            actor.ip,
            actor.node,
            theirs.python,
            theirs.numpy,
            theirs.ray,
            ours.python,
            ours.numpy,
            ours.ray
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_with_other_versions_is_refused_naming_both() {
        let ours = Versions {
            python: "3.11".into(),
            numpy: "2.4.6".into(),
            ray: "2.60.0".into(),
        };
        let place = |versions: Versions| ActorPlace {
            pid: 42,
            node: "abc".into(),
            ip: "10.0.0.7".into(),
            versions,
        };
        assert_eq!(mismatch(&place(ours.clone()), &ours), None);
        let theirs = Versions {
            numpy: "1.26.4".into(),
            ..ours.clone()
        };
        assert_eq!(
            mismatch(&place(theirs), &ours).unwrap(),
            "the Ray node 10.0.0.7 (abc) runs Python 3.11, NumPy 1.26.4 and Ray 2.60.0, the \
             program Python 3.11, NumPy 2.4.6 and Ray 2.60.0: every node needs the program's \
             versions (install them in the environment `ray start` runs from)"
        );
        let theirs = Versions {
            python: "3.12".into(),
            ..ours.clone()
        };
        assert!(mismatch(&place(theirs), &ours).is_some());
    }

    #[test]
    fn pools_are_listed_by_name_or_all() {
        assert!(listed("text, images", "images"));
        assert!(listed("*", "anything"));
        assert!(!listed("text", "tex"));
        assert!(!listed("", "text"));
    }
}
