//! Engine host, the worker's side (`gantry-node engine-worker`, a child of the node in
//! `process` isolation): opens one plugin in this process, loads one model and answers the
//! node's calls on a Unix socket, with each step's data in a shared mapping.
//!
//! The worker runs exactly the in-process call boundary (`plugin.rs`), so a plugin behaves
//! the same in both modes. It exits when the node's first connection closes — which the
//! kernel also does when the node dies — so no worker outlives its node, even one whose
//! plugin is stuck in a step. (Not `PR_SET_PDEATHSIG`: it fires when the *thread* that
//! started the worker ends, and the node starts workers from short-lived threads.)

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use gantry_engine_abi::{AdapterDescriptor, EngineError, Format, Input, SpeechRequest, ffi};

use super::wire::{self, Op, Reader, Writer};
use crate::{ModelExec, ModelShared, Plugin};

struct State {
    plugin: OnceLock<Plugin>,
    model: OnceLock<(Arc<ModelShared>, Mutex<ModelExec>)>,
    /// The first connection is the node's control connection; its end ends the worker.
    control_taken: AtomicBool,
}

/// Serve on `socket` until the node hangs up.
pub fn run(socket: &Path) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", socket.display()))?;
    let state = Arc::new(State {
        plugin: OnceLock::new(),
        model: OnceLock::new(),
        control_taken: AtomicBool::new(false),
    });
    for conn in listener.incoming() {
        let conn = conn?;
        let control = !state.control_taken.swap(true, Ordering::SeqCst);
        let st = state.clone();
        std::thread::Builder::new()
            .name(
                if control {
                    "worker-control"
                } else {
                    "worker-conn"
                }
                .into(),
            )
            .spawn(move || {
                serve_conn(&st, conn);
                if control {
                    // The node hung up (or shut this worker down): nothing is left to serve.
                    std::process::exit(0);
                }
            })?;
    }
    Ok(())
}

/// One connection's shared mapping for steps.
struct Shm {
    map: memmap2::MmapMut,
}

fn serve_conn(state: &State, mut conn: UnixStream) {
    let mut buf = Vec::new();
    let mut shm: Option<Shm> = None;
    let mut out = Writer::default();
    loop {
        if wire::read_frame(&mut conn, &mut buf).is_err() {
            return;
        }
        let reply = match handle(state, &buf, &mut shm, &mut out) {
            Ok(body) => body,
            Err(e) => wire::error_reply(&e),
        };
        if wire::write_frame(&mut conn, &reply).is_err() {
            return;
        }
        let _ = conn.flush();
    }
}

fn model(state: &State) -> Result<&(Arc<ModelShared>, Mutex<ModelExec>), EngineError> {
    state
        .model
        .get()
        .ok_or_else(|| EngineError::internal("engine worker: no model loaded"))
}

fn exec(state: &State) -> Result<std::sync::MutexGuard<'_, ModelExec>, EngineError> {
    Ok(model(state)?.1.lock().unwrap_or_else(|p| p.into_inner()))
}

fn handle(
    state: &State,
    body: &[u8],
    shm: &mut Option<Shm>,
    out: &mut Writer,
) -> Result<Vec<u8>, EngineError> {
    let (&op, rest) = body
        .split_first()
        .ok_or_else(|| EngineError::internal("empty request"))?;
    let op = Op::from_byte(op)
        .ok_or_else(|| EngineError::internal(format!("unknown engine worker op {op}")))?;
    let mut r = Reader::new(rest);
    let mut w = Writer::ok();
    match op {
        Op::Open => {
            let id = r.string()?;
            let binary = PathBuf::from(r.string()?);
            let config = wire::get_engine_config(&mut r)?;
            match Plugin::open(&binary, &id, &config) {
                Ok(p) => {
                    wire::put_engine_info(&mut w, p.info());
                    let _ = state.plugin.set(p);
                }
                Err(e) => {
                    let mut w = Writer::default();
                    w.u8(wire::OPEN_REFUSED)
                        .str(e.metric_label())
                        .str(&e.to_string());
                    return Ok(w.buf);
                }
            }
        }
        Op::Load => {
            let desc = wire::get_descriptor(&mut r)?;
            let plugin = state
                .plugin
                .get()
                .ok_or_else(|| EngineError::internal("engine worker: plugin not open"))?;
            if state.model.get().is_some() {
                return Err(EngineError::internal(
                    "engine worker: a worker serves one model",
                ));
            }
            let (shared, exec) = plugin.load_model(&desc)?;
            wire::put_model_info(&mut w, shared.info());
            let _ = state.model.set((shared, Mutex::new(exec)));
        }
        Op::Tokenize => {
            let add_special = r.bool()?;
            let parse_special = r.bool()?;
            let text = String::from_utf8_lossy(r.bytes()?);
            w.i32s(
                &model(state)?
                    .0
                    .tokenize(&text, add_special, parse_special)?,
            );
        }
        Op::Detokenize => {
            let render = r.bool()?;
            let tokens = r.i32s()?;
            w.bytes(&model(state)?.0.detokenize(&tokens, render)?);
        }
        Op::DetokenizeEach => {
            let render = r.bool()?;
            let tokens = r.i32s()?;
            let shared = &model(state)?.0;
            w.len(tokens.len());
            for t in tokens {
                w.bytes(&shared.detokenize(&[t], render)?);
            }
        }
        Op::SeqOpen => {
            w.u64(exec(state)?.seq_open()?);
        }
        Op::SeqRelease => {
            exec(state)?.seq_release(r.u64()?);
        }
        Op::SeqCachedTokens => {
            let n = exec(state)?.seq_cached_tokens(r.u64()?);
            w.i64(n.and_then(|n| i64::try_from(n).ok()).unwrap_or(-1));
        }
        Op::SeqFork => {
            w.u64(exec(state)?.seq_fork(r.u64()?)?);
        }
        Op::SeqTruncate => {
            let seq = r.u64()?;
            let n_keep = r.u64()?;
            exec(state)?.seq_truncate(seq, n_keep)?;
        }
        Op::AdapterLoad => {
            let desc = AdapterDescriptor {
                name: r.string()?,
                path: r.string()?.into(),
                format: Format::from_raw(r.u32()?)
                    .ok_or_else(|| EngineError::internal("unknown adapter format"))?,
                scale: r.f32()?,
            };
            let loaded = exec(state)?.adapter_load(&desc)?;
            w.u64(loaded.id).u64(loaded.bytes);
        }
        Op::AdapterUnload => exec(state)?.adapter_unload(r.u64()?),
        Op::SeqSetAdapter => {
            let seq = r.u64()?;
            let adapter = r.u64()?;
            exec(state)?.seq_set_adapter(seq, adapter)?;
        }
        Op::SeqSetInput => {
            let seq = r.u64()?;
            let kind = r.u32()?;
            let mut exec = exec(state)?;
            if kind == ffi::GANTRY_INPUT_AUDIO {
                let samples = r.f32s()?;
                let sample_rate = r.u32()?;
                let align = r.bool()?;
                exec.seq_set_input(
                    seq,
                    &Input::Audio {
                        samples: &samples,
                        sample_rate,
                        align,
                    },
                )?;
            } else {
                let rgb = r.bytes()?.to_vec();
                let (width, height) = (r.u32()?, r.u32()?);
                exec.seq_set_input(
                    seq,
                    &Input::Image {
                        rgb: &rgb,
                        width,
                        height,
                    },
                )?;
            }
        }
        Op::SpeechOpen => {
            let text = r.string()?;
            let voice = r.opt_string()?;
            let speed = r.f32()?;
            let req = SpeechRequest {
                text: &text,
                voice: voice.as_deref(),
                speed,
            };
            w.u64(exec(state)?.speech_open(&req)?);
        }
        Op::SpeechNext => {
            let piece = exec(state)?.speech_next(r.u64()?)?;
            w.f32s(&piece.samples).bool(piece.done);
        }
        Op::SpeechClose => exec(state)?.speech_close(r.u64()?),
        Op::SeqTokenProb => {
            let seq = r.u64()?;
            let n_fed = r.u64()? as usize;
            let token = r.i32()?;
            w.f32(exec(state)?.seq_token_prob(seq, n_fed, token)?);
        }
        Op::ModelCounters => {
            let counters = exec(state)?.counters()?;
            w.u32(counters.len() as u32);
            for (name, value) in &counters {
                w.str(name).u64(*value);
            }
        }
        Op::SeqTokenTimes => {
            let seq = r.u64()?;
            let first = r.u64()? as usize;
            w.f32s(&exec(state)?.seq_token_times(seq, first)?);
        }
        Op::Embed => {
            let n = r.u32()? as usize;
            let inputs = (0..n).map(|_| r.i32s()).collect::<Result<Vec<_>, _>>()?;
            let vectors = exec(state)?.embed_batch(&inputs)?;
            w.len(vectors.len());
            for v in &vectors {
                w.f32s(v);
            }
        }
        Op::MapShm => {
            let path = PathBuf::from(r.string()?);
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|e| {
                    EngineError::internal(format!("cannot open {}: {e}", path.display()))
                })?;
            // SAFETY: the file is the node's private mapping for this connection; the node
            // writes it only before sending a step and reads it only after the reply, so
            // the two processes never touch it at the same time.
            let map = unsafe { memmap2::MmapMut::map_mut(&f) }.map_err(|e| {
                EngineError::internal(format!("cannot map {}: {e}", path.display()))
            })?;
            *shm = Some(Shm { map });
        }
        Op::Step => {
            let len = r.u32()? as usize;
            let map = &mut shm
                .as_mut()
                .ok_or_else(|| EngineError::internal("step before the shared mapping"))?
                .map;
            let req = map
                .get(..len)
                .ok_or_else(|| EngineError::internal("step larger than the shared mapping"))?;
            let entries = wire::get_step(&mut Reader::new(req))?;
            let views: Vec<_> = entries.iter().map(wire::OwnedEntry::view).collect();
            let results = exec(state)?.step(&views)?;
            out.buf.clear();
            wire::put_step_results(out, &results);
            let dst = map
                .get_mut(..out.buf.len())
                .ok_or_else(|| EngineError::internal("step reply larger than the mapping"))?;
            dst.copy_from_slice(&out.buf);
            w.len(out.buf.len());
        }
    }
    Ok(w.buf)
}
