//! Native engine, CUDA backend: where a decode step's time goes, by CUDA events between its
//! phases (`GANTRY_NATIVE_CUDA_PROFILE=1`; off by default, and graphs are off while it is on).
//!
//! The launches of a step mark the end of each phase (`mark`); after the step's
//! synchronisation the time between consecutive marks is added to its phase. Decode steps are
//! summed per batch size, and one line per size goes to stderr when the size changes and at
//! drop: milliseconds per step of each phase (the layers' phases summed over the layers).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};

#[derive(Default)]
struct State {
    marks: Vec<(&'static str, CudaEvent)>,
    pool: Vec<CudaEvent>,
    totals: BTreeMap<&'static str, f64>,
    steps: u64,
    batch: usize,
}

pub(super) struct Profile {
    pub enabled: bool,
    ctx: Arc<CudaContext>,
    state: RefCell<State>,
}

impl Profile {
    pub fn new(ctx: &Arc<CudaContext>) -> Self {
        Self {
            enabled: std::env::var("GANTRY_NATIVE_CUDA_PROFILE").is_ok_and(|v| v == "1"),
            ctx: Arc::clone(ctx),
            state: RefCell::default(),
        }
    }

    /// The end of `phase` on the stream (nothing when profiling is off).
    pub fn mark(&self, phase: &'static str, stream: &CudaStream) {
        if !self.enabled {
            return;
        }
        let mut s = self.state.borrow_mut();
        let ev = match s.pool.pop() {
            Some(e) => e,
            None => match self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
                Ok(e) => e,
                Err(_) => return,
            },
        };
        if ev.record(stream).is_ok() {
            s.marks.push((phase, ev));
        }
    }

    /// After the step's synchronisation: add its phases to the totals of `batch` (a decode
    /// step), or drop them (any other step, `batch` None).
    pub fn collect(&self, batch: Option<usize>) {
        if !self.enabled {
            return;
        }
        let mut s = self.state.borrow_mut();
        let marks = std::mem::take(&mut s.marks);
        if let Some(b) = batch {
            if b != s.batch && s.steps > 0 {
                print_summary(&s);
                s.totals.clear();
                s.steps = 0;
            }
            s.batch = b;
            for pair in marks.windows(2) {
                if let Ok(ms) = pair[0].1.elapsed_ms(&pair[1].1) {
                    *s.totals.entry(pair[1].0).or_default() += f64::from(ms);
                }
            }
            s.steps += 1;
        }
        s.pool.extend(marks.into_iter().map(|(_, e)| e));
    }
}

fn print_summary(s: &State) {
    let per = |v: f64| v / s.steps as f64;
    let total: f64 = s.totals.values().sum();
    let phases: Vec<String> = s
        .totals
        .iter()
        .map(|(k, &v)| format!("{k} {:.4}", per(v)))
        .collect();
    eprintln!(
        "gantry-engine-native: step profile, batch {}, {} decode steps, ms per step: {}; total {:.4}",
        s.batch,
        s.steps,
        phases.join(", "),
        per(total)
    );
}

impl Drop for Profile {
    fn drop(&mut self) {
        let s = self.state.borrow();
        if self.enabled && s.steps > 0 {
            print_summary(&s);
        }
    }
}
