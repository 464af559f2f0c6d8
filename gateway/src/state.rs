//! What every request shares (the whole request path: axum hands it to each handler of
//! [`crate::router()`]): the route table, the upstream HTTP client, metrics, API keys, the
//! scale-up requests and the settings, plus the count of requests held now.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use crate::auth::ApiKeys;
use crate::metrics::GatewayMetrics;
use crate::route_table::RouteTable;
use crate::scale::ScaleRequests;
use crate::settings::GatewaySettings;

/// Shared by every request.
pub struct GatewayState {
    pub table: Arc<RouteTable>,
    pub client: reqwest::Client,
    pub metrics: Arc<GatewayMetrics>,
    pub keys: Option<Arc<ApiKeys>>,
    pub scale: ScaleRequests,
    pub settings: GatewaySettings,
    /// Requests held now, all models.
    pub(crate) held: AtomicUsize,
}

impl std::fmt::Debug for GatewayState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GatewayState")
    }
}
