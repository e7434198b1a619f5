//! The status listener over tokio: the accept loop for processes that run tokio (the proxy), and
//! the client that `rserpool status`, the benchmarks and the tests read a status with.

use crate::{
    EVENT_INTERVAL, IO_TIMEOUT, LINGER, MAX_CONNS, MAX_HEAD, Parse, Reply, event,
    event_stream_head, is_event_stream, parse_request, respond,
};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::timeout;

/// Serves `paths` on `listener` until the task is dropped: `handler` makes the reply for a path.
/// Each connection gets one answer and is closed; but [`EVENTS_PATH`](crate::EVENTS_PATH), when
/// in `paths`, streams `handler("/status")` every [`EVENT_INTERVAL`] until the client goes.
pub async fn serve<F>(listener: TcpListener, paths: &'static [&'static str], handler: F)
where
    F: Fn(&str) -> Reply + Send + Sync + 'static,
{
    let handler = Arc::new(handler);
    let slots = Arc::new(Semaphore::new(MAX_CONNS));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors and the like: do not spin; the next accept may work.
                tracing::debug!("status listener: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue; // Too many at once: dropping closes it.
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let _ = answer(stream, paths, &*handler).await;
            drop(slot);
        });
    }
}

async fn answer(
    mut s: TcpStream,
    paths: &[&str],
    handler: &(dyn Fn(&str) -> Reply + Send + Sync),
) -> io::Result<()> {
    let read_head = async {
        let mut buf = Vec::with_capacity(1024);
        loop {
            let mut chunk = [0u8; 2048];
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                return Ok::<_, io::Error>(Head::Closed);
            }
            buf.extend_from_slice(&chunk[..n]);
            match parse_request(&buf) {
                Parse::Incomplete => {}
                Parse::Complete(req) if is_event_stream(&req, paths) => return Ok(Head::Stream),
                Parse::Complete(req) => return Ok(Head::Answer(respond(&req, paths, handler))),
                Parse::Invalid(reply) => return Ok(Head::Answer(reply)),
            }
        }
    };
    let out = match timeout(IO_TIMEOUT, read_head).await.map_err(timed_out)?? {
        Head::Closed => return Ok(()),
        Head::Stream => return stream_events(s, handler).await,
        Head::Answer(out) => out,
    };
    for part in out.chunks(64 * 1024) {
        timeout(IO_TIMEOUT, s.write_all(part))
            .await
            .map_err(timed_out)??;
    }
    s.shutdown().await?;
    let drain = async {
        let mut sink = [0u8; 2048];
        while s.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    };
    let _ = timeout(LINGER, drain).await;
    Ok(())
}

enum Head {
    Closed,
    Answer(Vec<u8>),
    Stream,
}

/// The event stream: the status now and every [`EVENT_INTERVAL`], until the client closes or
/// stops taking it.
async fn stream_events(
    mut s: TcpStream,
    handler: &(dyn Fn(&str) -> Reply + Send + Sync),
) -> io::Result<()> {
    timeout(IO_TIMEOUT, s.write_all(&event_stream_head()))
        .await
        .map_err(timed_out)??;
    let (mut rd, mut wr) = s.split();
    let mut tick = tokio::time::interval(EVENT_INTERVAL);
    let mut sink = [0u8; 512];
    loop {
        tokio::select! {
            r = rd.read(&mut sink) => if r? == 0 { return Ok(()) },
            _ = tick.tick() => {
                let reply = handler("/status");
                timeout(IO_TIMEOUT, wr.write_all(&event(&reply.body)))
                    .await
                    .map_err(timed_out)??;
            }
        }
    }
}

fn timed_out(_: tokio::time::error::Elapsed) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, "no progress in time")
}

/// `GET path` from a status listener: the status code and the body.
pub async fn get(addr: SocketAddr, path: &str) -> io::Result<(u16, Vec<u8>)> {
    get_accepting(addr, path, None)
        .await
        .map(|(status, _, body)| (status, body))
}

/// [`get`] with an `Accept` header (a scrape asking for a format): the status code, the
/// content type and the body.
pub async fn get_accepting(
    addr: SocketAddr,
    path: &str,
    accept: Option<&str>,
) -> io::Result<(u16, String, Vec<u8>)> {
    let exchange = async {
        let mut s = TcpStream::connect(addr).await?;
        let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
        let req =
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut reply = Vec::new();
        s.read_to_end(&mut reply).await?;
        Ok::<_, io::Error>(reply)
    };
    let reply = timeout(IO_TIMEOUT, exchange).await.map_err(timed_out)??;
    let bad =
        |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("{what} from {addr}"));
    let mut headers = [httparse::EMPTY_HEADER; 32];
    let mut resp = httparse::Response::new(&mut headers);
    let head_len = match resp.parse(&reply[..reply.len().min(MAX_HEAD)]) {
        Ok(httparse::Status::Complete(n)) => n,
        _ => return Err(bad("not an HTTP answer")),
    };
    let status = resp.code.ok_or_else(|| bad("no status code"))?;
    let content_type = resp
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-type"))
        .map(|h| String::from_utf8_lossy(h.value).into_owned())
        .unwrap_or_default();
    Ok((status, content_type, reply[head_len..].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn serves_a_path_and_refuses_others() -> io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let server = tokio::spawn(serve(listener, &["/status"], |_| Reply::text(200, "fine")));
        assert_eq!(get(addr, "/status").await?, (200, b"fine\n".to_vec()));
        assert_eq!(get(addr, "/status?pretty").await?.0, 200);
        assert_eq!(get(addr, "/other").await?.0, 404);
        // Garbage gets a 400 and the listener goes on serving.
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(b"\x01\x00\x00\x08\r\n\r\n").await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        assert!(
            out.starts_with(b"HTTP/1.1 400"),
            "{}",
            String::from_utf8_lossy(&out)
        );
        // A request with a body the listener does not read still gets its whole answer.
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(b"POST /status HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
            .await?;
        s.write_all(&[b'x'; 5000]).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        assert!(
            out.starts_with(b"HTTP/1.1 405"),
            "{}",
            String::from_utf8_lossy(&out)
        );
        assert_eq!(get(addr, "/status").await?.0, 200);
        server.abort();
        Ok(())
    }
}
