//! The user a component runs as (Mesos `CommandInfo.user`): its uid, primary gid and
//! supplementary groups, looked up in a root's `/etc/passwd` and `/etc/group` — the host's
//! for the process runtime and for containers on the host's root, the image's for image
//! plugins — and the one dir the plugin must write that csi-agent makes: its socket dir.
//!
//! The files are read beneath the root without following symlinks, bounded
//! ([`super::oci::rootpaths::Root::read_etc`]): an image's are input like any other. A user
//! is a name or a numeric uid; a uid without a passwd line is refused like an unknown name
//! (there is no gid to give it, and guessing root's group would be more power, not less).
//!
//! It must not spawn or signal anything, and it changes the owner of nothing but the socket
//! dir it is given (and adds only the traverse bit to that dir's parent, the socket root).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use super::oci::rootpaths::Root;

/// A resolved user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (those of `/etc/group` listing the user), without `gid`.
    pub groups: Vec<u32>,
}

/// Why a user could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    #[error(
        "command.user {user:?} is not a user of {root}/etc/passwd: {reason}; give a user that exists there (a name, or a uid with a passwd line)"
    )]
    Unknown {
        user: String,
        root: String,
        reason: String,
    },
    #[error("cannot give the socket dir {} to command.user {user:?}: {source}", dir.display())]
    SocketDir {
        user: String,
        dir: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// `user` (a name or a numeric uid) in the root's `/etc/passwd` and `/etc/group`.
pub fn resolve(root_path: &Path, user: &str) -> Result<User, UserError> {
    let unknown = |reason: String| UserError::Unknown {
        user: user.to_owned(),
        root: root_path
            .display()
            .to_string()
            .trim_end_matches('/')
            .to_owned(),
        reason,
    };
    let root = Root::open(root_path).map_err(|err| unknown(err.to_string()))?;
    let passwd = root
        .read_etc("passwd")
        .map_err(|err| unknown(err.to_string()))?;
    let Some((name, uid, gid)) = in_passwd(&passwd, user) else {
        return Err(unknown("no such entry".to_owned()));
    };
    // No /etc/group (a minimal image): no supplementary groups.
    let group = root.read_etc("group").unwrap_or_default();
    let groups = groups_of(&group, &name, gid);
    Ok(User {
        name,
        uid,
        gid,
        groups,
    })
}

/// `(name, uid, gid)` of the first passwd line (`name:pw:uid:gid:gecos:home:shell`) whose
/// name is `user`, or whose uid is `user` when it is a number (getpwnam, then getpwuid).
pub fn in_passwd(passwd: &str, user: &str) -> Option<(String, u32, u32)> {
    let entries = || {
        passwd.lines().filter_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            if fields.len() < 7 {
                return None;
            }
            Some((fields[0], fields[2].parse().ok()?, fields[3].parse().ok()?))
        })
    };
    let by_name = entries().find(|(name, _, _)| *name == user);
    let by_uid = || {
        let uid: u32 = user.parse().ok()?;
        entries().find(|(_, u, _)| *u == uid)
    };
    by_name
        .or_else(by_uid)
        .map(|(name, uid, gid)| (name.to_owned(), uid, gid))
}

/// The gids of the group lines (`name:pw:gid:member,member`) listing `user`, without
/// `primary`, deduplicated, in file order.
pub fn groups_of(group: &str, user: &str, primary: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for line in group.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() < 4 {
            continue;
        }
        let Ok(gid) = fields[2].parse::<u32>() else {
            continue;
        };
        if gid != primary && !out.contains(&gid) && fields[3].split(',').any(|m| m == user) {
            out.push(gid);
        }
    }
    out
}

/// Gives the component's socket dir to `user` (owner uid and gid, mode kept 0700), so that
/// the plugin can create its socket there and nobody else can; and lets others traverse
/// (only: `--x`) the socket root above it, without which the plugin could not reach its dir.
/// With no user (the plugin runs as csi-agent's user), takes the dir back if an earlier
/// launch gave it away: the socket dir outlives relaunches, and a user no longer configured
/// must not keep the power to swap the socket csi-agent connects to.
/// Nothing else of csi-agent's changes owner: the work dir stays root's and private.
pub fn give_socket_dir(socket_dir: &Path, user: Option<&User>) -> Result<(), UserError> {
    use std::os::unix::fs::MetadataExt;
    let name = user.map_or("(csi-agent's own)", |u| u.name.as_str());
    let fail = |dir: &Path, source| UserError::SocketDir {
        user: name.to_owned(),
        dir: dir.to_path_buf(),
        source,
    };
    let (uid, gid) = match user {
        Some(user) => (user.uid, user.gid),
        None => (
            rustix::process::geteuid().as_raw(),
            rustix::process::getegid().as_raw(),
        ),
    };
    let meta = match std::fs::metadata(socket_dir) {
        Ok(meta) => meta,
        // Nothing to take back: a dir that is not there was given to no one.
        Err(err) if user.is_none() && err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) => return Err(fail(socket_dir, err)),
    };
    if (meta.uid(), meta.gid()) != (uid, gid) {
        std::os::unix::fs::chown(socket_dir, Some(uid), Some(gid))
            .map_err(|err| fail(socket_dir, err))?;
    }
    if user.is_none() {
        return Ok(());
    }
    if let Some(root) = socket_dir.parent() {
        let mode = std::fs::metadata(root)
            .map_err(|err| fail(root, err))?
            .permissions()
            .mode();
        if mode & 0o001 == 0 {
            std::fs::set_permissions(
                root,
                std::fs::Permissions::from_mode((mode | 0o011) & 0o7777),
            )
            .map_err(|err| fail(root, err))?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
        broken:x:notanumber:0::/:/bin/sh\n\
        short:x:5\n\
        plugin:x:1500:1500::/home/plugin:/bin/sh\n\
        nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n\
        alias:x:1500:42::/:/bin/sh\n";
    const GROUP: &str = "root:x:0:\n\
        plugin:x:1500:\n\
        disk:x:6:plugin,other\n\
        storage:x:77:other,plugin\n\
        dup:x:6:plugin\n\
        bad:x:zz:plugin\n\
        pluginx:x:88:pluginx\n";

    #[test]
    fn users_resolve_by_name_then_uid_with_their_groups() {
        assert_eq!(
            in_passwd(PASSWD, "plugin"),
            Some(("plugin".into(), 1500, 1500))
        );
        assert_eq!(
            in_passwd(PASSWD, "nobody"),
            Some(("nobody".into(), 65534, 65534))
        );
        // A uid: its first line, as getpwuid.
        assert_eq!(
            in_passwd(PASSWD, "1500"),
            Some(("plugin".into(), 1500, 1500))
        );
        for unknown in ["nosuchuser", "broken", "short", "4242", "", "root:x"] {
            assert_eq!(in_passwd(PASSWD, unknown), None, "{unknown}");
        }
        assert_eq!(groups_of(GROUP, "plugin", 1500), vec![6, 77]);
        assert_eq!(groups_of(GROUP, "nobody", 65534), Vec::<u32>::new());
    }

    #[test]
    fn a_root_s_files_are_read_beneath_it_and_an_unknown_user_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        std::fs::write(dir.path().join("etc/passwd"), PASSWD).unwrap();
        std::fs::write(dir.path().join("etc/group"), GROUP).unwrap();
        let user = resolve(dir.path(), "plugin").unwrap();
        assert_eq!((user.uid, user.gid, user.groups), (1500, 1500, vec![6, 77]));
        let err = resolve(dir.path(), "nosuchuser").unwrap_err().to_string();
        assert!(
            err.contains("command.user") && err.contains("\"nosuchuser\""),
            "{err}"
        );

        // A passwd that is a symlink (to the host's) is not read.
        std::fs::remove_file(dir.path().join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.path().join("etc/passwd")).unwrap();
        let err = resolve(dir.path(), "root").unwrap_err().to_string();
        assert!(err.contains("symlink"), "{err}");
    }

    #[test]
    fn the_socket_dir_is_given_to_the_user_and_taken_back_without_one() {
        use std::os::unix::fs::MetadataExt;
        if !rustix::process::geteuid().is_root() {
            eprintln!("skipped: needs root (chown)");
            return;
        }
        let root = tempfile::tempdir().unwrap();
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        let dir = root.path().join("0badcafe");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let nobody = User {
            name: "nobody".to_owned(),
            uid: 65534,
            gid: 65534,
            groups: vec![],
        };
        give_socket_dir(&dir, Some(&nobody)).unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (65534, 65534, 0o700)
        );
        // Its parent: traverse only for others, never read.
        assert_eq!(
            std::fs::metadata(root.path()).unwrap().mode() & 0o777,
            0o711
        );
        // The user is removed from the config: the next launch takes the dir back.
        give_socket_dir(&dir, None).unwrap();
        let meta = std::fs::metadata(&dir).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o777), (0, 0, 0o700));
    }
}
