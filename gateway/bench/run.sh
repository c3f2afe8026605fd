#!/usr/bin/env bash
# Gateway vs HAProxy vs nginx vs direct, side by side in one run with interleaved rounds:
# 10,000 tenants over 4 backends routed by x-tenant-id; wrk -c32 with a random tenant per
# request; ROUNDS rounds of DURATION each; medians of req/s and p99, ratios to HAProxy.
# Everything listens on 127.0.0.1 only. Needs haproxy, nginx and wrk (make bench-gateway installs
# them with apt-get).
set -euo pipefail
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-2s}
CONNS=${CONNS:-32}
THREADS=${THREADS:-2}
TENANTS=${TENANTS_N:-10000}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d /tmp/gwbench.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK/nats"
}
trap cleanup EXIT

for t in haproxy nginx wrk; do
  command -v "$t" >/dev/null || { echo "$t not installed (make bench-gateway installs it)"; exit 1; }
done
echo "work dir $WORK"
cd "$ROOT"
go build -o "$WORK/bin/" ./gateway/cmd/gateway ./gateway/bench/backend ./gateway/bench/benchenv ./gateway/bench/fastproxy

BACKENDS=127.0.0.1:9101,127.0.0.1:9102,127.0.0.1:9103,127.0.0.1:9104
i=0
for b in ${BACKENDS//,/ }; do
  i=$((i+1))
  "$WORK/bin/backend" -addr "$b" -name "b$i" & PIDS+=($!)
done

"$WORK/bin/benchenv" -backends "$BACKENDS" -tenants "$TENANTS" -nats-port 4333 -dir "$WORK" > "$WORK/benchenv.out" 2>&1 & PIDS+=($!)
for _ in $(seq 1 600); do grep -q READY "$WORK/benchenv.out" && break; sleep 0.1; done
grep -q READY "$WORK/benchenv.out" || { echo "benchenv not ready"; cat "$WORK/benchenv.out"; exit 1; }

TM_NATS_URL=nats://127.0.0.1:4333 TM_NATS_CREDS="$WORK/creds/gateway.creds" TM_ADDR=127.0.0.1:9080 TM_LOG_LEVEL=warn TM_PPROF=true env ${GW_ENV:-} "$WORK/bin/gateway" 2> "$WORK/gateway.log" & PIDS+=($!)
GW_PID=$!
# The same gateway with net/http.Transport to the backends, for the A/B of the upstream client.
TM_NATS_URL=nats://127.0.0.1:4333 TM_NATS_CREDS="$WORK/creds/gateway.creds" TM_ADDR=127.0.0.1:9083 TM_LOG_LEVEL=warn TM_STD_TRANSPORT=true env ${GW_ENV:-} "$WORK/bin/gateway" 2> "$WORK/gateway-std.log" & PIDS+=($!)
# And with the experimental lean path instead of httputil.ReverseProxy.
TM_NATS_URL=nats://127.0.0.1:4333 TM_NATS_CREDS="$WORK/creds/gateway.creds" TM_ADDR=127.0.0.1:9084 TM_LOG_LEVEL=warn TM_LEAN_PROXY=true env ${GW_ENV:-} "$WORK/bin/gateway" 2> "$WORK/gateway-lean.log" & PIDS+=($!)
# The experiment: a purpose-built HTTP/1.1 loop on the same placement watcher (see its doc).
"$WORK/bin/fastproxy" -addr 127.0.0.1:9085 -nats-url nats://127.0.0.1:4333 -nats-creds "$WORK/creds/gateway.creds" 2> "$WORK/fastproxy.log" & PIDS+=($!)
for port in 9080 9083 9084; do
  for _ in $(seq 1 300); do curl -fs "http://127.0.0.1:$port/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
  curl -fs "http://127.0.0.1:$port/readyz" >/dev/null || { echo "gateway on $port not ready"; cat "$WORK"/gateway*.log; exit 1; }
done

cat > "$WORK/haproxy.cfg" <<CFG
global
    maxconn 4096
    nbthread 2
defaults
    mode http
    timeout connect 1s
    timeout client 30s
    timeout server 30s
    http-reuse always
frontend fe
    bind 127.0.0.1:9081
    use_backend %[req.hdr(x-tenant-id),map($WORK/haproxy.map)]
$(for n in 1 2 3 4; do printf 'backend b%d\n    server s%d 127.0.0.1:910%d\n' "$n" "$n" "$n"; done)
CFG
haproxy -f "$WORK/haproxy.cfg" -db > "$WORK/haproxy.log" 2>&1 & PIDS+=($!)

cat > "$WORK/nginx.conf" <<CFG
worker_processes 2;
pid $WORK/nginx.pid;
error_log $WORK/nginx.err warn;
events { worker_connections 4096; }
http {
    access_log off;
    map_hash_bucket_size 128;
    map_hash_max_size 65536;
    map \$http_x_tenant_id \$tenant_backend { include $WORK/nginx.map; }
$(for n in 1 2 3 4; do printf '    upstream b%d { server 127.0.0.1:910%d; keepalive 64; }\n' "$n" "$n"; done)
    server {
        listen 127.0.0.1:9082;
        location / {
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass http://\$tenant_backend;
        }
    }
}
CFG
nginx -c "$WORK/nginx.conf" -p "$WORK" -g 'daemon off;' > "$WORK/nginx.log" 2>&1 & PIDS+=($!)

# Wait for both and check each proxy routes a tenant to its backend.
for port in 9081 9082 9080 9083 9084 9085; do
  for _ in $(seq 1 100); do curl -fs -H 'x-tenant-id: tenant-00001' "http://127.0.0.1:$port/" >/dev/null 2>&1 && break; sleep 0.1; done
  got=$(curl -fs -H 'x-tenant-id: tenant-00001' "http://127.0.0.1:$port/")
  [ "$got" = "ok b2" ] || { echo "port $port routed tenant-00001 to '$got', want 'ok b2'"; exit 1; }
done

declare -A URL=([haproxy]=http://127.0.0.1:9081/ [nginx]=http://127.0.0.1:9082/ [gateway]=http://127.0.0.1:9080/ [gateway-std]=http://127.0.0.1:9083/ [gateway-lean]=http://127.0.0.1:9084/ [fastproxy]=http://127.0.0.1:9085/ [direct]=http://127.0.0.1:9101/)
read -r -a TARGETS <<< "${TARGETS:-haproxy nginx gateway gateway-lean gateway-std fastproxy direct}"
export TENANTS="$WORK/tenants.txt"
: > "$WORK/results.txt"
# Warm-up: one short run per target.
for t in "${TARGETS[@]}"; do wrk -t"$THREADS" -c"$CONNS" -d1s -s "$ROOT/gateway/bench/tenant.lua" "${URL[$t]}" >/dev/null; done
for r in $(seq 1 "$ROUNDS"); do
  # Rotate the order each round so no target always runs first or last.
  for k in "${!TARGETS[@]}"; do
    t=${TARGETS[$(( (k + r) % ${#TARGETS[@]} ))]}
    line=$(wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" -s "$ROOT/gateway/bench/tenant.lua" "${URL[$t]}" | grep RESULT)
    echo "round $r $t $line" | tee -a "$WORK/results.txt"
  done
done

if [ -n "${PROFILE:-}" ]; then
  echo "profiling the gateway under load -> $PROFILE"
  wrk -t"$THREADS" -c"$CONNS" -d12s -s "$ROOT/gateway/bench/tenant.lua" "${URL[gateway]}" >/dev/null &
  WRK_PID=$!
  sleep 1
  curl -fs "http://127.0.0.1:9080/debug/pprof/profile?seconds=10" -o "$PROFILE" || echo "no pprof endpoint"
  wait "$WRK_PID"
  cp "$WORK/bin/gateway" "$PROFILE.bin"
fi

if [ -n "${SYSCALLS:-}" ] && command -v strace >/dev/null; then
  # Syscalls per request: strace -c on each proxy for 3s under wrk load (strace slows the proxy,
  # so only the counts per request mean anything here, not the rates).
  declare -A PIDOF=([gateway]=$GW_PID [haproxy]=$(pgrep -n -x haproxy) [nginx]="$(pgrep -d, -f 'nginx: worker')")
  for t in gateway haproxy nginx; do
    wrk -t"$THREADS" -c"$CONNS" -d4s -s "$ROOT/gateway/bench/tenant.lua" "${URL[$t]}" > "$WORK/strace-$t.wrk" &
    WRK_PID=$!
    sleep 0.5
    args=(); for p in ${PIDOF[$t]//,/ }; do args+=(-p "$p"); done
    timeout -s INT 3 strace -f -c -o "$WORK/strace-$t.txt" "${args[@]}" 2>/dev/null || true
    wait "$WRK_PID"
    echo "== $t: syscalls during 3s of $(grep RESULT "$WORK/strace-$t.wrk")"
    grep -E "total|read|write|recv|send|epoll|futex" "$WORK/strace-$t.txt" | head -12
  done
fi

python3 - "$WORK/results.txt" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"round \d+ (\S+) RESULT rps=([\d.]+) p50_us=(\d+) p99_us=(\d+) errors=(\d+)", line)
    if m:
        rows.setdefault(m[1], []).append((float(m[2]), int(m[3]), int(m[4]), int(m[5])))
med = {t: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v), statistics.median(r[2] for r in v), sum(r[3] for r in v)) for t, v in rows.items()}
h = med["haproxy"]
# Per-round ratios (each target against HAProxy in the same round) cancel some of the drift of a
# shared machine; their medians are printed beside the medians of the raw figures.
rounds = {}
for line in open(sys.argv[1]):
    m = re.match(r"round (\d+) (\S+) RESULT rps=([\d.]+) p50_us=(\d+) p99_us=(\d+)", line)
    if m:
        rounds.setdefault(m[1], {})[m[2]] = (float(m[3]), int(m[5]))
def rr(t, i):
    v = [r[t][i] / r["haproxy"][i] for r in rounds.values() if t in r and "haproxy" in r]
    return statistics.median(v) if v else float("nan")
print()
print("| target | req/s (median) | p50 | p99 (median) | req/s vs HAProxy | p99 vs HAProxy | per-round req/s ratio | per-round p99 ratio | errors |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for t in [t for t in ["haproxy", "nginx", "gateway", "gateway-lean", "gateway-std", "fastproxy", "direct"] if t in med]:
    rps, p50, p99, err = med[t]
    print(f"| {t} | {rps:,.0f} | {p50/1000:.2f} ms | {p99/1000:.2f} ms | {rps/h[0]:.2f} | {p99/h[2]:.2f} | {rr(t, 0):.2f} | {rr(t, 1):.2f} | {err} |")
PY
