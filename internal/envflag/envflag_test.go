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

func TestCheckKeepsGivenFlags(t *testing.T) {
	t.Setenv("TM_ADMIN_TOKEN", "from-env")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	var token string
	Secret(fs, &token, "admin-token", "admin token")
	if err := fs.Parse([]string{"--admin-token", "from-flag"}); err != nil {
		t.Fatal(err)
	}
	if err := Check(fs); err != nil || token != "from-flag" {
		t.Fatalf("after Check: token=%q err=%v", token, err)
	}
}

func TestSecretHidesItsValue(t *testing.T) {
	t.Setenv("TM_ADMIN_TOKEN", "s3cret")
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	var token string
	Secret(fs, &token, "admin-token", "admin token")
	var help strings.Builder
	fs.SetOutput(&help)
	fs.PrintDefaults()
	if token != "s3cret" || strings.Contains(help.String(), "s3cret") || !strings.Contains(help.String(), "TM_ADMIN_TOKEN") {
		t.Fatalf("token=%q, help:\n%s", token, help.String())
	}
}
