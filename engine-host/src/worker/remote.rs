//! Engine host, a model in a worker process (call boundary, `process` isolation): the
//! worker implementation of `model.rs`'s call traits — the shared calls over the worker's
//! socket (single-token pieces cached), the exec calls over the model's own connection with
//! each step's entries and results in a mapping shared with the worker.

use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use gantry_engine_abi::{
    AdapterDescriptor, EngineError, EngineInfo, Input, LoadedAdapter, SampledToken, SpeechPiece,
    SpeechRequest, StepEntry, ffi,
};

use super::client::{NEXT, Worker, io_error, shm_dir};
use super::wire::{self, Op, Reader, Writer};
use crate::model::{ExecCalls, SharedCalls, WorkerProcess};

/// The shared calls of a model in a worker (any thread).
pub struct RemoteModel {
    pub worker: Arc<Worker>,
    /// The plugin's info, as its probe reported it.
    plugin: Arc<EngineInfo>,
    /// Single-token pieces, by `render_special`: the scheduler turns every sampled token into
    /// text, and a token's piece never changes, so each crosses the socket once.
    pieces: [Mutex<std::collections::HashMap<i32, Vec<u8>>>; 2],
}

impl RemoteModel {
    pub fn new(worker: Arc<Worker>, plugin: Arc<EngineInfo>) -> Self {
        Self {
            worker,
            plugin,
            pieces: Default::default(),
        }
    }
}

impl SharedCalls for RemoteModel {
    fn plugin(&self) -> &EngineInfo {
        &self.plugin
    }

    fn worker_pid(&self) -> Option<u32> {
        Some(self.worker.pid())
    }

    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        let mut w = Writer::op(Op::Tokenize);
        w.bool(add_special).bool(parse_special).str(text);
        let reply = self.worker.shared_call(&w.buf)?;
        wire::reply(&reply)?.i32s()
    }

    fn detokenize(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        let cache = &self.pieces[usize::from(render_special)];
        if let [t] = tokens
            && let Some(b) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(t)
        {
            return Ok(b.clone());
        }
        let mut w = Writer::op(Op::Detokenize);
        w.bool(render_special).i32s(tokens);
        let reply = self.worker.shared_call(&w.buf)?;
        let bytes = wire::reply(&reply)?.bytes()?.to_vec();
        if let [t] = tokens {
            cache
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(*t, bytes.clone());
        }
        Ok(bytes)
    }

    /// Each token's bytes on its own, in one round trip.
    fn detokenize_each(
        &self,
        tokens: &[i32],
        render_special: bool,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        let mut w = Writer::op(Op::DetokenizeEach);
        w.bool(render_special).i32s(tokens);
        let reply = self.worker.shared_call(&w.buf)?;
        let mut r = wire::reply(&reply)?;
        let n = r.u32()? as usize;
        if n != tokens.len() {
            return Err(EngineError::internal("engine worker: wrong piece count"));
        }
        (0..n).map(|_| r.bytes().map(<[u8]>::to_vec)).collect()
    }
}

/// The exec calls of a model in a worker: its own connection and shared mapping.
pub struct RemoteExec {
    worker: Arc<Worker>,
    conn: UnixStream,
    map: Option<memmap2::MmapMut>,
    /// The request, encoded here and copied into the mapping (the buffer is reused).
    out: Writer,
    reply: Vec<u8>,
}

/// The smallest step mapping: a batch of 8 with 512-token prompts and masks for a 256k
/// vocabulary fits.
const MIN_SHM: usize = 1 << 20;

impl RemoteExec {
    pub fn new(worker: Arc<Worker>) -> Result<Self, EngineError> {
        let conn = worker.connect()?;
        let mut exec = Self {
            worker,
            conn,
            map: None,
            out: Writer::default(),
            reply: Vec::new(),
        };
        exec.grow(MIN_SHM)?;
        Ok(exec)
    }

    /// A new mapping of at least `need` bytes, shared with the worker.
    fn grow(&mut self, need: usize) -> Result<(), EngineError> {
        let size = need.next_power_of_two().max(MIN_SHM);
        let path = shm_dir().join(format!(
            "gantry-step-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_error(&format!("create {}", path.display()), e))?;
        let mapped = f
            .set_len(size as u64)
            .map_err(|e| io_error("size the step mapping", e))
            // SAFETY: a file this node just created for this connection alone; the worker
            // touches it only between a step request and its reply, while this side waits.
            .and_then(|()| {
                unsafe { memmap2::MmapMut::map_mut(&f) }.map_err(|e| io_error("map", e))
            });
        let result = mapped.and_then(|map| {
            let mut w = Writer::op(Op::MapShm);
            w.str(&path.to_string_lossy());
            self.worker.call(&mut self.conn, &w.buf, &mut self.reply)?;
            wire::reply(&self.reply)?;
            self.map = Some(map);
            Ok(())
        });
        // Both sides hold the mapping now (or the worker never will): the name can go.
        let _ = std::fs::remove_file(&path);
        result
    }

    fn exec_call(&mut self, body: &[u8]) -> Result<Reader<'_>, EngineError> {
        self.worker.call(&mut self.conn, body, &mut self.reply)?;
        wire::reply(&self.reply)
    }
}

impl ExecCalls for RemoteExec {
    fn seq_open(&mut self) -> Result<u64, EngineError> {
        self.exec_call(&[Op::SeqOpen as u8])?.u64()
    }

    fn seq_release(&mut self, seq: u64) {
        let mut w = Writer::op(Op::SeqRelease);
        w.u64(seq);
        let _ = self.exec_call(&w.buf);
    }

    fn seq_cached_tokens(&mut self, seq: u64) -> Option<u64> {
        let mut w = Writer::op(Op::SeqCachedTokens);
        w.u64(seq);
        let n = self.exec_call(&w.buf).ok()?.i64().ok()?;
        u64::try_from(n).ok()
    }

    fn seq_fork(&mut self, src: u64) -> Result<u64, EngineError> {
        let mut w = Writer::op(Op::SeqFork);
        w.u64(src);
        self.exec_call(&w.buf)?.u64()
    }

    fn seq_truncate(&mut self, seq: u64, n_keep: u64) -> Result<(), EngineError> {
        let mut w = Writer::op(Op::SeqTruncate);
        w.u64(seq).u64(n_keep);
        self.exec_call(&w.buf).map(|_| ())
    }

    fn adapter_load(&mut self, desc: &AdapterDescriptor) -> Result<LoadedAdapter, EngineError> {
        let mut w = Writer::op(Op::AdapterLoad);
        w.str(&desc.name)
            .str(&desc.path.to_string_lossy())
            .u32(desc.format.as_raw())
            .f32(desc.scale);
        let mut r = self.exec_call(&w.buf)?;
        Ok(LoadedAdapter {
            id: r.u64()?,
            bytes: r.u64()?,
        })
    }

    fn adapter_unload(&mut self, adapter: u64) {
        let mut w = Writer::op(Op::AdapterUnload);
        w.u64(adapter);
        // A worker that is gone holds no adapter any more.
        let _ = self.exec_call(&w.buf);
    }

    fn seq_set_adapter(&mut self, seq: u64, adapter: u64) -> Result<(), EngineError> {
        let mut w = Writer::op(Op::SeqSetAdapter);
        w.u64(seq).u64(adapter);
        self.exec_call(&w.buf).map(|_| ())
    }

    fn seq_set_input(&mut self, seq: u64, input: &Input<'_>) -> Result<(), EngineError> {
        let mut w = Writer::op(Op::SeqSetInput);
        w.u64(seq);
        match *input {
            Input::Audio {
                samples,
                sample_rate,
                align,
            } => w
                .u32(ffi::GANTRY_INPUT_AUDIO)
                .f32s(samples)
                .u32(sample_rate)
                .bool(align),
            Input::Image { rgb, width, height } => w
                .u32(ffi::GANTRY_INPUT_IMAGE)
                .bytes(rgb)
                .u32(width)
                .u32(height),
        };
        self.exec_call(&w.buf).map(|_| ())
    }

    fn speech_open(&mut self, req: &SpeechRequest<'_>) -> Result<u64, EngineError> {
        let mut w = Writer::op(Op::SpeechOpen);
        w.str(req.text).opt_str(req.voice).f32(req.speed);
        self.exec_call(&w.buf)?.u64()
    }

    fn speech_next(&mut self, speech: u64) -> Result<SpeechPiece, EngineError> {
        let mut w = Writer::op(Op::SpeechNext);
        w.u64(speech);
        let mut r = self.exec_call(&w.buf)?;
        Ok(SpeechPiece {
            samples: r.f32s()?,
            done: r.bool()?,
        })
    }

    fn seq_token_times(&mut self, seq: u64, first: usize) -> Result<Vec<f32>, EngineError> {
        let mut w = Writer::op(Op::SeqTokenTimes);
        w.u64(seq).u64(first as u64);
        self.exec_call(&w.buf)?.f32s()
    }

    fn seq_token_prob(&mut self, seq: u64, n_fed: usize, token: i32) -> Result<f32, EngineError> {
        let mut w = Writer::op(Op::SeqTokenProb);
        w.u64(seq).u64(n_fed as u64).i32(token);
        self.exec_call(&w.buf)?.f32()
    }

    fn counters(&mut self) -> Result<Vec<(String, u64)>, EngineError> {
        let w = Writer::op(Op::ModelCounters);
        let mut r = self.exec_call(&w.buf)?;
        let n = r.u32()? as usize;
        (0..n).map(|_| Ok((r.string()?, r.u64()?))).collect()
    }

    fn speech_close(&mut self, speech: u64) {
        let mut w = Writer::op(Op::SpeechClose);
        w.u64(speech);
        // A worker that is gone holds no speech any more.
        let _ = self.exec_call(&w.buf);
    }

    fn embed_batch(
        &mut self,
        inputs: &[Vec<i32>],
        _dims: usize,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut w = Writer::op(Op::Embed);
        w.len(inputs.len());
        for tokens in inputs {
            w.i32s(tokens);
        }
        let mut r = self.exec_call(&w.buf)?;
        let n = r.u32()? as usize;
        (0..n).map(|_| r.f32s()).collect()
    }

    fn step(
        &mut self,
        entries: &[StepEntry<'_>],
    ) -> Result<Vec<Option<SampledToken>>, EngineError> {
        let need = wire::step_request_size(entries).max(wire::step_reply_size(entries));
        if self.map.as_ref().is_none_or(|m| m.len() < need) {
            self.grow(need)?;
        }
        self.out.buf.clear();
        wire::put_step(&mut self.out, entries);
        let len = self.out.buf.len();
        let map = self
            .map
            .as_mut()
            .ok_or_else(|| EngineError::internal("no step mapping"))?;
        map[..len].copy_from_slice(&self.out.buf);
        let mut w = Writer::op(Op::Step);
        w.len(len);
        let reply_len = self.exec_call(&w.buf)?.u32()? as usize;
        let map = self
            .map
            .as_ref()
            .ok_or_else(|| EngineError::internal("no step mapping"))?;
        let body = map
            .get(..reply_len)
            .ok_or_else(|| EngineError::internal("step reply larger than the mapping"))?;
        wire::get_step_results(&mut Reader::new(body))
    }

    fn worker(&self) -> Option<Arc<dyn WorkerProcess>> {
        Some(self.worker.clone())
    }
}
