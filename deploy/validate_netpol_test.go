package deploy

import (
	"testing"
)

// TestShardsReachableByGatewaysOnly (issue 34, item 4): a shard reached directly, past the
// gateways, is what the gateway's proof defends against; the manifests keep it from happening
// too: every shard pod is selected by a NetworkPolicy that admits only gateways, shards and the
// rebalancer (its presence tells a dead process by a refused connection), and the scrapers'
// namespace, NATS admits only tenantmesh's pods, the gateway has the gateways'
// key and every shard its kind's key, and the gateway has an identity provider configured.
func TestShardsReachableByGatewaysOnly(t *testing.T) {
	objs := loadK8s(t)
	policies := map[string]obj{}
	for _, k := range objs {
		if k.kind() == "NetworkPolicy" {
			policies[k.name()] = k.o
		}
	}
	shards := policies["shards"]
	if getStr(shards, "spec", "podSelector", "matchLabels", "app.kubernetes.io/component") != "shard" {
		t.Fatal("no NetworkPolicy selects the shards' pods")
	}
	for _, rule := range getList(shards, "spec", "ingress") {
		for _, from := range getList(rule, "from") {
			if ns := getMap(from, "namespaceSelector"); ns != nil {
				if getStr(ns, "matchLabels", "tenantmesh.io/scrape") != "true" {
					t.Errorf("the shards admit namespace %v", ns)
				}
				continue
			}
			if c := getStr(from, "podSelector", "matchLabels", "app.kubernetes.io/component"); c != "gateway" && c != "shard" && c != "rebalancer" {
				t.Errorf("the shards admit pods %v", getMap(from, "podSelector"))
			}
		}
	}
	if getStr(policies["nats"], "spec", "podSelector", "matchLabels", "app.kubernetes.io/name") != "nats" {
		t.Error("no NetworkPolicy selects NATS")
	}
	for _, k := range objs {
		env := map[string]bool{}
		for _, c := range getList(k.o, "spec", "template", "spec", "containers") {
			for _, e := range getList(c, "env") {
				env[getStr(e, "name")] = true
			}
		}
		switch {
		case k.kind() == "Deployment" && k.name() == "gateway":
			if !env["TM_SHARD_KEY_FILE"] {
				t.Errorf("%v: no TM_SHARD_KEY_FILE: its requests to shards carry no proof", k)
			}
			if !env["TM_JWT_JWKS_URL"] && !env["TM_JWT_KEY_FILE"] && !env["TM_TRUST_TENANT_HEADER"] {
				t.Errorf("%v: no tenant identity at the edge: it would refuse to start", k)
			}
		case k.kind() == "StatefulSet" && getStr(k.o, "metadata", "labels", "app.kubernetes.io/component") == "shard":
			if !env["TM_GATEWAY_KEY_FILE"] {
				t.Errorf("%v: no TM_GATEWAY_KEY_FILE: it believes whoever reaches its port", k)
			}
		}
	}
}
