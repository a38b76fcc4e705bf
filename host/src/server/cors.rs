//! Cross-origin requests from browsers, as llama-server answers them (`--cors-origins`,
//! `--cors-methods`, `--cors-headers`, `--cors-credentials`): by default any origin, with
//! credentials — the request's `Origin` named back, as browsers take no `*` beside credentials.

use anyhow::{bail, Result};
use axum::http::{HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer};

/// llama-server's default `--cors-methods`.
pub const DEFAULT_METHODS: &str = "GET, POST, DELETE, OPTIONS";

/// Which origins may call the server.
#[derive(Debug, Clone, PartialEq)]
pub enum Origins {
    Any,
    /// llama-server's `localhost`: an origin on this machine (`localhost`, `127.0.0.1`, `[::1]`).
    Localhost,
    List(Vec<HeaderValue>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct CorsConfig {
    pub origins: Origins,
    /// None: any method (`*`).
    pub methods: Option<Vec<Method>>,
    /// None: any header (`*`; the request's named back, as a browser does not count
    /// `Authorization` as covered by a wildcard).
    pub headers: Option<Vec<HeaderName>>,
    pub credentials: bool,
}

impl Default for CorsConfig {
    fn default() -> Self {
        CorsConfig::parse("*", DEFAULT_METHODS, "*", true).expect("the defaults parse")
    }
}

impl CorsConfig {
    /// The flags' values: comma-separated lists, or `*` (also as one item of a list: any).
    pub fn parse(origins: &str, methods: &str, headers: &str, credentials: bool) -> Result<CorsConfig> {
        let list = |s: &str| -> Vec<String> {
            s.split(',').map(str::trim).filter(|s| !s.is_empty()).map(String::from).collect()
        };
        let any = |s: &str| list(s).iter().any(|i| i == "*");
        let origins = match origins.trim() {
            _ if any(origins) => Origins::Any,
            "localhost" => Origins::Localhost,
            s => {
                let values: Result<Vec<HeaderValue>, _> = list(s).iter().map(|o| HeaderValue::from_str(o)).collect();
                match values {
                    Ok(v) if !v.is_empty() => Origins::List(v),
                    _ => bail!("--cors-origins {s:?}: expected `*`, `localhost` or a comma-separated list of origins"),
                }
            }
        };
        let methods = match methods.trim() {
            _ if any(methods) => None,
            s => {
                let parsed: Result<Vec<Method>, _> = list(s).iter().map(|m| Method::from_bytes(m.as_bytes())).collect();
                match parsed {
                    Ok(v) if !v.is_empty() => Some(v),
                    _ => bail!("--cors-methods {s:?}: expected `*` or a comma-separated list of HTTP methods"),
                }
            }
        };
        let headers = match headers.trim() {
            _ if any(headers) => None,
            s => {
                let parsed: Result<Vec<HeaderName>, _> =
                    list(s).iter().map(|h| HeaderName::from_bytes(h.as_bytes())).collect();
                match parsed {
                    Ok(v) if !v.is_empty() => Some(v),
                    _ => bail!("--cors-headers {s:?}: expected `*` or a comma-separated list of header names"),
                }
            }
        };
        Ok(CorsConfig { origins, methods, headers, credentials })
    }

    /// The layer that answers preflights and marks responses. Wildcards are answered by naming the
    /// request's origin, method or headers back, which browsers accept with credentials too.
    pub fn layer(&self) -> CorsLayer {
        let origin = match &self.origins {
            Origins::Any => AllowOrigin::mirror_request(),
            Origins::Localhost => AllowOrigin::predicate(|origin, _| is_localhost(origin)),
            Origins::List(v) => AllowOrigin::list(v.clone()),
        };
        let methods = match &self.methods {
            None => AllowMethods::mirror_request(),
            Some(v) => AllowMethods::list(v.clone()),
        };
        let headers = match &self.headers {
            None => AllowHeaders::mirror_request(),
            Some(v) => AllowHeaders::list(v.clone()),
        };
        let layer = CorsLayer::new()
            .allow_origin(origin)
            .allow_methods(methods)
            .allow_headers(headers)
            .allow_credentials(self.credentials)
            .max_age(std::time::Duration::from_secs(3600));
        match (&self.origins, self.credentials) {
            // Without credentials, any origin is `*` (the answer then holds for every origin; a
            // cache keyed by Origin is not needed).
            (Origins::Any, false) => layer.allow_origin(tower_http::cors::Any),
            _ => layer,
        }
    }
}

/// Whether `origin` (`scheme://host[:port]`) is on this machine.
fn is_localhost(origin: &HeaderValue) -> bool {
    let Ok(s) = origin.to_str() else { return false };
    let Some((_, rest)) = s.split_once("://") else { return false };
    let host = match rest.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => rest.split(':').next().unwrap_or_default(),
    };
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_as_llama_server_reads_them() {
        let d = CorsConfig::default();
        assert_eq!((d.origins.clone(), d.headers.clone(), d.credentials), (Origins::Any, None, true));
        assert_eq!(d.methods.unwrap().len(), 4);
        let c = CorsConfig::parse("https://a.test, https://b.test", "*", "authorization,content-type", false).unwrap();
        assert!(matches!(c.origins, Origins::List(ref v) if v.len() == 2));
        assert_eq!((c.methods, c.headers.map(|h| h.len())), (None, Some(2)));
        assert_eq!(CorsConfig::parse("localhost", "*", "*", true).unwrap().origins, Origins::Localhost);
        assert!(CorsConfig::parse("", "*", "*", true).is_err());
        // A `*` among others is any (tower-http refuses it inside a list).
        let c = CorsConfig::parse("https://a.test,*", "*, ", " *, ", true).unwrap();
        assert_eq!((c.origins, c.methods, c.headers), (Origins::Any, None, None));
    }

    #[test]
    fn every_combination_of_the_flags_makes_a_usable_layer() {
        use tower::Layer;
        // tower-http panics when the layer wraps a service if credentials meet a wildcard.
        for origins in ["*", "https://a.test", "localhost", "https://a.test, *"] {
            for methods in ["*", "GET, POST", "GET,*"] {
                for headers in ["*", "authorization", "x-a, *"] {
                    for credentials in [true, false] {
                        let c = CorsConfig::parse(origins, methods, headers, credentials).unwrap();
                        let _ = c.layer().layer(tower::service_fn(|_: axum::extract::Request| async {
                            Ok::<_, std::convert::Infallible>(axum::response::Response::new(axum::body::Body::empty()))
                        }));
                    }
                }
            }
        }
        assert!(CorsConfig::parse("*", "GET POST", "*", true).is_err());
        assert!(CorsConfig::parse("*", "*", "bad header", true).is_err());
    }

    #[test]
    fn localhost_is_this_machine_only() {
        for o in ["http://localhost", "http://localhost:5173", "https://127.0.0.1:8080", "http://[::1]:3000"] {
            assert!(is_localhost(&HeaderValue::from_static(o)), "{o}");
        }
        for o in ["http://localhost.evil.test", "http://example.test", "null", "http://127.0.0.2"] {
            assert!(!is_localhost(&HeaderValue::from_static(o)), "{o}");
        }
    }
}
