package cli

import (
	"fmt"
	"text/tabwriter"

	"github.com/claudebox/claudebox/boxcore"
	"github.com/claudebox/claudebox/boxcore/templates"
)

// applyTemplate fills image, resources and first-boot config from the chosen template. The
// host's extra CA certificates go along (an intercepting proxy's CA is what lets a box reach
// the internet behind one); they are public certificates, never a credential.
func applyTemplate(c *Ctx, o *boxcore.NewOptions) error {
	t, err := templates.Get(c.String("template"))
	if err != nil {
		return boxcore.Usagef("new: %v", err)
	}
	cas, err := templates.HostExtraCAs(templates.HostCADir)
	if err != nil {
		return fmt.Errorf("new: reading the host's extra CA certificates: %w", err)
	}
	if err := boxcore.ApplyTemplate(o, boxcore.TemplateChoice{Template: t, Explicit: c.IsSet("template"), HostCAs: cas}); err != nil {
		return err
	}
	o.FirstBoot.Warn = func(s string) { c.Warn("%s", s) }
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
