//! Plugin images (issue #13): references, pulling from a registry, a content-addressed blob
//! store and the safe application of layer tars to a root file system.
//!
//! It owns these:
//! - [`reference`]: image names resolved as Docker and Mesos do, and the registry settings
//!   (default registry, insecure registries, credentials from a docker `config.json`).
//! - [`pull`]: a pull (manifest, index, config, layers), every blob verified into [`blobs`],
//!   every size and wait bounded, typed errors that say which ones are transient.
//! - [`registry`]: the HTTP conversation with a registry (on reqwest), every answer read
//!   under a size cap before it is buffered.
//! - [`store`]: the image store of the daemon (`<work_dir>/images`): the blob store, a
//!   durable index, each layer unpacked once (overlayfs) or a flattened rootfs per image,
//!   garbage collection, Mesos `cached`.
//! - [`progress`]: the pulls in flight and their bytes, per blob, for the API and csictl.
//! - [`budget`]: the per-image caps on unpacked bytes and inodes and the store's quota,
//!   charged while writing; the store's disk usage.
//! - [`blobs`]: `blobs/sha256/<hex>` under a directory the caller chooses. A blob enters only
//!   whole and verified (digest and size checked while streaming, fsynced, renamed into place,
//!   the directory fsynced); a partial or mismatching blob is never visible under its name.
//! - [`import`]: an OCI layout or `docker save` archive read as a hostile stream, every blob
//!   verified into [`blobs`], the images indexed through the same path as a pull.
//! - [`overlay`]: the overlayfs mount of an image's layer directories under a container's
//!   own upper directory, and the probe that says whether this host can make one.
//! - [`unpack`]: applying a layer tar (plain or gzip) to a root directory in the OCI layer
//!   semantics (whiteouts, opaque directories), creating every entry with `*at` syscalls
//!   relative to a parent fd reached beneath the root without following symlinks
//!   ([`crate::beneath`]), within configurable limits.
//!
//! Only [`pull`] and [`registry`] talk to the network. None of it decides where in the work dir the store lives,
//! nor which roots are safe to unpack into: the caller hands it a directory it owns
//! (an empty temp dir it will rename into place once every layer is applied). Layer tars are
//! treated as hostile input; the root directory given is trusted as the operator's.

pub mod blobs;
pub mod budget;
pub mod import;
pub mod overlay;
pub mod progress;
pub mod pull;
pub mod reference;
pub mod registry;
pub mod store;
pub mod unpack;
