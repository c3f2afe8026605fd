package runner

import (
	"testing"
	"time"
)

func TestConfigFromEnv(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	c, err := ConfigFromEnv(env(map[string]string{EnvMaxConcurrent: "4", EnvTenantJobsPerMinute: "600", EnvSMTPAddr: "mail:25", EnvSMTPFrom: "noreply@example.com", EnvRetention: "48h"}))
	if err != nil || c.MaxConcurrent != 4 || c.TenantJobsPerMinute != 600 || c.Effects["email"] == nil || c.Retention != 48*time.Hour {
		t.Fatalf("%+v %v", c, err)
	}
	for _, bad := range []map[string]string{{EnvMaxQueued: "lots"}, {EnvJobsPerMinute: "-1"}, {EnvSMTPAddr: "mail:25"}, {EnvRetention: "a week"}, {EnvRetention: "10ms"}} {
		if _, err := ConfigFromEnv(env(bad)); err == nil {
			t.Errorf("%v: no error", bad)
		}
	}
}
