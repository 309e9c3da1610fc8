#!/usr/bin/env bash
# The embedded default, on any Linux machine without a GPU: build, make the tiny random-weight
# Qwen3-MoE model, generate from it on the CPU backend (tokens and speed), then serve it over
# gRPC and stream a completion from the Python example client.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/build.sh
model=build/models/tiny
if [ ! -f "$model/config.json" ]; then
  build/moeserve make-model --arch qwen3_moe --preset tiny --out "$model"
fi
build/moeserve generate --model "$model" --prompt-ids 1,2,3,4,5,6,7,8 --max-new-tokens 32

echo "== moeserve serve, and a streaming client"
build/moeserve serve --model "$model" --listen 127.0.0.1:50051 --http 127.0.0.1:0 > build/serve.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 50); do grep -q "serving on port" build/serve.log 2>/dev/null && break; sleep 0.2; done
PYTHONPATH=build/python /usr/bin/python3 examples/stream_client.py --target 127.0.0.1:50051 --prompt-ids 1,2,3,4,5,6,7,8
http_port=$(sed -n 's/.*HTTP on port \([0-9]*\).*/\1/p' build/serve.log | head -1)
echo "== GET /health and a few lines of GET /metrics (port $http_port)"
curl -sS "http://127.0.0.1:$http_port/health"; echo
curl -sS "http://127.0.0.1:$http_port/metrics" | grep -E '^moeserve_(requests_finished|generated_tokens)_total'
kill -TERM $server
wait $server || true
grep '"event":"request"' build/serve.log | tail -1
