//! Operator binary entry point (reconcile path starts here).
#![forbid(unsafe_code)]

fn main() {
    eprintln!("gantry-operator: not built yet");
    std::process::exit(2);
}
