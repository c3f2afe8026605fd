// Package cli is the `rebalance` command: plan, apply, rollback and inspect tenant moves, and
// `rebalance serve`, the rebalancer service. Each subcommand is a small type with
// Run(ctx, args); [Main] dispatches and maps errors to exit codes, so tests run the whole CLI
// in-process with buffers for stdin, stdout and stderr.
//
// Exit codes: 0 success, 1 error, 2 usage error, 3 a plan finished partially (moves skipped,
// aborted or failed), 4 a verified move's target state differs from its source's.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/user"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/tenantmesh/tenantmesh/internal/envflag"
	"github.com/tenantmesh/tenantmesh/rebalancer"
	"github.com/tenantmesh/tenantmesh/shardkit/natsconn"
	"github.com/tenantmesh/tenantmesh/shardkit/schema"
)

// Main is the CLI with its streams. The zero value uses the process's streams and clock.
type Main struct {
	Stdin          io.Reader
	Stdout, Stderr io.Writer
	// Terminal reports whether a stream is an interactive terminal. Default: a character
	// device (*os.File whose mode has ModeCharDevice).
	Terminal func(any) bool
	// Now is the clock used for ages in tables. Default time.Now.
	Now func() time.Time
}

// command is one subcommand.
type command interface {
	Run(ctx context.Context, args []string) error
}

type commandInfo struct {
	name, summary string
	make          func(*Main) command
}

var commands = []commandInfo{
	{"plan", "make a plan: balance, evacuate <shard>, fill <shard>, move <tenant>, manual", func(m *Main) command { return &PlanCommand{m: m} }},
	{"apply", "apply a stored plan (by id) or a plan file", func(m *Main) command { return &ApplyCommand{m: m} }},
	{"rollback", "reverse an applied plan", func(m *Main) command { return &RollbackCommand{m: m} }},
	{"verify", "compare each move's target state at the fence with its source's", func(m *Main) command { return &VerifyCommand{m: m} }},
	{"pause", "pause a plan: no move starts until it is resumed", func(m *Main) command {
		return &ControlCommand{m: m, name: "pause", control: rebalancer.ControlPause}
	}},
	{"resume", "resume a paused plan from where it stopped", func(m *Main) command { return &ControlCommand{m: m, name: "resume"} }},
	{"cancel", "cancel a plan: moves past their handoff finish, the rest stop", func(m *Main) command {
		return &ControlCommand{m: m, name: "cancel", control: rebalancer.ControlCancel}
	}},
	{"autopilot", "the autopilot: mode, guardrails, budget used, decisions, dead shards", func(m *Main) command { return &AutopilotCommand{m: m} }},
	{"freeze", "freeze the autopilot's rearranging (failover still runs), or --off", func(m *Main) command { return &FreezeCommand{m: m} }},
	{"maintenance", "mark a shard for maintenance: the autopilot empties it; --off clears", func(m *Main) command { return &MaintenanceCommand{m: m} }},
	{"status", "list plans, or show one plan's moves", func(m *Main) command { return &StatusCommand{m: m} }},
	{"audit", "read the audit journal", func(m *Main) command { return &AuditCommand{m: m} }},
	{"kinds", "list kinds, or set a kind's config", func(m *Main) command { return &KindsCommand{m: m} }},
	{"instances", "the instance directory: status, heartbeat age, labels, metrics", func(m *Main) command { return &InstancesCommand{m: m} }},
	{"tenants", "the largest tenants by stored size: events, snapshot, views, queue, outbox, due", func(m *Main) command { return &TenantsCommand{m: m} }},
	{"serve", "run the rebalancer service: HTTP API, sweeper, leader lease", func(m *Main) command { return &ServeCommand{m: m} }},
	{"auth", "the NATS trust chain and each role's credentials: init, creds, permissions", func(m *Main) command { return &AuthCommand{m: m} }},
}

func (m *Main) defaults() {
	if m.Stdin == nil {
		m.Stdin = os.Stdin
	}
	if m.Stdout == nil {
		m.Stdout = os.Stdout
	}
	if m.Stderr == nil {
		m.Stderr = os.Stderr
	}
	if m.Terminal == nil {
		m.Terminal = isTerminal
	}
	if m.Now == nil {
		m.Now = time.Now
	}
}

// Run runs the subcommand args[0] with the rest of args.
func (m *Main) Run(ctx context.Context, args []string) error {
	m.defaults()
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" || args[0] == "-help" {
		m.usage(m.Stdout)
		if len(args) == 0 {
			return usagef("name a command")
		}
		return nil
	}
	for _, c := range commands {
		if c.name == args[0] {
			return c.make(m).Run(ctx, args[1:])
		}
	}
	return usagef("unknown command %q; run `rebalance help` for the list", args[0])
}

// Exit runs the CLI and returns the process exit code, printing an error as one line.
func (m *Main) Exit(ctx context.Context, args []string) int {
	err := m.Run(ctx, args)
	if err == nil {
		return 0
	}
	code := ExitCode(err)
	if code != 0 && !errors.Is(err, errReported) {
		fmt.Fprintf(m.Stderr, "rebalance: %s\n", oneLine(err.Error()))
	}
	return code
}

func (m *Main) usage(w io.Writer) {
	fmt.Fprint(w, "rebalance plans and applies tenant moves between shards.\n\nUsage: rebalance <command> [flags] [args]\n\nCommands:\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, c := range commands {
		fmt.Fprintf(tw, "  %s\t%s\n", c.name, c.summary)
	}
	tw.Flush()
	fmt.Fprint(w, "\nEvery command takes --nats-url (TM_NATS_URL), --output table|json and --help.\n\n"+
		"Examples:\n  rebalance plan balance --kind aggregate\n  rebalance apply p20260101-120000-0001 --yes\n  rebalance status\n")
}

// UsageError is a mistake in the command line: exit code 2.
type UsageError struct{ Msg string }

func (e *UsageError) Error() string { return e.Msg }

func usagef(format string, a ...any) error { return &UsageError{Msg: fmt.Sprintf(format, a...)} }

// ErrPartial means a plan finished but not every move is done: exit code 3.
var ErrPartial = errors.New("plan finished partially")

// errReported is an error already printed.
var errReported = errors.New("reported")

// ExitCode maps an error from Run to the process exit code.
func ExitCode(err error) int {
	var ue *UsageError
	switch {
	case err == nil, errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, &ue):
		return 2
	case errors.Is(err, ErrPartial):
		return 3
	case errors.Is(err, ErrMismatch):
		return 4
	}
	return 1
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// common are the flags every command takes.
type common struct {
	nats    natsconn.Options
	output  string
	timeout time.Duration
}

func (c *common) register(fs *flag.FlagSet) {
	c.nats.AddFlags(fs)
	fs.StringVar(&c.output, "output", "table", "output format: table or json")
	fs.DurationVar(&c.timeout, "timeout", 10*time.Second, "bound on connecting and reading state")
}

func (c *common) check() error {
	if c.output != "table" && c.output != "json" {
		return usagef("--output %q: use table or json", c.output)
	}
	return nil
}

// newFlags makes a command's flag set with a usage text: the synopsis, a description and
// examples.
func (m *Main) newFlags(name, synopsis, about, examples string) *flag.FlagSet {
	fs := flag.NewFlagSet("rebalance "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		w := m.Stdout
		fmt.Fprintf(w, "Usage: rebalance %s %s\n\n%s\n\nExamples:\n%s\nFlags:\n", name, synopsis, about, examples)
		fs.SetOutput(w)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// parse parses flags anywhere among the arguments and returns the positional ones.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, err // Parse printed the usage
			}
			return nil, usagef("%s: %v (see %s --help)", fs.Name(), err, fs.Name())
		}
		args = fs.Args()
		if len(args) == 0 {
			break
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
	if err := envflag.Check(fs); err != nil {
		return nil, usagef("%v", err)
	}
	return pos, nil
}

// connect opens the state store. It fails fast when NATS is unreachable.
func (c *common) connect(ctx context.Context) (*schema.Store, func(), error) {
	nc, err := natsconn.Dial(c.nats, "rebalance-cli", min(c.timeout, 5*time.Second))
	if err != nil {
		return nil, nil, err
	}
	octx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	st, err := schema.Open(octx, nc, schema.Options{})
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("open tenantmesh state at %s: %w", c.nats.Redacted(), err)
	}
	return st, nc.Close, nil
}

// emit writes v as indented JSON, or calls table.
func (c *common) emit(w io.Writer, v any, table func(io.Writer) error) error {
	if c.output == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	return table(w)
}

func isTerminal(v any) bool {
	f, ok := v.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// actor names the CLI's user in plans and the audit journal.
func actor() string {
	u := os.Getenv("USER")
	if u == "" {
		if cu, err := user.Current(); err == nil && cu.Username != "" {
			u = cu.Username
		} else {
			u = "unknown"
		}
	}
	return "cli/" + u
}

// holder names this CLI process in the leader lease: cli-<host>-<pid>, so two applies on one
// host exclude each other. Ctrl-C releases the lease, so re-running an interrupted apply
// resumes at once; after a crash the lease expires within its TTL (--lease-ttl).
func holder() string {
	h, _ := os.Hostname()
	var b strings.Builder
	for _, c := range h {
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' {
			b.WriteRune(c)
		}
	}
	host := b.String()
	if len(host) > 40 {
		host = host[:40]
	}
	return fmt.Sprintf("cli-%s-%d", host, os.Getpid())
}
