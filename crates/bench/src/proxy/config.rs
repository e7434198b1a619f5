//! The configuration files of the systems under test, as text: the nginx backends, and
//! rserpool's proxy, HAProxy and nginx set up alike (worker threads, round robin, kept-alive
//! connections to the backends, X-Forwarded-For).

use super::{GRPC_POOL, POOL};
use std::net::SocketAddr;
use std::path::Path;

/// Where Debian's libnginx-mod-stream puts nginx's TCP proxy module.
pub(super) const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// The back ends a proxy's configuration names.
pub(super) struct Upstreams<'a> {
    pub(super) backends: &'a [SocketAddr],
    pub(super) grpc_backends: &'a [SocketAddr],
}

/// An nginx backend (`i`): the static files and WebDAV uploads under `dir`/www, on `addr`
/// and on `check`, the address its sidecar checks.
pub(super) fn nginx_backend(i: usize, addr: SocketAddr, check: SocketAddr, dir: &Path) -> String {
    let d = dir.display();
    format!(
        r#"daemon off;
master_process off;
pid {d}/b{i}.pid;
error_log {d}/b{i}.err error;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    default_type application/octet-stream;
    client_body_temp_path {d}/b{i}-body;
    proxy_temp_path {d}/b{i}-proxy;
    fastcgi_temp_path {d}/b{i}-fcgi;
    uwsgi_temp_path {d}/b{i}-uwsgi;
    scgi_temp_path {d}/b{i}-scgi;
    server {{
        listen {addr} backlog=4096;
        listen {check} backlog=64;
        root {d}/www;
        add_header X-Backend b{i} always;
        location /up/ {{
            dav_methods PUT;
            create_full_put_path on;
            client_max_body_size 0;
            client_body_buffer_size 1m;
        }}
    }}
}}
"#,
    )
}

/// The bed's HTTPS certificate (ECDSA P-256, for 127.0.0.1 and localhost): the certificate,
/// its key, and both in one file (HAProxy's `crt`); the CA that issued it, for the bench's own
/// clients.
pub(crate) struct TlsFiles {
    pub(crate) ca: std::path::PathBuf,
    pub(crate) cert: std::path::PathBuf,
    pub(crate) key: std::path::PathBuf,
    pub(crate) both: std::path::PathBuf,
}

impl TlsFiles {
    /// Makes them under `dir` (a test CA of their own).
    pub(crate) fn make(dir: &Path) -> anyhow::Result<TlsFiles> {
        let ca = rserpool_tls::issue::new_ca("rserpool-bench CA")?;
        let sans = ["127.0.0.1".to_string(), "localhost".to_string()];
        let c = rserpool_tls::issue::issue(&ca, "localhost", &sans)?;
        let f = TlsFiles {
            ca: dir.join("https-ca.pem"),
            cert: dir.join("https.pem"),
            key: dir.join("https.key"),
            both: dir.join("https-both.pem"),
        };
        std::fs::write(&f.cert, format!("{}{}", c.cert_pem, ca.cert_pem))?;
        std::fs::write(&f.key, &c.key_pem)?;
        std::fs::write(&f.ca, &ca.cert_pem)?;
        std::fs::write(
            &f.both,
            format!("{}{}{}", c.cert_pem, ca.cert_pem, c.key_pem),
        )?;
        Ok(f)
    }
}

/// Where a system under test takes its clients.
pub(super) struct Fronts {
    pub(super) http: SocketAddr,
    pub(super) tcp: SocketAddr,
    /// HTTPS, HTTP/1.1 or HTTP/2 by ALPN.
    pub(super) https: SocketAddr,
    /// HTTP/2 in cleartext (prior knowledge).
    pub(super) h2c: SocketAddr,
    /// HTTP/2 onto the gRPC backends.
    pub(super) grpc: SocketAddr,
}

/// rserpool's proxy: HTTP, HTTPS, h2c and TCP listeners onto the pool, an h2c listener onto
/// the gRPC pool (HTTP/2 to its backends), `threads` worker threads.
pub(super) fn rserpool_proxy(
    registrar: SocketAddr,
    threads: usize,
    f: &Fronts,
    tls: &TlsFiles,
) -> String {
    let Fronts {
        http,
        tcp,
        https,
        h2c,
        grpc,
    } = f;
    format!(
        r#"registrars = ["{reg}"]
threads = {threads}
max-connections = 20000

[[listener]]
listen = "{http}"
mode = "http"
pool = "{POOL}"

[[listener]]
listen = "{tcp}"
mode = "tcp"
pool = "{POOL}"

[[listener]]
listen = "{https}"
mode = "http"
pool = "{POOL}"
[[listener.certificate]]
cert = "{cert}"
key = "{key}"

[[listener]]
listen = "{h2c}"
mode = "http"
pool = "{POOL}"

[[listener]]
listen = "{grpc}"
mode = "http"
pool = "{GRPC_POOL}"

[pool.{GRPC_POOL}]
protocol = "h2"
"#,
        reg = registrar,
        cert = tls.cert.display(),
        key = tls.key.display(),
    )
}

/// HAProxy with the same three listeners, round robin, connection reuse and its default
/// checks.
pub(super) fn haproxy(threads: usize, f: &Fronts, bed: &Upstreams<'_>, tls: &TlsFiles) -> String {
    let Fronts {
        http,
        tcp,
        https,
        h2c,
        grpc,
    } = f;
    let backends = &bed.backends;
    format!(
        r#"global
    nbthread {threads}
    maxconn 9900

defaults
    mode http
    timeout connect 1s
    timeout client 60s
    timeout server 60s
    timeout http-keep-alive 60s
    retries 3
    option redispatch

frontend web
    bind {http}
    option forwardfor
    http-reuse always
    default_backend pool

frontend webs
    bind {https} ssl crt {both} alpn h2,http/1.1
    option forwardfor
    default_backend pool

frontend h2c
    bind {h2c} proto h2
    option forwardfor
    default_backend pool

frontend grpc
    bind {grpc} proto h2
    option forwardfor
    default_backend grpcpool

backend grpcpool
    balance roundrobin
    http-reuse always
{grpc_servers}
backend pool
    balance roundrobin
    http-reuse always
{servers}
listen tcp
    mode tcp
    bind {tcp}
    balance roundrobin
{servers}"#,
        servers = servers(backends, &|i, b| format!("    server b{i} {b} check")),
        grpc_servers = servers(bed.grpc_backends, &|i, b| {
            format!("    server g{i} {b} proto h2 check")
        }),
        both = tls.both.display(),
    )
}

/// nginx with the same two listeners (the stream module for TCP), kept-alive upstream
/// connections; its files under `dir`.
pub(super) fn nginx_proxy(
    threads: usize,
    f: &Fronts,
    bed: &Upstreams<'_>,
    dir: &Path,
    tls: &TlsFiles,
) -> String {
    let Fronts {
        http,
        tcp,
        https,
        h2c,
        grpc,
    } = f;
    let backends = &bed.backends;
    let grpc_upstream = if bed.grpc_backends.is_empty() {
        String::new()
    } else {
        format!(
            "    upstream gpool {{\n{}        keepalive 64;\n    }}\n    server {{\n        \
             listen {grpc} http2 backlog=4096;\n        location / {{ grpc_pass grpc://gpool; \
             }}\n    }}\n",
            servers(bed.grpc_backends, &|_, b| format!("        server {b};"))
        )
    };
    let dd = dir.display();
    format!(
        r#"load_module {STREAM_MODULE};
daemon off;
worker_processes {threads};
worker_rlimit_nofile 40000;
pid {dd}/nginx-proxy.pid;
error_log {dd}/nginx-proxy.err error;
events {{ worker_connections 16384; }}
http {{
    access_log off;
    client_body_temp_path {dd}/np-body;
    proxy_temp_path {dd}/np-proxy;
    fastcgi_temp_path {dd}/np-fcgi;
    uwsgi_temp_path {dd}/np-uwsgi;
    scgi_temp_path {dd}/np-scgi;
    keepalive_requests 1000000;
    upstream pool {{
{servers}        keepalive 256;
    }}
{grpc_upstream}    server {{
        listen {http} backlog=4096;
        listen {https} ssl http2 backlog=4096;
        listen {h2c} http2 backlog=4096;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        client_max_body_size 0;
        location / {{
            proxy_pass http://pool;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_request_buffering off;
            proxy_max_temp_file_size 0;
            proxy_connect_timeout 1s;
        }}
    }}
}}
stream {{
    upstream tpool {{
{servers}    }}
    server {{
        listen {tcp} backlog=4096;
        proxy_pass tpool;
        proxy_connect_timeout 1s;
    }}
}}
"#,
        servers = servers(backends, &|_, b| format!("        server {b};")),
        cert = tls.cert.display(),
        key = tls.key.display(),
    )
}

/// One line per backend.
fn servers(backends: &[SocketAddr], line: &dyn Fn(usize, SocketAddr) -> String) -> String {
    backends
        .iter()
        .enumerate()
        .map(|(i, &b)| line(i, b) + "\n")
        .collect()
}
