package boxcore

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/claudebox/claudebox/boxcore/incus"
	"github.com/claudebox/claudebox/boxcore/templates"
)

// TemplateChoice is how `new` was asked to apply a template.
type TemplateChoice struct {
	Template templates.Template
	// Explicit is true when the user named the template: then an image without cloud-init is
	// an error rather than a warning.
	Explicit bool
	// HostCAs are extra CA certificates (PEM) the box should trust, e.g. an intercepting
	// proxy's; public material, never a credential.
	HostCAs []string
}

// ApplyTemplate fills a fresh box's image, resources and first-boot config from a template.
// Flags the user gave win over the template's defaults.
func ApplyTemplate(o *NewOptions, tc TemplateChoice) error {
	t := tc.Template
	if o.Image == "" {
		o.Image = t.Image.Container
		if o.VM {
			o.Image = t.Image.VM
		}
	}
	// The template's resources, clamped to what this host can give (a 4GiB template on a
	// small host gets the host's budget, not a refusal).
	cpus, memory := DefaultLimits().ClampTemplate(t.Resources.CPU, t.Resources.Memory)
	if o.CPU == "" && cpus > 0 {
		o.CPU = strconv.Itoa(cpus)
	}
	if o.Memory == "" {
		o.Memory = memory
	}
	if o.Disk == "" {
		o.Disk = t.Resources.Disk
	}
	userData, err := t.Render(templates.Params{Hostname: o.Name})
	if err != nil {
		return err
	}
	if o.Config == nil {
		o.Config = map[string]string{}
	}
	o.Config["cloud-init.user-data"] = userData
	if len(tc.HostCAs) > 0 {
		vd, err := templates.TrustCAVendorData(tc.HostCAs)
		if err != nil {
			return err
		}
		o.Config["cloud-init.vendor-data"] = vd
	}
	extra := t.ContainerConfig
	if o.VM {
		extra = t.VMConfig
	}
	for k, v := range extra {
		o.Config[k] = v
	}
	o.Config[TagTemplate] = t.Name
	o.FirstBoot = &FirstBoot{Required: tc.Explicit, Timeout: DefaultFirstBootTimeout}
	return nil
}

// TagTemplate records the template a box was minted from.
const TagTemplate = "user.claudebox.template"

// DefaultFirstBootTimeout bounds the wait for cloud-init (package installs, Claude install).
const DefaultFirstBootTimeout = 15 * time.Minute

// FirstBoot is the wait for cloud-init after a box starts.
type FirstBoot struct {
	// Required: an image without cloud-init fails `new` (else it is a warning).
	Required bool
	Timeout  time.Duration
	// Baked: the box comes from a bake, where cloud-init is off: wait for its lease instead.
	Baked bool
	// Warn receives a line for the user (an image without cloud-init); may be nil.
	Warn func(string)
	// noCloudInit: the box's root, read on the host before its start, has no cloud-init
	// (lacksCommand), so there is nothing to ask the box.
	noCloudInit bool
}

// FirstBootError is cloud-init failing or timing out: the stage, its errors and the log tail.
type FirstBootError struct {
	Box     string
	Summary string
	Stage   string
	LogTail string
}

func (e *FirstBootError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "box %s did not finish its first boot: %s", e.Box, e.Summary)
	if e.Stage != "" {
		fmt.Fprintf(&b, "\nfailing stage: %s", e.Stage)
	}
	if e.LogTail != "" {
		fmt.Fprintf(&b, "\nlast lines of /var/log/cloud-init-output.log:\n%s", strings.TrimRight(e.LogTail, "\n"))
	}
	return b.String()
}

// WaitFirstBoot waits for cloud-init to finish in a box, bounded by fb.Timeout. On a VM it
// first waits for the guest agent (exec fails until it runs).
func (bs *Boxes) WaitFirstBoot(ctx context.Context, b *Box, fb FirstBoot) error {
	_, err := bs.waitFirstBoot(ctx, b, fb)
	return err
}

// waitFirstBoot is WaitFirstBoot that also says whether a template ran (false for a bake
// and for an image with no cloud-init).
func (bs *Boxes) waitFirstBoot(ctx context.Context, b *Box, fb FirstBoot) (ran bool, err error) {
	if fb.Timeout <= 0 {
		fb.Timeout = DefaultFirstBootTimeout
	}
	if fb.Baked {
		return false, bs.waitLease(ctx, b.Name, fb.Timeout)
	}
	// The bound is told apart from the caller's context ending (an interrupt): only the
	// bound is "did not finish within".
	errBound := fmt.Errorf("cloud-init did not finish within %s", fb.Timeout)
	ctx, cancel := context.WithTimeoutCause(ctx, fb.Timeout, errBound)
	defer cancel()
	if fb.noCloudInit {
		return false, withoutCloudInit(b, fb)
	}
	res, err := bs.ExecWhenReady(ctx, b.Name, templates.WaitCommand())
	if err != nil {
		if isCommandNotFound(err) {
			return false, withoutCloudInit(b, fb)
		}
		if ctx.Err() != nil {
			if cause := context.Cause(ctx); cause != errBound {
				return true, fmt.Errorf("waiting for cloud-init in %s: %w", b.Name, cause)
			}
			return true, bs.firstBootFailure(b.Name, errBound.Error())
		}
		return true, fmt.Errorf("waiting for cloud-init in %s: %w", b.Name, err)
	}
	st, perr := templates.ParseStatus(res.Stdout)
	switch {
	case perr != nil:
		return true, bs.firstBootFailure(b.Name, fmt.Sprintf("cloud-init status unreadable (exit %d): %v", res.ExitCode, perr))
	case st.Failed():
		return true, bs.firstBootFailure(b.Name, st.Summary())
	}
	return true, nil
}

// firstBootFailure gathers the failing stage and the log tail, with a fresh context: the
// wait's own may be spent.
func (bs *Boxes) firstBootFailure(name, summary string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	e := &FirstBootError{Box: name, Summary: summary}
	if r, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: templates.StageCommand()}); err == nil && r.ExitCode == 0 {
		if st, ok, _ := templates.FailingStage(r.Stdout); ok {
			e.Stage = st.Name
			if len(st.Errors) > 0 {
				e.Stage += ": " + strings.Join(st.Errors, "; ")
			}
		}
	}
	if r, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: templates.LogTailCommand(25)}); err == nil {
		e.LogTail = string(r.Stdout)
	}
	return e
}

// ExecWhenReady runs a command in a box, retrying while a VM's guest agent is not up yet;
// any other error is returned at once.
func (bs *Boxes) ExecWhenReady(ctx context.Context, name string, cmd []string) (incus.ExecResult, error) {
	delay := 250 * time.Millisecond
	for {
		res, err := bs.Client.Exec(ctx, name, incus.ExecRequest{Command: cmd})
		if err == nil || !agentNotReady(err) {
			return res, err
		}
		select {
		case <-ctx.Done():
			return res, err
		case <-time.After(delay):
		}
		if delay < 2*time.Second {
			delay *= 2
		}
	}
}

// agentNotReady recognises the daemon's answers while a VM's incus-agent is not running yet.
func agentNotReady(err error) bool {
	s := strings.ToLower(err.Error())
	return strings.Contains(s, "agent isn't currently running") || strings.Contains(s, "agent is not running") ||
		strings.Contains(s, "vm agent isn't") || strings.Contains(s, "failed to connect to the vm agent")
}

// withoutCloudInit is the outcome of a first boot in an image that has no cloud-init: an
// error when the template was asked for by name, else a note.
func withoutCloudInit(b *Box, fb FirstBoot) error {
	if fb.Required {
		return noCloudInit(b.Instance.Config[TagFrom])
	}
	if fb.Warn != nil {
		fb.Warn(fmt.Sprintf("note: image %s has no cloud-init: %s was minted without its template (no claude user, no Claude Code)", b.Instance.Config[TagFrom], b.Name))
	}
	return nil
}

// noCloudInit refuses a template asked for by name on an image without cloud-init.
func noCloudInit(image string) error {
	return Usagef("new: image %s has no cloud-init, so its template cannot be applied: use an image with cloud-init (e.g. images:debian/12/cloud)", image)
}

func isCommandNotFound(err error) bool {
	return strings.Contains(err.Error(), "Command not found")
}

// waitLease waits, bounded by timeout, until a box's eth0 has an IPv4 address: the readiness
// of a baked box, which runs no first boot (its programs are in the image already; the lease
// is what a cold mint's cloud-init waited for too).
func (bs *Boxes) waitLease(ctx context.Context, name string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		st, err := bs.Client.InstanceState(ctx, name)
		if err == nil && hasIPv4(st, "eth0") {
			return nil
		}
		select {
		case <-ctx.Done():
			if ctx.Err() == context.DeadlineExceeded && err == nil {
				return &FirstBootError{Box: name, Summary: fmt.Sprintf("no IPv4 address on eth0 within %s (the box comes from a bake: no cloud-init runs)", timeout)}
			}
			return fmt.Errorf("waiting for the lease of %s: %w", name, context.Cause(ctx))
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func hasIPv4(st incus.InstanceState, iface string) bool {
	for _, a := range st.Network[iface].Addresses {
		if a.Family == "inet" && a.Scope == "global" {
			return true
		}
	}
	return false
}
