package cli

import (
	"fmt"
	"text/tabwriter"

	"github.com/urfave/cli/v2"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/templates"
)

// applyTemplate fills image, resources and first-boot config from the chosen template. The
// host's extra CA certificates go along (an intercepting proxy's CA is what lets a box reach
// the internet behind one); they are public certificates, never a credential.
func applyTemplate(c *Ctx, o *boxcore.NewOptions) error {
	return applyNamedTemplate(c, "new", o, c.String("template"), c.IsSet("template"))
}

// applyNamedTemplate applies the template called name ("" for the default) to o; verb names
// the command in a message.
func applyNamedTemplate(c *Ctx, verb string, o *boxcore.NewOptions, name string, explicit bool) error {
	t, err := templates.Get(name)
	if err != nil {
		return boxcore.Usagef("%s: %v", verb, err)
	}
	cas, err := templates.HostExtraCAs(templates.HostCADir)
	if err != nil {
		return fmt.Errorf("%s: reading the host's extra CA certificates: %w", verb, err)
	}
	if err := boxcore.ApplyTemplate(o, boxcore.TemplateChoice{Template: t, Explicit: explicit, HostCAs: cas}); err != nil {
		return err
	}
	o.FirstBoot.Warn = func(s string) { c.Warn("%s", s) }
	return nil
}

// useBake makes a fresh container mint from its template's bake when one fits, and says so
// when one exists but is stale (the box is then minted cold).
func useBake(c *Ctx, o *boxcore.NewOptions) error {
	if c.Bool("no-bake") {
		return nil
	}
	st, err := boxes(c).UseBake(c.Context.Context, o)
	if err != nil {
		return err
	}
	if st.Image != nil && st.Stale != "" {
		t := st.Recipe.Template
		c.Warn("note: the bake of template %s is stale (%s): minting without it; 'claudebox templates bake %s' bakes it again", t, st.Stale, t)
	}
	return nil
}

// templateCommands is the `templates` group: list them, and bake one.
func templateCommands() []Command {
	return []Command{
		{
			Name:     "templates list",
			Examples: []string{"claudebox templates list"},
			Summary:  "list the box templates `new --template` takes (also what 'claudebox templates' alone prints)",
			Pre:      []Precondition{NeedsArgs},
			Action:   listTemplates,
		},
		{
			Name: "templates bake", Optional: []string{"TEMPLATE"}, Synopsis: "[--refresh]",
			Examples: []string{"claudebox templates bake", "claudebox templates bake claude --refresh"},
			Summary:  "bake a template's first boot into a local image, so a container 'new' of it is ready in seconds (default: claude; only when missing or stale)",
			Pre:      []Precondition{NeedsArgs, NeedsDaemon},
			Flags: []cli.Flag{
				&cli.BoolFlag{Name: "refresh", Usage: "bake again even when the bake is up to date (a newer Claude Code when the template says latest)"},
			},
			Action: bakeTemplate,
		},
	}
}

// bakeTemplate bakes a template on the base image a container `new` of it uses.
func bakeTemplate(c *Ctx) error {
	name := argAt(c.Args, 0)
	if name == "" {
		name = templates.Default
	}
	if _, err := templates.Get(name); err != nil {
		return boxcore.Usagef("templates bake: %v", err)
	}
	bs := boxes(c)
	o := boxcore.NewOptions{}
	img, err := bs.LocalDefaultImage(c.Context.Context)
	if err != nil {
		return err
	}
	o.Image = img
	if err := applyNamedTemplate(c, "templates bake", &o, name, true); err != nil {
		return err
	}
	progress := pipedProgressAs(c, "bake")
	stop := func() {}
	if c.Env.Terminal {
		progress, stop = terminalProgress(c)
	}
	res, err := bs.Bake(c.Context.Context, boxcore.BakeOptions{New: o, Refresh: c.Bool("refresh"), Progress: progress})
	stop()
	if err != nil {
		return err
	}
	st := res.State
	if res.UpToDate {
		c.Out("%s is up to date: %s (--refresh bakes it again)", st.Alias, st.Label())
		return nil
	}
	c.Out("%s: baked (%s) in %.0fs (builder %.0fs, publish %.1fs): %s", st.Alias, res.Why, res.Total.Seconds(), res.Mint.Seconds(), res.Publish.Seconds(), st.Label())
	if res.Replaced != "" {
		what := "kept: another alias names it"
		if res.Removed {
			what = "deleted"
		}
		c.Out("replaced image %s (%s)", res.Replaced[:12], what)
	}
	c.Out("a container 'claudebox new --template %s' now mints from it: claudebox new --name work --container", name)
	return nil
}

func listTemplates(c *Ctx) error {
	tw := tabwriter.NewWriter(c.Env.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tIMAGE (container / vm)\tCPU\tMEMORY\tDISK\tDESCRIPTION")
	for _, t := range templates.List() {
		name := t.Name
		if name == templates.Default {
			name += " (default)"
		}
		fmt.Fprintf(tw, "%s\t%s / %s\t%d\t%s\t%s\t%s\n", name, t.Image.Container, t.Image.VM, t.Resources.CPU, t.Resources.Memory, t.Resources.Disk, t.Description)
	}
	return tw.Flush()
}
