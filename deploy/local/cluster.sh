#!/usr/bin/env bash
# A local Ray head on loopback, so `distill submit` works on a laptop as on a cluster.
#   deploy/local/cluster.sh up     # GCS 127.0.0.1:6379, Jobs API / dashboard 127.0.0.1:8265
#   deploy/local/cluster.sh down
# RAY_PORT, DASHBOARD_PORT, RAY_TEMP_DIR and RAY_NUM_CPUS (logical CPUs to announce: a job
# places one actor per CPU, so a laptop oversubscribes its cores) override the defaults. Jobs run with this
# checkout's .venv (its bin/ comes first on PATH for the head and its workers).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venv}"
export PATH="$(pwd)/$VENV/bin:$PATH"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_USAGE_STATS_ENABLED=0
# Ray workers inherit it: see services/__init__.py (grpc/grpc#43055).
export GRPC_ENABLE_FORK_SUPPORT=false
RAY_PORT="${RAY_PORT:-6379}"
DASHBOARD_PORT="${DASHBOARD_PORT:-8265}"
RAY_TEMP_DIR="${RAY_TEMP_DIR:-/tmp/distill-ray-local}"
case "${1:-}" in
  up)
    ray start --head --node-ip-address=127.0.0.1 --port="$RAY_PORT" \
      --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
      --temp-dir="$RAY_TEMP_DIR" --num-cpus="${RAY_NUM_CPUS:-8}" --disable-usage-stats
    echo "Jobs API: http://127.0.0.1:$DASHBOARD_PORT  (export RAY_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT)"
    ;;
  down)
    ray stop
    ;;
  *)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
