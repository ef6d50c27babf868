//! The image store's local half against real tars built here with the `tar` crate: layers
//! merge with whiteouts to exactly the expected tree, hostile entries are refused or
//! neutralised with nothing written outside the root, limits hold, blobs are verified.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use csi_agent::beneath::BeneathError;
use csi_agent::image::blobs::{BlobError, BlobStore, Digest, Put};
use csi_agent::image::store::ImageStoreError;
use csi_agent::image::unpack::{
    Compression, LimitKind, Limits, OVERLAY_OPAQUE_XATTR, Refusal, Report, UnpackError,
    apply_layer, apply_overlay_layer,
};
use tar::EntryType;

/// A layer tar built entry by entry, names and link targets written raw into the header so
/// that hostile ones (which the tar crate's setters refuse) can be made.
struct LayerTar {
    builder: tar::Builder<Vec<u8>>,
}

const MTIME: u64 = 1_600_000_000;

impl LayerTar {
    fn new() -> Self {
        Self {
            builder: tar::Builder::new(Vec::new()),
        }
    }

    fn raw(&mut self, name: &[u8], kind: EntryType, mode: u32, link: &[u8], data: &[u8]) {
        assert!(
            name.len() < 100 && link.len() < 100,
            "names must fit the header"
        );
        let mut header = tar::Header::new_ustar();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(MTIME);
        header.set_size(data.len() as u64);
        let bytes = header.as_mut_bytes();
        bytes[..100].fill(0);
        bytes[..name.len()].copy_from_slice(name);
        bytes[157..257].fill(0);
        bytes[157..157 + link.len()].copy_from_slice(link);
        header.set_cksum();
        self.builder.append(&header, data).unwrap();
    }

    fn dir(&mut self, name: &str, mode: u32) -> &mut Self {
        self.raw(name.as_bytes(), EntryType::Directory, mode, b"", b"");
        self
    }

    fn file(&mut self, name: &str, data: &[u8], mode: u32) -> &mut Self {
        self.raw(name.as_bytes(), EntryType::Regular, mode, b"", data);
        self
    }

    fn owned_file(&mut self, name: &str, data: &[u8], uid: u64, gid: u64) -> &mut Self {
        let mut header = tar::Header::new_ustar();
        header.set_entry_type(EntryType::Regular);
        header.set_mode(0o640);
        header.set_uid(uid);
        header.set_gid(gid);
        header.set_mtime(MTIME);
        header.set_size(data.len() as u64);
        header.set_path(name).unwrap();
        header.set_cksum();
        self.builder.append(&header, data).unwrap();
        self
    }

    fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.raw(
            name.as_bytes(),
            EntryType::Symlink,
            0o777,
            target.as_bytes(),
            b"",
        );
        self
    }

    fn hardlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.raw(
            name.as_bytes(),
            EntryType::Link,
            0o644,
            target.as_bytes(),
            b"",
        );
        self
    }

    fn whiteout(&mut self, name: &str) -> &mut Self {
        self.file(name, b"", 0o644)
    }

    fn bytes(&mut self) -> Vec<u8> {
        let builder = std::mem::replace(&mut self.builder, tar::Builder::new(Vec::new()));
        builder.into_inner().unwrap()
    }

    fn gzip(&mut self) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(&self.bytes()).unwrap();
        encoder.finish().unwrap()
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Node {
    Dir(u32),
    File(u32, Vec<u8>),
    Symlink(PathBuf),
    Other(u32),
}

/// Everything beneath `root`, symlinks not followed.
fn tree(root: &Path) -> BTreeMap<PathBuf, Node> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Node>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path)
                .unwrap_or_else(|err| panic!("{}: {err}", path.display()));
            let mode = meta.permissions().mode() & 0o7777;
            let rel = path.strip_prefix(root).unwrap().to_path_buf();
            let node = if meta.file_type().is_symlink() {
                Node::Symlink(std::fs::read_link(&path).unwrap())
            } else if meta.is_dir() {
                walk(root, &path, out);
                Node::Dir(mode)
            } else if meta.is_file() {
                Node::File(mode, std::fs::read(&path).unwrap())
            } else {
                Node::Other(mode)
            };
            out.insert(rel, node);
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

fn umask() -> u32 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Umask:")).unwrap();
    u32::from_str_radix(line.trim_start_matches("Umask:").trim(), 8).unwrap()
}

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn apply(root: &Path, layer: &[u8]) -> Result<Report, UnpackError> {
    apply_layer(root, layer, Compression::Detect, &Limits::default())
}

/// The overlay form of [`apply`]: `layer` into `dir`, over the one lower layer `lower`.
fn apply_over(dir: &Path, lower: &Path, layer: &[u8]) -> Result<Report, UnpackError> {
    apply_overlay_layer(
        dir,
        &[lower.to_path_buf()],
        layer,
        Compression::Detect,
        &Limits::default(),
    )
}

/// A root and, beside it, an "outside" dir with a sentinel the escapes aim at.
struct Scene {
    _dir: tempfile::TempDir,
    base: PathBuf,
    root: PathBuf,
    outside: PathBuf,
}

impl Scene {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().to_path_buf();
        let root = base.join("root");
        let outside = base.join("outside");
        std::fs::create_dir(&root).unwrap();
        std::fs::create_dir_all(outside.join("sub")).unwrap();
        std::fs::write(outside.join("secret"), b"sentinel").unwrap();
        std::fs::write(outside.join("sub/x"), b"sentinel x").unwrap();
        Self {
            _dir: dir,
            base,
            root,
            outside,
        }
    }

    fn outside_str(&self) -> String {
        self.outside.to_str().unwrap().to_owned()
    }

    /// The base holds only the root and the outside dir.
    fn base_names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.base)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

/// The lower layer of the whiteout tests.
fn whiteout_lower() -> Vec<u8> {
    LayerTar::new()
        .dir("etc/", 0o755)
        .file("etc/keep", b"k", 0o644)
        .file("etc/gone", b"g", 0o644)
        .dir("opt/", 0o755)
        .dir("opt/old/", 0o755)
        .file("opt/old/a", b"a", 0o644)
        .dir("opt/old/sub/", 0o755)
        .file("opt/old/sub/b", b"b", 0o644)
        .dir("bin/", 0o755)
        .file("bin/tool", b"v1", 0o755)
        .hardlink("bin/tool2", "bin/tool")
        .symlink("link", "bin/tool")
        .dir("var/", 0o711)
        .dir("var/lib/", 0o700)
        .file("var/lib/db", b"db", 0o600)
        .bytes()
}

/// The upper layer of the whiteout tests: 5 whiteouts (2 of nothing), an opaque dir.
fn whiteout_upper() -> Vec<u8> {
    LayerTar::new()
        .whiteout("etc/.wh.gone")
        .dir("opt/old/", 0o750)
        // Same-layer content before the opaque marker is kept; lower content is not.
        .file("opt/old/new", b"n", 0o644)
        .dir("opt/old/sub/", 0o755)
        .file("opt/old/sub/c", b"c", 0o644)
        .whiteout("opt/old/.wh..wh..opq")
        .file("bin/tool", b"v2", 0o4755)
        // A whole directory whited out, and a file under a parent no entry names.
        .whiteout("./var/.wh.lib")
        .file("/newdir/file", b"f", 0o600)
        // Whiteouts of what does not exist are no-ops.
        .whiteout("etc/.wh.never")
        .whiteout("nodir/.wh.never")
        .gzip()
}

#[test]
fn two_layers_with_whiteout_and_opaque_merge_to_exactly_the_expected_tree() {
    let scene = Scene::new();
    let root = &scene.root;
    apply(root, &whiteout_lower()).unwrap();
    let report = apply(root, &whiteout_upper()).unwrap();
    assert_eq!(report.whiteouts, 5, "{report:?}");

    let file = |mode, data: &[u8]| Node::File(mode, data.to_vec());
    let expected: BTreeMap<PathBuf, Node> = [
        ("etc", Node::Dir(0o755)),
        ("etc/keep", file(0o644, b"k")),
        ("opt", Node::Dir(0o755)),
        ("opt/old", Node::Dir(0o750)),
        ("opt/old/new", file(0o644, b"n")),
        ("opt/old/sub", Node::Dir(0o755)),
        ("opt/old/sub/c", file(0o644, b"c")),
        ("bin", Node::Dir(0o755)),
        ("bin/tool", file(0o4755, b"v2")),
        // The hard link keeps the inode the replaced file had.
        ("bin/tool2", file(0o755, b"v1")),
        ("link", Node::Symlink(PathBuf::from("bin/tool"))),
        ("var", Node::Dir(0o711)),
        ("newdir", Node::Dir(0o755 & !umask())),
        ("newdir/file", file(0o600, b"f")),
    ]
    .into_iter()
    .map(|(p, n)| (PathBuf::from(p), n))
    .collect();
    assert_eq!(tree(root), expected);

    // mtimes are the header's, directories' included (set after their children).
    for path in ["etc/keep", "opt/old", "opt/old/sub", "bin/tool"] {
        let meta = std::fs::symlink_metadata(root.join(path)).unwrap();
        assert_eq!(meta.mtime(), MTIME as i64, "{path}");
    }
    assert_eq!(
        std::fs::symlink_metadata(root.join("link"))
            .unwrap()
            .mtime(),
        MTIME as i64
    );
}

/// A third layer for the overlay comparison: a hard link to a file two layers down, a file
/// under a directory this layer does not list (its mode must stay the lower one's), a file
/// whited out and re-created in the same layer.
fn third_layer() -> Vec<u8> {
    LayerTar::new()
        .hardlink("opt/linked", "etc/keep")
        .file("var/extra", b"x", 0o640)
        .whiteout("bin/.wh.tool2")
        .file("bin/tool2", b"v3", 0o700)
        .bytes()
}

/// Owner and group of everything beneath `root`, symlinks not followed.
fn owners(root: &Path) -> BTreeMap<PathBuf, (u32, u32)> {
    tree(root)
        .keys()
        .map(|rel| {
            let meta = std::fs::symlink_metadata(root.join(rel)).unwrap();
            (rel.clone(), (meta.uid(), meta.gid()))
        })
        .collect()
}

#[test]
fn the_overlay_form_stacks_to_the_same_tree_as_the_flattened_one() {
    // Real overlayfs mounts and whiteout device nodes: as root, in a private mount namespace.
    csi_agent::mounts::require_private_mount_namespace();
    let scene = Scene::new();
    let layers = [whiteout_lower(), whiteout_upper(), third_layer()];
    for layer in &layers {
        apply(&scene.root, layer).unwrap();
    }

    // Each layer on its own, the ones below handed in nearest first.
    let mut dirs: Vec<PathBuf> = Vec::new();
    for (index, layer) in layers.iter().enumerate() {
        let dir = scene.base.join(format!("layer{index}"));
        std::fs::create_dir(&dir).unwrap();
        let lowers: Vec<PathBuf> = dirs.iter().rev().cloned().collect();
        apply_overlay_layer(
            &dir,
            &lowers,
            layer.as_slice(),
            Compression::Detect,
            &Limits::default(),
        )
        .unwrap();
        dirs.push(dir);
    }
    // The upper layer records its whiteouts and opaque dir as overlayfs reads them.
    let whiteout = std::fs::symlink_metadata(dirs[1].join("etc/gone")).unwrap();
    assert!(
        std::os::unix::fs::FileTypeExt::is_char_device(&whiteout.file_type())
            && whiteout.rdev() == 0,
        "{whiteout:?}"
    );
    let mut value = [0u8; 4];
    let len =
        rustix::fs::getxattr(dirs[1].join("opt/old"), OVERLAY_OPAQUE_XATTR, &mut value).unwrap();
    assert_eq!(&value[..len], b"y");
    // Nothing of a lower layer is copied into an upper one but the hard-linked file.
    assert!(!dirs[1].join("etc/keep").exists() && !dirs[2].join("etc/keep").exists());
    assert_eq!(std::fs::read(dirs[2].join("opt/linked")).unwrap(), b"k");
    // The lower layers were only read.
    assert_eq!(tree(&dirs[0]).len(), 15, "{:?}", tree(&dirs[0]));

    let merged = scene.base.join("merged");
    std::fs::create_dir(&merged).unwrap();
    csi_agent::image::overlay::mount(&dirs, None, &merged).unwrap();
    let stacked = tree(&merged);
    let stacked_owners = owners(&merged);
    rustix::mount::unmount(&merged, rustix::mount::UnmountFlags::DETACH).unwrap();
    assert_eq!(stacked, tree(&scene.root));
    assert_eq!(stacked_owners, owners(&scene.root));
    assert_eq!(stacked.get(Path::new("var")), Some(&Node::Dir(0o711)));
    assert_eq!(
        stacked.get(Path::new("opt/linked")),
        Some(&Node::File(0o644, b"k".to_vec()))
    );
}

#[test]
fn the_overlay_form_refuses_hostile_entries_like_the_flattened_one() {
    let scene = Scene::new();
    let lower = scene.base.join("lower");
    std::fs::create_dir(&lower).unwrap();
    std::os::unix::fs::symlink(&scene.outside, lower.join("escape")).unwrap();
    let outside = scene.outside_str();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (LayerTar::new().file("../x", b"x", 0o644).bytes(), "../x"),
        (
            LayerTar::new()
                .hardlink("stolen", &format!("{outside}/secret")[1..])
                .bytes(),
            "stolen",
        ),
        // A hard link to the outside through a lower layer's symlink is not copied up.
        (
            LayerTar::new().hardlink("stolen", "escape/secret").bytes(),
            "stolen",
        ),
        (
            LayerTar::new().whiteout("../.wh.secret").bytes(),
            "../.wh.secret",
        ),
    ];
    for (layer, entry) in cases {
        let dir = scene.base.join("layer");
        std::fs::create_dir(&dir).unwrap();
        let result = apply_over(&dir, &lower, &layer);
        assert!(result.is_err(), "{entry}: {result:?}");
        expect_final(&result, entry);
        assert!(!dir.join("stolen").exists(), "{entry}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            std::fs::read(scene.outside.join("secret")).unwrap(),
            b"sentinel"
        );
        assert_eq!(
            scene.base_names(),
            vec!["lower", "outside", "root"],
            "{entry}"
        );
    }
}

#[test]
fn ownership_is_kept_when_running_as_root() {
    let scene = Scene::new();
    let layer = LayerTar::new()
        .owned_file("owned", b"o", 1234, 5678)
        .bytes();
    apply(&scene.root, &layer).unwrap();
    let meta = std::fs::metadata(scene.root.join("owned")).unwrap();
    if is_root() {
        assert_eq!((meta.uid(), meta.gid()), (1234, 5678));
    } else {
        assert_eq!(meta.uid(), rustix::process::geteuid().as_raw());
    }
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
}

#[test]
fn device_nodes_are_made_only_as_root_and_fifos_always() {
    let scene = Scene::new();
    let mut builder = tar::Builder::new(Vec::new());
    for (name, kind, mode) in [
        ("null", EntryType::Char, 0o666),
        ("pipe", EntryType::Fifo, 0o620),
    ] {
        let mut header = tar::Header::new_ustar();
        header.set_path(name).unwrap();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_size(0);
        header.set_device_major(1).unwrap();
        header.set_device_minor(3).unwrap();
        header.set_cksum();
        builder.append(&header, &b""[..]).unwrap();
    }
    // The device fields of this one are left empty: they read as 0, as Go's tar reads them.
    let mut layer = LayerTar::new();
    layer.raw(b"pipe2", EntryType::Fifo, 0o600, b"", b"");
    let mut bytes = builder.into_inner().unwrap();
    bytes.truncate(bytes.len() - 1024);
    bytes.extend(layer.bytes());
    let report = apply(&scene.root, &bytes).unwrap();
    assert!(scene.root.join("pipe2").exists());
    let pipe = std::fs::symlink_metadata(scene.root.join("pipe")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&pipe.file_type()));
    assert_eq!(pipe.permissions().mode() & 0o7777, 0o620);
    let null = std::fs::symlink_metadata(scene.root.join("null"));
    if is_root() {
        let null = null.unwrap();
        assert!(std::os::unix::fs::FileTypeExt::is_char_device(
            &null.file_type()
        ));
        assert_eq!(null.permissions().mode() & 0o7777, 0o666);
        assert_eq!(null.rdev(), rustix::fs::makedev(1, 3));
        assert_eq!(report.devices_skipped, 0);
    } else {
        assert!(null.is_err());
        assert_eq!(report.devices_skipped, 1);
    }
}

#[test]
fn pax_xattrs_are_kept_for_allowed_namespaces_only() {
    let scene = Scene::new();
    let mut builder = tar::Builder::new(Vec::new());
    builder
        .append_pax_extensions([
            ("SCHILY.xattr.user.kept", &b"yes"[..]),
            ("SCHILY.xattr.trusted.overlay.opaque", &b"y"[..]),
        ])
        .unwrap();
    let mut header = tar::Header::new_ustar();
    header.set_path("x").unwrap();
    header.set_size(1);
    header.set_mode(0o644);
    header.set_entry_type(EntryType::Regular);
    header.set_cksum();
    builder.append(&header, &b"x"[..]).unwrap();
    let report = apply(&scene.root, &builder.into_inner().unwrap()).unwrap();
    let path = scene.root.join("x");
    let mut value = [0u8; 16];
    let trusted = rustix::fs::getxattr(&path, "trusted.overlay.opaque", &mut value[..]);
    assert!(trusted.is_err(), "a trusted.* xattr from a layer was set");
    match rustix::fs::getxattr(&path, "user.kept", &mut value[..]) {
        Ok(n) => {
            assert_eq!(&value[..n], b"yes");
            assert_eq!(report.xattrs_not_kept, 1, "{report:?}");
        }
        // A file system without user xattrs: best effort, counted.
        Err(_) => assert_eq!(report.xattrs_not_kept, 2, "{report:?}"),
    }
}

/// Every refusal of a hostile layer is final: retrying unpacks the same bytes the same way.
fn expect_final(result: &Result<Report, UnpackError>, entry: &str) {
    if let Err(err) = result {
        assert!(!err.is_transient(), "{entry}: {err} is classed transient");
    }
}

fn expect_refused(result: Result<Report, UnpackError>, wanted: Refusal, entry: &str) {
    expect_final(&result, entry);
    match result {
        Err(UnpackError::Refused { entry: e, reason }) => {
            assert_eq!(reason, wanted);
            assert_eq!(e, entry);
        }
        other => panic!("{entry}: expected a refusal, got {other:?}"),
    }
}

fn expect_symlink_refused(result: Result<Report, UnpackError>, entry: &str) {
    expect_final(&result, entry);
    match result {
        Err(UnpackError::Beneath {
            entry: e,
            source: BeneathError::Symlink { .. },
        }) => assert_eq!(e, entry),
        other => panic!("{entry}: expected the walk to refuse a symlink, got {other:?}"),
    }
}

#[test]
fn hostile_entries_are_refused_or_neutralised_and_nothing_lands_outside() {
    let scene = Scene::new();
    let root = &scene.root;
    let outside = scene.outside_str();
    let before = tree(&scene.outside);
    let etc_passwd = std::fs::read("/etc/passwd").ok();

    expect_refused(
        apply(
            root,
            &LayerTar::new().file("../outside/evil", b"e", 0o644).bytes(),
        ),
        Refusal::ParentDir,
        "../outside/evil",
    );
    expect_refused(
        apply(
            root,
            &LayerTar::new()
                .file("a/../../outside/evil", b"e", 0o644)
                .bytes(),
        ),
        Refusal::ParentDir,
        "a/../../outside/evil",
    );
    expect_refused(
        apply(
            root,
            &LayerTar::new().dir("../outside/newdir/", 0o755).bytes(),
        ),
        Refusal::ParentDir,
        "../outside/newdir/",
    );
    expect_refused(
        apply(
            root,
            &LayerTar::new().hardlink("h", "../outside/secret").bytes(),
        ),
        Refusal::LinkParentDir,
        "h",
    );
    expect_refused(
        apply(root, &LayerTar::new().whiteout(".wh..").bytes()),
        Refusal::WhiteoutName,
        ".wh..",
    );
    expect_refused(
        apply(root, &LayerTar::new().hardlink("self", "./self").bytes()),
        Refusal::LinkToSelf,
        "self",
    );

    // A symlink to the outside dir, then entries through it: the walk refuses each.
    apply(root, &LayerTar::new().symlink("a", &outside).bytes()).unwrap();
    expect_symlink_refused(
        apply(root, &LayerTar::new().file("a/passwd", b"p", 0o644).bytes()),
        "a/passwd",
    );
    expect_symlink_refused(
        apply(root, &LayerTar::new().dir("a/sub/deeper/", 0o755).bytes()),
        "a/sub/deeper/",
    );
    expect_symlink_refused(
        apply(root, &LayerTar::new().symlink("a/l", "/").bytes()),
        "a/l",
    );
    expect_symlink_refused(
        apply(root, &LayerTar::new().hardlink("h", "a/secret").bytes()),
        "h",
    );
    expect_symlink_refused(
        apply(root, &LayerTar::new().whiteout("a/.wh.secret").bytes()),
        "a/.wh.secret",
    );
    expect_symlink_refused(
        apply(root, &LayerTar::new().whiteout("a/.wh..wh..opq").bytes()),
        "a/.wh..wh..opq",
    );
    // Relative symlinks that climb out are refused the same way.
    apply(root, &LayerTar::new().symlink("up", "../outside").bytes()).unwrap();
    expect_symlink_refused(
        apply(root, &LayerTar::new().file("up/evil", b"e", 0o644).bytes()),
        "up/evil",
    );

    // Absolute names and symlinks are neutralised: the name lands beneath the root, the
    // symlink is made as it is and never followed.
    let neutral = LayerTar::new()
        .file("/etc/passwd", b"inside", 0o644)
        .symlink("abs", "/etc")
        .symlink("secret-link", &format!("{outside}/secret"))
        // A hard link to a symlink links the symlink itself.
        .hardlink("hl", "secret-link")
        // Replacing a symlink to an outside file by a file writes nothing through it...
        .symlink("s2", &format!("{outside}/secret"))
        .file("s2", b"replaced", 0o644)
        // ...and a directory entry over a symlink to an outside dir replaces the symlink.
        .symlink("s3", &outside)
        .dir("s3/", 0o755)
        .file("s3/inner", b"i", 0o644)
        .bytes();
    apply(root, &neutral).unwrap();
    assert_eq!(std::fs::read(root.join("etc/passwd")).unwrap(), b"inside");
    assert_eq!(
        std::fs::read_link(root.join("abs")).unwrap(),
        PathBuf::from("/etc")
    );
    assert!(
        std::fs::symlink_metadata(root.join("hl"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(std::fs::read(root.join("s2")).unwrap(), b"replaced");
    assert!(
        !std::fs::symlink_metadata(root.join("s2"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(std::fs::symlink_metadata(root.join("s3")).unwrap().is_dir());
    assert_eq!(std::fs::read(root.join("s3/inner")).unwrap(), b"i");
    // And through the absolute symlink: refused.
    expect_symlink_refused(
        apply(
            root,
            &LayerTar::new().file("abs/passwd", b"p", 0o644).bytes(),
        ),
        "abs/passwd",
    );

    assert_eq!(
        tree(&scene.outside),
        before,
        "something changed outside the root"
    );
    assert_eq!(scene.base_names(), vec!["outside", "root"]);
    assert_eq!(std::fs::read("/etc/passwd").ok(), etc_passwd);
}

#[test]
fn limits_give_their_typed_errors() {
    let scene = Scene::new();
    let root = &scene.root;
    let limited = |limits: Limits, layer: &[u8]| {
        apply_layer(root, layer, Compression::Detect, &limits).unwrap_err()
    };
    let expect = |err: UnpackError, wanted: LimitKind| {
        assert!(!err.is_transient(), "{err} is classed transient");
        match err {
            UnpackError::Limit { limit, .. } => assert_eq!(limit, wanted),
            other => panic!("expected {wanted:?}, got {other:?}"),
        }
    };

    let many = LayerTar::new()
        .file("1", b"", 0o644)
        .file("2", b"", 0o644)
        .file("3", b"", 0o644)
        .bytes();
    expect(
        limited(
            Limits {
                max_entries: 2,
                ..Limits::default()
            },
            &many,
        ),
        LimitKind::Entries,
    );
    let big = LayerTar::new().file("big", &[7u8; 4096], 0o644).bytes();
    expect(
        limited(
            Limits {
                max_file_bytes: 4095,
                ..Limits::default()
            },
            &big,
        ),
        LimitKind::FileBytes,
    );
    // A gzip bomb: 8 MiB of zeros in a few KiB; decompression stops at the bound.
    let bomb = LayerTar::new()
        .file("zeros", &vec![0u8; 8 << 20], 0o644)
        .gzip();
    assert!(bomb.len() < 64 << 10);
    expect(
        limited(
            Limits {
                max_layer_bytes: 1 << 20,
                ..Limits::default()
            },
            &bomb,
        ),
        LimitKind::LayerBytes,
    );
    let deep = LayerTar::new().file("a/b/c/d/e", b"", 0o644).bytes();
    expect(
        limited(
            Limits {
                max_depth: 4,
                ..Limits::default()
            },
            &deep,
        ),
        LimitKind::Depth,
    );
    expect(
        limited(
            Limits {
                max_path_bytes: 8,
                ..Limits::default()
            },
            &LayerTar::new().file("123456789", b"", 0o644).bytes(),
        ),
        LimitKind::PathBytes,
    );
    expect(
        limited(
            Limits {
                max_path_bytes: 8,
                ..Limits::default()
            },
            &LayerTar::new().symlink("l", "123456789").bytes(),
        ),
        LimitKind::PathBytes,
    );
    // Within the same limits, the same layers apply.
    apply(root, &bomb).unwrap();
    apply(root, &deep).unwrap();
    assert_eq!(
        std::fs::metadata(root.join("zeros")).unwrap().len(),
        8 << 20
    );
}

/// Issue #23 (L1): a hard link to a target no entry made was an I/O error, answered 503
/// and retried as if the host had failed. It is the layer's fault: a typed refusal naming
/// the entry and the target, final, in both forms. Only a failure of the host is transient.
#[test]
fn a_hard_link_to_a_missing_target_is_a_final_refusal() {
    let scene = Scene::new();
    let layer = LayerTar::new()
        .file("present", b"p", 0o644)
        .hardlink("h", "missing/target")
        .bytes();
    let result = apply(&scene.root, &layer);
    match &result {
        Err(UnpackError::LinkTargetMissing { entry, target }) => {
            assert_eq!((entry.as_str(), target.as_str()), ("h", "missing/target"));
        }
        other => panic!("expected a missing link target, got {other:?}"),
    }
    expect_final(&result, "h");
    let message = result.unwrap_err().to_string();
    assert!(
        message.contains("\"h\"") && message.contains("missing/target"),
        "{message}"
    );
    // The overlay form, with a lower layer that lacks it too.
    let lower = scene.base.join("lower");
    let dir = scene.base.join("layer");
    std::fs::create_dir(&lower).unwrap();
    std::fs::create_dir(&dir).unwrap();
    let result = apply_over(&dir, &lower, &layer);
    assert!(
        matches!(result, Err(UnpackError::LinkTargetMissing { .. })),
        "{result:?}"
    );
    expect_final(&result, "h (overlay)");
    // Through the image store: the same class, so the API answers 400, not 503.
    let err = ImageStoreError::Unpack {
        reference: "r/evil:v1".to_owned(),
        layer: "sha256:00".to_owned(),
        source: Box::new(result.unwrap_err()),
    };
    assert!(!err.is_transient(), "{err}");

    // What the host causes stays transient: a full disk, an I/O error.
    for (code, transient) in [
        (28 /* ENOSPC */, true),
        (5 /* EIO */, true),
        (
            17, /* EEXIST: an entry over what the layer made */
            false,
        ),
        (31 /* EMLINK: too many links to one inode */, false),
    ] {
        let err = UnpackError::Io {
            entry: "f".to_owned(),
            op: "write",
            source: std::io::Error::from_raw_os_error(code),
        };
        assert_eq!(err.is_transient(), transient, "{err}");
    }
}

#[test]
fn unsupported_compression_and_garbage_are_errors() {
    let scene = Scene::new();
    let zstd = [0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0];
    assert!(matches!(
        apply(&scene.root, &zstd),
        Err(UnpackError::UnsupportedCompression("zstd"))
    ));
    let garbage = vec![0x55u8; 1024];
    let result = apply(&scene.root, &garbage);
    assert!(matches!(result, Err(UnpackError::Read { .. })));
    expect_final(&result, "garbage");
    // A truncated gzip stream.
    let mut gz = LayerTar::new().file("f", &[1u8; 100_000], 0o644).gzip();
    gz.truncate(gz.len() / 2);
    assert!(matches!(
        apply(&scene.root, &gz),
        Err(UnpackError::Read { .. })
    ));
}

#[test]
fn blobs_are_verified_stored_once_and_feed_the_unpacker() {
    let dir = tempfile::tempdir().unwrap();
    let store = BlobStore::open(dir.path()).unwrap();
    let sha = dir.path().join("blobs/sha256");
    let layer = LayerTar::new().file("hello", b"world", 0o644).gzip();
    let digest = Digest::of(&layer);

    // The wrong bytes under this digest: refused, nothing kept.
    let mut tampered = layer.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 1;
    match store.put(tampered.as_slice(), &digest, tampered.len() as u64) {
        Err(BlobError::DigestMismatch { expected, actual }) => {
            assert_eq!(expected, digest);
            assert_ne!(actual, digest);
        }
        other => panic!("tampered blob: {other:?}"),
    }
    assert_eq!(std::fs::read_dir(&sha).unwrap().count(), 0);
    assert!(!store.contains(&digest).unwrap());

    assert_eq!(
        store
            .put(layer.as_slice(), &digest, layer.len() as u64)
            .unwrap(),
        Put::Stored
    );
    let inode = std::fs::metadata(store.path_of(&digest)).unwrap().ino();
    // Put again: not rewritten, and the source is not even read.
    struct Unread;
    impl std::io::Read for Unread {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            panic!("a present blob's source was read");
        }
    }
    assert_eq!(
        store.put(Unread, &digest, layer.len() as u64).unwrap(),
        Put::AlreadyPresent
    );
    assert_eq!(std::fs::read_dir(&sha).unwrap().count(), 1);
    assert_eq!(
        std::fs::metadata(store.path_of(&digest)).unwrap().ino(),
        inode
    );

    // Reopening keeps the blob; the stored blob unpacks.
    let store = BlobStore::open(dir.path()).unwrap();
    let root = dir.path().join("rootfs");
    std::fs::create_dir(&root).unwrap();
    let blob = store.open_blob(&digest).unwrap();
    apply_layer(&root, blob, Compression::Gzip, &Limits::default()).unwrap();
    assert_eq!(std::fs::read(root.join("hello")).unwrap(), b"world");
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        prop::collection::vec(
            prop::sample::select(vec![
                "..",
                ".",
                "",
                "a",
                "b",
                "s",
                "out",
                ".wh.a",
                ".wh..wh..opq",
                ".wh..",
            ]),
            1..5,
        )
        .prop_map(|parts| parts.join("/"))
        .prop_filter("fits a ustar name", |n| !n.is_empty() && n.len() < 100)
    }

    #[derive(Clone, Debug)]
    enum Kind {
        File,
        Dir,
        SymlinkOut,
        SymlinkUp,
        Hardlink(String),
    }

    fn kind() -> impl Strategy<Value = Kind> {
        prop_oneof![
            Just(Kind::File),
            Just(Kind::Dir),
            Just(Kind::SymlinkOut),
            Just(Kind::SymlinkUp),
            name().prop_map(Kind::Hardlink),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_entries_never_write_outside_the_root(
            entries in prop::collection::vec((name(), kind()), 1..12),
            split in 0usize..12,
        ) {
            let scene = Scene::new();
            let before = tree(&scene.outside);
            let outside = scene.outside_str();
            // Two layers, so that later entries meet what earlier ones left.
            let (first, second) = entries.split_at(split.min(entries.len()));
            for part in [first, second] {
                let mut layer = LayerTar::new();
                for (name, kind) in part {
                    match kind {
                        Kind::File => layer.file(name, b"data", 0o644),
                        Kind::Dir => layer.dir(name, 0o755),
                        Kind::SymlinkOut => layer.symlink(name, &outside),
                        Kind::SymlinkUp => layer.symlink(name, "../../outside"),
                        Kind::Hardlink(target) => layer.hardlink(name, target),
                    };
                }
                // Errors are expected for many of these; escapes never are.
                let _ = apply(&scene.root, &layer.bytes());
            }
            prop_assert_eq!(tree(&scene.outside), before);
            prop_assert_eq!(scene.base_names(), vec!["outside", "root"]);
        }
    }
}
