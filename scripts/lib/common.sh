# Shared by scripts/demo and scripts/test (sourced, not run).

# Re-runs the calling script ($script, absolute) as root through sudo when it is not root and sudo exists, keeping
# the toolchain (rustup/cargo live in the invoking user's home) and CARGO_TARGET_DIR.
as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        return 0
    fi
    if command -v sudo >/dev/null 2>&1; then
        echo "$(basename "$0"): re-running as root through sudo (real bind mounts need it)" >&2
        exec sudo env "PATH=$PATH" \
            "CARGO_HOME=${CARGO_HOME:-$HOME/.cargo}" "RUSTUP_HOME=${RUSTUP_HOME:-$HOME/.rustup}" \
            ${CARGO_TARGET_DIR:+"CARGO_TARGET_DIR=$CARGO_TARGET_DIR"} \
            "$script" "$@"
    fi
    return 1
}

# The directory cargo builds into, honouring CARGO_TARGET_DIR and .cargo/config (asked of cargo,
# not guessed).
target_dir() {
    cargo metadata --no-deps --format-version 1 |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p'
}

# Installs, through apt, the commands the tests and the demo need that this machine lacks.
# Each entry: command:package, or a bare package that has no command of its own (such as
# python3-venv), looked up in dpkg's database.
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
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$(basename "$0"): missing ${missing[*]} and no apt-get to install them" >&2
        return 1
    fi
    echo "$(basename "$0"): installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
}

# What scripts/schemathesis needs: a Python with venv (the schemathesis venv is made by it).
SCHEMATHESIS_DEPS=(python3:python3 python3-venv)

# What the test suite runs besides cargo. crun: the oci runtime's tests run again with it
# (.ci/run, CSI_TEST_OCI_RUNTIME=crun).
TEST_DEPS=(unshare:util-linux mount:mount umount:mount curl:curl pgrep:procps pkill:procps runc:runc crun:crun docker-registry:docker-registry skopeo:skopeo)
