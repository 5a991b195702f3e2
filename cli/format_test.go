package cli

import (
	"bytes"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/drill"
)

func sampleInfo() boxcore.Info {
	created := time.Date(2026, 12, 2, 11, 39, 0, 0, time.UTC)
	return boxcore.Info{
		Summary: boxcore.Summary{
			Name: "work", State: "RUNNING", Type: "container", IPv4: []string{"10.87.0.10"},
			Addresses: []boxcore.Address{{Interface: "eth0", Family: "inet", Address: "10.87.0.10", Netmask: "24", Scope: "global"}},
			Snapshots: 1, Created: created, Limits: boxcore.BoxLimits{Processes: "2048", Memory: "4GiB"},
		},
		Provenance: map[string]string{"origin": "fresh", "version": "true", "created": "2026"},
		Profiles:   []string{"claude-dev"},
		Snapshots:  []incus.Snapshot{{Name: "authed", CreatedAt: created, Config: map[string]string{"a": "0123"}}},
		CloneLine:  "claudebox new --name work-2 --from work/authed",
	}
}

// The YAML is the JSON: same keys in the same order, same values, for every verb's data.
func TestYAMLIsJSON(t *testing.T) {
	check := &boxcore.CheckReport{Rows: []boxcore.CheckRow{{Layer: "wall", Item: "x", Expected: "1", Actual: "yes", OK: false}}}
	for _, v := range []any{sampleInfo(), []boxcore.Summary{sampleInfo().Summary}, check, []boxcore.Summary{}} {
		var y, j bytes.Buffer
		if err := encodeYAML(&y, v); err != nil {
			t.Fatal(err)
		}
		if err := encodeJSON(&j, v); err != nil {
			t.Fatal(err)
		}
		var fromY, fromJ any
		if err := yaml.Unmarshal(y.Bytes(), &fromY); err != nil {
			t.Fatalf("%v\n%s", err, y.String())
		}
		if err := json.Unmarshal(j.Bytes(), &fromJ); err != nil {
			t.Fatal(err)
		}
		a, _ := json.Marshal(fromY)
		b, _ := json.Marshal(fromJ)
		if !bytes.Equal(a, b) {
			t.Errorf("yaml and json differ:\nyaml %s\njson %s\n%s", a, b, y.String())
		}
	}
	// Key order follows the JSON (the struct's), and the yaml is block style.
	y, _ := toYAML(sampleInfo())
	if !strings.HasPrefix(string(y), "name: work\nstate: RUNNING\n") || strings.Contains(string(y), "{") {
		t.Errorf("yaml not in the struct's order / not block style:\n%s", y)
	}
	// Strings that look like other types stay strings.
	if !strings.Contains(string(y), `version: "true"`) || !strings.Contains(string(y), `a: "0123"`) {
		t.Errorf("yaml lost string types:\n%s", y)
	}
}

// info's YAML is flat like its JSON (it used to nest under summary:); addresses are plain.
func TestInfoFlat(t *testing.T) {
	for _, format := range []string{"json", "yaml"} {
		var out bytes.Buffer
		if err := writeInfo(&out, format, sampleInfo()); err != nil {
			t.Fatal(err)
		}
		var top map[string]any
		if err := yaml.Unmarshal(out.Bytes(), &top); err != nil {
			t.Fatal(err)
		}
		if _, nested := top["summary"]; nested {
			t.Errorf("%s: info nests under summary:\n%s", format, out.String())
		}
		if top["name"] != "work" || !slices.Equal(toStrings(top["ipv4"]), []string{"10.87.0.10"}) {
			t.Errorf("%s: name %v ipv4 %v:\n%s", format, top["name"], top["ipv4"], out.String())
		}
		if !strings.Contains(out.String(), "2026-12-02T11:39:00Z") {
			t.Errorf("%s: created not RFC 3339 UTC:\n%s", format, out.String())
		}
	}
}

func toStrings(v any) []string {
	var out []string
	l, _ := v.([]any)
	for _, x := range l {
		s, _ := x.(string)
		out = append(out, s)
	}
	return out
}

// One --format with the same four values on every verb that prints data, and each format
// prints something of its own.
func TestOneFormatFlag(t *testing.T) {
	for _, name := range []string{"list", "info", "host check", "drill"} {
		row, _, ok := findRow(strings.Fields(name))
		if !ok {
			t.Fatalf("no row %s", name)
		}
		found := false
		for _, f := range row.Flags {
			if slices.Contains(f.Names(), "format") {
				found = true
				if !strings.Contains(f.String(), strings.Join(Formats, "|")) {
					t.Errorf("%s: --format is %s", name, f.String())
				}
			}
		}
		if !found || !strings.Contains(row.Synopsis, "[--format "+strings.Join(Formats, "|")+"]") {
			t.Errorf("%s: no --format %s (synopsis %q)", name, strings.Join(Formats, "|"), row.Synopsis)
		}
	}
	list := []boxcore.Summary{sampleInfo().Summary}
	rep := &drill.Report{RunID: "r1", OK: true, Verdict: "PASS"}
	want := map[string][]string{
		"table": {"NAME  STATE    TYPE       IPV4        SNAPSHOTS  CREATED\nwork  RUNNING  container  10.87.0.10  1          2026-12-02 11:39\n"},
		"csv":   {"name,state,type,ipv4,snapshots,created,member\nwork,RUNNING,container,10.87.0.10,1,2026-12-02T11:39:00Z,\n"},
		"json":  {`"ipv4": [`, `"10.87.0.10"`, `"interface": "eth0"`},
		"yaml":  {"- name: work\n", "ipv4:\n", "- 10.87.0.10\n", "interface: eth0"},
	}
	for _, format := range Formats {
		var out bytes.Buffer
		if err := writeList(&out, format, list); err != nil {
			t.Fatal(err)
		}
		for _, w := range want[format] {
			if !strings.Contains(out.String(), w) {
				t.Errorf("list --format %s lacks %q:\n%s", format, w, out.String())
			}
		}
		out.Reset()
		if err := writeCheck(&out, format, boxcore.CheckReport{Rows: []boxcore.CheckRow{{Layer: "wall", Item: "i", Expected: "e", Actual: "a"}}}); err != nil || out.Len() == 0 {
			t.Errorf("host check --format %s: %v %q", format, err, out.String())
		}
		out.Reset()
		if err := writeDrill(&out, format, rep); err != nil || out.Len() == 0 {
			t.Errorf("drill --format %s: %v %q", format, err, out.String())
		}
		if format == "json" && !strings.Contains(out.String(), `"run_id": "r1"`) {
			t.Errorf("drill --format json: %s", out.String())
		}
	}
	// drill's old --json is a hidden alias; info's old "text" is the table.
	row, _, _ := findRow([]string{"drill"})
	if !hasFlag(row, "json") || strings.Contains(runCLI("drill", "--help").stdout, "--json") {
		t.Errorf("drill: --json must stay, hidden")
	}
}

// On a cluster list's table gains a MEMBER column (and info a member line); a standalone
// host's output is as before (TestOneFormatFlag).
func TestListMemberColumn(t *testing.T) {
	a, b := sampleInfo(), sampleInfo()
	a.Member, b.Name = "m2", "other"
	var out bytes.Buffer
	if err := writeList(&out, "table", []boxcore.Summary{a.Summary, b.Summary}); err != nil {
		t.Fatal(err)
	}
	want := "NAME   STATE    TYPE       IPV4        SNAPSHOTS  CREATED           MEMBER\n" +
		"work   RUNNING  container  10.87.0.10  1          2026-12-02 11:39  m2\n" +
		"other  RUNNING  container  10.87.0.10  1          2026-12-02 11:39  -\n"
	if out.String() != want {
		t.Errorf("table:\n%s\nwant:\n%s", out.String(), want)
	}
	out.Reset()
	if err := writeInfo(&out, "table", a); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "member:    m2 (cluster member)\n") {
		t.Errorf("info has no member line:\n%s", out.String())
	}
	out.Reset()
	if err := writeList(&out, "json", []boxcore.Summary{a.Summary, b.Summary}); err != nil {
		t.Fatal(err)
	}
	if strings.Count(out.String(), `"member"`) != 1 {
		t.Errorf("json: a member field on the clustered box only:\n%s", out.String())
	}
}
