//! The model store: turning a MODEL argument into a folder. In order: a local folder; the Hugging Face
//! cache (reused read-only); mlxcel's own store; otherwise a download from the hub. A bare name
//! without `/` means `mlx-community/<name>` (`MLXCEL_DEFAULT_ORG` changes the owner).

pub mod hub;
pub mod resolve;

pub use resolve::{resolve_model, store_root, RepoId, ResolveOptions, Resolved};
