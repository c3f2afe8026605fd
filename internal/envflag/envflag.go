// Package envflag binds command-line flags to TM_* environment variables: every flag's default
// comes from its variable when set, so `--nats-url` and TM_NATS_URL mean the same, and the
// flag, when given, wins. Help text names the variable.
package envflag

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Var returns the environment variable for a flag name: "nats-url" -> "TM_NATS_URL".
func Var(name string) string {
	return "TM_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

func lookup(name string) (string, bool) { return os.LookupEnv(Var(name)) }

func usage(name, help string) string { return fmt.Sprintf("%s (env %s)", help, Var(name)) }

// String defines a string flag defaulting to $TM_<NAME> or def.
func String(fs *flag.FlagSet, p *string, name, def, help string) {
	if v, ok := lookup(name); ok {
		def = v
	}
	fs.StringVar(p, name, def, usage(name, help))
}

// Secret defines a string flag defaulting to $TM_<NAME>, like String, whose value --help never
// shows.
func Secret(fs *flag.FlagSet, p *string, name, help string) {
	String(fs, p, name, "", help)
	fs.Lookup(name).DefValue = ""
}

// Int defines an int flag defaulting to $TM_<NAME> or def.
func Int(fs *flag.FlagSet, p *int, name string, def int, help string) {
	if v, ok := lookup(name); ok {
		if n, err := strconv.Atoi(v); err == nil {
			def = n
		}
	}
	fs.IntVar(p, name, def, usage(name, help))
}

// Bool defines a bool flag defaulting to $TM_<NAME> or def.
func Bool(fs *flag.FlagSet, p *bool, name string, def bool, help string) {
	if v, ok := lookup(name); ok {
		if b, err := strconv.ParseBool(v); err == nil {
			def = b
		}
	}
	fs.BoolVar(p, name, def, usage(name, help))
}

// Duration defines a duration flag defaulting to $TM_<NAME> or def.
func Duration(fs *flag.FlagSet, p *time.Duration, name string, def time.Duration, help string) {
	if v, ok := lookup(name); ok {
		if d, err := time.ParseDuration(v); err == nil {
			def = d
		}
	}
	fs.DurationVar(p, name, def, usage(name, help))
}

// Check reports environment variables that are set but do not parse, so a typo is an error
// rather than a silent default. Call it after defining flags, before or after parsing: a flag
// given on the command line keeps its value.
func Check(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var bad []string
	fs.VisitAll(func(f *flag.Flag) {
		v, ok := lookup(f.Name)
		if !ok || given[f.Name] {
			return
		}
		if err := f.Value.Set(v); err != nil {
			bad = append(bad, fmt.Sprintf("%s=%q: %v", Var(f.Name), v, err))
		}
	})
	if len(bad) > 0 {
		return fmt.Errorf("bad environment: %s", strings.Join(bad, "; "))
	}
	return nil
}
