//! Engine host, worker wire format, its codec (under every message of `worker/wire.rs`, between
//! `worker/client.rs` and `worker/serve.rs`): length-prefixed frames on the socket, the
//! little-endian [`Writer`] and [`Reader`] every message is written and read with, and the
//! reply envelope (OK byte or status code and message).

use std::io::{Read, Write};

use gantry_engine_abi::{EngineError, Status};

use super::{MAX_FRAME, Op};

/// Write one frame.
pub fn write_frame(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    let len =
        u32::try_from(body.len()).map_err(|_| std::io::Error::other("frame larger than 4 GiB"))?;
    // One write for small frames: the header and body in one segment.
    if body.len() <= 4096 {
        let mut buf = Vec::with_capacity(4 + body.len());
        buf.extend_from_slice(&len.to_le_bytes());
        buf.extend_from_slice(body);
        return w.write_all(&buf);
    }
    w.write_all(&len.to_le_bytes())?;
    w.write_all(body)
}

/// Read one frame into `buf` (reused between calls).
pub fn read_frame(r: &mut impl Read, buf: &mut Vec<u8>) -> std::io::Result<()> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::other(format!(
            "frame of {len} bytes is over the {MAX_FRAME}-byte limit"
        )));
    }
    buf.clear();
    buf.resize(len, 0);
    r.read_exact(buf)
}

/// Appends values to a buffer.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn op(op: Op) -> Writer {
        Writer {
            buf: vec![op as u8],
        }
    }
    pub fn ok() -> Writer {
        Writer { buf: vec![0] }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(u8::from(v))
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn len(&mut self, n: usize) -> &mut Self {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX))
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.len(b.len());
        self.buf.extend_from_slice(b);
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.bytes(s.as_bytes())
    }
    pub fn opt_str(&mut self, s: Option<&str>) -> &mut Self {
        match s {
            Some(s) => self.bool(true).str(s),
            None => self.bool(false),
        }
    }
    pub fn i32s(&mut self, v: &[i32]) -> &mut Self {
        self.len(v.len());
        for x in v {
            self.i32(*x);
        }
        self
    }
    pub fn u32s(&mut self, v: &[u32]) -> &mut Self {
        self.len(v.len());
        for x in v {
            self.u32(*x);
        }
        self
    }
    pub fn f32s(&mut self, v: &[f32]) -> &mut Self {
        self.len(v.len());
        for x in v {
            self.f32(*x);
        }
        self
    }
}

/// Reads values back; every read checks the length, so a short or garbled buffer is an
/// error, never a panic.
pub struct Reader<'a> {
    buf: &'a [u8],
}

fn short() -> EngineError {
    EngineError::internal("engine worker message ended early")
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], EngineError> {
        if self.buf.len() < n {
            return Err(short());
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], EngineError> {
        self.take(N)?.try_into().map_err(|_| short())
    }
    pub fn u8(&mut self) -> Result<u8, EngineError> {
        Ok(self.take(1)?[0])
    }
    pub fn bool(&mut self) -> Result<bool, EngineError> {
        Ok(self.u8()? != 0)
    }
    pub fn u32(&mut self) -> Result<u32, EngineError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn i32(&mut self) -> Result<i32, EngineError> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, EngineError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub fn i64(&mut self) -> Result<i64, EngineError> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    pub fn f32(&mut self) -> Result<f32, EngineError> {
        Ok(f32::from_le_bytes(self.array()?))
    }
    /// A count, checked against what is left at `width` bytes per item.
    pub(super) fn count(&mut self, width: usize) -> Result<usize, EngineError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(width) > self.buf.len() {
            return Err(short());
        }
        Ok(n)
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], EngineError> {
        let n = self.count(1)?;
        self.take(n)
    }
    pub fn string(&mut self) -> Result<String, EngineError> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
    pub fn opt_string(&mut self) -> Result<Option<String>, EngineError> {
        if self.bool()? {
            self.string().map(Some)
        } else {
            Ok(None)
        }
    }
    pub fn i32s(&mut self) -> Result<Vec<i32>, EngineError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.i32()).collect()
    }
    pub fn u32s(&mut self) -> Result<Vec<u32>, EngineError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    pub fn f32s(&mut self) -> Result<Vec<f32>, EngineError> {
        let n = self.count(4)?;
        (0..n).map(|_| self.f32()).collect()
    }
    pub fn rest(&self) -> &'a [u8] {
        self.buf
    }
}

/// An error reply: the status byte and the message.
pub fn error_reply(e: &EngineError) -> Vec<u8> {
    let mut w = Writer::default();
    // Status codes are small positive numbers; OK (0) never travels as an error.
    let code = u8::try_from(e.status.as_raw()).unwrap_or(Status::Internal as u8);
    w.u8(if code == 0 {
        Status::Internal as u8
    } else {
        code
    });
    w.buf.extend_from_slice(e.message.as_bytes());
    w.buf
}

/// Split a reply into its payload, or the error it carries.
pub fn reply(body: &[u8]) -> Result<Reader<'_>, EngineError> {
    match body.split_first() {
        Some((0, rest)) => Ok(Reader::new(rest)),
        Some((code, rest)) => Err(EngineError::new(
            Status::from_raw(i32::from(*code)),
            String::from_utf8_lossy(rest).into_owned(),
        )),
        None => Err(short()),
    }
}
