#!/usr/bin/env bash
# Run a command as an ordinary (non-root) user, for what must hold for a trainer that is not
# root (the BFCL fidelity replay, worlds/bfcl/README.md). Run as root, from anywhere:
#
#   bench/as_user.sh [USER] -- python -m worlds.bfcl.fidelity --workers 2
#
# USER (default opd-user) is created when missing (a system user: no home, no login shell).
# The command runs in the repository root with PYTHONPATH set to it, HOME a fresh directory of
# the user's (removed afterwards), and `python` the interpreter of $PYTHON (default: python3 on
# PATH). Where that interpreter lies under a directory the user may not enter (pyenv under a
# 0700 /root), the command runs in a private mount namespace where that directory is an empty
# tmpfs with only the interpreter's prefixes bound back, as the tool sandbox shows it to
# `nobody` (opd/sandbox_fs.py): the host's files and modes are left alone.
set -euo pipefail

user=opd-user
if [[ $# -gt 0 && $1 != -- ]]; then user=$1; shift; fi
[[ ${1:-} == -- ]] && shift
if [[ $# -eq 0 ]]; then
    echo "usage: bench/as_user.sh [USER] -- COMMAND..." >&2; exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "bench/as_user.sh must run as root (it switches to $user)" >&2; exit 2
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')
prefixes=$("$python" -c 'import sys; print(sys.base_prefix); print(sys.prefix)' | sort -u)

id -u "$user" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$user"
home=$(mktemp -d /tmp/opd-user-home.XXXXXX)
chown "$user:" "$home"
trap 'rm -rf "$home"' EXIT

# The highest directory above a prefix that others may not enter (none: nothing to do).
closed=""
for prefix in $prefixes; do
    dir=""
    IFS=/ read -ra parts <<< "${prefix#/}"
    for part in "${parts[@]}"; do
        dir="$dir/$part"
        if [[ $(( 8#$(stat -c %a "$dir") & 1 )) -eq 0 ]]; then
            [[ -n $closed && $closed != "$dir" ]] && {
                echo "bench/as_user.sh: prefixes under two closed directories" >&2; exit 2; }
            closed=$dir; break
        fi
    done
done

run=(runuser -u "$user" -- env -i PATH="$(dirname "$python"):/usr/local/bin:/usr/bin:/bin"
     HOME="$home" LANG="${LANG:-C.UTF-8}" PYTHONPATH="$repo" PYTHONDONTWRITEBYTECODE=1
     bash -c 'cd "$0" && exec "$@"' "$repo" "$@")
if [[ -z $closed ]]; then
    exec "${run[@]}"
fi
# In a mount namespace of its own: keep the closed directory reachable at a stash, cover it
# with an empty tmpfs, recreate the prefixes' paths in it and bind them back from the stash.
exec unshare --mount --propagation private bash -euc '
    closed=$1 prefixes=$2; shift 2
    stash=$(mktemp -d)
    mount --bind "$closed" "$stash"
    mount -t tmpfs -o mode=0755,size=1m opd-as-user "$closed"
    for prefix in $prefixes; do
        mkdir -p "$prefix"
        mount --bind "$stash/${prefix#"$closed"/}" "$prefix"
    done
    umount "$stash" && rmdir "$stash"
    exec "$@"' bash "$closed" "$prefixes" "${run[@]}"
