-- wrk script: every request carries a random tenant from tenants.txt as x-tenant-id; the path
-- is $BENCH_PATH (default /).
local tenants = {}
for line in io.lines(os.getenv("TENANTS") or "tenants.txt") do
  tenants[#tenants + 1] = line
end
local path = os.getenv("BENCH_PATH") or "/"
math.randomseed(os.time())

request = function()
  return wrk.format("GET", path, { ["x-tenant-id"] = tenants[math.random(#tenants)] })
end

done = function(summary, latency, requests)
  local errors = summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.status + summary.errors.timeout
  io.write(string.format("RESULT rps=%.1f p50_us=%d p99_us=%d errors=%d requests=%d\n",
    summary.requests / (summary.duration / 1e6), latency:percentile(50), latency:percentile(99), errors, summary.requests))
end
