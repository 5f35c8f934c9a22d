//! A server that speaks just enough HTTP/2 to end every connection with a
//! GOAWAY carrying debug data of its choosing, as a hook server, or a proxy
//! in front of one, may: the h2 server API sends GOAWAY without debug data,
//! so the frames are written by hand.

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The client connection preface (RFC 9113, section 3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
/// ENHANCE_YOUR_CALM, as a server shedding load says it.
pub const REASON: u32 = 0xb;

/// Starts the server on port 0; its `http://` endpoint.
pub async fn start(debug_data: &'static [u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(go_away(tcp, debug_data));
        }
    });
    format!("http://{addr}")
}

fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    // length (24 bits), type, flags, stream 0
    let mut f = vec![
        (len >> 16) as u8,
        (len >> 8) as u8,
        len as u8,
        kind,
        0,
        0,
        0,
        0,
        0,
    ];
    f.extend_from_slice(payload);
    f
}

/// Sends SETTINGS, waits for the client's first request (so it is in flight
/// when the GOAWAY comes), then refuses it and everything after with a
/// GOAWAY (last stream 0) carrying `debug_data`, and holds the connection
/// until the client closes it.
async fn go_away(mut tcp: TcpStream, debug_data: &[u8]) {
    if tcp.write_all(&frame(SETTINGS, &[])).await.is_err() {
        return;
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    'request: loop {
        match tcp.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        let mut at = PREFACE.len();
        while at + 9 <= got.len() {
            if got[at + 3] == HEADERS {
                break 'request;
            }
            let len = (usize::from(got[at]) << 16)
                | (usize::from(got[at + 1]) << 8)
                | usize::from(got[at + 2]);
            at += 9 + len;
        }
    }
    let mut payload = 0u32.to_be_bytes().to_vec();
    payload.extend_from_slice(&REASON.to_be_bytes());
    payload.extend_from_slice(debug_data);
    if tcp.write_all(&frame(GOAWAY, &payload)).await.is_err() {
        return;
    }
    while matches!(tcp.read(&mut buf).await, Ok(n) if n > 0) {}
}
