package envflag

import (
	"flag"
	"strings"
	"testing"
	"time"
)

func TestEnvDefaultsAndFlagsWin(t *testing.T) {
	t.Setenv("TM_NATS_URL", "nats://env:4222")
	t.Setenv("TM_HOLD_BUDGET", "3s")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	var url, addr string
	var hold time.Duration
	String(fs, &url, "nats-url", "nats://127.0.0.1:4222", "NATS URL")
	String(fs, &addr, "addr", ":8080", "listen address")
	Duration(fs, &hold, "hold-budget", time.Second, "hold budget")
	if err := fs.Parse([]string{"--addr", ":9"}); err != nil {
		t.Fatal(err)
	}
	if url != "nats://env:4222" || addr != ":9" || hold != 3*time.Second {
		t.Fatalf("url=%q addr=%q hold=%s", url, addr, hold)
	}
	if !strings.Contains(fs.Lookup("nats-url").Usage, "TM_NATS_URL") {
		t.Fatal("usage does not name the variable")
	}
}

func TestCheckRejectsBadEnv(t *testing.T) {
	t.Setenv("TM_HEARTBEAT", "soon")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	var hb time.Duration
	Duration(fs, &hb, "heartbeat", time.Second, "heartbeat")
	err := Check(fs)
	if err == nil || !strings.Contains(err.Error(), "TM_HEARTBEAT") {
		t.Fatalf("Check = %v", err)
	}
}
