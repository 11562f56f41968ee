#!/usr/bin/env bash
# Check the systemd files in systemd/ the way systemd itself would read them.
#  - `systemd-analyze verify` on the unit (ExecStart pointed at a binary that exists, in a
#    temporary copy). verify exits 0 on unknown keys and bad values, so any output fails.
#  - `systemd-analyze security --offline=yes`: overall exposure must be <= 3.0.
#  - sysusers and tmpfiles snippets applied to a scratch root.
#  - the example kvtier.toml loads as a kvtier configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
max_exposure=${MAX_EXPOSURE:-3.0}
for tool in systemd-analyze systemd-sysusers systemd-tmpfiles; do
  command -v "$tool" >/dev/null || { echo "check_systemd: $tool is not installed" >&2; exit 1; }
done
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

sed "s|^ExecStart=/opt/kvtier/bin/kvtier |ExecStart=$(command -v true) |" \
  systemd/kvtier.service > "$scratch/kvtier.service"
grep -q "^ExecStart=$(command -v true) serve" "$scratch/kvtier.service"
mkdir -p "$scratch/kvtier.service.d"
cp systemd/kvtier-nvme.conf "$scratch/kvtier.service.d/nvme.conf"
out=$(cd "$scratch" && SYSTEMD_LOG_LEVEL=notice systemd-analyze verify kvtier.service 2>&1) || true
if [ -n "$out" ]; then
  echo "systemd-analyze verify systemd/kvtier.service said:" >&2
  echo "$out" >&2
  exit 1
fi
echo "systemd-analyze verify: clean"

report=$(systemd-analyze security --offline=yes --no-pager "$scratch/kvtier.service" 2>&1)
exposure=$(echo "$report" | sed -n 's/.*Overall exposure level for kvtier.service: \([0-9.]*\).*/\1/p')
if [ -z "$exposure" ]; then
  echo "$report" >&2
  echo "check_systemd: no exposure level in the security report" >&2
  exit 1
fi
if ! awk -v e="$exposure" -v m="$max_exposure" 'BEGIN { exit !(e <= m) }'; then
  echo "$report" | grep '✗' >&2
  echo "check_systemd: exposure $exposure is above $max_exposure" >&2
  exit 1
fi
echo "systemd-analyze security --offline=yes: exposure $exposure (limit $max_exposure)"

root="$scratch/root"
mkdir -p "$root/etc"
systemd-sysusers --root="$root" "$PWD/systemd/kvtier.sysusers" 2>&1
grep -q '^kvtier:' "$root/etc/passwd"
systemd-tmpfiles --root="$root" --create "$PWD/systemd/kvtier.tmpfiles"
test -d "$root/var/cache/kvtier/nvme"
echo "sysusers and tmpfiles: applied to a scratch root"

"$python" -m kvtier config validate --config systemd/kvtier.toml
