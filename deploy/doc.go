// Package deploy holds tenantmesh's deployment files (NATS cluster config, container image,
// docker-compose, Kubernetes manifests, Prometheus and Grafana) and the template the shard
// StatefulSets under k8s/shards are generated from (go run ./deploy/k8s/gen). Its test validates
// all of them without a container engine: YAML and JSON parse, Kubernetes objects are
// consistent with each other, compose references resolve, the NATS config is a 3-node
// JetStream cluster, and every metric the Grafana dashboard queries exists in the code.
package deploy
