#!/usr/bin/env bash
# Install the system packages the xffl test stack needs (two SLURM clusters, munge, one sshd),
# Charliecloud's runtime (ch-run: tests/site_profiles/test_container_stack.py trains a site's
# ranks inside a container; unprivileged, it needs user namespaces), and headless Chromium, in which tests/cli/test_report_layout.py lays out `xffl report`'s page
# (Debian's chromium without recommends: 25 packages, 115 MB to download, 398 MB installed,
# about 2 minutes on a 2-core machine).
#
# Idempotent, for root on Debian 12 (bookworm) / Ubuntu: returns in well under a second when
# everything is already installed. `apt-get update` runs only when the package lists are missing
# or when an install attempt fails on stale lists.
#
# Accounting: the stack uses JobCompType=jobcomp/filetxt (`sacct -c`), so slurmdbd and
# mariadb are NOT installed unless XFFL_WITH_SLURMDBD=1 is set.
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client munge openssh-server openssh-client cron charliecloud-runtime
      chromium)
if [[ "${XFFL_WITH_SLURMDBD:-0}" == "1" ]]; then
    PKGS+=(slurmdbd mariadb-server)
fi

log() { printf 'install-system-deps: %s\n' "$*" >&2; }

missing=()
for p in "${PKGS[@]}"; do
    if ! dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed; then
        missing+=("$p")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    log "all present: ${PKGS[*]}"
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo -n)
    else
        log "missing ${missing[*]} and not root (no sudo): cannot install"
        exit 1
    fi
else
    SUDO=()
fi

export DEBIAN_FRONTEND=noninteractive
# Debian's maintainer scripts try to start services; with no init system that only prints
# noise (and policy-rc.d would be the proper switch). Prevent the auto-start when we can.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e "$policy" && "$(id -u)" -eq 0 ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created_policy=1
fi
cleanup() { if [[ $created_policy -eq 1 ]]; then rm -f "$policy"; fi; }
trap cleanup EXIT

APT_OPTS=(-y -q --no-install-recommends -o Dpkg::Use-Pty=0 -o APT::Color=0)
lists_present() { compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; }

apt_update() {
    log "apt-get update"
    "${SUDO[@]}" apt-get update -q -o APT::Color=0 >/dev/null
}

install() {
    "${SUDO[@]}" apt-get install "${APT_OPTS[@]}" "${missing[@]}" >/tmp/xffl-apt-install.log 2>&1
}

if ! lists_present; then
    apt_update
fi
log "installing ${missing[*]}"
if ! install; then
    log "install failed; refreshing package lists and retrying"
    apt_update
    if ! install; then
        tail -n 30 /tmp/xffl-apt-install.log >&2
        log "apt-get install failed (log: /tmp/xffl-apt-install.log)"
        exit 1
    fi
fi

# The Debian packages' postinst may have started daemons (when an init system exists) on the
# default ports / default munge socket; the test stack does not use them, so leave them be.
for b in slurmctld slurmd munged mungekey sshd sinfo sbatch ch-run chromium; do
    if ! command -v "$b" >/dev/null 2>&1 && [[ ! -x "/usr/sbin/$b" ]]; then
        log "after install, $b is still missing"
        exit 1
    fi
done
log "done"
