//! A tokio server whose handlers `.await` pyop ops: one whose body runs in a pool of worker
//! processes (`_async` of a `#[py_op(numpy, workers = 2)]` function) and one whose body runs in
//! the program. No handler blocks a runtime thread, so two runtime threads serve every
//! connection, and a heartbeat task on the same runtime keeps its pace.
//!
//! The protocol is a line per request: `tokens <text>` answers the number of words of each
//! length in the text, `scale <x> <k>` answers `x * k`. The example serves CONNECTIONS clients
//! of its own at once (`PYOP_EXAMPLE_CONNECTIONS`, 200 by default), checks every answer, and
//! prints what it served.
//!
//! ```text
//! $ cargo run --release --example async_server
//! served 400 requests from 200 connections at once: every answer right
//! heartbeat: 48 ticks, late by 1.0 ms (median), 10.7 ms (worst)
//! ```

use std::time::{Duration, Instant};

use pyop::candle::{Device, Tensor};
use pyop::py_op;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[py_op(
    code = "import numpy as np\ndef lengths(codes):\n    words = bytes(codes.astype(np.uint8)).decode().split()\n    return np.bincount([len(w) for w in words], minlength=8)[:8].astype(np.int64)",
    numpy,
    workers = 2,
    tout = i64
)]
fn lengths(codes: &Tensor) -> pyop::Result<Tensor>;

#[py_op(code = "def scale(x, k):\n    return x * k", tout = f64)]
fn scale(x: &Tensor, k: f64) -> pyop::Result<Tensor>;

/// Answers one request line.
async fn answer(line: &str) -> Result<String, Box<dyn std::error::Error + Send + Sync>> {
    let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
    match verb {
        "tokens" => {
            let codes: Vec<u32> = rest.bytes().map(u32::from).collect();
            let codes = Tensor::new(codes, &Device::Cpu)?;
            let counts = lengths_async(&codes).await?.to_vec1::<i64>()?;
            Ok(format!("{counts:?}"))
        }
        "scale" => {
            let mut numbers = rest.split(' ').map(str::parse::<f64>);
            let (Some(Ok(x)), Some(Ok(k))) = (numbers.next(), numbers.next()) else {
                return Ok("error: scale <x> <k>".to_owned());
            };
            let y = scale_async(&Tensor::new(&[x], &Device::Cpu)?, k).await?;
            Ok(format!("{}", y.to_vec1::<f64>()?[0]))
        }
        _ => Ok(format!("error: unknown request {verb:?}")),
    }
}

/// Serves one connection: a line in, a line out.
async fn serve(stream: TcpStream) {
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let reply = answer(&line)
            .await
            .unwrap_or_else(|e| format!("error: {e}"));
        if write
            .write_all(format!("{reply}\n").as_bytes())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// A client: two requests on one connection, each answer checked.
async fn client(addr: std::net::SocketAddr, i: usize) -> std::io::Result<()> {
    let stream = TcpStream::connect(addr).await?;
    let (read, mut write) = stream.into_split();
    let mut lines = BufReader::new(read).lines();
    let words = "a bb ccc ".repeat(i % 5 + 1);
    write
        .write_all(format!("tokens {words}\n").as_bytes())
        .await?;
    let n = (i % 5 + 1) as i64;
    assert_eq!(
        lines.next_line().await?.unwrap(),
        format!("{:?}", [0, n, n, n, 0, 0, 0, 0])
    );
    write
        .write_all(format!("scale {i} 0.5\n").as_bytes())
        .await?;
    assert_eq!(
        lines.next_line().await?.unwrap(),
        format!("{}", i as f64 * 0.5)
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let connections: usize = std::env::var("PYOP_EXAMPLE_CONNECTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // The pool's workers started now (each an interpreter and NumPy, ~70 ms of CPU), not by the
    // first requests.
    pyop::op!(lengths).get()?.start_workers()?;
    rt.block_on(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream));
            }
        });
        // A heartbeat: how late its 1 ms ticks come while the server works.
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let heartbeat = tokio::spawn(async move {
            let mut stopped = stopped;
            let mut late = Vec::new();
            loop {
                let asked = Instant::now();
                tokio::select! {
                    _ = &mut stopped => return late,
                    _ = tokio::time::sleep(Duration::from_millis(1)) => {}
                }
                late.push(asked.elapsed().saturating_sub(Duration::from_millis(1)));
            }
        });
        let clients: Vec<_> = (0..connections)
            .map(|i| tokio::spawn(client(addr, i)))
            .collect();
        for c in clients {
            c.await??;
        }
        let _ = stop.send(());
        let mut late = heartbeat.await?;
        late.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "served {} requests from {connections} connections at once: every answer right",
            2 * connections
        );
        // tokio's timer rounds a 1 ms sleep up to its next millisecond: ~1 ms late when idle.
        // The worst tick waits its turn behind the burst of clients all starting at once.
        println!(
            "heartbeat: {} ticks, late by {:.1} ms (median), {:.1} ms (worst)",
            late.len(),
            ms(late[late.len() / 2]),
            ms(late[late.len() - 1])
        );
        Ok(())
    })
}
