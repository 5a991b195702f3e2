package probes

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Exit codes of Main.
const (
	ExitOK    = 0
	ExitError = 1 // the agent itself failed (cannot bind, cannot read the kernel)
	ExitUsage = 2 // bad arguments or bad JSON: the caller's bug
)

// Stdin is read by `run` when no JSON argument is given (a variable for tests).
var Stdin io.Reader = os.Stdin

const usage = `usage: claudebox probe <sub-command> [args]

  run [JSON]             run probes: JSON is one Spec or an array of Specs, from the
                         argument or stdin; prints a JSON array of Results (exit 0
                         whatever the outcomes: they are data)
  run --detach F [JSON]  run them in the background, detached from the caller (it may be
                         gone when they end: an incusd restart ends every exec); the
                         Results go to F once done
  run --nested P [JSON]  run them in a nested container (new namespaces behind a veth
                         pair on the /30 P, masqueraded out of eth0, as Docker does)
  collect F              end a detached run's floods (their tails still run), wait for
                         it and print its Results
  facts [--iface eth0]   print the box's Facts as JSON
  hits [--file F]        print the listeners' hits as a JSON array (default ` + DefaultHitsFile + `)
  status [--file F]      print PID-1 mode's status file (default ` + DefaultStatusFile + `)
  serve [--tcp 7001,..] [--udp 7002,..] [--hits F] [--capture IFACE]
                         run listeners in the foreground until SIGTERM/SIGINT; prints one
                         JSON line {"tcp":[...],"udp":[...]} once bound
  init                   PID-1 mode, explicitly (refused unless PID 1)

exit codes: 0 ok, 1 the agent failed, 2 bad arguments or JSON
`

// Main implements `claudebox probe <sub> ...`; args start at <sub>.
func Main(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return ExitUsage
	}
	sub, rest := args[0], args[1:]
	switch sub {
	case "run":
		if len(rest) > 0 && rest[0] == "--detach" {
			return mainDetach(rest[1:], stderr)
		}
		if len(rest) > 1 && rest[0] == "--nested" {
			return mainNested(rest[1], rest[2:], stdout, stderr)
		}
		return mainRun(rest, stdout, stderr)
	case "nested-child":
		return nestedChild(rest, stdout, stderr)
	case "collect":
		if len(rest) != 1 {
			fmt.Fprintln(stderr, "probe collect: want the detached run's results file")
			return ExitUsage
		}
		return mainCollect(rest[0], stdout, stderr)
	case "facts":
		fs := newFlags("facts", stderr)
		iface := fs.String("iface", DefaultIface, "interface holding the lease")
		if !parse(fs, rest) {
			return ExitUsage
		}
		f, err := GatherFacts(*iface)
		if err != nil {
			fmt.Fprintf(stderr, "probe facts: %v\n", err)
			return ExitError
		}
		return printJSON(stdout, stderr, f)
	case "hits":
		fs := newFlags("hits", stderr)
		file := fs.String("file", DefaultHitsFile, "hits file")
		if !parse(fs, rest) {
			return ExitUsage
		}
		hs, err := ReadHits(*file)
		if err != nil {
			fmt.Fprintf(stderr, "probe hits: %v\n", err)
			return ExitError
		}
		return printJSON(stdout, stderr, hs)
	case "status":
		fs := newFlags("status", stderr)
		file := fs.String("file", DefaultStatusFile, "status file")
		if !parse(fs, rest) {
			return ExitUsage
		}
		s, err := ReadStatus(*file)
		if err != nil {
			fmt.Fprintf(stderr, "probe status: %v\n", err)
			return ExitError
		}
		return printJSON(stdout, stderr, s)
	case "serve":
		return mainServe(rest, stdout, stderr)
	case "init":
		err := RunInit(InitConfig{}) // returns only when refused (not PID 1)
		fmt.Fprintf(stderr, "probe init: %v\n", err)
		return ExitError
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return ExitOK
	default:
		fmt.Fprintf(stderr, "probe: unknown sub-command %q\n%s", sub, usage)
		return ExitUsage
	}
}

func newFlags(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("probe "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return fs
}

func parse(fs *flag.FlagSet, args []string) bool {
	if err := fs.Parse(args); err != nil {
		return false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		return false
	}
	return true
}

func printJSON(stdout, stderr io.Writer, v any) int {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		fmt.Fprintf(stderr, "probe: encoding output: %v\n", err)
		return ExitError
	}
	_, _ = stdout.Write(append(b, '\n'))
	return ExitOK
}

// ParseSpecs accepts one Spec object or an array of them, strictly: unknown
// fields, trailing data and invalid specs are errors naming the spec's index.
func ParseSpecs(data []byte) ([]Spec, error) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil, errors.New("no JSON given")
	}
	var specs []Spec
	dec := json.NewDecoder(bytes.NewReader(data))
	if data[0] == '{' {
		var s Spec
		if err := dec.Decode(&s); err != nil {
			return nil, fmt.Errorf("bad spec JSON: %w", err)
		}
		specs = []Spec{s}
	} else if err := dec.Decode(&specs); err != nil {
		return nil, fmt.Errorf("bad spec JSON (want a Spec or an array of Specs): %w", err)
	}
	if dec.More() {
		return nil, errors.New("bad spec JSON: trailing data after the first value")
	}
	for i, s := range specs {
		if err := s.Validate(); err != nil {
			return nil, fmt.Errorf("spec %d (id %q): %w", i, s.ID, err)
		}
	}
	return specs, nil
}

func mainRun(args []string, stdout, stderr io.Writer) int {
	specs, code := readSpecs("probe run", args, stderr)
	if specs == nil {
		return code
	}
	ctx, stop := signal.NotifyContext(context.Background(), unix.SIGTERM, unix.SIGINT)
	defer stop()
	return printJSON(stdout, stderr, RunMany(ctx, specs))
}

// mainNested is `probe run --nested PREFIX [JSON]`: the probes run in a nested container.
func mainNested(prefix string, args []string, stdout, stderr io.Writer) int {
	p, err := netip.ParsePrefix(prefix)
	if err != nil {
		fmt.Fprintf(stderr, "probe run --nested: %v\n", err)
		return ExitUsage
	}
	specs, code := readSpecs("probe run", args, stderr)
	if specs == nil {
		return code
	}
	ctx, stop := signal.NotifyContext(context.Background(), unix.SIGTERM, unix.SIGINT)
	defer stop()
	res, err := RunNested(ctx, "/proc/self/exe", p, specs)
	if err != nil {
		fmt.Fprintf(stderr, "probe run --nested: %v\n", err)
		return ExitError
	}
	return printJSON(stdout, stderr, res)
}

// readSpecs reads a run's specs from its one argument or stdin; nil and the exit code when
// they cannot be read.
func readSpecs(what string, args []string, stderr io.Writer) ([]Spec, int) {
	var data []byte
	switch len(args) {
	case 0:
		b, err := io.ReadAll(Stdin)
		if err != nil {
			fmt.Fprintf(stderr, "%s: reading stdin: %v\n", what, err)
			return nil, ExitError
		}
		data = b
	case 1:
		data = []byte(args[0])
	default:
		fmt.Fprintf(stderr, "%s: want one JSON argument (or JSON on stdin)\n", what)
		return nil, ExitUsage
	}
	specs, err := ParseSpecs(data)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", what, err)
		return nil, ExitUsage
	}
	if specs == nil {
		specs = []Spec{}
	}
	return specs, ExitOK
}

func mainServe(args []string, stdout, stderr io.Writer) int {
	fs := newFlags("serve", stderr)
	tcp := fs.String("tcp", strconv.Itoa(DefaultTCPPort), "comma-separated TCP ports (empty: none)")
	udp := fs.String("udp", strconv.Itoa(DefaultUDPPort), "comma-separated UDP echo ports (empty: none)")
	hits := fs.String("hits", DefaultHitsFile, "append hits here as JSON lines (empty: nowhere)")
	capture := fs.String("capture", "", "record marker frames and frames from unexpected sources seen on this interface (empty: off)")
	if !parse(fs, args) {
		return ExitUsage
	}
	cfg := ListenerConfig{HitsFile: *hits, Capture: *capture}
	var err error
	if cfg.TCP, err = ports(*tcp); err == nil {
		cfg.UDP, err = ports(*udp)
	}
	if err != nil {
		fmt.Fprintf(stderr, "probe serve: %v\n", err)
		return ExitUsage
	}
	ctx, stop := signal.NotifyContext(context.Background(), unix.SIGTERM, unix.SIGINT, unix.SIGPWR)
	defer stop()
	ls, err := Serve(ctx, cfg)
	if err != nil {
		fmt.Fprintf(stderr, "probe serve: %v\n", err)
		return ExitError
	}
	t, u := boundPorts(ls)
	b, _ := json.Marshal(map[string]any{"tcp": t, "udp": u, "hits_file": cfg.HitsFile})
	fmt.Fprintln(stdout, string(b))
	<-ctx.Done()
	_ = ls.Close()
	return ExitOK
}

func ports(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		p, err := strconv.Atoi(f)
		if err != nil || p < 0 || p > 65535 {
			return nil, fmt.Errorf("bad port %q", f)
		}
		out = append(out, p)
	}
	return out, nil
}
