//! Framing of the admission to the store rank 0 hosts: reads and writes bounded by a deadline,
//! and the answer frame.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use super::store::remaining;
use super::MAGIC;

/// Bytes of a client's hello: magic, identity, rendezvous number, rank, world size, whether it
/// holds a shared secret, nonce.
pub(super) const HELLO: usize = 32 + 1 + super::secret::NONCE;

/// `read_exact` that fails once `deadline` has passed, however slowly the peer trickles.
pub(super) fn read_by(
    stream: &mut TcpStream,
    mut buf: &mut [u8],
    deadline: Instant,
) -> std::io::Result<()> {
    while !buf.is_empty() {
        if Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "deadline passed",
            ));
        }
        stream.set_read_timeout(Some(remaining(deadline)))?;
        match stream.read(buf)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => buf = &mut buf[n..],
        }
    }
    Ok(())
}

/// `write_all` that fails once `deadline` has passed.
pub(super) fn write_by(
    stream: &mut TcpStream,
    mut buf: &[u8],
    deadline: Instant,
) -> std::io::Result<()> {
    while !buf.is_empty() {
        if Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "deadline passed",
            ));
        }
        stream.set_write_timeout(Some(remaining(deadline)))?;
        match stream.write(buf)? {
            0 => return Err(std::io::ErrorKind::WriteZero.into()),
            n => buf = &buf[n..],
        }
    }
    Ok(())
}

/// The answer frame: `MAGIC`, a status, a u32 length and the body.
pub(super) fn frame(status: u8, body: &[u8]) -> Vec<u8> {
    frame_as(MAGIC, status, body)
}

/// [`frame`] opened by another protocol version's `magic`.
pub(super) fn frame_as(magic: &[u8], status: u8, body: &[u8]) -> Vec<u8> {
    let mut reply = magic.to_vec();
    reply.push(status);
    reply.extend_from_slice(&(body.len() as u32).to_le_bytes());
    reply.extend_from_slice(body);
    reply
}
