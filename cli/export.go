package cli

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"github.com/claudebox/claudebox/boxcore"
)

// exportCommands are the rows of export and import: a box with its snapshots to one file
// and back.
func exportCommands() []Command {
	return []Command{
		{
			Name: "export", Args: []string{"BOX"}, Optional: []string{"FILE"}, Synopsis: "[--overwrite]",
			Examples: []string{"claudebox export work", "claudebox export work work.tar.gz", "claudebox export work - > work.tar.gz"},
			Summary:  "write a box and its snapshots to one file (default BOX.tar.gz; - for stdout), whole or not at all",
			Pre:      boxPre,
			Flags:    []cli.Flag{&cli.BoolFlag{Name: "overwrite", Usage: "replace FILE if it exists"}},
			Action:   exportBox,
		},
		{
			Name: "import", Args: []string{"FILE"}, Synopsis: "[--name NAME]",
			Examples: []string{"claudebox import work.tar.gz", "claudebox import work.tar.gz --name work2", "claudebox import - --name work2 < work.tar.gz"},
			Summary:  "make a box of an exported file (- for stdin): judged by the clone boundary first, new MAC and machine-id",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon},
			Flags:    []cli.Flag{&cli.StringFlag{Name: "name", Usage: "the new box's name (default: the name it was exported under)"}},
			Action:   importBox,
		},
	}
}

func exportBox(c *Ctx) error {
	file := argAt(c.Args, 1)
	if file == "" {
		file = c.Box.Name + ".tar.gz"
	}
	start := time.Now()
	var n int64
	var err error
	if file == "-" {
		if f, ok := c.Env.Stdout.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			return boxcore.Usagef("export: stdout is a terminal: redirect it (claudebox export %s - > %s.tar.gz) or name a FILE", c.Box.Name, c.Box.Name)
		}
		n, err = boxes(c).Export(c.Context.Context, c.Box, c.Env.Stdout)
	} else {
		n, err = boxes(c).ExportFile(c.Context.Context, c.Box, file, c.Bool("overwrite"))
	}
	if err != nil {
		return err
	}
	where := file
	if file == "-" {
		where = "stdout"
	}
	c.Warn("exported %s to %s (%.1f MB, %.1fs): claudebox import %s", c.Box.Name, where, float64(n)/1e6, time.Since(start).Seconds(), importHint(file))
	return nil
}

func importHint(file string) string {
	if file == "-" {
		return "FILE"
	}
	return file
}

func importBox(c *Ctx) error {
	name := c.String("name")
	if name != "" {
		if err := boxcore.ValidateName(name); err != nil {
			return err
		}
	}
	file := c.Args[0]
	if file == "-" {
		// The file is read twice (judged, then streamed): stdin is kept in a private
		// temporary file meanwhile.
		tmp, err := spool(c.Env.Stdin)
		if err != nil {
			return err
		}
		defer os.Remove(tmp)
		file = tmp
	}
	start := time.Now()
	t := &boxcore.ImportTimings{}
	box, err := boxes(c).Import(c.Context.Context, file, boxcore.ImportOptions{Name: name, Timings: t})
	if err != nil {
		return err
	}
	c.Out("%s is ready (imported %s, %.1fs): claudebox shell %s", box.Name, box.Instance.Type, time.Since(start).Seconds(), box.Name)
	c.Warn("time: check %.1fs, upload and unpack %.1fs, start %.1fs", t.Check.Seconds(), t.Upload.Seconds(), t.Start.Seconds())
	return nil
}

// spool copies r to a new temporary file (mode 0600) and returns its path.
func spool(r io.Reader) (string, error) {
	f, err := os.CreateTemp("", "claudebox-import-")
	if err != nil {
		return "", err
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		os.Remove(f.Name())
		return "", fmt.Errorf("import: reading stdin: %w", err)
	}
	if err := f.Close(); err != nil {
		os.Remove(f.Name())
		return "", err
	}
	return f.Name(), nil
}
