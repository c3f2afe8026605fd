package runner

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Environment variables read by ConfigFromEnv (the runner binary's own settings, beside the
// TM_* flags every shard binary has).
const (
	EnvMaxConcurrent       = "TM_RUNNER_MAX_CONCURRENT"
	EnvJobsPerMinute       = "TM_RUNNER_JOBS_PER_MINUTE"
	EnvTenantJobsPerMinute = "TM_RUNNER_TENANT_JOBS_PER_MINUTE"
	EnvMaxQueued           = "TM_RUNNER_MAX_QUEUED"
	EnvRetention           = "TM_RUNNER_RETENTION"
	EnvSMTPAddr            = "TM_SMTP_ADDR"
	EnvSMTPFrom            = "TM_SMTP_FROM"
	// EnvWebhookAllow is the webhook's allow-list, comma-separated (Webhook.Allow).
	EnvWebhookAllow = "TM_RUNNER_WEBHOOK_ALLOW"
)

// ConfigFromEnv reads the runner's limits, how long finished runs are kept and its SMTP relay from the environment (getenv is
// os.Getenv in the binary). Unset variables keep the defaults; the email effect exists only
// when TM_SMTP_ADDR is set.
func ConfigFromEnv(getenv func(string) string) (Config, error) {
	var c Config
	for _, v := range []struct {
		name string
		dst  *int
	}{
		{EnvMaxConcurrent, &c.MaxConcurrent},
		{EnvJobsPerMinute, &c.InstanceJobsPerMinute},
		{EnvTenantJobsPerMinute, &c.TenantJobsPerMinute},
		{EnvMaxQueued, &c.MaxQueued},
	} {
		s := getenv(v.name)
		if s == "" {
			continue
		}
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 {
			return Config{}, fmt.Errorf("%s=%q: want a whole number >= 0", v.name, s)
		}
		*v.dst = n
	}
	if v := getenv(EnvRetention); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < time.Second {
			return Config{}, fmt.Errorf("%s=%q: want a duration of at least 1s, like 168h", EnvRetention, v)
		}
		c.Retention = d
	}
	if v := getenv(EnvWebhookAllow); v != "" {
		c.WebhookAllow = strings.Split(v, ",")
		if _, err := parseDestinations(c.WebhookAllow); err != nil {
			return Config{}, fmt.Errorf("%s=%q: %w", EnvWebhookAllow, v, err)
		}
	}
	if addr := getenv(EnvSMTPAddr); addr != "" {
		from := getenv(EnvSMTPFrom)
		if from == "" {
			return Config{}, fmt.Errorf("%s is set: %s (the sender address) is required too", EnvSMTPAddr, EnvSMTPFrom)
		}
		c.Effects = map[string]Effect{"email": &SMTP{Addr: addr, From: from}}
	}
	return c, nil
}
