//! Model reconcile, validate step (pure, no client): turns a `Model` into a [`ValidModel`] or
//! lists every reason it cannot be served as written.
//!
//! The CRD schema already refuses most bad input at admission. This step
//! re-checks what matters for building objects (the CRD installed in a
//! cluster may be older than this operator) and adds what a schema cannot
//! express: quantity grammar, path traversal in sources, quantization on a
//! non-GGUF format. Each failure quotes the field, becomes part of the
//! `InvalidSpec` condition message, and the reconcile waits for a change.

use gantry_api::source::is_dns1123_subdomain;
use gantry_api::source::{Source, check_relative_file};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;

use crate::context::Settings;
use gantry_crd::{
    Autoscaling, AutoscalingMode, Cache, CacheType, EngineConfig, GpuBackend, LoadPolicy, Model,
    ModelFormat, Replicas, Rollout, RolloutStrategy, Scheduling,
};

/// A Model that passed validation, with every default filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidModel {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub generation: Option<i64>,
    /// OpenAI model id: `spec.servedName` or the object name.
    pub served_name: String,
    pub source: ValidSource,
    pub format: ModelFormat,
    /// `spec.architecture`, when the user stated it.
    pub declared_architecture: Option<String>,
    /// `spec.engine`.
    pub pin: Option<String>,
    /// `cuda` when the Model asks for GPUs, `cpu` otherwise.
    pub backend: GpuBackend,
    pub gpus: i32,
    pub gpu_resource: String,
    pub memory: Option<Quantity>,
    pub cpu: Option<Quantity>,
    pub scheduling: Scheduling,
    pub replicas: Replicas,
    pub autoscaling: ValidAutoscaling,
    pub rollout: ValidRollout,
    pub engine_config: EngineConfig,
    pub cache: Cache,
    pub load: LoadPolicy,
    /// `spec.pool`: the ModelPool whose pods serve this Model instead of its own.
    pub pool: Option<String>,
    /// The object the owned objects belong to: the Model itself, or the ModelPool for the
    /// template the pool reconcile builds its pods from (pool/validate.rs).
    pub owner: Owner,
}

/// The controller reference of built objects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// `Model` or `ModelPool`.
    pub kind: &'static str,
    pub name: String,
}

/// `spec.autoscaling` with every default filled in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidAutoscaling {
    pub mode: AutoscalingMode,
    /// Requests per node pod to aim for.
    pub target_queue_depth: i32,
    /// KV-cache (VRAM) utilization per node pod to aim for, in percent.
    pub target_vram_utilization: i32,
    pub scale_down_stabilization_seconds: i32,
    pub scale_to_zero_after_seconds: i32,
}

/// `spec.rollout` as the Deployment's RollingUpdate: exactly one of the two is non-zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidRollout {
    pub strategy: RolloutStrategy,
    pub max_surge: i32,
    pub max_unavailable: i32,
}

impl Default for ValidRollout {
    /// `Surge` by one pod: no downtime, whatever the replica count.
    fn default() -> Self {
        ValidRollout {
            strategy: RolloutStrategy::Surge,
            max_surge: 1,
            max_unavailable: 0,
        }
    }
}

/// Fill the rollout defaults and re-check what the CRD's schema and CEL rules state: each knob
/// belongs to one strategy, and is between 1 and 100.
fn validate_rollout(spec: Option<&Rollout>, problems: &mut Vec<Invalid>) -> ValidRollout {
    let Some(r) = spec else {
        return ValidRollout::default();
    };
    let mut knob = |name: &'static str, value: Option<i32>| {
        let v = value.unwrap_or(1);
        if !(1..=100).contains(&v) {
            problems.push(Invalid::new(
                name,
                format!("must be between 1 and 100, got {v}"),
            ));
        }
        v
    };
    let (surge, unavailable) = (
        knob("spec.rollout.maxSurge", r.max_surge),
        knob("spec.rollout.maxUnavailable", r.max_unavailable),
    );
    match r.strategy {
        RolloutStrategy::Surge => {
            if r.max_unavailable.is_some() {
                problems.push(Invalid::new(
                    "spec.rollout.maxUnavailable",
                    "applies only to strategy InPlace (Surge never removes a pod before its replacement is ready)",
                ));
            }
            ValidRollout {
                strategy: r.strategy,
                max_surge: surge,
                max_unavailable: 0,
            }
        }
        RolloutStrategy::InPlace => {
            if r.max_surge.is_some() {
                problems.push(Invalid::new(
                    "spec.rollout.maxSurge",
                    "applies only to strategy Surge (InPlace never starts a pod above the count)",
                ));
            }
            ValidRollout {
                strategy: r.strategy,
                max_surge: 0,
                max_unavailable: unavailable,
            }
        }
    }
}

/// Defaults of `spec.autoscaling` (docs/autoscaling.md lists them).
pub const DEFAULT_TARGET_QUEUE_DEPTH: i32 = 4;
pub const DEFAULT_TARGET_VRAM_UTILIZATION: i32 = 80;
pub const DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS: i32 = 300;
pub const DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS: i32 = 600;

impl Default for ValidAutoscaling {
    fn default() -> Self {
        ValidAutoscaling {
            mode: AutoscalingMode::Builtin,
            target_queue_depth: DEFAULT_TARGET_QUEUE_DEPTH,
            target_vram_utilization: DEFAULT_TARGET_VRAM_UTILIZATION,
            scale_down_stabilization_seconds: DEFAULT_SCALE_DOWN_STABILIZATION_SECONDS,
            scale_to_zero_after_seconds: DEFAULT_SCALE_TO_ZERO_AFTER_SECONDS,
        }
    }
}

/// Fill the autoscaling defaults and re-check the ranges the CRD schema states.
fn validate_autoscaling(
    spec: Option<&Autoscaling>,
    replicas: &Replicas,
    problems: &mut Vec<Invalid>,
) -> ValidAutoscaling {
    let d = ValidAutoscaling::default();
    let Some(a) = spec else { return d };
    let mut field = |name: &'static str, value: Option<i32>, lo: i32, hi: i32, default: i32| {
        let v = value.unwrap_or(default);
        if !(lo..=hi).contains(&v) {
            problems.push(Invalid::new(
                name,
                format!("must be between {lo} and {hi}, got {v}"),
            ));
        }
        v
    };
    let out = ValidAutoscaling {
        mode: a.mode,
        target_queue_depth: field(
            "spec.autoscaling.targetQueueDepth",
            a.target_queue_depth,
            1,
            10000,
            d.target_queue_depth,
        ),
        target_vram_utilization: field(
            "spec.autoscaling.targetVramUtilization",
            a.target_vram_utilization,
            1,
            100,
            d.target_vram_utilization,
        ),
        scale_down_stabilization_seconds: field(
            "spec.autoscaling.scaleDownStabilizationSeconds",
            a.scale_down_stabilization_seconds,
            0,
            3600,
            d.scale_down_stabilization_seconds,
        ),
        scale_to_zero_after_seconds: field(
            "spec.autoscaling.scaleToZeroAfterSeconds",
            a.scale_to_zero_after_seconds,
            0,
            86400,
            d.scale_to_zero_after_seconds,
        ),
    };
    // `minReplicas: 0` needs the alpha HPAScaleToZero gate; refusing is clearer than a silent 1.
    if a.mode == AutoscalingMode::Hpa && replicas.min < 1 {
        problems.push(Invalid::new(
            "spec.replicas.min",
            format!(
                "must be >= 1 with autoscaling.mode HPA (a HorizontalPodAutoscaler cannot scale to zero; use mode Builtin for min 0), got {}",
                replicas.min
            ),
        ));
    }
    out
}

/// A validated source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidSource {
    /// `spec.source.uri` as written.
    pub uri: String,
    /// What the node is told to fetch: the URI, except `pvc://claim/path`, which becomes
    /// `file:///models/claim/path` on a read-only mount of the claim.
    pub node_uri: String,
    /// `pvc://` sources: the claim to mount.
    pub claim: Option<String>,
    pub files: Vec<String>,
    pub quantization: Option<String>,
    /// Secret name and key of the source token.
    pub secret: Option<(String, String)>,
}

impl ValidSource {
    /// What `status.observedSource` records: the URI plus `@quantization` when set.
    pub fn key(&self) -> String {
        match &self.quantization {
            Some(q) => format!("{} ({q})", self.uri),
            None => self.uri.clone(),
        }
    }

    pub fn is_hugging_face(&self) -> bool {
        self.uri.starts_with("hf://")
    }

    pub fn is_s3(&self) -> bool {
        self.uri.starts_with("s3://")
    }
}

/// One reason a Model cannot be served as written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    /// The offending field, as a path (`spec.source.uri`).
    pub field: &'static str,
    pub message: String,
}

impl Invalid {
    pub(crate) fn new(field: &'static str, message: impl Into<String>) -> Self {
        Invalid {
            field,
            message: message.into(),
        }
    }

    /// Stable label for the `reconcile_errors_total` metric.
    pub fn metric_label(&self) -> &'static str {
        "invalid_spec"
    }
}

/// Every reason, joined for a condition message.
pub fn message(problems: &[Invalid]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Validate a Model against everything the build step relies on.
pub fn validate(model: &Model, settings: &Settings) -> Result<ValidModel, Vec<Invalid>> {
    let mut problems = Vec::new();
    let spec = &model.spec;
    let name = model.name_any();

    if !is_dns1035_label(&name) {
        problems.push(Invalid::new(
            "metadata.name",
            format!("must be a DNS-1035 label of at most 63 characters (it names the Service), got {name:?}"),
        ));
    }
    let namespace = model.namespace().unwrap_or_default();
    if namespace.is_empty() {
        problems.push(Invalid::new("metadata.namespace", "must be set"));
    }

    let served_name = spec.served_name.clone().unwrap_or_else(|| name.clone());
    if !is_served_name(&served_name) {
        problems.push(Invalid::new(
            "spec.servedName",
            format!("must be 1-128 characters of letters, digits and . _ : / -, starting with a letter or digit, got {served_name:?}"),
        ));
    }

    let source = match validate_source(model) {
        Ok(s) => Some(s),
        Err(mut p) => {
            problems.append(&mut p);
            None
        }
    };

    // A GPU count selects the `cuda` backend for engine selection; 0 means CPU.
    let resources = spec.resources.clone().unwrap_or_default();
    let gpus = resources.gpus.unwrap_or(0);
    if !(0..=16).contains(&gpus) {
        problems.push(Invalid::new(
            "spec.resources.gpus",
            format!("must be between 0 and 16, got {gpus}"),
        ));
    }
    let gpu_resource = resources
        .gpu_resource_name
        .clone()
        .unwrap_or_else(|| settings.default_gpu_resource.clone());
    if !is_resource_name(&gpu_resource) {
        problems.push(Invalid::new(
            "spec.resources.gpuResourceName",
            format!(
                "must be an extended resource name such as nvidia.com/gpu, got {gpu_resource:?}"
            ),
        ));
    }
    check_quantity(
        &mut problems,
        "spec.resources.memory",
        resources.memory.as_ref(),
        true,
    );
    check_quantity(
        &mut problems,
        "spec.resources.cpu",
        resources.cpu.as_ref(),
        true,
    );

    let replicas = spec.replicas.clone().unwrap_or_default();
    if replicas.min < 0 {
        problems.push(Invalid::new(
            "spec.replicas.min",
            format!("must be >= 0, got {}", replicas.min),
        ));
    }
    if replicas.max < 1 {
        problems.push(Invalid::new(
            "spec.replicas.max",
            format!("must be >= 1, got {}", replicas.max),
        ));
    }
    if replicas.min > replicas.max {
        problems.push(Invalid::new(
            "spec.replicas",
            format!("min ({}) must be <= max ({})", replicas.min, replicas.max),
        ));
    }

    let autoscaling = validate_autoscaling(spec.autoscaling.as_ref(), &replicas, &mut problems);
    let rollout = validate_rollout(spec.rollout.as_ref(), &mut problems);

    let engine_config = spec.engine_config.clone().unwrap_or_default();
    for (field, value) in [
        (
            "spec.engineConfig.contextLength",
            engine_config.context_length,
        ),
        (
            "spec.engineConfig.maxBatchSize",
            engine_config.max_batch_size,
        ),
        ("spec.engineConfig.threads", engine_config.threads),
    ] {
        if let Some(v) = value.filter(|v| *v < 1) {
            problems.push(Invalid::new(field, format!("must be >= 1, got {v}")));
        }
    }

    let cache = spec.cache.clone().unwrap_or_default();
    if cache.type_ == CacheType::PersistentVolumeClaim && cache.size.is_none() {
        problems.push(Invalid::new(
            "spec.cache.size",
            "is required when spec.cache.type is PersistentVolumeClaim",
        ));
    }
    check_quantity(&mut problems, "spec.cache.size", cache.size.as_ref(), true);

    if let Some(pin) = &spec.engine
        && !crate::acceptance::is_engine_id(pin)
    {
        problems.push(Invalid::new(
            "spec.engine",
            format!("must be an engine id (lower-case letters, digits, _ and -), got {pin:?}"),
        ));
    }
    if let Some(pool) = &spec.pool {
        check_pool_member(model, pool, source.as_ref(), &mut problems);
    }
    // A Model's node pods serve that one model, and a node loads lazily only
    // when it serves several (it refuses the config otherwise). Pool members always load lazily.
    if spec.load == gantry_crd::LoadPolicy::Lazy && spec.pool.is_none() {
        problems.push(Invalid::new(
            "spec.load",
            "`lazy` needs a node serving several models; a Model's node pods serve one, so use `eager`",
        ));
    }
    if spec.format != ModelFormat::Gguf && source.as_ref().is_some_and(|s| s.quantization.is_some())
    {
        problems.push(Invalid::new(
            "spec.source.quantization",
            "only applies to format gguf",
        ));
    }

    match source {
        Some(source) if problems.is_empty() => Ok(ValidModel {
            uid: model.uid().unwrap_or_default(),
            generation: model.metadata.generation,
            served_name,
            source,
            format: spec.format,
            declared_architecture: spec.architecture.clone(),
            pin: spec.engine.clone(),
            backend: if gpus > 0 {
                GpuBackend::Cuda
            } else {
                GpuBackend::Cpu
            },
            gpus,
            gpu_resource,
            memory: resources.memory,
            cpu: resources.cpu,
            scheduling: spec.scheduling.clone().unwrap_or_default(),
            replicas,
            autoscaling,
            rollout,
            engine_config,
            cache,
            load: spec.load,
            pool: spec.pool.clone(),
            owner: Owner {
                kind: "Model",
                name: name.clone(),
            },
            name,
            namespace,
        }),
        _ => Err(problems),
    }
}

/// A pool member leaves the pod template to its pool: the fields that shape node pods are
/// refused on it, and so are sources that need a per-model volume or Secret in the pod.
fn check_pool_member(
    model: &Model,
    pool: &str,
    source: Option<&ValidSource>,
    problems: &mut Vec<Invalid>,
) {
    let spec = &model.spec;
    let resources = spec.resources.clone().unwrap_or_default();
    for (field, set) in [
        ("spec.replicas", spec.replicas.is_some()),
        ("spec.autoscaling", spec.autoscaling.is_some()),
        ("spec.rollout", spec.rollout.is_some()),
        ("spec.scheduling", spec.scheduling.is_some()),
        ("spec.cache", spec.cache.is_some()),
        ("spec.resources.gpus", resources.gpus.is_some()),
        (
            "spec.resources.gpuResourceName",
            resources.gpu_resource_name.is_some(),
        ),
        ("spec.resources.cpu", resources.cpu.is_some()),
    ] {
        if set {
            problems.push(Invalid::new(
                field,
                format!("belongs to the ModelPool `{pool}` for a member of it; set it there, or remove spec.pool"),
            ));
        }
    }
    if let Some(claim) = source.and_then(|s| s.claim.as_ref()) {
        problems.push(Invalid::new(
            "spec.source.uri",
            format!("a pvc:// source (claim `{claim}`) cannot join a pool: the pool's pods mount no per-model claims; use hf://, s3://, https:// or a file:// path on the pool's cache"),
        ));
    }
    if source.is_some_and(|s| s.secret.is_some()) {
        problems.push(Invalid::new(
            "spec.source.secretRef",
            "a source with a Secret cannot join a pool: the pool's pods carry no per-model credentials",
        ));
    }
}

/// The URI by the grammar the node applies too (`gantry_api::source`), plus the one cluster
/// policy (no plain `http://`). `pvc://` sources are rewritten to a read-only mount of the
/// claim, so the node only ever sees `file://`.
fn validate_source(model: &Model) -> Result<ValidSource, Vec<Invalid>> {
    let src = &model.spec.source;
    let uri = src.uri.trim();
    let mut problems = Vec::new();
    let mut claim = None;
    let mut node_uri = uri.to_string();
    match Source::parse(uri).and_then(|s| s.check_cluster_policy(uri).map(|()| s)) {
        Ok(source) => {
            node_uri = source.node_uri(uri);
            if let Source::Pvc { claim: c, .. } = &source {
                claim = Some(c.clone());
            }
        }
        Err(e) => problems.push(Invalid::new("spec.source.uri", e.reason)),
    }
    for f in &src.files {
        if let Err(message) = check_relative_file(f) {
            problems.push(Invalid::new("spec.source.files", message));
        }
    }
    let secret = src.secret_ref.as_ref().map(|r| {
        (
            r.name.clone(),
            r.key.clone().unwrap_or_else(|| "token".to_string()),
        )
    });
    if let Some((name, _)) = &secret
        && !is_dns1123_subdomain(name)
    {
        problems.push(Invalid::new(
            "spec.source.secretRef.name",
            format!("must be a Secret name, got {name:?}"),
        ));
    }
    if problems.is_empty() {
        Ok(ValidSource {
            uri: uri.to_string(),
            node_uri,
            claim,
            files: src.files.clone(),
            quantization: src.quantization.clone(),
            secret,
        })
    } else {
        Err(problems)
    }
}

fn check_quantity(
    problems: &mut Vec<Invalid>,
    field: &'static str,
    q: Option<&Quantity>,
    positive: bool,
) {
    if let Some(q) = q {
        if !is_quantity(&q.0) {
            problems.push(Invalid::new(
                field,
                format!(
                    "must be a Kubernetes quantity such as 8Gi or 500m, got {:?}",
                    q.0
                ),
            ));
        } else if positive && (q.0.starts_with('-') || is_zero(&q.0)) {
            problems.push(Invalid::new(
                field,
                format!("must be positive, got {:?}", q.0),
            ));
        }
    }
}

/// True for `0`, `0.0`, `000m`...: a zero quantity requests nothing and limits to nothing.
fn is_zero(s: &str) -> bool {
    let digits: String = s
        .trim_start_matches('+')
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    digits.chars().all(|c| c == '0' || c == '.')
}

/// Kubernetes' quantity grammar: `[+-]number[suffix]`, suffix one of the binary-SI
/// (`Ki`..`Ei`), decimal-SI (`n u m k M G T P E`) or an exponent (`e3`, `E-2`).
pub fn is_quantity(s: &str) -> bool {
    fn number(s: &str) -> Option<&str> {
        let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
        let rest = &s[int_len..];
        match rest.strip_prefix('.') {
            Some(frac) => {
                let frac_len = frac.bytes().take_while(u8::is_ascii_digit).count();
                if int_len == 0 && frac_len == 0 {
                    None
                } else {
                    Some(&frac[frac_len..])
                }
            }
            None if int_len > 0 => Some(rest),
            None => None,
        }
    }
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let Some(suffix) = number(s) else {
        return false;
    };
    match suffix {
        "" | "Ki" | "Mi" | "Gi" | "Ti" | "Pi" | "Ei" | "n" | "u" | "m" | "k" | "M" | "G" | "T"
        | "P" | "E" => true,
        exp => match exp.strip_prefix(['e', 'E']) {
            Some(e) => {
                let e = e.strip_prefix(['+', '-']).unwrap_or(e);
                number(e) == Some("")
            }
            None => false,
        },
    }
}

/// Bytes of a quantity [`is_quantity`] accepts (`512Mi`, `2G`, `1.5e9`); `None` for anything
/// else. Close enough for comparing memory sizes, not for money.
pub fn quantity_bytes(s: &str) -> Option<f64> {
    if !is_quantity(s) {
        return None;
    }
    const SUFFIXES: [(&str, f64); 15] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("Ei", 1152921504606846976.0),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    for (suffix, factor) in SUFFIXES {
        if let Some(n) = s.strip_suffix(suffix)
            && let Ok(v) = n.parse::<f64>()
        {
            return Some(v * factor);
        }
    }
    // Plain numbers and decimal exponents (`1e9`) parse as they are.
    s.parse::<f64>().ok()
}

/// `[a-z]([-a-z0-9]*[a-z0-9])?`, at most 63 characters.
pub fn is_dns1035_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_lowercase()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[b.len() - 1] != b'-'
}

/// Lower-case alphanumerics, `-` and `.`, starting and ending alphanumeric, at most 253.
fn is_served_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && b[0].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"._:/-".contains(c))
}

/// `[prefix/]name` as Kubernetes resource names are written (`nvidia.com/gpu`).
pub fn is_resource_name(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    prefix.is_none_or(is_dns1123_subdomain)
        && !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric()
}
