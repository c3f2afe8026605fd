package main

// entry is one `go test -bench` invocation of the suite and how to report it.
type entry struct {
	title string
	pkg   string // package path, e.g. ./gateway/
	bench string // -bench regexp (anchored; sub-benchmarks all run)
	// benchtime is -benchtime: a duration ("1s", which -benchtime overrides) or a fixed
	// iteration count ("3x", kept as is: those benchmarks set up a large world per run).
	benchtime string
	count     int  // -count (overridden by -count)
	benchmem  bool // -benchmem
	// ratios are the peer comparisons reported under the entry's table.
	ratios []ratio
	// note is one line under the command, saying what the figures are.
	note string
	// script, instead of go test: a shell command run with bash from the repository root; the
	// last markdown table it prints goes into the section as it is.
	script string
}

// ratio is num/den, each the median of one metric of one benchmark (names without the
// "Benchmark" prefix, sub-benchmarks included).
type ratio struct{ num, den ref }

type ref struct{ bench, unit string }

func same(unit, num, den string) ratio { return ratio{ref{num, unit}, ref{den, unit}} }

// suite is what `make bench` runs, in order. TestSuiteCoversEveryBenchmark checks that every
// Benchmark function in the repository is in it.
var suite = []entry{
	{
		title:  "Gateway vs HAProxy vs nginx vs direct",
		script: "ROUNDS=5 DURATION=2s ./gateway/bench/run.sh",
		note:   "10,000 tenants over 4 backends routed by x-tenant-id; wrk -t2 at -c32 and -c256 with 64 B and 16 KiB answers and a random tenant per request; interleaved rounds (the order rotates), medians, ratios to HAProxy (also per round), CPU per request from /proc (user+system of the proxy's processes over the same runs). Needs haproxy, nginx and wrk: `make bench` installs them.",
	},
	{
		title:     "Placement watcher: lookup, put -> applied",
		pkg:       "./shardkit/placement/",
		bench:     "^Benchmark(Lookup1M|Lookup1MGoMap|LookupParallel|PutToApplied|Takeovers1M)$",
		benchtime: "1s", count: 3, benchmem: true,
		ratios: []ratio{same("ns/op", "Lookup1M", "Lookup1MGoMap"), same("B/placement", "Lookup1M", "Lookup1MGoMap")},
		note:   "Lookup1M: hit lookup among 1M placements; the peer is a plain Go map. PutToApplied: KV put issued -> watcher applied, embedded server. Takeovers1M: one look for the 100 tenants in a takeover among 1M placements (the retake detector's, every few seconds while any exists).",
	},
	{
		title:     "Placement watcher: cold start at 1M placements",
		pkg:       "./shardkit/placement/",
		bench:     "^BenchmarkColdStart$",
		benchtime: "1x", count: 2,
		ratios: []ratio{
			{ref{"ColdStart", "snapshot-start-s"}, ref{"ColdStart", "nats-watch-s"}},
			{ref{"ColdStart", "full-read-s"}, ref{"ColdStart", "nats-watch-s"}},
		},
		note: "Time to ready from a compacted snapshot and reading every key; the peer is nats.go's KeyValue.WatchAll to its initial-values marker (TM_BENCH_PLACEMENTS changes the size).",
	},
	{
		title:     "Gateway: placement change -> routed, 1 and 3 gateways on 1 and 3 NATS nodes",
		pkg:       "./gateway/",
		bench:     "^BenchmarkPlacementChangeRouted$",
		benchtime: "1000x", count: 3,
		ratios: []ratio{
			same("all-gw-p99-from-ack-us", "PlacementChangeRouted/nodes=1/gateways=3", "PlacementChangeRouted/nodes=1/gateways=1"),
			same("all-gw-p99-from-ack-us", "PlacementChangeRouted/nodes=3/gateways=1", "PlacementChangeRouted/nodes=1/gateways=1"),
			same("all-gw-p99-from-ack-us", "PlacementChangeRouted/nodes=3/gateways=3", "PlacementChangeRouted/nodes=1/gateways=1"),
		},
		note: "Microseconds until every gateway routes the tenant's next request to the new owner, from the CAS write's start and from its acknowledgement; cas-* is the write's own round trip. All NATS nodes, gateways and backends share the 2 cores.",
	},
	{
		title:     "Gateway: request path",
		pkg:       "./gateway/",
		bench:     "^Benchmark(Lookup|Proxy|ProxyRaw|PickWriter|PickLoad)$",
		benchtime: "1s", count: 3, benchmem: true,
		ratios: []ratio{same("ns/op", "Proxy/jwt", "Proxy/plain"), same("ns/op", "PickLoad/plain", "PickLoad/score"),
			same("ns/op", "PickLoad/producer", "PickLoad/score")},
		note: "Lookup: route match + placement lookup in memory. Proxy: client -> gateway -> shard over loopback, 1,000 tenants over 4 shards, parallel clients (net/http client and shard: their allocations count too); jwt checks each tenant's ES256 bearer token (first sight, then remembered). ProxyRaw: the same with a raw TCP client and shard that allocate nothing, so allocs/op is the gateway's own per proxied request (goal 0). PickWriter: a single-writer kind's rendezvous choice among 3 instances. PickLoad: a load kind's pick among 3 instances: score (load scores alone, the pre-producer-route path), plain (a route that is not a producer route), producer (a producer route redirected to the instance with consumers).",
	},
	{
		title:     "Gateway: unary gRPC through its HTTP/2 engine",
		pkg:       "./gateway/",
		bench:     "^BenchmarkGRPCUnary$",
		benchtime: "20000x", count: 3, benchmem: true,
		note: "A grpc-go client, the gateway's own HTTP/2 engine (h2c front, multiplexed upstream) and a grpc-go instance in one process, 32 calls at once: time is shared by all three, allocs/op is the comparable part. The side-by-side figures against HAProxy and nginx come from make bench-grpc.",
	},
	{
		title:     "Gateway: tenant identity at the edge (JWT check)",
		pkg:       "./gateway/edgeauth/",
		bench:     "^BenchmarkVerify$",
		benchtime: "2000x", count: 3, benchmem: true,
		ratios: []ratio{same("ns/op", "Verify/first-sight-RS256", "Verify/cached")},
		note:   "cached: a token verified before (kept until it expires, at most 5 min); first-sight-RS256: the signature check of a 2048-bit RS256 token with its key in the JWKS cache. No network call on either path.",
	},
	{
		title:     "Shard gate",
		pkg:       "./shardkit/",
		bench:     "^BenchmarkGate(Parallel)?$",
		benchtime: "1s", count: 3, benchmem: true,
	},
	{
		title:     "Gateway proof (X-Tm-Proof): signing one request",
		pkg:       "./internal/gatesig/",
		bench:     "^BenchmarkAppend$",
		benchtime: "1s", count: 3, benchmem: true,
		note: "The HMAC-SHA256 over the request line, tenant, epoch, shard and subject a gateway adds to every proxied request (the shard verifies the same).",
	},
	{
		title:     "Sidecar: added latency per request",
		pkg:       "./shardkit/sidecar/",
		bench:     "^BenchmarkSidecarLatency$",
		benchtime: "5000x", count: 5, benchmem: true,
		ratios: []ratio{same("p50-µs", "SidecarLatency/sidecar", "SidecarLatency/embedded")},
		note:   "One request at a time over loopback to the same Go handler: behind shardkit's gate in its own server (embedded) and behind shardkit-sidecar's gate and proxy (sidecar); the added latency is the difference of the p50s.",
	},
	{
		title:     "Aggregate: warm-up, snapshot vs cold replay",
		pkg:       "./services/aggregate/",
		bench:     "^BenchmarkWarm$",
		benchtime: "3x", count: 3,
		ratios: []ratio{
			same("warm-ms", "Warm/events=10000/snapshot", "Warm/events=10000/replay"),
			same("warm-ms", "Warm/events=100000/snapshot", "Warm/events=100000/replay"),
		},
	},
	{
		title:     "Aggregate: a tenant's stored size, counter vs stream info",
		pkg:       "./services/aggregate/",
		bench:     "^BenchmarkTenantSize$",
		benchtime: "1s", count: 5, benchmem: true,
		ratios: []ratio{same("ns/op", "TenantSize/counter", "TenantSize/stream-info")},
		note:   "One tenant of 10,000 events on 100 subjects: the event log's counter of events and bytes (what telemetry reads every heartbeat) against a subject-filtered stream info of TM_EVENTS (one request, message counts only).",
	},
	{
		title:     "Aggregate: commands",
		pkg:       "./services/aggregate/",
		bench:     "^BenchmarkCommands$",
		benchtime: "1s", count: 3, benchmem: true,
		note: "16 concurrent clients, 64 tenants, one JetStream append with expected-last-subject-sequence per command, no HTTP.",
	},
	{
		title:     "Projection: a tenant's apply while another's views are stored",
		pkg:       "./services/projection/",
		bench:     "^BenchmarkApplyDuringFlush$",
		benchtime: "3s", count: 3,
		note: "One tail; a tenant with 60,000 transactions whose views are stored back to back while its events keep coming, and a small tenant's event timed from publish to applied (p50/p99/max): the stores must not hold the tail.",
	},
	{
		title:     "Projection: storing a big tenant's views",
		pkg:       "./services/projection/",
		bench:     "^BenchmarkFlush$",
		benchtime: "30x", count: 3,
		note: "A tenant with 60,000 transactions stores its views after 100 more arrived (the periodic store late in a long run): time and KiB written per store; only the head and the pages that became full are written.",
	},
	{
		title:     "Projection: warm-up, catch-up over 10,000 tenants, filtered consumers",
		pkg:       "./services/projection/",
		bench:     "^Benchmark(Warm|Tenants10k|Tenants1kLive|FilterConsumer)$",
		benchtime: "1x", count: 3,
		ratios: []ratio{
			same("warm-ms", "Warm/events=100000/stored-views", "Warm/events=100000/cold"),
			same("applied/s", "Tenants10k/partitions=1/noise=1x", "Tenants10k/partitions=1/noise=0"),
		},
	},
	{
		title:     "Runner: job create and run",
		pkg:       "./services/runner/",
		bench:     "^Benchmark(Create|CreateLatency|Run)$",
		benchtime: "1s", count: 3, benchmem: true,
		note: "Create: creates 2 at a time (throughput); CreateLatency: one at a time, with and without an idempotency key, on one NATS node and on a 3-node cluster with R3 streams (a create is two round trips: the run record, with the queue's depth read beside it, then the enqueue).",
	},
	{
		title:     "Runner: a move's digest of the queue at the fence",
		pkg:       "./services/runner/",
		bench:     "^BenchmarkQueueDigest$",
		benchtime: "1s", count: 3, benchmem: true,
		note: "What verification (KindConfig.Verify) costs a runner move inside the handoff pause, by the number of jobs waiting in the tenant's queue (embedded server).",
	},
	{
		title:     "Cutover pause under load (whole platform)",
		pkg:       "./test/",
		bench:     "^BenchmarkCutoverPause$",
		benchtime: "30x", count: 3,
		note: "The dev stack as processes (embedded NATS, gateway, rebalancer, 2 shards of each kind), 6 tenants sending commands, queries and webhook jobs through the gateway; each iteration moves one tenant across all three kinds. Pause = handoff -> commit of each kind move (the time the gateway holds the tenant's requests); goal p99 <= 20 ms.",
	},
	{
		title:     "Ledger under contention: one writer per tenant (whole platform)",
		pkg:       "./test/",
		bench:     "^BenchmarkContention$",
		benchtime: "1x", count: 3,
		ratios: []ratio{
			{ref{"Contention/instances=2/writer", "cmds/s/account"}, ref{"Contention/instances=1/writer", "cmds/s/account"}},
			{ref{"Contention/instances=3/writer", "cmds/s/account"}, ref{"Contention/instances=1/writer", "cmds/s/account"}},
			{ref{"Contention/instances=3/any", "cmds/s/account"}, ref{"Contention/instances=1/writer", "cmds/s/account"}},
		},
		note: "The dev stack with 1, 2 or 3 instances per aggregate shard (other kinds 1); 16 clients x 300 deposits and withdrawals on 2 accounts of each of 3 tenants through the gateway. writer: the gateway sends each tenant to one instance (single_writer); any: any instance, siblings race and the loser decides again. Goal: 0 conflict answers, per-account rate not below one instance.",
	},
	{
		title:     "Planner: balance 1M tenants x 1,000 shards (and 100k x 100)",
		pkg:       "./rebalancer/planner/",
		bench:     "^BenchmarkBalance(1M|100k)$",
		benchtime: "3x", count: 3, benchmem: true,
		note: "Zipf loads, shards about 7x unevenly filled, 0.1% pinned; moves/bound is moves over an independent lower bound.",
	},
	{
		title:     "Rebalancer: store a 1,000-move plan on a 3-node cluster",
		pkg:       "./rebalancer/",
		bench:     "^BenchmarkStorePlan$",
		benchtime: "3x", count: 3,
		ratios: []ratio{
			same("ns/op", "StorePlan/workers=32", "StorePlan/workers=1"),
		},
		note: "The plan's move records written one at a time (workers=1, as before) and 32 at once (the product's storeWorkers), then the plan record; R3 KV, embedded cluster.",
	},
}
