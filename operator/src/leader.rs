//! Leader election (before any reconcile runs): only the replica holding the
//! `coordination.k8s.io/v1` Lease runs the controllers.
//!
//! kube 5 ships no leader-election helper, so this is the client-go algorithm
//! in small: read the Lease; create it if absent; renew it if we hold it; take
//! it over if its holder has not renewed for `leaseDurationSeconds`. Every
//! write is a create or a `resourceVersion`-guarded replace, so two candidates
//! racing for the same Lease cannot both win: the loser gets 409 Conflict.
//!
//! Expiry is judged on this replica's monotonic clock — how long the record
//! has stayed unchanged since we first saw it — never by comparing the
//! holder's `renewTime` with our wall clock, so clock skew between nodes
//! cannot make a live leader look expired.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};

use crate::metrics::Metrics;

/// Lease timing, as client-go defaults them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a holder's Lease stays valid without renewal.
    pub lease_duration: Duration,
    /// A leader that cannot renew for this long steps down.
    pub renew_deadline: Duration,
    /// How often to renew, and how often a follower retries.
    pub retry_period: Duration,
}

impl LeaseConfig {
    pub fn new(namespace: String, name: String, identity: String) -> Self {
        LeaseConfig {
            namespace,
            name,
            identity,
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Why a Lease call failed (other than losing a race, which is not an error).
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    #[error("cannot read Lease {name}: {source}")]
    Read {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot write Lease {name}: {source}")]
    Write {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("lost the leader Lease: not renewed within {0:?}")]
    Lost(Duration),
}

impl LeaseError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            LeaseError::Read { .. } => "lease_read",
            LeaseError::Write { .. } => "lease_write",
            LeaseError::Lost(_) => "lease_lost",
        }
    }
}

/// What to do with the Lease as read.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// No Lease yet: create this one.
    Create(Lease),
    /// We hold it: write this renewed copy.
    Renew(Lease),
    /// Its holder let it expire: write this copy naming us.
    TakeOver(Lease),
    /// Someone else holds it.
    Follow { holder: String },
}

/// Decide from the Lease as read. `expired` is the caller's monotonic-clock judgement of
/// whether the current record has gone unrenewed for its duration.
pub fn decide(
    config: &LeaseConfig,
    current: Option<&Lease>,
    expired: bool,
    now: Timestamp,
) -> Step {
    let duration = i32::try_from(config.lease_duration.as_secs()).unwrap_or(15);
    let Some(lease) = current else {
        return Step::Create(Lease {
            metadata: ObjectMeta {
                name: Some(config.name.clone()),
                namespace: Some(config.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(config.identity.clone()),
                lease_duration_seconds: Some(duration),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..LeaseSpec::default()
            }),
        });
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.clone().unwrap_or_default();
    // The copy keeps metadata.resourceVersion: the replace is refused if anyone wrote since.
    let mut next = lease.clone();
    if holder == config.identity {
        next.spec = Some(LeaseSpec {
            renew_time: Some(MicroTime(now)),
            lease_duration_seconds: Some(duration),
            ..spec
        });
        return Step::Renew(next);
    }
    if !holder.is_empty() && !expired {
        return Step::Follow { holder };
    }
    next.spec = Some(LeaseSpec {
        holder_identity: Some(config.identity.clone()),
        lease_duration_seconds: Some(duration),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(spec.lease_transitions.unwrap_or(0).saturating_add(1)),
        ..spec
    });
    Step::TakeOver(next)
}

/// One candidate for leadership.
pub struct LeaderElector {
    api: Api<Lease>,
    config: LeaseConfig,
    /// The last record seen held by someone else, and when we first saw it.
    observed: Option<(String, Instant)>,
}

impl LeaderElector {
    pub fn new(client: kube::Client, config: LeaseConfig) -> Self {
        LeaderElector {
            api: Api::namespaced(client, &config.namespace),
            config,
            observed: None,
        }
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    /// One round: returns whether we hold the Lease afterwards.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool, LeaseError> {
        let name = self.config.name.clone();
        let current = self
            .api
            .get_opt(&name)
            .await
            .map_err(|source| LeaseError::Read {
                name: name.clone(),
                source,
            })?;
        let expired = match &current {
            Some(lease) => {
                let spec = lease.spec.clone().unwrap_or_default();
                let record = format!(
                    "{}|{:?}|{}",
                    spec.holder_identity.unwrap_or_default(),
                    spec.renew_time.map(|t| t.0),
                    lease.metadata.resource_version.clone().unwrap_or_default()
                );
                let duration = spec
                    .lease_duration_seconds
                    .and_then(|s| u64::try_from(s).ok())
                    .map_or(self.config.lease_duration, Duration::from_secs);
                let seen = match &self.observed {
                    Some((r, at)) if *r == record => *at,
                    _ => {
                        let at = Instant::now();
                        self.observed = Some((record, at));
                        at
                    }
                };
                seen.elapsed() > duration
            }
            None => false,
        };
        let write_err = |source| LeaseError::Write {
            name: name.clone(),
            source,
        };
        let result = match decide(&self.config, current.as_ref(), expired, Timestamp::now()) {
            Step::Follow { .. } => return Ok(false),
            Step::Create(lease) => self.api.create(&PostParams::default(), &lease).await,
            Step::Renew(lease) | Step::TakeOver(lease) => {
                self.api
                    .replace(&name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => Ok(true),
            // Someone else wrote first: not leader this round.
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(write_err(e)),
        }
    }

    /// Block until this replica holds the Lease.
    pub async fn acquire(&mut self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election"),
            }
            tokio::time::sleep(self.config.retry_period).await;
        }
    }

    /// Renew until renewing fails for longer than the renew deadline; returns why it stopped.
    pub async fn hold(&mut self, metrics: &Metrics) -> LeaseError {
        let mut last_renewed = Instant::now();
        loop {
            tokio::time::sleep(self.config.retry_period).await;
            match self.try_acquire_or_renew().await {
                Ok(true) => last_renewed = Instant::now(),
                Ok(false) => {
                    metrics.leader.set(0);
                    return LeaseError::Lost(self.config.renew_deadline);
                }
                Err(e) => tracing::warn!(error = %e, "cannot renew the leader Lease"),
            }
            if last_renewed.elapsed() > self.config.renew_deadline {
                metrics.leader.set(0);
                return LeaseError::Lost(self.config.renew_deadline);
            }
        }
    }

    /// Give the Lease up on clean shutdown so a successor need not wait for it to expire.
    pub async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.config.name).await else {
            return;
        };
        let mut spec = lease.spec.clone().unwrap_or_default();
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        lease.spec = Some(spec);
        if let Err(e) = self
            .api
            .replace(&self.config.name, &PostParams::default(), &lease)
            .await
        {
            tracing::warn!(error = %e, "cannot release the leader Lease");
        }
    }
}
