//! Model reconcile, validate step (pure): the Kubernetes grammars a spec's strings must follow
//! — quantities (and their size in bytes, for the pool's memory fit), DNS-1035 labels,
//! extended resource names — and the OpenAI served-name grammar.

use gantry_api::source::is_dns1123_subdomain;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::invalid::Invalid;

pub(super) fn check_quantity(
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
pub(super) fn is_served_name(s: &str) -> bool {
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
