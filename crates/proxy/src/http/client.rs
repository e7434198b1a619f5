//! A minimal HTTP/1.1 client on one kept-alive connection, built from the proxy's own head
//! parser and body framing. It exists for the tests and the benchmark (`rserpool-bench proxy`),
//! which need to see status codes, headers and exact bodies, or to count body bytes at full
//! speed without keeping them.

use crate::http::message::{BodyState, Head, response_framing};
use bytes::BytesMut;
use std::io;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_HEAD: usize = 1 << 16;
const READ_CHUNK: usize = 256 * 1024;

pub struct Client {
    pub stream: TcpStream,
    buf: BytesMut,
}

#[derive(Debug)]
pub struct Response {
    pub head: Head,
    pub code: u16,
    /// The body, unless it was only counted.
    pub body: Vec<u8>,
    pub body_len: u64,
    /// The server will close the connection after this response.
    pub close: bool,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<String> {
        self.head
            .get(name)
            .map(|v| String::from_utf8_lossy(v).into_owned())
    }
}

fn get_request(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").into_bytes()
}

fn invalid(what: impl std::fmt::Debug) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{what:?}"))
}

impl Client {
    pub async fn connect(addr: SocketAddr) -> io::Result<Client> {
        Self::over(TcpStream::connect(addr).await?)
    }

    /// A client over a connection made elsewhere (from a chosen source address, say).
    pub fn over(stream: TcpStream) -> io::Result<Client> {
        stream.set_nodelay(true)?;
        Ok(Client {
            stream,
            buf: BytesMut::with_capacity(READ_CHUNK),
        })
    }

    /// Sends raw request bytes and reads the response, keeping its body.
    pub async fn send(&mut self, req: &[u8]) -> io::Result<Response> {
        self.stream.write_all(req).await?;
        self.read_response(false, true).await
    }

    pub async fn get(&mut self, path: &str) -> io::Result<Response> {
        self.stream.write_all(&get_request(path)).await?;
        self.read_response(false, true).await
    }

    /// GET whose body is counted, not kept.
    pub async fn get_counted(&mut self, path: &str) -> io::Result<Response> {
        self.stream.write_all(&get_request(path)).await?;
        self.read_response(false, false).await
    }

    /// PUT of `body` with a Content-Length; the response body is kept.
    pub async fn put(&mut self, path: &str, body: &[u8]) -> io::Result<Response> {
        let head = format!(
            "PUT {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        self.stream.write_all(head.as_bytes()).await?;
        self.stream.write_all(body).await?;
        self.read_response(false, true).await
    }

    /// Reads one response; `head_only` for answers to HEAD.
    pub async fn read_response(&mut self, head_only: bool, keep: bool) -> io::Result<Response> {
        let head = loop {
            if let Some(h) = Head::response(&mut self.buf, MAX_HEAD).map_err(invalid)? {
                break h;
            }
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        };
        let mut body = Vec::new();
        let mut body_len = 0u64;
        let mut st = BodyState::new(response_framing(&head, head_only).map_err(invalid)?);
        loop {
            if !self.buf.is_empty() && !st.is_done() {
                let k = st.take(&self.buf).map_err(invalid)?;
                let part = self.buf.split_to(k);
                body_len += k as u64;
                if keep {
                    body.extend_from_slice(&part);
                }
            }
            if st.is_done() {
                break;
            }
            self.buf.reserve(READ_CHUNK);
            if self.stream.read_buf(&mut self.buf).await? == 0 {
                if matches!(st, BodyState::Close) {
                    break;
                }
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(Response {
            code: head.code,
            close: head.has_token("connection", "close"),
            head,
            body,
            body_len,
        })
    }
}
