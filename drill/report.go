package drill

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"
)

// Report is one drill run: what the record holds.
type Report struct {
	RunID        string    `json:"run_id"`
	Started      time.Time `json:"started_utc"`
	Host         HostInfo  `json:"host"`
	Stack        string    `json:"stack"`
	InstanceType string    `json:"instance_type"`
	// Member: on an Incus cluster, the member drilled (its kernel, its boxes, its decoys).
	Member       string        `json:"member,omitempty"`
	VMBoundary   string        `json:"vm_boundary"`
	Boxes        int           `json:"boxes"`
	BoxList      []*Box        `json:"box_list,omitempty"`
	Decoy        *Decoy        `json:"decoy,omitempty"`
	Forwarder    string        `json:"dnsmasq_forwarder,omitempty"`
	LayersBefore []LayerState  `json:"layers_before"`
	Matrix       *Matrix       `json:"matrix,omitempty"`
	Holes        []*HoleResult `json:"seeded_holes,omitempty"`
	Reapplies    ReapplyCount  `json:"reapplies"`
	Phases       []Phase       `json:"phases"`
	Wall         time.Duration `json:"wall_ns"`
	WallSeconds  float64       `json:"wall_s"`
	OK           bool          `json:"ok"`
	Verdict      string        `json:"verdict"`
	Error        string        `json:"error,omitempty"`
}

// ReapplyCount is every re-apply of the network Incus made while the run was on (from the
// decoys up to the end of teardown), by what covered it. Unmeasured ones are windows nobody
// flooded: the drill's own must never be one (another writer's can be).
type ReapplyCount struct {
	Seen       int `json:"seen"`
	UnderFlood int `json:"under_flood"` // in a re-apply window or the soak: measured
	SeededHole int `json:"seeded_hole"` // a self-test hole switching a layer off or back on
	Unmeasured int `json:"unmeasured"`
	// WatchLost: times the kernel dropped nftables events during the run (the count may miss
	// re-applies then).
	WatchLost int `json:"watch_lost,omitempty"`
}

func (c ReapplyCount) String() string {
	s := fmt.Sprintf("%d (%d under the boxes' floods, %d by seeded holes, %d unmeasured)", c.Seen, c.UnderFlood, c.SeededHole, c.Unmeasured)
	if c.WatchLost > 0 {
		s += fmt.Sprintf("; the watch lost events %d times, so the count may be short", c.WatchLost)
	}
	return s
}

func (r *Report) finish() {
	r.WallSeconds = r.Wall.Seconds()
	if r.InstanceType == "" {
		r.InstanceType = "container"
	}
	if r.InstanceType == "container" {
		r.VMBoundary = "not validated: container mode; the VM trust boundary was not tested"
	} else {
		r.VMBoundary = "validated"
	}
	r.OK = r.Error == "" && r.Matrix != nil && r.Matrix.OK()
	for _, h := range r.Holes {
		r.OK = r.OK && h.OK
	}
	pass, fail, cf := 0, 0, 0
	if r.Matrix != nil {
		pass, fail, cf = r.Matrix.Counts()
	}
	switch {
	case r.Error != "":
		r.Verdict = "ERROR: " + r.Error
	case r.OK:
		r.Verdict = fmt.Sprintf("PASS: every claim holds and every control passed (%d rows)", pass)
	default:
		r.Verdict = fmt.Sprintf("FAIL: %d row(s) failed, %d check-failed, %d passed", fail, cf, pass)
	}
	if len(r.Holes) > 0 {
		n := 0
		for _, h := range r.Holes {
			if h.OK {
				n++
			}
		}
		r.Verdict += fmt.Sprintf("; seeded holes %d/%d as attributed", n, len(r.Holes))
	}
}

// mark is one outcome as a matrix cell.
func mark(r *Row) string {
	m := map[Outcome]string{Open: "O", Refused: "R", Dropped: ".", CheckFailed: "?", Answer: "A",
		NoAnswer: "-", Silence: "s", None: "-", HasIPv6: "6", Lease: "L", NoLease: "!"}[r.Observed]
	if m == "" {
		m = string(r.Observed)
	}
	switch r.Verdict {
	case Fail:
		return m + "X"
	case NoCheck:
		return m + "?"
	}
	return m
}

// PrintMatrix writes the truth tables: per claim, expected vs observed, one line per probe
// row, then the box→box grid (from × to, one mark per protocol), then the verdict line.
func (r *Report) PrintMatrix(w io.Writer) {
	if r.Matrix == nil {
		fmt.Fprintln(w, "no matrix:", r.Error)
		return
	}
	fmt.Fprintln(w, "marks: O open  R refused  . dropped  A answer  - no answer/none  s silence  ? check-failed  L lease; suffix X = FAIL, ? = no verdict")
	printRows(w, r.Matrix.Rows, false)
	printGrid(w, r.Matrix.Rows)
	fmt.Fprintf(w, "instance type: %s (%s)\n", r.InstanceType, r.VMBoundary)
	if r.Member != "" {
		fmt.Fprintf(w, "cluster member: %s (its kernel and its boxes; each member runs its own drill)\n", r.Member)
	}
	fmt.Fprintln(w, r.Verdict)
}

func printRows(w io.Writer, rows []*Row, onlyBad bool) {
	tw := tabwriter.NewWriter(w, 0, 0, 1, ' ', 0)
	fmt.Fprintln(tw, "CLAIM\tFROM\tTO\tPROBE\tEXPECTED\tOBSERVED\tVERDICT\tLAYERS\tWHY")
	for _, c := range ClaimOrder {
		for _, row := range rows {
			if row.Claim != c || (onlyBad && row.Verdict == Pass) {
				continue
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s %s\t%s\t%s\t%s\n", row.Claim, row.From, row.To, row.ProbeLabel(),
				row.Expected, mark(row), row.Observed, row.Verdict, row.Layers, truncate(row.Why, 90))
		}
	}
	tw.Flush()
}

// ProbeLabel names a row's probe for people: "tcp/7001", "dns A name", "icmp".
func (r *Row) ProbeLabel() string {
	p := r.Probe
	switch p.Kind {
	case "tcp", "udp", "tcp6ll":
		return fmt.Sprintf("%s/%d", p.Kind, p.Port)
	case "dns":
		if p.DNS.TCP {
			return "dns/tcp " + p.DNS.Type + " " + p.DNS.Name
		}
		return "dns " + p.DNS.Type + " " + p.DNS.Name
	}
	return p.Kind
}

// printGrid is the Kubernetes-netpol-style truth table of box→box: rows are sources,
// columns targets, each cell the marks of tcp udp icmp arp tcp6ll.
func printGrid(w io.Writer, rows []*Row) {
	var names []string
	cell := map[[2]string]string{}
	for _, r := range rows {
		if r.Claim != ClaimBoxBox && r.Claim != ClaimBoxBoxL2 {
			continue
		}
		for _, n := range []string{r.From, r.To} {
			if !slices.Contains(names, n) {
				names = append(names, n)
			}
		}
		cell[[2]string{r.From, r.To}] += mark(r)
	}
	if len(names) == 0 {
		return
	}
	slices.Sort(names)
	fmt.Fprintln(w, "box→box truth table (cell = tcp udp icmp arp tcp6ll; expected all '.'):")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprint(tw, "from \\ to\t")
	for _, n := range names {
		fmt.Fprintf(tw, "%s\t", short(n))
	}
	fmt.Fprintln(tw)
	for _, a := range names {
		fmt.Fprintf(tw, "%s\t", short(a))
		for _, b := range names {
			c := cell[[2]string{a, b}]
			if a == b {
				c = "x"
			}
			fmt.Fprintf(tw, "%s\t", c)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
}

func short(n string) string {
	if i := strings.LastIndexByte(n, '-'); i >= 0 {
		return n[i+1:]
	}
	return n
}

func truncate(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n]) + "…" // by runes: never half a character
	}
	return s
}

// DefaultRecord is $XDG_STATE_HOME/claudebox/RUNS.md, else ~/.local/state/claudebox/RUNS.md.
func DefaultRecord() string {
	if x := os.Getenv("XDG_STATE_HOME"); x != "" {
		return filepath.Join(x, "claudebox", "RUNS.md")
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".local", "state", "claudebox", "RUNS.md")
}

// JSONLPath is the JSON-lines sibling of a record: RUNS.md → RUNS.jsonl.
func JSONLPath(md string) string {
	return strings.TrimSuffix(md, filepath.Ext(md)) + ".jsonl"
}

// JSON is the run as one line.
func (r *Report) JSON() []byte {
	b, _ := json.Marshal(r)
	return b
}

// Append appends the human entry to the record and the JSON line to its sibling.
func (r *Report) Append(md string) error {
	if err := os.MkdirAll(filepath.Dir(md), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(md, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	if st, _ := f.Stat(); st != nil && st.Size() == 0 {
		fmt.Fprintln(f, "# claudebox drill runs\n\nOne entry per `claudebox drill` run (appended by the drill; the same run is one JSON line in RUNS.jsonl).")
	}
	r.WriteMarkdown(f)
	if err := f.Close(); err != nil {
		return err
	}
	j, err := os.OpenFile(JSONLPath(md), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	_, err = j.Write(append(r.JSON(), '\n'))
	if cerr := j.Close(); err == nil {
		err = cerr
	}
	return err
}

// WriteMarkdown writes the human entry.
func (r *Report) WriteMarkdown(w io.Writer) {
	fmt.Fprintf(w, "\n## %s — %s — run %s\n\n", r.Started.Format("2006-01-02 15:04:05Z"), r.Host.Hostname, r.RunID)
	fmt.Fprintf(w, "- kernel %s, Incus %s, nft_meta_bridge %v\n", r.Host.Kernel, r.Host.IncusVersion, r.Host.NFTBridgeMeta)
	fmt.Fprintf(w, "- stack %s, %d %s boxes; VM boundary: %s\n", r.Stack, r.Boxes, r.InstanceType, r.VMBoundary)
	if r.Forwarder != "" {
		fmt.Fprintf(w, "- temporary dnsmasq line (removed after): `%s`\n", r.Forwarder)
	}
	fmt.Fprintf(w, "- wall time %.2fs (", r.WallSeconds)
	for i, p := range r.Phases {
		if i > 0 {
			fmt.Fprint(w, ", ")
		}
		fmt.Fprintf(w, "%s %.2fs", p.Name, p.Elapsed.Seconds())
	}
	fmt.Fprintf(w, ")\n- **%s**\n\n", r.Verdict)
	fmt.Fprintln(w, "Layers before the run:\n\n| layer | on | reading |\n|---|---|---|")
	for _, l := range r.LayersBefore {
		fmt.Fprintf(w, "| %s | %v | %s |\n", l.Layer, l.On, strings.ReplaceAll(l.What, "|", "/"))
	}
	if r.Matrix != nil {
		fmt.Fprintln(w, "\n| claim | from | to | probe | expected | observed | verdict | layers |\n|---|---|---|---|---|---|---|---|")
		for _, c := range ClaimOrder {
			for _, row := range r.Matrix.Rows {
				if row.Claim == c {
					fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s |\n", row.Claim, row.From, row.To, row.ProbeLabel(),
						row.Expected, row.Observed, row.Verdict, row.Layers)
				}
			}
		}
	}
	if len(r.Holes) > 0 {
		fmt.Fprintln(w, "\nSeeded holes (rows that turned red, by claim/probe; the JSON line lists every row):\n\n| hole | layers off | expected red | observed red | turned red | as attributed | host restored |\n|---|---|---|---|---|---|---|")
		for _, h := range r.Holes {
			fmt.Fprintf(w, "| %s | %v | %d | %d | %s | %v | %v |\n", h.Name, h.Off, len(h.ExpectedRed), len(h.ObservedRed), summarize(h.ObservedRed), h.OK, h.Restored)
		}
	}
	if r.Error != "" {
		fmt.Fprintf(w, "\nError: %s\n", r.Error)
	}
}
