package probes

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// A detached run outlives the exec that started it: the soak restarts incusd, which ends every
// exec session, while the boxes keep flooding. The run writes its pid to F.pid, runs until its
// specs end or SIGTERM ends its floods, and renames its Results into F (F.tmp first, so a
// reader never sees half a file).

// detachedChild marks the re-exec'd child (an env var, so the parent's argv stays the API).
const detachedChild = "CLAUDEBOX_PROBE_DETACHED"

// collectWait bounds how long collect waits for the run to write its Results after SIGTERM
// (the floods' tails, at most a probe's timeout past the flood).
const collectWait = 30 * time.Second

func mainDetach(args []string, stderr io.Writer) int {
	if len(args) < 1 || len(args) > 2 || args[0] == "" {
		fmt.Fprintln(stderr, "probe run --detach: want a results file (and the JSON, or JSON on stdin)")
		return ExitUsage
	}
	out := args[0]
	var data []byte
	if len(args) == 2 {
		data = []byte(args[1])
	} else {
		b, err := io.ReadAll(Stdin)
		if err != nil {
			fmt.Fprintf(stderr, "probe run: reading stdin: %v\n", err)
			return ExitError
		}
		data = b
	}
	specs, err := ParseSpecs(data)
	if err != nil {
		fmt.Fprintf(stderr, "probe run: %v\n", err)
		return ExitUsage
	}
	if os.Getenv(detachedChild) == "1" {
		return runDetached(out, specs, stderr)
	}
	for _, f := range []string{out, out + ".pid", out + ".tmp"} {
		_ = os.Remove(f)
	}
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "probe run --detach: %v\n", err)
		return ExitError
	}
	cmd := exec.Command(self, "probe", "run", "--detach", out, string(data))
	cmd.Env = append(os.Environ(), detachedChild+"=1")
	cmd.SysProcAttr = &unix.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(stderr, "probe run --detach: %v\n", err)
		return ExitError
	}
	// The child writes F.pid before it runs anything: once it is there, collect can end it.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if _, err := os.Stat(out + ".pid"); err == nil {
			_ = cmd.Process.Release()
			return ExitOK
		}
	}
	_ = cmd.Process.Kill()
	fmt.Fprintln(stderr, "probe run --detach: the detached run did not start within 5s")
	return ExitError
}

func runDetached(out string, specs []Spec, stderr io.Writer) int {
	if err := os.WriteFile(out+".pid", []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		fmt.Fprintf(stderr, "probe run --detach: %v\n", err)
		return ExitError
	}
	stop := make(chan struct{})
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, unix.SIGTERM, unix.SIGINT, unix.SIGHUP)
	go func() { <-sig; close(stop) }()
	res := RunMany(WithFloodStop(context.Background(), stop), specs)
	b, err := json.Marshal(res)
	if err == nil {
		err = os.WriteFile(out+".tmp", b, 0o644)
	}
	if err == nil {
		err = os.Rename(out+".tmp", out)
	}
	if err != nil {
		fmt.Fprintf(stderr, "probe run --detach: %v\n", err)
		return ExitError
	}
	return ExitOK
}

func mainCollect(out string, stdout, stderr io.Writer) int {
	b, err := os.ReadFile(out + ".pid")
	if errors.Is(err, os.ErrNotExist) {
		if _, err := os.Stat(out); err != nil {
			fmt.Fprintf(stderr, "probe collect: no results in %s: no detached run started here\n", out)
			return ExitError
		}
	}
	if err == nil {
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
			_ = unix.Kill(pid, unix.SIGTERM)
		}
	}
	for deadline := time.Now().Add(collectWait); ; time.Sleep(20 * time.Millisecond) {
		b, err := os.ReadFile(out)
		if err == nil {
			var res []Result
			if err := json.Unmarshal(b, &res); err != nil {
				fmt.Fprintf(stderr, "probe collect: %s: %v\n", out, err)
				return ExitError
			}
			return printJSON(stdout, stderr, res)
		}
		if !errors.Is(err, os.ErrNotExist) || time.Now().After(deadline) {
			fmt.Fprintf(stderr, "probe collect: no results in %s: %v\n", out, err)
			return ExitError
		}
	}
}
