// Package deploy holds tenantmesh's deployment files (NATS cluster config, container image,
// docker-compose, Kubernetes manifests, the Helm chart, Prometheus scrape configs and alerting
// rules, Grafana) and the template the shard StatefulSets under k8s/shards are generated from
// (go run ./deploy/k8s/gen). Its test validates all of them without a container engine: YAML
// and JSON parse, Kubernetes objects (from k8s/ and from helm template) are consistent with each
// other and with the binaries' flags, compose references resolve, the NATS config is a 3-node
// JetStream cluster, every metric the Grafana dashboard and the alert rules read exists in the
// code, and promtool's unit tests of the rules pass.
package deploy
