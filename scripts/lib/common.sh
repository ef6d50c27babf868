# Shared by scripts/demo, scripts/test and scripts/schemathesis (sourced, not run).
#
# Who does what (issue #30): cargo never runs as root on a user's behalf, so that nothing in the
# clone's target dir or in the user's cargo home becomes root-owned; only what needs root (the
# daemon, the test binaries) runs as root.
# - started by a user: cargo runs as that user, root work goes through `sudo -n`;
# - started as `sudo ./scripts/…` by hand: cargo runs as $SUDO_USER, in their login environment
#   (their toolchain: sudo's secure_path has no ~/.cargo/bin);
# - started by root itself (no SUDO_USER): everything as root.

# The user cargo runs as (see above).
build_user() {
    if [[ $(id -u) -eq 0 && -n ${SUDO_USER:-} && ${SUDO_USER} != root ]]; then
        echo "$SUDO_USER"
    else
        id -un
    fi
}

# Runs a command as build_user: for a script started through sudo by hand, in that user's login
# environment with ~/.cargo/bin on PATH, keeping CARGO_TARGET_DIR and the variables named in
# CARGO_PASS_ENV from this environment.
as_builder() {
    if [[ $(build_user) == "$(id -un)" ]]; then
        "$@"
        return
    fi
    local pass=() name
    for name in CARGO_TARGET_DIR ${CARGO_PASS_ENV:-}; do
        [[ -n ${!name:-} ]] && pass+=("$name=${!name}")
    done
    # -H: the user's HOME (their CARGO_HOME and RUSTUP_HOME); bash -l: their profile, where
    # rustup puts ~/.cargo/bin on PATH.
    sudo -u "$SUDO_USER" -H -- env ${pass[@]+"${pass[@]}"} bash -lc \
        'PATH="$HOME/.cargo/bin:$PATH"; exec "$@"' as-builder "$@"
}
run_cargo() {
    as_builder cargo "$@"
}

# True when this script can run commands as root: it is root, or `sudo` works without a
# password, or (at a terminal) after asking for one. False for a user without sudo rights,
# whatever sudo would print.
can_be_root() {
    [[ $(id -u) -eq 0 ]] && return 0
    command -v sudo >/dev/null 2>&1 || return 1
    sudo -n true 2>/dev/null && return 0
    [[ -t 0 ]] || return 1
    echo "$(basename "$0"): real bind mounts need root: asking sudo" >&2
    sudo -v
}

# Runs a command as root (through sudo when not root), with this environment less what
# belongs to the user's session (HOME, XDG_*, …: root's processes must not write into the
# user's home or runtime dir). sudo resets the environment, so the rest is passed through
# env(1) explicitly. exec_as_root replaces the calling shell with it.
as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
        return
    fi
    local vars=()
    root_env vars
    sudo -n -- env ${vars[@]+"${vars[@]}"} "$@"
}
exec_as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        exec "$@"
    fi
    local vars=()
    root_env vars
    exec sudo -n -- env ${vars[@]+"${vars[@]}"} "$@"
}
# Fills the array named $1 with NAME=VALUE for what as_root passes on.
root_env() {
    local -n into=$1
    local kv
    while IFS= read -r -d '' kv; do
        case ${kv%%=*} in
        HOME | USER | LOGNAME | MAIL | SHELL | SUDO_* | XDG_* | DBUS_* | BASH_FUNC_*) ;;
        *) into+=("$kv") ;;
        esac
    done < <(env -0)
}

# The directory cargo builds into, honouring CARGO_TARGET_DIR and .cargo/config (asked of cargo,
# not guessed).
target_dir() {
    run_cargo metadata --no-deps --format-version 1 |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p'
}

# Installs, through apt, the commands the tests and the demo need that this machine lacks.
# Each entry: command:package (the command by name on PATH, or by absolute path), or a bare package that has no command of its own (such as
# python3-venv), looked up in dpkg's database. Not root: through sudo, when it can.
install_missing() {
    local missing=() entry
    for entry in "$@"; do
        if [[ $entry == *:* ]]; then
            command -v "${entry%%:*}" >/dev/null 2>&1 || missing+=("${entry#*:}")
        elif ! dpkg-query -W -f='${Status}' "$entry" 2>/dev/null | grep -q 'ok installed'; then
            missing+=("$entry")
        fi
    done
    ((${#missing[@]})) || return 0
    if ! command -v apt-get >/dev/null 2>&1 || ! can_be_root; then
        echo "$(basename "$0"): missing ${missing[*]}: install them (apt-get install ${missing[*]})" >&2
        return 1
    fi
    echo "$(basename "$0"): installing ${missing[*]}" >&2
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
}

# What scripts/schemathesis needs: a Python with venv (the schemathesis venv is made by it).
SCHEMATHESIS_DEPS=(python3:python3 python3-venv)

# What the test suite runs besides cargo. crun: the oci runtime's tests run again with it
# (.ci/run, CSI_TEST_OCI_RUNTIME=crun). busybox-static: a static sh and mount for the plugin
# images of tests/image_roots.rs and of the container engines' tests. docker.io and podman: the
# volume plugin front door's tests run a real dockerd and podman (csi-agent-testkit's engines),
# named by absolute path here as there: dockerd is in /usr/sbin, off a user's PATH, and a `docker`
# or `podman` elsewhere on PATH (/usr/local/bin) is not Debian's. On a machine with systemd,
# installing docker.io starts a system dockerd and containerd: the tests share nothing with them
# (own containerd, data and exec roots; /run/docker, /run/containerd and /etc/docker private).
# etcd-server: csi-etcd's tests run real etcd members (csi-agent-testkit's etcd, /usr/bin/etcd,
# on their own ports, never 2379/2380); on a machine with systemd, installing it also starts
# Debian's own etcd service on 2379, which the tests leave alone. etcd-client: etcdctl, which
# the auth test uses to add a user and enable auth. openssl: the TLS tests' certificates
# (csi-agent-testkit's etcd, EtcdTls).
TEST_DEPS=(unshare:util-linux mount:mount umount:mount curl:curl pgrep:procps pkill:procps runc:runc crun:crun docker-registry:docker-registry skopeo:skopeo busybox:busybox-static
    /usr/sbin/dockerd:docker.io /usr/bin/docker:docker.io /usr/bin/podman:podman etcd:etcd-server etcdctl:etcd-client openssl:openssl)
