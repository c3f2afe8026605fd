#!/usr/bin/env bash
# Gateway vs HAProxy vs nginx vs direct, side by side in one run with interleaved rounds:
# 10,000 tenants over 4 backends routed by x-tenant-id; wrk with a random tenant per request, at
# each concurrency of CONNS_LIST and each response size of SIZES; ROUNDS rounds of DURATION per
# point, the order of the targets rotated each round. Reports medians of req/s and p99, ratios
# to HAProxy (of the medians and per round), errors, and CPU per request (user+system time of
# the proxy's processes from /proc over the same runs). Everything listens on 127.0.0.1 only.
# Needs haproxy, nginx and wrk (make bench-gateway installs them with apt-get).
#
# PEER_FIELDS=1 (the default) makes HAProxy and nginx send the backends the fields the gateway
# sends (X-Forwarded-For/-Host/-Proto, X-Request-Id, X-Tm-Kind/-Epoch/-Shard, the epoch from a
# second map), so the routing is the same and the backends, on the same two cores, parse the same
# requests behind each proxy; PEER_FIELDS=0 runs them bare, as before 2026-11-29.
#
# EXTRA_START (a command run with WORK, NATS_URL and NATS_CREDS set once the backends and NATS
# are up) and EXTRA_TARGETS ("name=url=process-name ...") add targets started outside this
# script, for experiments measured side by side (process-name: for the CPU figures, pgrep -x).
set -euo pipefail
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-2s}
CONNS_LIST=${CONNS_LIST:-${CONNS:-32 256}}
SIZES=${SIZES:-64 16384}
THREADS=${THREADS:-2}
TENANTS=${TENANTS_N:-10000}
PEER_FIELDS=${PEER_FIELDS:-1}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d /tmp/gwbench.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ -n "${EXTRA_PID:-}" ]; then pkill -P "$EXTRA_PID" 2>/dev/null || true; kill "$EXTRA_PID" 2>/dev/null || true; fi
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK/nats"
}
trap cleanup EXIT

for t in haproxy nginx wrk; do
  command -v "$t" >/dev/null || { echo "$t not installed (make bench-gateway installs it)"; exit 1; }
done
echo "work dir $WORK"
cd "$ROOT"
go build -o "$WORK/bin/" ./gateway/cmd/gateway ./gateway/bench/backend ./gateway/bench/benchenv

BACKENDS=127.0.0.1:9101,127.0.0.1:9102,127.0.0.1:9103,127.0.0.1:9104
i=0
for b in ${BACKENDS//,/ }; do
  i=$((i+1))
  "$WORK/bin/backend" -addr "$b" -name "b$i" & PIDS+=($!)
  BACKEND_PIDS="${BACKEND_PIDS:-} $!"
done

"$WORK/bin/benchenv" -backends "$BACKENDS" -tenants "$TENANTS" -nats-port 4333 -dir "$WORK" > "$WORK/benchenv.out" 2>&1 & PIDS+=($!)
for _ in $(seq 1 600); do grep -q READY "$WORK/benchenv.out" && break; sleep 0.1; done
grep -q READY "$WORK/benchenv.out" || { echo "benchenv not ready"; cat "$WORK/benchenv.out"; exit 1; }

TM_NATS_URL=nats://127.0.0.1:4333 TM_NATS_CREDS="$WORK/creds/gateway.creds" TM_ADDR=127.0.0.1:9080 TM_TRUST_TENANT_HEADER=true TM_LOG_LEVEL=warn TM_PPROF=true TM_ADMIN_TOKEN=bench env ${GW_ENV:-} "$WORK/bin/gateway" 2> "$WORK/gateway.log" & PIDS+=($!)
GW_PID=$!
for _ in $(seq 1 300); do curl -fs "http://127.0.0.1:9080/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
curl -fs "http://127.0.0.1:9080/readyz" >/dev/null || { echo "gateway not ready"; cat "$WORK"/gateway.log; exit 1; }

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
    http-request set-var(txn.shard) req.hdr(x-tenant-id),map($WORK/haproxy.map)
$(if [ "$PEER_FIELDS" = 1 ]; then cat <<FIELDS
    option forwardfor
    http-request set-header X-Forwarded-Host %[req.hdr(host)]
    http-request set-header X-Forwarded-Proto http
    http-request set-header X-Request-Id %[uuid]
    http-request set-header X-Tm-Kind aggregate
    http-request set-header X-Tm-Epoch %[req.hdr(x-tenant-id),map($WORK/haproxy-epoch.map)]
    http-request set-header X-Tm-Shard %[var(txn.shard)]
FIELDS
fi)
    use_backend %[var(txn.shard)]
$(for n in 1 2 3 4; do printf 'backend aggregate-%d\n    server s%d 127.0.0.1:910%d\n' "$n" "$n" "$n"; done)
CFG
haproxy -f "$WORK/haproxy.cfg" -db > "$WORK/haproxy.log" 2>&1 & PIDS+=($!)
HAPROXY_PID=$!

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
    map \$http_x_tenant_id \$tenant_epoch { include $WORK/nginx-epoch.map; }
$(for n in 1 2 3 4; do printf '    upstream aggregate-%d { server 127.0.0.1:910%d; keepalive 64; }\n' "$n" "$n"; done)
    server {
        listen 127.0.0.1:9082;
        location / {
            proxy_http_version 1.1;
            proxy_set_header Connection "";
$(if [ "$PEER_FIELDS" = 1 ]; then cat <<FIELDS
            proxy_set_header X-Forwarded-For \$remote_addr;
            proxy_set_header X-Forwarded-Host \$host;
            proxy_set_header X-Forwarded-Proto \$scheme;
            proxy_set_header X-Request-Id \$request_id;
            proxy_set_header X-Tm-Kind aggregate;
            proxy_set_header X-Tm-Epoch \$tenant_epoch;
            proxy_set_header X-Tm-Shard \$tenant_backend;
FIELDS
fi)
            proxy_pass http://\$tenant_backend;
        }
    }
}
CFG
nginx -c "$WORK/nginx.conf" -p "$WORK" -g 'daemon off;' > "$WORK/nginx.log" 2>&1 & PIDS+=($!)
NGINX_PID=$!

declare -A URL=([haproxy]=http://127.0.0.1:9081 [nginx]=http://127.0.0.1:9082 [gateway]=http://127.0.0.1:9080 [direct]=http://127.0.0.1:9101)
declare -A PROCS=([haproxy]=$HAPROXY_PID [gateway]=$GW_PID [direct]=)
if [ -n "${EXTRA_START:-}" ]; then
  # Not in a session of its own: with autogroup scheduling (Linux's default on desktops and
  # many servers) a new session is a scheduling group of its own, which changes how the kernel
  # shares the two cores and made an identical gateway measure half as fast.
  WORK=$WORK NATS_URL=nats://127.0.0.1:4333 NATS_CREDS="$WORK/creds/gateway.creds" bash -c "$EXTRA_START" & EXTRA_PID=$!
fi
EXTRA_NAMES=()
for x in ${EXTRA_TARGETS:-}; do
  IFS== read -r name url pid <<< "$x"
  URL[$name]=$url; PROCS[$name]=${pid:-}; EXTRA_NAMES+=("$name")
done

# Wait for every proxy and check each routes a tenant to its backend.
for t in haproxy nginx gateway "${EXTRA_NAMES[@]}"; do
  for _ in $(seq 1 100); do curl -fs -H 'x-tenant-id: tenant-00001' "${URL[$t]}/" >/dev/null 2>&1 && break; sleep 0.1; done
  got=$(curl -fs -H 'x-tenant-id: tenant-00001' "${URL[$t]}/")
  [ "$got" = "ok b2" ] || { echo "$t routed tenant-00001 to '$got', want 'ok b2'"; exit 1; }
  got=$(curl -fs -H 'x-tenant-id: tenant-00001' "${URL[$t]}/bytes/16384" | wc -c)
  [ "$got" = 16384 ] || { echo "$t answered $got bytes for /bytes/16384"; exit 1; }
  if [ "$PEER_FIELDS" = 1 ]; then
    got=$(curl -fs -H 'x-tenant-id: tenant-00001' "${URL[$t]}/fields" | tr '\n' ' ')
    want=$(curl -fs -H 'x-tenant-id: tenant-00001' "${URL[gateway]}/fields" | tr '\n' ' ')
    [ "$got" = "$want" ] || { echo "$t sends the fields '$got', the gateway '$want'"; exit 1; }
  fi
done
echo "fields the backends get from each proxy: $(curl -fs -H 'x-tenant-id: tenant-00001' "${URL[gateway]}/fields" | tr '\n' ' ')"
PROCS[nginx]=$(pgrep -d' ' -P "$NGINX_PID" || true)
for name in "${EXTRA_NAMES[@]}"; do
  [ -n "${PROCS[$name]}" ] && PROCS[$name]=$(pgrep -d' ' -x "${PROCS[$name]}" || true)
done

# cpu_ticks PIDS: user+system clock ticks of the processes (and their threads) so far.
cpu_ticks() {
  local sum=0 p
  for p in $1; do
    [ -r "/proc/$p/stat" ] || continue
    sum=$((sum + $(awk '{sub(/^.*\) /, ""); print $12 + $13}' "/proc/$p/stat")))
  done
  echo "$sum"
}
TICK_US=$((1000000 / $(getconf CLK_TCK)))

read -r -a TARGETS <<< "${TARGETS:-haproxy nginx gateway ${EXTRA_NAMES[*]} direct}"
export TENANTS="$WORK/tenants.txt"
: > "$WORK/results.txt"
for t in "${TARGETS[@]}"; do BENCH_PATH=/bytes/64 wrk -t"$THREADS" -c32 -d1s -s "$ROOT/gateway/bench/tenant.lua" "${URL[$t]}" >/dev/null; done
for r in $(seq 1 "$ROUNDS"); do
  for c in $CONNS_LIST; do
    for s in $SIZES; do
      # Rotate the order each round so no target always runs first or last.
      for k in "${!TARGETS[@]}"; do
        t=${TARGETS[$(( (k + r) % ${#TARGETS[@]} ))]}
        c0=$(cpu_ticks "${PROCS[$t]}")
        b0=$(cpu_ticks "$BACKEND_PIDS")
        line=$(BENCH_PATH=/bytes/$s wrk -t"$THREADS" -c"$c" -d"$DURATION" -s "$ROOT/gateway/bench/tenant.lua" "${URL[$t]}" | grep RESULT)
        c1=$(cpu_ticks "${PROCS[$t]}")
        b1=$(cpu_ticks "$BACKEND_PIDS")
        echo "round $r c$c/${s}B $t $line cpu_us=$(( (c1 - c0) * TICK_US )) backend_us=$(( (b1 - b0) * TICK_US ))" | tee -a "$WORK/results.txt"
      done
    done
  done
done

if [ -n "${PROFILE:-}" ]; then
  echo "profiling the gateway under load -> $PROFILE"
  BENCH_PATH=${PROFILE_PATH:-/bytes/64} wrk -t"$THREADS" -c"${PROFILE_CONNS:-32}" -d12s -s "$ROOT/gateway/bench/tenant.lua" "${URL[gateway]}" >/dev/null &
  WRK_PID=$!
  sleep 1
  curl -fs -H "Authorization: Bearer bench" "http://127.0.0.1:9080/debug/pprof/profile?seconds=10" -o "$PROFILE" || echo "no pprof endpoint"
  wait "$WRK_PID"
  cp "$WORK/bin/gateway" "$PROFILE.bin"
fi

cp "$WORK/results.txt" "${RESULTS:-/tmp/gwbench-results.txt}"
python3 - "$WORK/results.txt" <<'PY'
import re, statistics, sys
rows = {}
pat = re.compile(r"round (\d+) (\S+) (\S+) RESULT rps=([\d.]+) p50_us=(\d+) p99_us=(\d+) errors=(\d+) requests=(\d+) cpu_us=(\d+) backend_us=(\d+)")
for line in open(sys.argv[1]):
    m = pat.match(line)
    if m:
        rows.setdefault(m[2], {}).setdefault(m[3], []).append(
            dict(round=m[1], rps=float(m[4]), p50=int(m[5]), p99=int(m[6]), err=int(m[7]), n=int(m[8]), cpu=int(m[9]), be=int(m[10])))
med = statistics.median
print()
print("| point | target | req/s (median) | p50 | p99 (median) | req/s vs HAProxy | p99 vs HAProxy | per-round req/s ratio | per-round p99 ratio | CPU µs/req | CPU vs HAProxy | backends' CPU µs/req | errors |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for point, targets in rows.items():
    h = targets.get("haproxy")
    byround = {}
    for t, v in targets.items():
        for x in v:
            byround.setdefault(x["round"], {})[t] = x
    def rr(t, k):
        v = [r[t][k] / r["haproxy"][k] for r in byround.values() if t in r and "haproxy" in r and r["haproxy"][k]]
        return med(v) if v else float("nan")
    def cpu(v, k="cpu"):
        c = [x[k] / x["n"] for x in v if x["n"] and x[k]]
        return med(c) if c else float("nan")
    hr, hp, hc = med(x["rps"] for x in h), med(x["p99"] for x in h), cpu(h)
    for t in [t for t in ["haproxy", "nginx", "gateway"] + sorted(set(targets) - {"haproxy", "nginx", "gateway", "direct"}) + ["direct"] if t in targets]:
        v = targets[t]
        rps, p50, p99, c = med(x["rps"] for x in v), med(x["p50"] for x in v), med(x["p99"] for x in v), cpu(v)
        print(f"| {point} | {t} | {rps:,.0f} | {p50/1000:.2f} ms | {p99/1000:.2f} ms | {rps/hr:.2f} | {p99/hp:.2f} | {rr(t, 'rps'):.2f} | {rr(t, 'p99'):.2f} | {c:.1f} | {c/hc:.2f} | {cpu(v, 'be'):.1f} | {sum(x['err'] for x in v)} |")
PY
