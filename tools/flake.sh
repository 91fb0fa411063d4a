#!/usr/bin/env bash
# Run a selection of tests N times, optionally with every core kept busy, and report every failure.
#
#   tools/flake.sh [-n N] [-l] [PYTEST_ARGS...]     (default: -n 5, the whole tests/ folder)
#     -n N  repetitions
#     -l    load: one spinning process per core for the whole run (CI machines are loaded)
#   e.g. tools/flake.sh -n 5 -l -m "not stress" tests/integration tests/e2e
#
# Prints one line per run and every failed test of every run; exits 1 when any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
N=5
LOAD=0
while getopts "n:l" opt; do
  case $opt in
    n) N=$OPTARG ;;
    l) LOAD=1 ;;
    *) sed -n '2,9p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -eq 0 ] && set -- tests
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

spinners=()
pytest_pid=
logs=$(mktemp -d)
# Stopping the script (Ctrl-C, kill) stops the run in progress and the spinners with it.
stop() {
  [ -n "$pytest_pid" ] && kill "$pytest_pid" 2>/dev/null
  for pid in "${spinners[@]}"; do kill "$pid" 2>/dev/null; done
}
trap stop EXIT
trap 'exit 130' INT TERM
if [ "$LOAD" = 1 ]; then
  for _ in $(seq "$(nproc)"); do
    python3 -c 'while 1: pass' &
    spinners+=($!)
  done
fi

failed=0
for i in $(seq "$N"); do
  log="$logs/run$i.log"
  start=$(date +%s)
  "$PY" -m pytest -q "$@" >"$log" 2>&1 &
  pytest_pid=$!
  wait "$pytest_pid"
  rc=$?
  pytest_pid=
  echo "run $i/$N: exit $rc in $(($(date +%s) - start)) s, load $(cut -d' ' -f1 /proc/loadavg): $(tail -n 1 "$log")"
  grep -E '^(FAILED|ERROR) ' "$log" | sed "s/^/    /"
  [ "$rc" -ne 0 ] && failed=$((failed + 1))
done
echo "flake: $failed of $N run(s) failed$([ "$LOAD" = 1 ] && echo " with every core kept busy"); logs in $logs"
[ "$failed" -eq 0 ]
