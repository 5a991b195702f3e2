// Command testsummary reads `go test -json` from stdin, streams each package's result line as
// `go test` would print it, prints the output of every failed test, and ends with one plain line,
// "N passed, N failed, N skipped", so CI and humans read the same verdict. It exits 1 when any
// test or package failed (including a build failure), 0 otherwise.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"time"
)

type event struct {
	Time    time.Time
	Action  string
	Package string
	Test    string
	Elapsed float64
	Output  string
}

func main() {
	var passed, failed, skipped int
	pkgFailed := false
	outputs := map[string]*strings.Builder{} // package/test → output, kept until the test ends
	var failures []string
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 16<<20)
	for in.Scan() {
		line := in.Bytes()
		var e event
		if json.Unmarshal(line, &e) != nil {
			fmt.Println(string(line)) // build errors arrive as plain text
			continue
		}
		key := e.Package + "/" + e.Test
		switch e.Action {
		case "output":
			b := outputs[key]
			if b == nil {
				b = &strings.Builder{}
				outputs[key] = b
			}
			b.WriteString(e.Output)
		case "pass", "fail", "skip":
			if e.Test == "" {
				status := map[string]string{"pass": "ok  ", "fail": "FAIL", "skip": "?   "}[e.Action]
				fmt.Printf("%s\t%s\t%.3fs\n", status, e.Package, e.Elapsed)
				if e.Action == "fail" {
					pkgFailed = true
					if b := outputs[key]; b != nil && !strings.Contains(b.String(), "--- FAIL") {
						failures = append(failures, fmt.Sprintf("=== %s (package)\n%s", e.Package, b.String()))
					}
				}
				delete(outputs, key)
				continue
			}
			switch e.Action {
			case "pass":
				passed++
			case "fail":
				failed++
				if b := outputs[key]; b != nil {
					failures = append(failures, fmt.Sprintf("=== %s %s\n%s", e.Package, e.Test, b.String()))
				}
			case "skip":
				skipped++
			}
			delete(outputs, key)
		}
	}
	sort.Strings(failures)
	for _, f := range failures {
		fmt.Print("\n", f)
	}
	fmt.Printf("\n%d passed, %d failed, %d skipped\n", passed, failed, skipped)
	if failed > 0 || pkgFailed {
		os.Exit(1)
	}
}
