package cli

import (
	"cmp"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/urfave/cli/v2"
	"gopkg.in/yaml.v3"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/drill"
)

// Formats are the output formats of every verb that prints data (list, info, host check,
// drill): one --format, the same four values everywhere, table first (the default).
var Formats = []string{"table", "json", "yaml", "csv"}

// formatFlag is the --format flag. Every verb takes the same formats; the arguments are
// ignored (kept so that rows written against the older per-verb lists still build).
func formatFlag(_ ...string) cli.Flag {
	return &cli.StringFlag{Name: "format", Value: Formats[0], Usage: "output format: " + strings.Join(Formats, "|")}
}

// checkFormat reads --format: one of Formats ("text", info's old name for table, still works).
func checkFormat(c *Ctx, _ ...string) (string, error) {
	f := c.String("format")
	if f == "text" {
		f = "table"
	}
	for _, a := range Formats {
		if f == a {
			return f, nil
		}
	}
	return "", boxcore.Usagef("%s: unknown --format %q (one of %s)", c.Cmd.Name, f, strings.Join(Formats, ", "))
}

func writeJSON(c *Ctx, v any) error { return encodeJSON(c.Env.Stdout, v) }

func encodeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// encodeYAML writes v as YAML made from its JSON encoding, so the two formats never differ:
// same keys, same nesting, same order, same values.
func encodeYAML(w io.Writer, v any) error {
	b, err := toYAML(v)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

func toYAML(v any) ([]byte, error) {
	j, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	// JSON is YAML: parsed into a node it keeps the keys' order; the styles JSON forces
	// (flow, double quotes) are cleared so that it prints as block YAML.
	var n yaml.Node
	if err := yaml.Unmarshal(j, &n); err != nil {
		return nil, err
	}
	var clear func(*yaml.Node)
	clear = func(n *yaml.Node) {
		n.Style = 0
		for _, k := range n.Content {
			clear(k)
		}
	}
	clear(&n)
	var b strings.Builder
	enc := yaml.NewEncoder(&b)
	enc.SetIndent(2)
	if err := enc.Encode(&n); err != nil {
		return nil, err
	}
	return []byte(b.String()), enc.Close()
}

// writeData prints v as json or yaml, and reports whether format was one of those.
func writeData(w io.Writer, format string, v any) (bool, error) {
	switch format {
	case "json":
		return true, encodeJSON(w, v)
	case "yaml":
		return true, encodeYAML(w, v)
	}
	return false, nil
}

func writeCSV(w io.Writer, header []string, rows [][]string) error {
	cw := csv.NewWriter(w)
	_ = cw.Write(header)
	for _, r := range rows {
		_ = cw.Write(r)
	}
	cw.Flush()
	return cw.Error()
}

// rfc3339 is how every format but the table prints a time: RFC 3339, UTC.
func rfc3339(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// listHeader is the CSV columns; new ones go at the end, so a script's column numbers hold.
var listHeader = []string{"name", "state", "type", "ipv4", "snapshots", "created", "member"}

func listRow(b boxcore.Summary) []string {
	return []string{b.Name, b.State, b.Type, strings.Join(b.IPv4, " "), fmt.Sprint(b.Snapshots), rfc3339(b.Created), b.Member}
}

// writeList prints list's boxes in a format.
func writeList(w io.Writer, format string, list []boxcore.Summary) error {
	if ok, err := writeData(w, format, list); ok {
		return err
	}
	if format == "csv" {
		rows := make([][]string, 0, len(list))
		for _, b := range list {
			rows = append(rows, listRow(b))
		}
		return writeCSV(w, listHeader, rows)
	}
	// On a cluster a MEMBER column says where each box lives; a standalone host has none.
	clustered := slices.ContainsFunc(list, func(b boxcore.Summary) bool { return b.Member != "" })
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	header := "NAME\tSTATE\tTYPE\tIPV4\tSNAPSHOTS\tCREATED"
	if clustered {
		header += "\tMEMBER"
	}
	fmt.Fprintln(tw, header)
	for _, b := range list {
		ip := strings.Join(b.IPv4, ", ")
		if ip == "" {
			ip = "-"
		}
		line := fmt.Sprintf("%s\t%s\t%s\t%s\t%d\t%s", b.Name, b.State, b.Type, ip, b.Snapshots, b.Created.UTC().Format("2006-01-02 15:04"))
		if clustered {
			line += "\t" + cmp.Or(b.Member, "-")
		}
		fmt.Fprintln(tw, line)
	}
	return tw.Flush()
}

// writeInfo prints info's box in a format; table is the readable text.
func writeInfo(w io.Writer, format string, info boxcore.Info) error {
	if ok, err := writeData(w, format, info); ok {
		return err
	}
	if format == "csv" {
		var exposed []string
		for _, e := range info.Exposures {
			exposed = append(exposed, fmt.Sprintf("%d=%s", e.Port, e.On))
		}
		return writeCSV(w, append(append([]string{}, listHeader...), "profiles", "clone_command", "exposures"),
			[][]string{append(listRow(info.Summary), strings.Join(info.Profiles, " "), info.CloneLine, strings.Join(exposed, " "))})
	}
	out := func(format string, a ...any) { fmt.Fprintf(w, format+"\n", a...) }
	out("name:      %s", info.Name)
	out("state:     %s", info.State)
	if info.State == boxcore.StateMinting {
		out("           not ready: a 'claudebox new' is still making it, or died before it could clean up (then: claudebox rm %s --force)", info.Name)
	}
	out("type:      %s", info.Type)
	if info.Member != "" {
		out("member:    %s (cluster member)", info.Member)
	}
	out("profiles:  %s", strings.Join(info.Profiles, ", "))
	out("created:   %s", rfc3339(info.Created))
	out("limits:    %s", limitsLine(info.Limits))
	out("addresses:")
	for _, a := range info.Addresses {
		out("  %s %s/%s (%s)", a.Interface, a.Address, a.Netmask, a.Scope)
	}
	out("provenance:")
	for _, k := range []string{"origin", "from", "template", "bake", "created", "version"} {
		if v, ok := info.Provenance[k]; ok {
			out("  %s: %s", k, v)
		}
	}
	out("snapshots: %d", len(info.Snapshots))
	for _, s := range info.Snapshots {
		out("  %s  %s", s.Name, rfc3339(s.CreatedAt))
	}
	if len(info.Exposures) == 0 {
		out("exposed:   nothing (claudebox expose %s PORT)", info.Name)
	} else {
		out("exposed:   %d (from this host only)", len(info.Exposures))
		for _, e := range info.Exposures {
			out("  box port %d on %s", e.Port, e.On)
		}
	}
	out("clone it:  %s", info.CloneLine)
	return nil
}

// writeCheck prints host check's readings in a format.
func writeCheck(w io.Writer, format string, r boxcore.CheckReport) error {
	if ok, err := writeData(w, format, r); ok {
		return err
	}
	if format == "csv" {
		rows := make([][]string, 0, len(r.Rows))
		for _, row := range r.Rows {
			rows = append(rows, []string{row.Layer, row.Item, row.Expected, row.Actual, fmt.Sprint(row.OK)})
		}
		return writeCSV(w, []string{"layer", "item", "expected", "actual", "ok"}, rows)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "LAYER\tITEM\tEXPECTED\tACTUAL\t")
	for _, row := range r.Rows {
		mark := ""
		if !row.OK {
			mark = "DRIFT"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", row.Layer, row.Item, row.Expected, row.Actual, mark)
	}
	return tw.Flush()
}

// writeDrill prints a drill run in a format; table is the matrix.
func writeDrill(w io.Writer, format string, rep *drill.Report) error {
	switch format {
	case "json", "yaml":
		_, err := writeData(w, format, json.RawMessage(rep.JSON()))
		return err
	case "csv":
		var rows [][]string
		if rep.Matrix != nil {
			for _, row := range rep.Matrix.Rows {
				rows = append(rows, []string{fmt.Sprint(row.Claim), fmt.Sprint(row.From), fmt.Sprint(row.To), row.ProbeLabel(),
					fmt.Sprint(row.Expected), fmt.Sprint(row.Observed), fmt.Sprint(row.Verdict), fmt.Sprint(row.Layers), row.Why})
			}
		}
		return writeCSV(w, []string{"claim", "from", "to", "probe", "expected", "observed", "verdict", "layers", "why"}, rows)
	}
	rep.PrintMatrix(w)
	return nil
}
