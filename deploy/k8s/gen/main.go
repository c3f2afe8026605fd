// Command gen writes the shard manifests under deploy/k8s/shards from deploy.Shards and the
// template in package deploy. Run from the repository root: go run ./deploy/k8s/gen. To add a
// shard, add it to deploy.Shards, run gen and list the new file in deploy/k8s/kustomization.yaml
// (the deploy test checks both).
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/tenantmesh/tenantmesh/deploy"
)

func main() {
	dir := flag.String("dir", "deploy/k8s", "the deploy/k8s directory")
	flag.Parse()
	for _, s := range deploy.Shards {
		b, err := deploy.RenderShard(s)
		if err != nil {
			fmt.Fprintln(os.Stderr, "gen:", err)
			os.Exit(1)
		}
		path := filepath.Join(*dir, deploy.ShardFile(s))
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			fmt.Fprintln(os.Stderr, "gen:", err)
			os.Exit(1)
		}
		if err := os.WriteFile(path, b, 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "gen:", err)
			os.Exit(1)
		}
		fmt.Println(path)
	}
}
