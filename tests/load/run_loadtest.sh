#!/usr/bin/env bash
# make loadtest: start the server on 127.0.0.1, run locust headless for a bounded time, stop.
set -euo pipefail
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8000}
USERS=${USERS:-32}
DURATION=${DURATION:-30s}
HOST=127.0.0.1 PORT=$PORT LOG_LEVEL=warning "$PY" -m app &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 300); do
    if curl -sf "http://127.0.0.1:$PORT/readyz" >/dev/null; then break; fi
    kill -0 $server 2>/dev/null || { echo "server exited" >&2; exit 1; }
    sleep 0.5
done
"$PY" -m locust -f tests/load/locustfile.py --host "http://127.0.0.1:$PORT" \
    --headless -u "$USERS" -r "$USERS" -t "$DURATION" --only-summary --exit-code-on-error 1
echo "--- metrics after the run"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E \
    '^microbatch_(http_requests_total|batch_size_(count|sum)|queue_wait_seconds_(count|sum)|model_seconds_(count|sum)|rejected_total|workers_(alive|ready)|queue_depth|worker_restarts_total)'

