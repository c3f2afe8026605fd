#!/usr/bin/env bash
# gRPC through the gateway vs HAProxy (HTTP/2 backends) vs nginx (grpc_pass) vs direct, side by
# side in one run with interleaved rounds, and plain HTTP requests from HTTP/2 clients (h2c) to
# HTTP/1.1 backends. 10,000 tenants over 4 shards routed by x-tenant-id (the same maps as
# run.sh); each shard has an HTTP/1.1 backend (gateway/bench/backend) and a gRPC one (the same
# binary with -grpc: grpc-go's own transport, h2c). h2load (Debian's nghttp2-client) drives
# each point for DURATION per round, ROUNDS rounds, the targets' order rotated each round:
#
#   unary    POST /bench.v1.Bench/Unary, 10-byte message in, 64-byte message out (gRPC framing)
#   stream   POST /bench.v1.Bench/Stream: a server stream of 100 64-byte messages per call
#   h2c-get  GET /bytes/64 over h2c, to the HTTP/1.1 backends
#
# h2load sends one tenant's calls per run (it cannot vary a header per request); the tenant
# changes each round. Latencies come from h2load's per-request log (p50, p99); CPU per call
# from /proc as in run.sh. Reports medians and the ratios to the better of HAProxy and nginx
# (per round, then the median). Everything listens on 127.0.0.1 only.
#
# EXTRA_START (a command run with WORK, NATS_URL and NATS_CREDS set) and EXTRA_TARGETS
# ("name=url=process-name ...") add targets started outside this script, as in run.sh.
set -euo pipefail
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-2}
CLIENTS=${CLIENTS:-8}
STREAMS=${STREAMS:-32}
THREADS=${THREADS:-2}
POINTS=${POINTS:-unary stream h2c-get}
TENANTS=${TENANTS_N:-10000}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d /tmp/grpcbench.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx.pid" ] && kill "$(cat "$WORK/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK/nats"
}
trap cleanup EXIT

for t in haproxy nginx h2load curl; do
  command -v "$t" >/dev/null || { echo "$t not installed (make bench-grpc installs it)"; exit 1; }
done
echo "work dir $WORK"
cd "$ROOT"
go build -o "$WORK/bin/" ./gateway/cmd/gateway ./gateway/bench/backend ./gateway/bench/benchenv

BACKENDS=127.0.0.1:9101,127.0.0.1:9102,127.0.0.1:9103,127.0.0.1:9104
GBACKENDS=127.0.0.1:9111,127.0.0.1:9112,127.0.0.1:9113,127.0.0.1:9114
BACKEND_PIDS=
i=0
for b in ${BACKENDS//,/ }; do
  i=$((i+1)); "$WORK/bin/backend" -addr "$b" -name "b$i" & PIDS+=($!); BACKEND_PIDS="$BACKEND_PIDS $!"
done
i=0
for b in ${GBACKENDS//,/ }; do
  i=$((i+1)); "$WORK/bin/backend" -grpc -addr "$b" -name "g$i" & PIDS+=($!); BACKEND_PIDS="$BACKEND_PIDS $!"
done

"$WORK/bin/benchenv" -backends "$BACKENDS" -grpc-backends "$GBACKENDS" -tenants "$TENANTS" -nats-port 4333 -dir "$WORK" > "$WORK/benchenv.out" 2>&1 & PIDS+=($!)
for _ in $(seq 1 600); do grep -q READY "$WORK/benchenv.out" && break; sleep 0.1; done
grep -q READY "$WORK/benchenv.out" || { echo "benchenv not ready"; cat "$WORK/benchenv.out"; exit 1; }

TM_NATS_URL=nats://127.0.0.1:4333 TM_NATS_CREDS="$WORK/creds/gateway.creds" TM_ADDR=127.0.0.1:9080 TM_TRUST_TENANT_HEADER=true TM_LOG_LEVEL=warn TM_PPROF=true TM_ADMIN_TOKEN=bench env ${GW_ENV:-} "$WORK/bin/gateway" 2> "$WORK/gateway.log" & PIDS+=($!)
GW_PID=$!
for _ in $(seq 1 300); do curl -fs "http://127.0.0.1:9080/readyz" >/dev/null 2>&1 && break; sleep 0.1; done
curl -fs "http://127.0.0.1:9080/readyz" >/dev/null || { echo "gateway not ready"; cat "$WORK"/gateway.log; exit 1; }

# HAProxy: h2c on the front (proto h2), HTTP/2 to the gRPC backends, HTTP/1.1 to the others.
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
    bind 127.0.0.1:9081 proto h2
    use_backend g%[req.hdr(x-tenant-id),map($WORK/haproxy.map)] if { path_beg /bench.v1.Bench/ }
    use_backend %[req.hdr(x-tenant-id),map($WORK/haproxy.map)]
$(for n in 1 2 3 4; do printf 'backend aggregate-%d\n    server s%d 127.0.0.1:910%d\nbackend gaggregate-%d\n    server s%d 127.0.0.1:911%d proto h2\n' "$n" "$n" "$n" "$n" "$n" "$n"; done)
CFG
haproxy -f "$WORK/haproxy.cfg" -db > "$WORK/haproxy.log" 2>&1 & PIDS+=($!)
HAPROXY_PID=$!

# nginx: h2c on the front (listen ... http2), grpc_pass to the gRPC backends.
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
$(for n in 1 2 3 4; do printf '    upstream aggregate-%d { server 127.0.0.1:910%d; keepalive 64; keepalive_requests 10000000; }\n    upstream gaggregate-%d { server 127.0.0.1:911%d; keepalive 64; keepalive_requests 10000000; }\n' "$n" "$n" "$n" "$n"; done)
    server {
        listen 127.0.0.1:9082 http2;
        http2_max_concurrent_streams 256;
        keepalive_requests 10000000; # nginx closes a client connection after 1,000 requests by default
        location /bench.v1.Bench/ {
            grpc_pass grpc://g\$tenant_backend;
        }
        location / {
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_pass http://\$tenant_backend;
        }
    }
}
CFG
nginx -c "$WORK/nginx.conf" -p "$WORK" -g 'daemon off;' > "$WORK/nginx.log" 2>&1 & PIDS+=($!)
NGINX_PID=$!

declare -A URL=([haproxy]=http://127.0.0.1:9081 [nginx]=http://127.0.0.1:9082 [gateway]=http://127.0.0.1:9080)
declare -A PROCS=([haproxy]=$HAPROXY_PID [gateway]=$GW_PID [direct]=)
if [ -n "${EXTRA_START:-}" ]; then
  WORK=$WORK NATS_URL=nats://127.0.0.1:4333 NATS_CREDS="$WORK/creds/gateway.creds" bash -c "$EXTRA_START" & PIDS+=($!)
fi
EXTRA_NAMES=()
for x in ${EXTRA_TARGETS:-}; do
  IFS== read -r name url pid <<< "$x"
  URL[$name]=$url; PROCS[$name]=${pid:-}; EXTRA_NAMES+=("$name")
done
# The request message: gRPC framing (uncompressed, length 10) and 10 bytes.
printf '\x00\x00\x00\x00\x0a0123456789' > "$WORK/req.bin"
mapfile -t TENANT_LIST < <(head -n 1000 "$WORK/tenants.txt")

# grpc_call TARGET TENANT METHOD: status line of a call through TARGET, for the checks.
grpc_call() {
  curl -s --http2-prior-knowledge -H 'content-type: application/grpc' -H 'te: trailers' -H "x-tenant-id: $2" \
    --data-binary @"$WORK/req.bin" -o "$WORK/answer.bin" -w '%{http_code} %{size_download}' "$1/bench.v1.Bench/$3" || true
}
for t in haproxy nginx gateway "${EXTRA_NAMES[@]}"; do
  for _ in $(seq 1 100); do [ "$(grpc_call "${URL[$t]}" tenant-00001 Unary)" = "200 69" ] && break; sleep 0.1; done
  got=$(grpc_call "${URL[$t]}" tenant-00001 Unary); [ "$got" = "200 69" ] || { echo "$t: unary call answered '$got', want '200 69'"; exit 1; }
  got=$(grpc_call "${URL[$t]}" tenant-00001 Stream); [ "$got" = "200 6900" ] || { echo "$t: stream call answered '$got', want '200 6900'"; exit 1; }
  case " ${EXTRA_NAMES[*]} " in *" $t "*) continue ;; esac # an experiment may serve gRPC only
  got=$(curl -fs --http2-prior-knowledge -H 'x-tenant-id: tenant-00001' "${URL[$t]}/bytes/64" | head -c 5)
  [ "$got" = "ok b2" ] || { echo "$t: h2c GET routed tenant-00001 to '$got', want 'ok b2'"; exit 1; }
done
PROCS[nginx]=$(pgrep -d' ' -P "$NGINX_PID" || true)
for name in "${EXTRA_NAMES[@]}"; do
  [ -n "${PROCS[$name]}" ] && PROCS[$name]=$(pgrep -d' ' -x "${PROCS[$name]}" || true)
done

cpu_ticks() {
  local sum=0 p
  for p in $1; do
    [ -r "/proc/$p/stat" ] || continue
    sum=$((sum + $(awk '{sub(/^.*\) /, ""); print $12 + $13}' "/proc/$p/stat")))
  done
  echo "$sum"
}
TICK_US=$((1000000 / $(getconf CLK_TCK)))

# run_point POINT TARGET TENANT: one h2load run; prints "rps p50_us p99_us errors requests".
run_point() {
  local url=${URL[$2]:-} args=() log="$WORK/h2load.log"
  if [ "$2" = direct ]; then
    url=http://127.0.0.1:911$(( ($(echo "$3" | sed 's/tenant-0*//;s/^$/0/') % 4) + 1 ))
    [ "$1" = h2c-get ] && url=http://127.0.0.1:910$(( ($(echo "$3" | sed 's/tenant-0*//;s/^$/0/') % 4) + 1 ))
  fi
  case $1 in
    unary) args=(-d "$WORK/req.bin" -H 'content-type: application/grpc' -H 'te: trailers' "$url/bench.v1.Bench/Unary") ;;
    stream) args=(-d "$WORK/req.bin" -H 'content-type: application/grpc' -H 'te: trailers' "$url/bench.v1.Bench/Stream") ;;
    h2c-get) args=("$url/bytes/64") ;;
  esac
  rm -f "$log"
  local out
  out=$(h2load -t"$THREADS" -c"$CLIENTS" -m"$STREAMS" -D "$DURATION" --warm-up-time=300ms -H "x-tenant-id: $3" --log-file="$log" "${args[@]}" 2>&1)
  echo "$out" > "$WORK/h2load-$1-$2.txt" # the last run's summary of each point and target
  python3 - "$log" "$DURATION" <<'PY' "$out"
import sys, statistics
lat, ok, bad = [], 0, 0
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) < 3: continue
    if f[1].startswith("2"): ok += 1; lat.append(int(f[2]))
    elif f[1] != "0": bad += 1  # 0: still under way when the run stopped
lat.sort()
pct = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0
out = sys.argv[3]
errs, rps = 0, ok / float(sys.argv[2])
for l in out.splitlines():
    if l.startswith("finished in"):
        rps = float(l.split(",")[1].split()[0])
    if l.startswith("requests:"):
        # requests: N total, N started, N done, N succeeded, N failed, N errored, N timeout
        p = [int(w) for w in l.replace(",", " ").split() if w.isdigit()]
        errs = p[4] + p[5] + p[6] if len(p) >= 7 else 0
print(f"{rps:.1f} {pct(0.5)} {pct(0.99)} {errs + bad} {ok}")
PY
}

read -r -a TARGETS <<< "${TARGETS:-haproxy nginx gateway ${EXTRA_NAMES[*]} direct}"
: > "$WORK/results.txt"
for t in "${TARGETS[@]}"; do run_point unary "$t" tenant-00001 >/dev/null; done # warm-up
for r in $(seq 1 "$ROUNDS"); do
  tenant=${TENANT_LIST[$(( (r * 7) % ${#TENANT_LIST[@]} ))]}
  for p in $POINTS; do
    for k in "${!TARGETS[@]}"; do
      t=${TARGETS[$(( (k + r) % ${#TARGETS[@]} ))]}
      c0=$(cpu_ticks "${PROCS[$t]:-}"); b0=$(cpu_ticks "$BACKEND_PIDS")
      read -r rps p50 p99 errs n < <(run_point "$p" "$t" "$tenant")
      c1=$(cpu_ticks "${PROCS[$t]:-}"); b1=$(cpu_ticks "$BACKEND_PIDS")
      echo "round $r $p $t RESULT rps=$rps p50_us=$p50 p99_us=$p99 errors=$errs requests=$n cpu_us=$(( (c1 - c0) * TICK_US )) backend_us=$(( (b1 - b0) * TICK_US ))" | tee -a "$WORK/results.txt"
    done
  done
done

if [ -n "${PROFILE:-}" ]; then
  echo "profiling the gateway under unary load -> $PROFILE"
  h2load -t"$THREADS" -c"$CLIENTS" -m"$STREAMS" -D 12 -H 'x-tenant-id: tenant-00001' -d "$WORK/req.bin" -H 'content-type: application/grpc' \
    -H 'te: trailers' "${URL[gateway]}/bench.v1.Bench/${PROFILE_METHOD:-Unary}" > "$WORK/profile-h2load.txt" 2>&1 &
  H2_PID=$!
  sleep 1
  ss -tn state established '( dport = :9112 )' | tail -n +2 | wc -l | sed 's/^/connections to the tenant'"'"'s backend: /'
  curl -fs -H "Authorization: Bearer bench" "http://127.0.0.1:9080/debug/pprof/profile?seconds=10" -o "$PROFILE" || echo "no pprof endpoint"
  wait "$H2_PID"
  grep -E 'requests:|status codes|finished' "$WORK/profile-h2load.txt"
  cp "$WORK/bin/gateway" "$PROFILE.bin"
fi

cp "$WORK/results.txt" "${RESULTS:-/tmp/grpcbench-results.txt}"
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
print("| point | target | calls/s (median) | p50 | p99 (median) | calls/s vs best peer | p99 vs best peer | per-round calls/s ratio | per-round p99 ratio | CPU µs/call | errors |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for point, targets in rows.items():
    byround = {}
    for t, v in targets.items():
        for x in v:
            byround.setdefault(x["round"], {})[t] = x
    peers = [p for p in ("haproxy", "nginx") if p in targets]
    # The best peer: the one with the higher median calls/s (its p99 is the one compared).
    best = max(peers, key=lambda p: med(x["rps"] for x in targets[p]))
    br, bp = med(x["rps"] for x in targets[best]), med(x["p99"] for x in targets[best])
    def rr(t, k):
        v = [r[t][k] / max(r[p][k] for p in peers if p in r) if k == "rps" else r[t][k] / r[best][k]
             for r in byround.values() if t in r and all(p in r for p in peers) and r[best][k]]
        return med(v) if v else float("nan")
    def cpu(v):
        c = [x["cpu"] / x["n"] for x in v if x["n"] and x["cpu"]]
        return med(c) if c else float("nan")
    for t in [t for t in ["haproxy", "nginx", "gateway"] + sorted(set(targets) - {"haproxy", "nginx", "gateway", "direct"}) + ["direct"] if t in targets]:
        v = targets[t]
        rps, p50, p99 = med(x["rps"] for x in v), med(x["p50"] for x in v), med(x["p99"] for x in v)
        print(f"| {point} | {t} | {rps:,.0f} | {p50/1000:.2f} ms | {p99/1000:.2f} ms | {rps/br:.2f} | {p99/bp:.2f} | {rr(t, 'rps'):.2f} | {rr(t, 'p99'):.2f} | {cpu(v):.1f} | {sum(x['err'] for x in v)} |")
    print(f"| {point} | (best peer: {best}) | | | | | | | | | |")
PY
